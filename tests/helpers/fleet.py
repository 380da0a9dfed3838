"""Waiting on the fleet scheduler actor in tests: a job's grant once Ray has placed its hosts."""

import time

import ray

DEADLINE_S = 60.0


def until(fleet, run, placed, what, deadline_s=DEADLINE_S):
    """The job's grant once Ray has placed `placed` of its hosts (bounded: `deadline_s`)."""
    from orchestrator.fleet.scheduler import Grant

    end = time.monotonic() + deadline_s
    while True:
        grant = Grant.from_dict(ray.get(fleet.report.remote(run)))
        if len(grant.hosts) == placed or time.monotonic() > end:
            assert len(grant.hosts) == placed, f"{what}: {grant}"
            return grant
        time.sleep(0.05)
