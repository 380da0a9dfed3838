"""`remesh run`: wire a job file to a cluster, a planner and a controller, and run it."""
from __future__ import annotations

import dataclasses
import os
import sys

from .chaos import ChaosSpecError, parse_chaos
from .controller import ControllerConfig, JobController, program_fingerprint
from .jobfile import JobSpec
from .program import check_program, load_program


def run_job(job: JobSpec, *, chaos: str | None = None, address: str | None = None, hosts: int | None = None,
            config: ControllerConfig | None = None, printer=None):
    """Run `job` to completion on an embedded local cluster (or the Ray cluster at `address`);
    returns the RunSummary."""
    import partitioner

    from .cluster import LocalClusterConfig, RayCluster

    faults = parse_chaos(chaos)
    if faults and address:
        raise ChaosSpecError("--chaos kills and adds emulated hosts, so it needs the embedded cluster: drop --address")
    sys.path.insert(0, os.getcwd())  # programs are named relative to the directory the job runs in
    program = load_program(job.program)
    state, batch = check_program(program, job.global_batch, job.seed)
    fingerprint = program_fingerprint(job.program, state, batch)

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
    try:
        controller = JobController(job, cluster, planner=planner, fingerprint=fingerprint, config=config,
                                   chaos=faults, printer=printer)
        summary = controller.run()
    finally:
        cluster.shutdown()
    return summary
