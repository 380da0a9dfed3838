"""Controller -> host: what one process needs to run one segment, and what is asked of it."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json

from ..job.jobfile import CheckpointSpec


class Stop(enum.IntEnum):
    """What the controller asked of a running segment."""

    RUN = 0  # train on
    AT_CHECKPOINT = 1  # finish the segment at the next checkpoint boundary (a resize)
    NOW = 2  # save the step reached and finish (a stop or a preemption)


class LoopAt(enum.StrEnum):
    """Where a host's loop is in a step, as its polls say (`worker.progress`): a host that has
    returned from a step's dispatch waits on the devices and its peers; one still dispatching is
    the one they wait on, if the step hangs."""

    DISPATCHING = "dispatching"
    DISPATCHED = "dispatched"


@dataclasses.dataclass(frozen=True)
class HookRef:
    """A worker hook that tests attach to one host (fault injection): `factory` ("module:name")
    is called with the segment's report function and `args`, and returns an object with the
    methods of `worker.hooks.FaultHook`. Named, not imported, so the worker imports no test code."""

    factory: str
    args: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SegmentSpec:
    """Everything one process needs to run one segment; plain data, so it crosses Ray and JSON."""

    program: str
    steps: int
    global_batch: int
    seed: int
    checkpoint: CheckpointSpec
    plan_json: str
    coordinator: str
    num_processes: int
    process_id: int
    segment: int = 0
    digest: bool = True  # record a digest of the state at every save, check it at restore (job/digest.py)
    compilation_cache: str | None = None
    fingerprint: str = ""  # of the program and its abstract inputs; saved with every checkpoint
    hardware: str = "cpu"  # profile whose peak FLOP/s MFU is measured against
    job: str = ""  # the job's name, for labels
    model_flops: float | None = None  # of one step (step_flops), counted once by the controller; None: count here
    options: dict = dataclasses.field(default_factory=dict)  # the job file's [options], for a program factory
    test_hook: HookRef | None = None  # fault injection on this host (orchestrator/chaos/); None in real jobs
    # The group's slices and this host's among them, slice-major (TPU multi-slice: libtpu joins
    # the slices over the data-center network by the MEGASCALE_* variables set from these).
    slices: int = 1
    slice_id: int = 0
    # Steps between comparisons of the state's copies (`job.replicas`); 0: as often as costs 1% of
    # a step, measured; -1: never.
    digest_every: int = 0
    # The newest step to restore (a corruption found after it: its copies' last agreement, or the
    # step before a loss spike); None: the newest there is.
    restore_at_most: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SegmentSpec:
        d = json.loads(text)
        d["checkpoint"] = CheckpointSpec(**d["checkpoint"])
        if d.get("test_hook") is not None:
            d["test_hook"] = HookRef(**d["test_hook"])
        return cls(**d)


def plan_key(plan_json: str) -> str:
    """Names the plan that executables compiled ahead were compiled for."""
    return hashlib.sha256(plan_json.encode()).hexdigest()[:16]
