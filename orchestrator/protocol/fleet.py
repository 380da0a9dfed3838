"""Job <-> fleet scheduler: what a job on a shared cluster says of itself and what it is granted.

A scheduler started by one version of remesh answers another's jobs, so these travel as plain
dicts (`dataclasses.asdict` one way, `from_dict` the other); a field added later has a default.
"""

from __future__ import annotations

import dataclasses

# The Ray resource that marks a node as a host. On a shared cluster only the fleet scheduler
# reserves it, so a host reserved for a job is that job's until it gives it back.
HOST_RESOURCE = "remesh_host"


@dataclasses.dataclass(frozen=True)
class Registration:
    """A job joining the fleet: who it is, how many hosts it runs on, how it wants them."""

    run: str  # the submission's id: one per attempt at a job
    job: str
    priority: int
    queue: str
    min_hosts: int
    max_hosts: int
    checkpoint_dir: str
    slice_hosts: int = 0  # hosts of a slice it runs whole (a TPU job); 0: hosts one by one


@dataclasses.dataclass(frozen=True)
class Grant:
    """What a job may do now: run on `target` hosts, on the reserved `hosts` (node id, placement
    group id) that Ray has placed; `state` "queued" (target 0: wait, or give every host back)
    or "running"; `reason`: why it holds fewer than its maximum."""

    run: str
    state: str
    target: int
    hosts: tuple[tuple[str, str], ...]
    reason: str

    @classmethod
    def from_dict(cls, d: dict) -> Grant:
        return cls(d["run"], d["state"], d["target"], tuple(tuple(h) for h in d["hosts"]), d["reason"])


@dataclasses.dataclass(frozen=True)
class FleetProgress:
    """What a job tells the fleet scheduler with each heartbeat: what a shrink would cost it now,
    and whether growing would pay for its resize (`fleet.policy` weighs them)."""

    since_snapshot: int = 0  # steps a shrink now would compute again
    smaller_ready: bool = False  # a plan and executables for one host fewer are ready
    grows: bool = True
