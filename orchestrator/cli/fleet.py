"""`remesh queue` and `remesh fleet start`: the cluster's fleet scheduler, seen from outside it.

`--address` is either the Ray dashboard's URL (as `remesh submit` takes it: the command then runs
itself on the cluster as a short Ray job and reads its answer from the job's output) or a Ray
cluster address (`auto`, `host:port`: it connects to the cluster directly).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from .submit import SubmitError, client


def queue(address: str) -> list[dict]:
    """Every job registered with the fleet, running first, then waiting in admission order."""
    if address.startswith(("http://", "https://")):
        return _on_cluster(address, ["queue", "--address", "auto", "--json"])
    actor = _scheduler(address)
    if actor is None:
        return []
    import ray

    return ray.get(actor.queue.remote())


def start_fleet(address: str, config_path: str | None) -> dict:
    """Start the cluster's fleet scheduler with the fleet file's queues (its quotas); one already
    running is left as it is. Returns its queues and whether it was started now."""
    from ..fleet.config import load_fleet

    quotas = {q: quota.hosts for q, quota in load_fleet(config_path).quotas.items()}  # checked here, first
    if address.startswith(("http://", "https://")):
        answer = _on_cluster(address, ["fleet", "start", "--address", "auto", "--quotas", json.dumps(quotas), "--json"])
        return answer
    return start_with(address, quotas)


def start_with(address: str, quotas: dict) -> dict:
    import ray

    from ..fleet.scheduler import FleetSchedulerConfig, start

    running = _scheduler(address)
    actor = running or start(FleetSchedulerConfig(quotas=quotas))
    return {"started": running is None, "quotas": ray.get(actor.quotas.remote())}


def _scheduler(address: str):
    import ray

    from ..fleet.scheduler import NAME, NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _on_cluster(address: str, args: list[str], timeout_s: float = 120.0):
    """Run `remesh ARGS` on the cluster as a Ray job (this directory, this Python, as `remesh
    submit` without --working-dir) and return what it answered."""
    c = client(address)
    entrypoint = f"cd {shlex.quote(os.getcwd())} && " + shlex.join([sys.executable, "-m", "orchestrator.cli", *args])
    sid = c.submit_job(entrypoint=entrypoint)
    deadline = time.monotonic() + timeout_s
    while str(c.get_job_status(sid).value) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        if time.monotonic() > deadline:
            c.stop_job(sid)
            raise SubmitError(
                f"`remesh {' '.join(args)}` on the cluster at {address} did not answer within {timeout_s:.0f} s"
            )
        time.sleep(0.5)
    logs = c.get_job_logs(sid)
    for line in reversed(logs.splitlines()):  # the answer is the last JSON line (--json)
        if line.startswith(("[", "{")):
            return json.loads(line)
    raise SubmitError(f"`remesh {' '.join(args)}` on the cluster at {address} failed:\n{logs[-2000:]}")


def print_queue(rows: list[dict], as_json: bool, out=sys.stdout) -> None:
    if as_json:
        out.write(json.dumps(rows) + "\n")
        return
    if not rows:
        out.write("no jobs registered with the fleet\n")
        return
    out.write(f"{'run':34} {'state':8} {'prio':>4} {'queue':10} {'hosts':>9}  why\n")
    for r in rows:
        hosts = f"{r['hosts']}/{r['target']} of {r['min_hosts']}-{r['max_hosts']}"
        wait = f" (waiting {r['waiting_s']:.0f} s)" if r["state"] == "queued" else ""
        out.write(f"{r['run']:34} {r['state']:8} {r['priority']:>4} {r['queue']:10} {hosts:>9}  {r['reason']}{wait}\n")
