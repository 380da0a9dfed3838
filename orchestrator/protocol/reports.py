"""Host -> controller: one frozen dataclass per kind of report, a plain dict on the wire.

A report says what it is besides its fields, as class attributes: the goodput category its time
counts as (`CATEGORY`) and whether it is an event of the run summary (`EVENT`). The controller's
dispatch, the goodput ledger, the summary and the fleet store read those, never a kind's name, so
a new kind of report is its dataclass here and whatever consumes it:

    class ReportKind(enum.StrEnum):
        ...
        SNAPSHOT_TAKEN = "snapshot_taken"

    @report
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SnapshotTaken(Report):
        KIND = ReportKind.SNAPSHOT_TAKEN
        CATEGORY = "checkpoint"  # its lap counts as checkpoint time
        EVENT = True  # and it is listed in the run summary's events
        step: int
        bytes: int

`to_dict` leaves out the optional fields a report did not carry, so the dicts on the wire, in
summaries and in the fleet store are what they were before the types.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar


class ReportError(ValueError):
    """A dict that is not a report of this protocol (an unknown kind, a missing or unknown field)."""


class ReportKind(enum.StrEnum):
    GROUP_START = "group_start"  # the process joined its jax.distributed group
    LOAD = "load"  # the program loaded, the plan bound to the devices
    COMPILE = "compile"  # the step compiled (or loaded, compiled ahead)
    RESTORE = "restore"  # the state restored from disk or a peer snapshot
    INIT = "init"  # no checkpoint: the state initialised
    CHECKPOINT_CORRUPT = "checkpoint_corrupt"  # a committed step failed its checks and was moved aside
    SNAPSHOT_UNUSABLE = "snapshot_unusable"  # the peer snapshot chosen could not be read intact
    STEP = "step"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"  # a save begun (its lap: the time the loop was held)
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_FLUSH = "checkpoint_flush"  # the segment's last save finished
    COMPILE_AHEAD = "compile_ahead"  # programs for another mesh compiled beside training
    HANG = "chaos_frozen"  # fault injection: a host hangs in a phase (the wire keeps its first name)
    REPLICAS_DIFFER = "replicas_differ"  # copies of the state that should be equal are not


def _optional(default: Any = None) -> Any:
    """A field a report carries only sometimes: left out of its dict while it is None."""
    return dataclasses.field(default=default, metadata={"optional": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """One thing a host reports. Reports made as laps (`worker.laps.Laps`) cover the host's time
    back to back: `seconds` since the previous lap, ending at wall-clock time `at`."""

    KIND: ClassVar[ReportKind]
    CATEGORY: ClassVar[str | None] = None  # the goodput category its lap is charged to (goodput.py)
    EVENT: ClassVar[bool] = False  # listed in the run summary's events
    seconds: float | None = _optional()
    at: float | None = _optional()

    def to_dict(self) -> dict:
        out = {"kind": self.KIND.value}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (f.metadata.get("optional") and value is None):
                out[f.name] = value
        return out

    def event_fields(self) -> dict:
        """What its run-summary event records besides kind, step, time and seconds."""
        return {k: v for k, v in self.to_dict().items() if k not in ("kind", "step", "seconds", "at")}

    def event_seconds(self) -> float:
        return self.seconds or 0.0


REPORTS: dict[ReportKind, type[Report]] = {}


def report(cls: type[Report]) -> type[Report]:
    """Registers a report class for `from_dict`."""
    REPORTS[cls.KIND] = cls
    return cls


def from_dict(d: Mapping[str, Any]) -> Report:
    """The report a dict on the wire holds."""
    try:
        cls = REPORTS[ReportKind(d["kind"])]
    except (KeyError, ValueError):
        raise ReportError(
            f"not a report: kind {d.get('kind')!r}, expected one of {[k.value for k in REPORTS]}"
        ) from None
    try:
        return cls(**{k: v for k, v in d.items() if k != "kind"})
    except TypeError as e:
        raise ReportError(f"a {cls.KIND.value} report with fields {sorted(d)}: {e}") from None


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupStart(Report):
    KIND = ReportKind.GROUP_START
    CATEGORY = "startup"
    EVENT = True
    devices: int


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Load(Report):
    KIND = ReportKind.LOAD
    CATEGORY = "startup"


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Compile(Report):
    KIND = ReportKind.COMPILE
    CATEGORY = "compile"
    EVENT = True
    loaded: list = dataclasses.field(default_factory=list)  # programs loaded, compiled ahead
    load_failed: list = dataclasses.field(default_factory=list)
    model_flops: float = 0.0  # of one step, unpartitioned (what MFU divides by)
    device_flops: float | None = None  # of one device's compiled program, where the backend counts it


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Restore(Report):
    KIND = ReportKind.RESTORE
    CATEGORY = "restore"
    EVENT = True
    step: int
    source: str  # "disk" or "memory" (a peer snapshot)
    took: float | None = _optional()  # all it took, beside the compile (its lap holds what it took beyond)
    bytes_read: int = 0
    bytes_needed: int = 0
    # The step reports its metadata kept (`CheckpointMeta.step_records`), and the segment that ran them.
    reported: dict | None = _optional()
    digest: str | None = _optional()
    saved_digest: str | None = _optional()

    def event_fields(self) -> dict:
        return {k: v for k, v in super().event_fields().items() if k != "reported"}

    def unreported(self, done: int) -> list[dict]:
        """The step records its metadata kept of steps after `done`, up to the restored one: steps
        that ran but whose reports never reached the controller."""
        steps = (self.reported or {}).get("steps", [])
        return [r for r in steps if done < r["step"] <= self.step]


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Init(Report):
    KIND = ReportKind.INIT
    CATEGORY = "startup"
    took: float | None = _optional()


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCorrupt(Report):
    KIND = ReportKind.CHECKPOINT_CORRUPT
    CATEGORY = "restore"
    EVENT = True
    step: int
    error: str
    took: float | None = _optional()

    def event_fields(self) -> dict:
        return {"error": self.error}

    def event_seconds(self) -> float:
        return 0.0


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotUnusable(Report):
    KIND = ReportKind.SNAPSHOT_UNUSABLE
    CATEGORY = "restore"
    error: str
    took: float | None = _optional()


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Step(Report):
    """A training step done. Its category is the ledger's call: useful the first time a step is
    done, lost when it is done again after a restore."""

    KIND = ReportKind.STEP
    step: int
    loss: float
    metrics: dict = dataclasses.field(default_factory=dict)  # every other scalar the step returned
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    input_seconds: float = 0.0  # of `seconds`, waiting for the batch
    snapshot_seconds: float = 0.0  # of `seconds`, copying a peer snapshot to the host
    wait_seconds: float = 0.0  # the rest, waiting on the devices and the peers (a straggler waits least)
    snapshot_every: int = 0  # the peer snapshot interval agreed when it was dispatched


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Eval(Report):
    KIND = ReportKind.EVAL
    CATEGORY = "eval"
    EVENT = True
    step: int
    loss: float
    metrics: dict = dataclasses.field(default_factory=dict)


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoint(Report):
    KIND = ReportKind.CHECKPOINT
    CATEGORY = "checkpoint"
    EVENT = True
    step: int


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointFlush(Report):
    KIND = ReportKind.CHECKPOINT_FLUSH
    CATEGORY = "checkpoint"
    step: int


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointFailed(Report):
    KIND = ReportKind.CHECKPOINT_FAILED
    EVENT = True
    step: int
    error: str
    newest: int | None  # the newest committed step, which stands


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileAhead(Report):
    """Programs for a smaller mesh compiled beside training: `executables` (serialised, for the
    group that runs that plan) where it worked, `error` where it did not."""

    KIND = ReportKind.COMPILE_AHEAD
    EVENT = True
    devices: int | None = _optional()
    executables: dict | None = _optional()
    error: str | None = _optional()

    def event_fields(self) -> dict:
        fields = {k: v for k, v in super().event_fields().items() if k != "executables"}
        if self.executables is not None:  # the event names them; the bytes stay with the controller
            fields["executables"] = sorted(k for k in self.executables if k != "plan")
        return fields


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class Hang(Report):
    """Fault injection: a host hangs as `phase` begins (or instead of saving `step`) until the
    controller kills it."""

    KIND = ReportKind.HANG
    phase: str
    step: int | None = None


@report
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicasDiffer(Report):
    """Copies of the state that should be equal differ after `step` (`job.replicas`): each
    disagreement's leaf, block, devices and processes. `clean_step`: the newest step whose
    copies agreed (the segment's first, restored and checked, where none was compared since).
    Not itself an event: what the health loop decides of it is."""

    KIND = ReportKind.REPLICAS_DIFFER
    step: int
    clean_step: int
    every: int = 0  # the comparison's interval in steps (0: not agreed yet; boundaries only)
    disagreements: list = dataclasses.field(default_factory=list)
