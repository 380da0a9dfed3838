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

import collections
import math
import statistics

from ..control.state import Phase
from ..protocol import Compile, ControllerCallback, EventKind, Step

USEFUL = "useful"
BADPUT = ("queued", "startup", "planning", "compile", "restore", "checkpoint", "input", "eval", "lost")
BADPUT_MEANING = {
    "queued": "waiting on a shared cluster for the fleet scheduler to grant hosts (at the start, or suspended)",
    "startup": "spawning host actors, joining the jax.distributed group, loading the program, "
    "initialising state, stopping a group",
    "planning": "the partitioner's search (cached plans cost nothing)",
    "compile": "jax.jit lowering and XLA compilation of the step",
    "restore": "reading the checkpoint onto the new plan",
    "checkpoint": "time the training loop was blocked by saves (device-to-host copy, final flush) and by "
    "copying peer snapshots to host memory",
    "input": "time the training loop waited for its next batch (reading and placing it) that the prefetch did not hide",
    "eval": "the program's evaluation on held-out data (Program.evaluation), every so many steps",
    "lost": "steps recomputed after a restore, and failure detection and tear-down",
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
        if category not in self.seconds:
            raise ValueError(f"unknown goodput category {category!r}; expected {USEFUL!r} or one of {BADPUT}")
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


class RunningMedian:
    """The median of every value added, in memory bounded by the values' spread rather than their
    count: values are counted in bins 0.1% wide (on a log scale), and a bin that only ever saw one
    value gives that value back exactly. So a status flush costs the same at step 10 and at step
    10^6, and the median is within 0.1% of `statistics.median`'s (equal to it where the values
    repeat, as step times do)."""

    RESOLUTION = math.log1p(1e-3)

    def __init__(self, values=()):
        self._bins: dict[int, list] = {}  # bin -> [count, the value if it is the only one seen]
        self._count = 0
        for x in values:
            self.add(x)

    def add(self, x: float) -> None:
        key = self._bin(x)
        entry = self._bins.get(key)
        if entry is None:
            self._bins[key] = [1, x]
        else:
            entry[0] += 1
            if entry[1] is not None and entry[1] != x:
                entry[1] = None
        self._count += 1

    def _bin(self, x: float) -> int:
        # Zero, then negatives, below every positive bin (|log x| / RESOLUTION < 10^6 for floats).
        if x <= 0:
            return -(1 << 62) if x == 0 else -(1 << 62) - 10**7 - int(math.floor(math.log(-x) / self.RESOLUTION))
        return int(math.floor(math.log(x) / self.RESOLUTION))

    def _value(self, key: int) -> float:
        count, exact = self._bins[key]
        if exact is not None:
            return exact
        return math.exp((key + 0.5) * self.RESOLUTION)

    def __len__(self) -> int:
        return self._count

    def median(self) -> float | None:
        if not self._count:
            return None
        lo, hi = (self._count - 1) // 2, self._count // 2  # the middle ranks
        seen, found = 0, []
        for key in sorted(self._bins):
            n = self._bins[key][0]
            for rank in (lo, hi):
                if seen <= rank < seen + n:
                    found.append(self._value(key))
            seen += n
            if len(found) == 2:
                break
        return (found[0] + found[1]) / 2


RECENT = 64  # steps kept whole, for the figures of the last few (`Throughput.recent`)


class Throughput:
    """Per-step figures of the speaking process (SPMD: every host runs the same steps): medians
    over every step, kept as running medians, and the last RECENT steps."""

    FIELDS = ("step_seconds", "tokens_per_second", "mfu")

    def __init__(self, model_flops_per_step: float = 0.0):
        self.model_flops_per_step = model_flops_per_step
        self._medians = {f: RunningMedian() for f in self.FIELDS}
        self._recent: collections.deque = collections.deque(maxlen=RECENT)

    def add(self, report: Step) -> None:
        values = (report.seconds, report.tokens_per_second, report.mfu)
        for f, x in zip(self.FIELDS, values):
            self._medians[f].add(x)
        self._recent.append(values)

    def recent(self, n: int) -> dict:
        """`summary`'s figures over the last `n` steps (at most RECENT)."""
        last = list(self._recent)[-n:]
        med = lambda i: round(statistics.median(v[i] for v in last), 6) if last else None  # noqa: E731
        return {
            "steps_measured": len(last),
            **{f: med(i) for i, f in enumerate(self.FIELDS)},
            "model_flops_per_step": self.model_flops_per_step,
        }

    def summary(self) -> dict:
        """Medians: the first step of a segment waits on lazy set-up and a save's step on the
        copy, so a mean would describe neither."""
        med = lambda f: round(m, 6) if (m := self._medians[f].median()) is not None else None  # noqa: E731
        return {
            "steps_measured": len(self._medians["step_seconds"]),
            **{f: med(f) for f in self.FIELDS},
            "model_flops_per_step": self.model_flops_per_step,
        }


HOST_LOSS_BADPUT = ("lost", "startup", "planning", "compile", "restore")  # what a host loss costs


class GoodputCallback(ControllerCallback):
    """Charges the job's wall time to the ledger: each report of the host that speaks for the group
    by its category (`protocol.Report.CATEGORY`), each step as useful or lost, planning as the
    controller's. Keeps the step throughput, per segment too, and what each host loss cost."""

    def __init__(self):
        self.ledger: Ledger | None = None
        self.throughput = Throughput()
        self.segments: list[Throughput] = []  # one per segment
        self.loss_badput: list[dict] = []  # per host loss: the badput from the loss to the first step past it
        self._at_host_loss: dict | None = None  # the ledger when the loss being recovered from was detected

    def on_attach(self, view) -> None:
        self.ledger = Ledger(view.started_wall)

    def on_state(self, view, previous, state) -> None:
        if state.phase is Phase.QUEUED and previous.phase is not Phase.QUEUED:
            self.ledger.fill(view.wall())
            self.ledger.gap = "queued"
        elif previous.phase is Phase.QUEUED and state.phase is not Phase.QUEUED:
            self.ledger.fill(view.wall(), "queued")
            self.ledger.gap = "startup"
        if state.phase is Phase.STARTING:
            self.ledger.add("planning", *state.planning_wall)
            self.ledger.gap = "startup"  # until the new group's first report
        elif state.phase is Phase.RUNNING and previous.phase is Phase.STARTING:
            self.segments.append(Throughput())

    def on_event(self, view, event) -> None:
        if event.kind == EventKind.HOST_LOST:
            if self._at_host_loss is None:  # a loss during a recovery is charged to the first
                self._at_host_loss = dict(self.ledger.seconds)
            # From the last report to now the group was failing, and until the next plan it is torn down.
            self.ledger.fill(view.wall(), "lost")
            self.ledger.gap = "lost"

    def on_report(self, view, host, report, speaker) -> None:
        if not speaker:
            return
        if isinstance(report, Step):
            self._step(view, report)
            return
        if isinstance(report, Compile):
            self.throughput.model_flops_per_step = report.model_flops
        if report.CATEGORY is not None and report.at is not None:
            self.ledger.add(report.CATEGORY, report.at - report.seconds, report.at)

    def _step(self, view, r: Step) -> None:
        self.throughput.add(r)
        self.segments[-1].add(r)
        begun = r.at - r.seconds
        waited = min(r.input_seconds or 0.0, r.seconds)
        copied = min(r.snapshot_seconds or 0.0, r.seconds - waited)
        if waited > 0:  # the step's lap holds its input wait: that part is input badput
            self.ledger.add("input", begun, begun + waited)
        if copied > 0:  # and the copy of a peer snapshot: checkpoint badput
            self.ledger.add("checkpoint", begun + waited, begun + waited + copied)
        # A step is useful the first time it is done; again after a restore, it is progress lost.
        self.ledger.add(USEFUL if r.step > view.step_reached else "lost", begun, r.at)
        recovery = getattr(view.state, "recovery", None)
        if recovery is not None and r.step > recovery.step and self._at_host_loss is not None:
            self._charge_host_loss()

    def _charge_host_loss(self) -> None:
        """What the ledger charged since the loss is its badput, by category; its total counts
        detection and tear-down, group start, planning, compile, restore and steps computed again
        (`HOST_LOSS_BADPUT`). Saves, input waits and evaluations in the window would have happened anyway."""
        before, self._at_host_loss = self._at_host_loss, None
        charged = {k: round(v - before[k], 4) for k, v in self.ledger.seconds.items() if k != USEFUL}
        self.loss_badput.append({"total": round(sum(charged[k] for k in HOST_LOSS_BADPUT), 4), **charged})

    def breakdown(self, view) -> dict:
        return self.ledger.breakdown(view.wall())

    def segment_medians(self) -> list[dict]:
        """Each segment's median step seconds, tokens per second and MFU, in segment order."""
        out = []
        for throughput in self.segments:
            s = throughput.summary()
            out.append({k: s[k] for k in ("step_seconds", "tokens_per_second", "mfu")})
        return out
