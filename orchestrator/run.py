"""`remesh run`: wire a job file to a cluster, a planner and a controller, and run it."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading

from .chaos import ANY_CLUSTER, ChaosSpecError, parse_chaos
from .controller import ControllerConfig, JobController, JobStopped, program_fingerprint
from .fleet import FleetStoreConfig
from .metrics import RayMetrics
from .recorder import FleetRecorder
from .jobfile import JobSpec
from .program import check_program, load_program
from .worker import step_flops


def run_job(job: JobSpec, *, chaos: str | None = None, address: str | None = None, hosts: int | None = None,
            config: ControllerConfig | None = None, printer=None, store: FleetStoreConfig | None = FleetStoreConfig(),
            cluster_name: str | None = None):
    """Run `job` to completion on an embedded local cluster (or the Ray cluster at `address`);
    returns the RunSummary. Progress goes to the fleet store `store` (None: nowhere) under the
    cluster's name (`cluster_name`, else $REMESH_CLUSTER, else where it runs)."""
    import partitioner

    from .cluster import LocalClusterConfig, RayCluster

    faults = parse_chaos(chaos)
    if address and any(f.kind not in ANY_CLUSTER for f in faults):
        raise ChaosSpecError("--chaos lose, add and lose-in-save kill and add emulated hosts, which needs the embedded "
                             f"cluster: drop --address (on a running cluster only {', '.join(ANY_CLUSTER)} applies)")
    sys.path.insert(0, os.getcwd())  # programs are named relative to the directory the job runs in
    program = load_program(job.program)
    state, batch = check_program(program, job.global_batch, job.seed)
    fingerprint = program_fingerprint(job.program, state, batch)
    model_flops = step_flops(program.step, (state, batch))["model_flops"]  # once, for every host's MFU

    def planner(devices: int):
        if job.planner == "shapes":
            return partitioner.plan_by_shapes(program.step, state, batch, devices=devices, hardware=job.hardware)
        return partitioner.plan(program.step, state, batch, devices=devices, hardware=job.hardware, level=job.planner)

    config = config or ControllerConfig()
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    config = dataclasses.replace(
        config,
        env_vars={"PYTHONPATH": pythonpath, **config.env_vars},
        compilation_cache=config.compilation_cache or os.path.join(os.path.dirname(job.checkpoint.dir), "xla-cache"),
    )
    if address:
        cluster = RayCluster(address)
    else:
        n = hosts or job.hosts.max
        (printer or print)(f"start embedded Ray cluster: {n} hosts x {job.hosts.devices_per_host} fake CPU devices")
        cluster = LocalClusterConfig(hosts=n, devices_per_host=job.hosts.devices_per_host).create()
    _stop_on_sigterm()
    try:
        recorder = None
        if store is not None:
            name = cluster_name or os.environ.get("REMESH_CLUSTER") or (
                address if address and address != "auto" else f"{'ray' if address else 'embedded'}@{socket.gethostname()}")
            recorder = FleetRecorder(store.open(), job, cluster=name, metrics=RayMetrics())
        controller = JobController(job, cluster, planner=planner, fingerprint=fingerprint, config=config,
                                   chaos=faults, printer=printer, recorder=recorder, model_flops=model_flops)
        summary = controller.run()
    finally:
        cluster.shutdown()
    return summary


def _stop_on_sigterm() -> None:
    """`remesh stop` (Ray's stop_job) sends SIGTERM: unwind through the controller, so the hosts
    are stopped and the fleet store and summary say the job was stopped. Installed after Ray
    connects, whose own handler for SIGTERM would otherwise end the process on the spot."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stopped(signum, frame):
        raise JobStopped(f"stopped by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stopped)
