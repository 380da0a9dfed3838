"""Where a job's wall time went: useful steps and each kind of badput, adding up to the wall time.

The controller feeds a `Ledger` intervals of wall-clock time, each with a category: the host
actors report every piece of their work (joining the group, restoring, compiling, each step, each
checkpoint) as back-to-back laps stamped with wall-clock end times, and the controller adds its own
(planning). Time that no interval covers is charged to the category of what the job was waiting
for then: start-up while a group forms or after it stops, progress lost while a failure is being
detected and the broken group torn down. So the parts partition the wall time by construction.

A step is useful the first time it completes; completing it again after a restore from an older
checkpoint is progress lost to the failure (as Google's goodput measurement counts it).
"""

from __future__ import annotations

import dataclasses
import statistics

USEFUL = "useful"
BADPUT = ("startup", "planning", "compile", "restore", "checkpoint", "lost")
BADPUT_MEANING = {
    "startup": "spawning host actors, joining the jax.distributed group, loading the program, "
    "initialising state, stopping a group",
    "planning": "the partitioner's search (cached plans cost nothing)",
    "compile": "jax.jit lowering and XLA compilation of the step",
    "restore": "reading the checkpoint onto the new plan",
    "checkpoint": "time the training loop was blocked by saves (device-to-host copy, final flush)",
    "lost": "steps recomputed after a restore, and failure detection and tear-down",
}

# What each host report counts as; steps are decided by the high-water mark.
REPORT_CATEGORY = {
    "group_start": "startup",
    "load": "startup",
    "init": "startup",
    "restore": "restore",
    "checkpoint_corrupt": "restore",
    "compile": "compile",
    "checkpoint": "checkpoint",
    "checkpoint_flush": "checkpoint",
}


class Ledger:
    """Partitions [start, end) of wall-clock time into categories."""

    def __init__(self, start: float):
        self.start = self.cursor = start
        self.seconds = dict.fromkeys((USEFUL, *BADPUT), 0.0)
        self.gap = "startup"  # what uncovered time is charged to now

    def fill(self, until: float, category: str | None = None) -> None:
        """Charge the time from the cursor to `until` to `category` (default: the current gap)."""
        if until > self.cursor:
            self.seconds[category or self.gap] += until - self.cursor
            self.cursor = until

    def add(self, category: str, start: float, end: float) -> None:
        """An interval of work. Intervals arrive in time order; one that overlaps what is already
        charged (clocks of different hosts disagree by a little) is clipped."""
        assert category in self.seconds, category
        self.fill(start)
        self.fill(end, category)

    def breakdown(self, end: float) -> dict:
        """Goodput and badput up to `end`; the uncovered tail is charged to the current gap
        without moving the cursor, so this can be asked for while the job runs."""
        seconds = dict(self.seconds)
        if end > self.cursor:
            seconds[self.gap] += end - self.cursor
        wall = max(end, self.cursor) - self.start
        return {
            "wall_seconds": round(wall, 4),
            "useful_seconds": round(seconds[USEFUL], 4),
            "goodput_ratio": round(seconds[USEFUL] / wall, 4) if wall > 0 else 0.0,
            "badput_seconds": {k: round(seconds[k], 4) for k in BADPUT},
        }


@dataclasses.dataclass
class Throughput:
    """Per-step figures of process 0 (SPMD: every host runs the same steps)."""

    model_flops_per_step: float = 0.0
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    tokens_per_second: list[float] = dataclasses.field(default_factory=list)
    mfu: list[float] = dataclasses.field(default_factory=list)

    def add(self, report: dict) -> None:
        self.step_seconds.append(report["seconds"])
        self.tokens_per_second.append(report["tokens_per_second"])
        self.mfu.append(report["mfu"])

    def last(self, n: int) -> Throughput:
        return Throughput(self.model_flops_per_step, self.step_seconds[-n:], self.tokens_per_second[-n:], self.mfu[-n:])

    def summary(self) -> dict:
        """Medians: the first step of a segment waits on lazy set-up and a save's step on the
        copy, so a mean would describe neither."""
        med = lambda xs: round(statistics.median(xs), 6) if xs else None
        return {
            "steps_measured": len(self.step_seconds),
            "step_seconds": med(self.step_seconds),
            "tokens_per_second": med(self.tokens_per_second),
            "mfu": med(self.mfu),
            "model_flops_per_step": self.model_flops_per_step,
        }
