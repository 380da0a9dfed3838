"""The controller's states, each carrying its own data (as Ray Train v2's controller states do).

    Planning --plan for the hosts there are--> Starting --new group, restore--> Running
    Planning --the last step is already committed--> Finished
    Running --hosts lost--> (FailurePolicy) Planning | Failed
    Running --more hosts--> (ScalingPolicy) stop at the next checkpoint --> Planning
    Running --segment ended without a new step--> (FailurePolicy) Planning | Failed
    Running --last step--> Finished
    Running --a stop request (a signal)--> Stopping --the step reached saved, or grace over--> Stopped
    On a shared cluster (the fleet scheduler's grant):
    Planning --no hosts granted, or not yet given back by another job--> Queued --granted--> Planning
    Running --fewer hosts granted--> stop at the next step boundary --> Planning (or Queued: none)
    Running --more hosts granted--> stop at the next checkpoint --> Planning

A host loss is recovered from across several states: `Recovery` rides along from the loss to the
first step computed past it. States are frozen: every change, a resize decided or a recovery's
progress included, is a new state that the callbacks see (`ControllerCallback.on_state`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from .policies import Resize, Restart


class Phase(enum.Enum):
    PLANNING = "planning"
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"
    QUEUED = "queued"

    @property
    def is_terminal(self) -> bool:
        return self in (Phase.FINISHED, Phase.FAILED, Phase.STOPPED)


@dataclasses.dataclass(frozen=True)
class Recovery:
    """A host loss being recovered from."""

    step: int  # the step reached at the loss: a restore before it means steps computed again
    detected: float  # when the loss was detected (controller clock)
    failures: int = 1  # losses in a row without a step computed past the first one's step
    restored: bool = False  # the restore that says how many steps are computed again was reported
    recovered: bool = False  # a step of the new group is done: the recovery time is measured
    at_most: int | None = None  # the newest step to restore (after a corruption: its copies' last agreement)


@dataclasses.dataclass
class Segment:
    """One group's run: what the run summary lists as a segment."""

    index: int
    mesh: dict
    hosts: int
    devices: int
    plan: str
    spawn_seconds: float
    started_at: float
    first_step: int | None = None
    last_step: int | None = None
    first_step_at: float | None = None
    model_flops: float | None = None
    device_flops: float | None = None
    snapshot_every: int = 0  # the peer snapshot interval its last step reported

    def to_dict(self, medians: dict | None = None) -> dict:
        """As the run summary lists it; `medians`: its median step seconds, tokens/s and MFU,
        where a callback measured them (`telemetry.goodput`)."""
        out = {
            "mesh": self.mesh,
            "hosts": self.hosts,
            "devices": self.devices,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "spawn_seconds": self.spawn_seconds,
            "started_at": self.started_at,
            "first_step_at": self.first_step_at,
            "plan": self.plan,
        }
        if self.model_flops is not None:  # once the group's compile is reported
            out.update(model_flops=self.model_flops, device_flops=self.device_flops)
        return {**out, **{f"median_{k}": v for k, v in (medians or {}).items()}}


@dataclasses.dataclass(frozen=True)
class State:
    PHASE: ClassVar[Phase]

    @property
    def phase(self) -> Phase:
        return self.PHASE


@dataclasses.dataclass(frozen=True)
class Planning(State):
    PHASE = Phase.PLANNING
    target: int | None = None  # hosts the next segment should run on; None: as the scaling policy starts a job
    recovery: Recovery | None = None
    stalled: int = 0  # segments in a row that ended without a new step
    decision: Resize | Restart | None = None  # the failure policy's, after a host loss


@dataclasses.dataclass(frozen=True)
class Queued(State):
    """Waiting for the fleet scheduler to grant hosts (at the start, or suspended)."""

    PHASE = Phase.QUEUED
    reason: str
    since: float  # controller clock: waiting since then
    recovery: Recovery | None = None


@dataclasses.dataclass(frozen=True)
class Starting(State):
    PHASE = Phase.STARTING
    plan: object
    target: int
    hosts: int  # of `target`, the hosts whose devices the plan uses (a host none of whose devices it uses is left idle)
    cached: bool  # the plan was made before (for this mesh, or ahead while the last group trained)
    ahead: bool  # made ahead while the last group trained
    recovery: Recovery | None = None
    stalled: int = 0
    planning_wall: tuple[float, float] = (0.0, 0.0)  # when planning began and ended, wall clock


@dataclasses.dataclass(frozen=True)
class Running(State):
    PHASE = Phase.RUNNING
    segment: Segment
    target: int
    started_after: int  # the step the segment started after
    recovery: Recovery | None = None
    stalled: int = 0
    resize: Resize | None = None  # a resize decided: the group stops at its next boundary


@dataclasses.dataclass(frozen=True)
class Stopping(State):
    PHASE = Phase.STOPPING
    segment: Segment
    reason: str
    deadline: float  # controller clock: hosts that have not finished by then are stopped


@dataclasses.dataclass(frozen=True)
class Finished(State):
    PHASE = Phase.FINISHED
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Failed(State):
    PHASE = Phase.FAILED
    reason: str


class StopOutcome(enum.Enum):
    COMMITTED = "the step reached was committed"
    HOSTS_FAILED = "hosts failed while stopping"
    GRACE_OVER = "hosts did not finish within the grace"
    AT_ONCE = "stopped at once"


@dataclasses.dataclass(frozen=True)
class Stopped(State):
    PHASE = Phase.STOPPED
    reason: str
    outcome: StopOutcome
    detail: str = ""  # the failure, for HOSTS_FAILED
