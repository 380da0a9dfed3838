"""The run summary of ../shared/DESIGN.md, built up by the controller and written as JSON."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

EVENT_KINDS = ("host_lost", "host_added", "replan", "restore", "checkpoint", "compile", "group_start",
               "checkpoint_corrupt")


@dataclasses.dataclass
class RunSummary:
    job: str
    steps: int
    losses: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> loss (last run wins)
    segments: list[dict] = dataclasses.field(default_factory=list)
    events: list[dict] = dataclasses.field(default_factory=list)
    recovery_seconds: list[float] = dataclasses.field(default_factory=list)
    state: str = "running"
    reason: str = ""
    wall_seconds: float = 0.0
    goodput: dict = dataclasses.field(default_factory=dict)  # goodput.Ledger.breakdown
    throughput: dict = dataclasses.field(default_factory=dict)  # goodput.Throughput.summary

    def event(self, kind: str, *, step: int | None, at: float, seconds: float = 0.0, **extra: Any) -> dict:
        assert kind in EVENT_KINDS, kind
        e = {"kind": kind, "step": step, "at": round(at, 4), "seconds": round(seconds, 4), **extra}
        self.events.append(e)
        return e

    @property
    def steps_completed(self) -> int:
        return max(self.losses, default=0)

    def to_dict(self) -> dict:
        return {
            "job": self.job,
            "state": self.state,
            "reason": self.reason,
            "steps": self.steps,
            "steps_completed": self.steps_completed,
            "losses": [self.losses.get(s) for s in range(1, self.steps_completed + 1)],
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
