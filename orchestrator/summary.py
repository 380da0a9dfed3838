"""The run summary (the contract in DESIGN.md), built up by the controller and written as JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

EVENT_KINDS = (
    "host_lost",
    "host_added",
    "replan",
    "restore",
    "checkpoint",
    "compile",
    "group_start",
    "checkpoint_corrupt",
)


@dataclasses.dataclass
class RunSummary:
    job: str
    steps: int
    losses: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> loss (last run wins)
    metrics: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)  # name -> step -> value
    # The highest step known done: reported by a host, or restored from a checkpoint (a resumed
    # run starts from there). An int kept up to date, so asking for it costs nothing per report.
    steps_completed: int = 0
    segments: list[dict] = dataclasses.field(default_factory=list)
    events: list[dict] = dataclasses.field(default_factory=list)
    recovery_seconds: list[float] = dataclasses.field(default_factory=list)
    state: str = "running"
    reason: str = ""
    wall_seconds: float = 0.0
    goodput: dict = dataclasses.field(default_factory=dict)  # goodput.Ledger.breakdown
    throughput: dict = dataclasses.field(default_factory=dict)  # goodput.Throughput.summary

    def event(self, kind: str, *, step: int | None, at: float, seconds: float = 0.0, **extra: Any) -> dict:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
        e = {"kind": kind, "step": step, "at": round(at, 4), "seconds": round(seconds, 4), **extra}
        self.events.append(e)
        return e

    def record_step(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        self.losses[step] = loss
        for name, value in (metrics or {}).items():
            self.metrics.setdefault(name, {})[step] = value
        self.reached(step)

    def reached(self, step: int) -> None:
        """`step` is known done (a restore of it, or a step report)."""
        self.steps_completed = max(self.steps_completed, step)

    def to_dict(self) -> dict:
        steps = range(1, self.steps_completed + 1)
        return {
            "job": self.job,
            "state": self.state,
            "reason": self.reason,
            "steps": self.steps,
            "steps_completed": self.steps_completed,
            "losses": [self.losses.get(s) for s in steps],
            "metrics": {name: [values.get(s) for s in steps] for name, values in self.metrics.items()},
            "segments": self.segments,
            "events": self.events,
            "recovery_seconds": self.recovery_seconds,
            "wall_seconds": round(self.wall_seconds, 3),
            "goodput": self.goodput,
            "throughput": self.throughput,
        }

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
