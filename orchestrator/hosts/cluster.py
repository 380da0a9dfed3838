"""Where hosts come from. `Cluster` is what the controller asks of every cluster, whatever it is:
`LocalCluster` embeds a real Ray cluster on this machine whose "hosts" are Ray nodes (one raylet
each) carrying the `remesh_host` resource, each emulating a host of N fake CPU devices;
`RayCluster` attaches to a running cluster of real hosts; `fleet.cluster.FleetCluster` is the share
of one that the fleet scheduler grants a job; `slices.SlicedCluster` sees any of them through its
slices. Only the local one can kill, stop and add hosts (`EmulatedHosts`, for fault injection).

Token authentication stays on: the local cluster writes a fresh token (mode 0600) into its state
directory and points RAY_AUTH_TOKEN_PATH at it before any Ray process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import tempfile
import warnings

import ray

from ..protocol.fleet import HOST_RESOURCE
from .group import alive_hosts
from .interface import Cluster
from .slices import SLICE_RESOURCE, host_slices


@dataclasses.dataclass(frozen=True)
class LocalClusterConfig:
    hosts: int
    devices_per_host: int
    # Ray's default node health check takes ~30 s to declare a dead node; a host loss must be
    # noticed in about a second.
    health_check_period_ms: int = 300
    health_check_failure_threshold: int = 3
    object_store_bytes: int = 80 * 2**20
    hosts_per_slice: int | None = None  # lay the hosts out in slices of this many (a resource each says)

    def create(self) -> LocalCluster:
        return LocalCluster(self)


class LocalCluster(Cluster):
    def __init__(self, config: LocalClusterConfig):
        from ray.cluster_utils import Cluster

        self.config = config
        self._state_dir = tempfile.mkdtemp(prefix="remesh-cluster-")
        _enable_token_auth(self._state_dir)
        system_config = {
            "health_check_initial_delay_ms": 0,
            "health_check_period_ms": config.health_check_period_ms,
            "health_check_timeout_ms": config.health_check_period_ms,
            "health_check_failure_threshold": config.health_check_failure_threshold,
        }
        with warnings.catch_warnings(), _daemons_in_own_process_groups():
            # Ray starts its daemons with fork+exec, which is safe in a process that imported JAX.
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            self._cluster = Cluster(
                initialize_head=True,
                shutdown_at_exit=False,  # shutdown() is explicit; Ray's hook trips over removed nodes
                head_node_args=dict(
                    num_cpus=1,
                    include_dashboard=False,
                    object_store_memory=config.object_store_bytes,
                    _system_config=system_config,
                ),
            )
        self._slices: dict[str, str] = {}  # node id -> slice, where laid out in slices
        for i in range(config.hosts):
            self._add_node(str(i // config.hosts_per_slice) if config.hosts_per_slice else None)
        ray.init(address=self._cluster.address, log_to_driver=False)

    @property
    def address(self) -> str:
        return self._cluster.address

    def _add_node(self, slice_name: str | None = None):
        resources = {HOST_RESOURCE: 1}
        if slice_name is not None:
            resources[SLICE_RESOURCE + slice_name] = 1
        with warnings.catch_warnings(), _daemons_in_own_process_groups():
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            node = self._cluster.add_node(
                num_cpus=1, resources=resources, object_store_memory=self.config.object_store_bytes
            )
        if slice_name is not None:
            self._slices[node.node_id] = slice_name
        return node

    def alive_hosts(self) -> list[str]:
        return alive_hosts()

    def slice_of(self) -> dict[str, str]:
        """Each live host's slice, where laid out in slices (else {})."""
        return {node: self._slices[node] for node in self.alive_hosts() if node in self._slices}

    def host_env(self) -> dict[str, str]:
        """Set before jax is imported in each host process: this emulated host's fake devices."""
        return {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={self.config.devices_per_host}",
        }

    def kill_host(self, node_id: str) -> None:
        """An ungraceful host loss: SIGKILL the node's raylet and every process on it."""
        node = next((n for n in self._cluster.worker_nodes if n.node_id == node_id), None)
        if node is None:
            raise KeyError(f"no live emulated host with node id {node_id}")
        self._cluster.remove_node(node, allow_graceful=False)

    def freeze_process(self, pid: int) -> None:
        """A hung host: stop a host's process (SIGSTOP), leaving its node alive to Ray. The
        emulated hosts' processes are this machine's."""
        os.kill(pid, signal.SIGSTOP)

    def add_host(self) -> None:
        """Start one more host (Ray starts a node's daemons from the main thread only; the
        running group keeps training meanwhile). Laid out in slices, it joins the slice with the
        fewest live hosts: the one a lost host left short."""
        if not self.config.hosts_per_slice:
            self._add_node()
            return
        alive = set(self.alive_hosts())
        count = {s: 0 for s in dict.fromkeys(self._slices.values())}
        for node, s in self._slices.items():
            count[s] += node in alive
        self._add_node(min(count, key=lambda s: (count[s], int(s))))

    def shutdown(self) -> None:
        """Disconnect, then SIGKILL every node's daemons: the hosts are already stopped and Ray
        keeps nothing that needs flushing, and a graceful stop waits on each daemon in turn."""
        ray.shutdown()
        for node in [*self._cluster.worker_nodes, self._cluster.head_node]:
            if node is not None:
                self._cluster.remove_node(node, allow_graceful=False)
        self._cluster.shutdown()  # with no nodes left: only Ray's module state is reset


class RayCluster(Cluster):
    """A running Ray cluster (`ray start`), reached at `address`: real hosts, real devices."""

    def __init__(self, address: str = "auto"):
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)

    def alive_hosts(self) -> list[str]:
        return alive_hosts()

    def slice_of(self) -> dict[str, str]:
        return host_slices()

    def shutdown(self) -> None:
        ray.shutdown()


@contextlib.contextmanager
def _daemons_in_own_process_groups():
    """Start the embedded cluster's daemons (GCS, raylets, and through them the host actors) each
    in a process group of its own. A signal sent to remesh's process group (Ctrl-C in a terminal,
    `timeout`, a shell's job control) then reaches remesh alone, which stops the job in order,
    instead of also killing the daemons it needs to stop the job (a driver whose GCS is gone waits
    60 s and aborts). A remesh killed outright (SIGKILL) leaves them running, as it did before; its
    own shutdown, on every other exit, kills them."""
    from ray._private import services

    base = services.ConsolePopen

    class Popen(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = Popen
    try:
        yield
    finally:
        services.ConsolePopen = base


def _enable_token_auth(state_dir: str) -> None:
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return  # the user chose otherwise explicitly; respect it
    path = os.path.join(state_dir, "auth_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = path
    # Ray caches its config and token when it is imported; make this process see the new ones
    # (the same refresh Ray's own `ray.init` does when it turns token auth on).
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
