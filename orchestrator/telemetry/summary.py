"""The run summary (the contract: `remesh run --summary FILE`), built by a controller callback and written as JSON."""

from __future__ import annotations

import array
import dataclasses
import json
from collections.abc import Iterator, MutableMapping
from typing import Any

from ..control.state import Phase
from ..protocol import EVENT_KINDS, ControllerCallback, Eval, EventKind, Restore, Step
from .goodput import GoodputCallback


class StepSeries(MutableMapping):
    """step -> value, held as 9 bytes a step (a float64 and a flag): a long run's per-step losses
    and metrics cost the controller little, where a dict costs about 100 bytes a step."""

    def __init__(self, items=()):
        self._values, self._present = array.array("d"), bytearray()
        self.update(items)

    def __setitem__(self, step: int, value: float) -> None:
        if step < 0:
            raise KeyError(step)
        if step >= len(self._present):
            grow = max(step + 1, 2 * len(self._present)) - len(self._present)
            self._values.extend([0.0] * grow)
            self._present.extend(bytes(grow))
        self._values[step], self._present[step] = value, 1

    def __getitem__(self, step: int) -> float:
        if not (0 <= step < len(self._present) and self._present[step]):
            raise KeyError(step)
        return self._values[step]

    def __delitem__(self, step: int) -> None:
        self[step]  # noqa: B018 (raises KeyError where absent)
        self._present[step] = 0

    def __iter__(self) -> Iterator[int]:
        return (s for s, p in enumerate(self._present) if p)

    def __len__(self) -> int:
        return self._present.count(1)

    def __repr__(self) -> str:
        return f"StepSeries({dict(self.items())})"


@dataclasses.dataclass
class RunSummary:
    job: str
    steps: int
    losses: StepSeries = dataclasses.field(default_factory=StepSeries)  # step -> loss (last run wins)
    metrics: dict[str, StepSeries] = dataclasses.field(default_factory=dict)  # name -> step -> value
    # The highest step known done: reported by a host, or restored from a checkpoint (a resumed
    # run starts from there). An int kept up to date, so asking for it costs nothing per report.
    steps_completed: int = 0
    segments: list = dataclasses.field(default_factory=list)  # control.state.Segment
    segment_medians: list = dataclasses.field(default_factory=list)  # per segment, where measured
    events: list[dict] = dataclasses.field(default_factory=list)
    recovery_seconds: list[float] = dataclasses.field(default_factory=list)
    recomputed_steps: list[int] = dataclasses.field(default_factory=list)  # per host loss: steps done again
    # Per host loss: the badput charged from the loss to the first step past it, by category and in total.
    loss_badput: list[dict] = dataclasses.field(default_factory=list)
    state: str = "running"
    reason: str = ""
    wall_seconds: float = 0.0
    goodput: dict = dataclasses.field(default_factory=dict)  # goodput.Ledger.breakdown
    throughput: dict = dataclasses.field(default_factory=dict)  # goodput.Throughput.summary

    def event(self, kind: str, *, step: int | None, at: float, seconds: float = 0.0, **extra: Any) -> dict:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; expected one of {EVENT_KINDS}")
        e = {"kind": str(kind), "step": step, "at": round(at, 4), "seconds": round(seconds, 4), **extra}
        self.events.append(e)
        return e

    def record_step(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        self.losses[step] = loss
        for name, value in (metrics or {}).items():
            self.metrics.setdefault(name, StepSeries())[step] = value
        self.reached(step)

    def record_eval(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        """An evaluation after `step`: kept beside the training metrics as `eval/loss`, `eval/...`."""
        for name, value in {"loss": loss, **(metrics or {})}.items():
            self.metrics.setdefault(f"eval/{name}", StepSeries())[step] = value

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
            "segments": segments_dicts(self.segments, self.segment_medians),
            "events": self.events,
            "recovery_seconds": self.recovery_seconds,
            "recomputed_steps": self.recomputed_steps,
            "loss_badput": self.loss_badput,
            "wall_seconds": round(self.wall_seconds, 3),
            "goodput": self.goodput,
            "throughput": self.throughput,
        }

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def segments_dicts(segments, medians) -> list[dict]:
    """The segments as the run summary and the fleet store list them, each with its medians."""
    return [s.to_dict(medians[i] if i < len(medians) else None) for i, s in enumerate(segments)]


class SummaryCallback(ControllerCallback):
    """Builds the run summary from what the speaking host reports and the controller's events;
    at the end, the goodput and throughput figures from `goodput`, which only reads them (it
    changes nothing it is given, so the two are called in any order)."""

    def __init__(self, goodput: GoodputCallback):
        self.goodput = goodput
        self.summary: RunSummary | None = None

    def on_attach(self, view) -> None:
        self.summary = RunSummary(job=view.job.name, steps=view.job.steps)
        self.summary.loss_badput = self.goodput.loss_badput

    def on_state(self, view, previous, state) -> None:
        if state.phase is Phase.RUNNING and previous.phase is Phase.STARTING:
            self.summary.segments.append(state.segment)
        elif state.phase is Phase.STOPPING or state.phase.is_terminal:
            self.summary.reason = state.reason or self.summary.reason  # a job that finishes while stopping keeps why
            self.summary.reached(view.step_reached)

    def on_report(self, view, host, report, speaker) -> None:
        if not speaker:
            return
        if isinstance(report, Step):
            self.summary.record_step(report.step, report.loss, report.metrics)
        elif isinstance(report, Eval):
            self.summary.record_eval(report.step, report.loss, report.metrics)
        elif isinstance(report, Restore):
            self._unreported(view.step_reached, report)
            self.summary.reached(report.step)  # a resumed run starts from there

    def _unreported(self, done: int, report: Restore) -> None:
        """Steps up to the restored one whose reports never came (a group that went before its
        last steps were polled): the restored step's metadata kept them. On a resume (no step of
        this run yet) they belong to an earlier run."""
        if done == 0:
            return
        for r in report.unreported(done):
            self.summary.record_step(r["step"], r["loss"], r.get("metrics"))

    def on_event(self, view, event) -> None:
        e = self.summary.event(event.kind, step=event.step, at=event.at, seconds=event.seconds, **event.fields)
        if event.kind == Restore.KIND and "recomputed" in e:
            self.summary.recomputed_steps.append(e["recomputed"])

    def on_recovered(self, view, seconds: float) -> None:
        self.summary.recovery_seconds.append(round(seconds, 3))

    def on_end(self, view) -> None:
        s = self.summary
        s.state, s.wall_seconds = view.phase.value, view.now()
        s.goodput = self.goodput.breakdown(view)
        s.throughput = self.goodput.throughput.summary()
        s.segment_medians = self.goodput.segment_medians()


__all__ = ["EVENT_KINDS", "EventKind", "RunSummary", "StepSeries", "SummaryCallback"]
