"""The typed protocol between a job's controller, its hosts and its observers, in one place.

segment.py    controller -> host: `SegmentSpec` (everything one process needs to run one
              segment), `Stop` (what the controller asks of it), `HookRef` (a test hook)
reports.py    host -> controller: one dataclass per `ReportKind`, a plain dict on the wire;
              a new kind is its dataclass there and whatever consumes it
meta.py       host -> disk or peers -> host: `CheckpointMeta`, kept beside a state it saves
observers.py  controller -> observers: `Event` (the run summary's events) and
              `ControllerCallback`, what everything that watches a job implements
"""

from .meta import STEP_RECORD, CheckpointMeta, step_record
from .observers import EVENT_KINDS, ControllerCallback, Event, EventKind
from .reports import (
    REPORTS,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointFailed,
    CheckpointFlush,
    Compile,
    CompileAhead,
    Eval,
    GroupStart,
    Hang,
    Init,
    Load,
    ReplicasDiffer,
    Report,
    ReportError,
    ReportKind,
    Restore,
    SnapshotUnusable,
    Step,
    from_dict,
    report,
)
from .segment import HookRef, LoopAt, SegmentSpec, Stop, plan_key

__all__ = [
    "EVENT_KINDS",
    "REPORTS",
    "STEP_RECORD",
    "Checkpoint",
    "CheckpointCorrupt",
    "CheckpointFailed",
    "CheckpointFlush",
    "CheckpointMeta",
    "Compile",
    "CompileAhead",
    "ControllerCallback",
    "Eval",
    "Event",
    "EventKind",
    "GroupStart",
    "Hang",
    "HookRef",
    "LoopAt",
    "Init",
    "Load",
    "ReplicasDiffer",
    "Report",
    "ReportError",
    "ReportKind",
    "Restore",
    "SegmentSpec",
    "SnapshotUnusable",
    "Step",
    "Stop",
    "from_dict",
    "plan_key",
    "report",
    "step_record",
]
