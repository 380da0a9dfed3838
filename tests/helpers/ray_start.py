"""A real Ray cluster for tests, made the way users make one: `ray start --head` on 127.0.0.1 and
worker nodes joined to it with `ray start --address`, token authentication on. Each worker node is
one emulated host (the `remesh_host` resource, N fake CPU devices in its environment) and runs in
its own process group, so a test can stop it like a machine going away."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# Fast failure detection, as the embedded cluster has: a stopped node is declared dead in ~1 s.
SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 300,
    "health_check_timeout_ms": 300,
    "health_check_failure_threshold": 3,
}


# Ports below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768 and up by
# default): a port taken from that range can be handed to some process's outgoing connection
# before the Ray agent meant to listen on it binds it ("Address already in use").
_PORTS = (20000, 32000)
_given: set[int] = set()


def free_port() -> int:
    """A port no process listens on, outside the ephemeral range, never given twice in a process."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*_PORTS)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORTS[0]}-{_PORTS[1]} after 200 tries")


def _node_ports() -> list[str]:
    return [
        "--dashboard-agent-listen-port",
        str(free_port()),
        "--dashboard-agent-grpc-port",
        str(free_port()),
        "--runtime-env-agent-port",
        str(free_port()),
        "--node-manager-port",
        str(free_port()),
        "--object-manager-port",
        str(free_port()),
        "--object-store-memory",
        str(80 * 2**20),
    ]


class RayStartCluster:
    def __init__(self, root: str, workers: int, devices_per_host: int, slices: list[str] | None = None):
        """`slices`: each worker's slice, said by the node label `remesh.io/slice` (None: none)."""
        self.root, self.slices = root, slices
        token = os.path.join(root, "auth_token")
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RAY_ADDRESS")},
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": token,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.temp_dir = os.path.join("/tmp", "rs-" + secrets.token_hex(3))  # Unix socket paths must stay short
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.metrics_ports = [free_port() for _ in range(workers + 1)]
        self.devices_per_host = devices_per_host
        self.workers: list[subprocess.Popen] = []
        # --block in a session of its own: stopping this cluster stops exactly its processes.
        self.head = subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                str(self.gcs_port),
                "--dashboard-host",
                "127.0.0.1",
                "--dashboard-port",
                str(self.dashboard_port),
                "--num-cpus",
                "1",
                "--temp-dir",
                self.temp_dir,
                "--metrics-export-port",
                str(self.metrics_ports[0]),
                "--system-config",
                json.dumps(SYSTEM_CONFIG),
                "--disable-usage-stats",
                "--block",
                *_node_ports(),
            ],
            env=self.env,
            stdout=open(os.path.join(root, "head.log"), "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.wait_for_hosts(0)
            for i in range(workers):  # one at a time: nodes joining at once race for socket names
                self.add_worker(self.metrics_ports[i + 1])
                self.wait_for_hosts(i + 1)
        except BaseException:
            self.shutdown()  # nobody else holds this cluster yet: leave no process behind
            raise

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_worker(self, metrics_port: int) -> None:
        env = {
            **self.env,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.devices_per_host}",
        }
        index = len(self.workers)
        log = open(os.path.join(self.root, f"worker{index}.log"), "w")
        labels = ["--labels", f"remesh.io/slice={self.slices[index]}"] if self.slices else []
        self.workers.append(
            subprocess.Popen(
                [
                    RAY,
                    "start",
                    "--address",
                    f"127.0.0.1:{self.gcs_port}",
                    "--node-ip-address",
                    "127.0.0.1",
                    "--num-cpus",
                    "1",
                    "--resources",
                    json.dumps({"remesh_host": 1}),
                    "--metrics-export-port",
                    str(metrics_port),
                    *labels,
                    "--block",
                    *_node_ports(),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def hosts(self) -> int:
        """Alive nodes with the remesh_host resource, from Ray's state API (token in the header)."""
        req = urllib.request.Request(f"{self.address}/api/v0/nodes")
        with open(self.env["RAY_AUTH_TOKEN_PATH"]) as f:
            req.add_header("Authorization", f"Bearer {f.read().strip()}")
        with urllib.request.urlopen(req, timeout=10) as r:
            nodes = json.load(r)["data"]["result"]["result"]
        return sum(1 for n in nodes if n["state"] == "ALIVE" and n["resources_total"].get("remesh_host"))

    def wait_for_hosts(self, n: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.hosts() == n:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{n} hosts did not join the cluster within {timeout:.0f} s")

    def stop_worker(self, index: int) -> None:
        """The node and everything it runs go at once, as when a machine is lost."""
        os.killpg(self.workers[index].pid, signal.SIGKILL)
        self.workers[index].wait(30)

    def watch_host_actors(self, path: str) -> subprocess.Popen:
        """A process writing Ray's table of live host actors, [[node id, job id], ...], as a
        line of JSON to `path` every 0.5 s until killed (a process of its own: it needs this
        cluster's token in its environment)."""
        return subprocess.Popen([sys.executable, "-c", _WATCH, f"127.0.0.1:{self.gcs_port}", path], env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def metrics(self) -> str:
        """Every node's Prometheus exposition, concatenated."""
        text = []
        for port in self.metrics_ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text.append(r.read().decode())
            except OSError:
                pass  # a stopped node
        return "\n".join(text)

    def shutdown(self) -> None:
        procs = [p for p in (*self.workers, self.head) if p.poll() is None]
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever of its session is left
            except ProcessLookupError:
                pass


_WATCH = """
import json, sys, time
import ray
from ray.util.state import list_actors
ray.init(address=sys.argv[1], log_to_driver=False)
with open(sys.argv[2], "a") as out:
    while True:
        alive = list_actors(filters=[("class_name", "=", "HostActor"), ("state", "=", "ALIVE")], limit=10000)
        out.write(json.dumps([[a.node_id, a.job_id] for a in alive]) + "\\n")
        out.flush()
        time.sleep(0.5)
"""
