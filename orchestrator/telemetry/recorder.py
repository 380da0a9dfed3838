"""Where a controller's observations go besides its run summary: the fleet store and Ray's metrics.

`Recorder` is the no-op the controller uses when neither is wanted (tests driving the state
machine); `FleetRecorder` buffers rows and writes them to the store at most once per
`flush_interval_s`, so a job of fast steps does not hold the store's write lock for each one. It
keeps rows for at most `step_rows` steps per host: when a run reaches that, the rows kept so far
are thinned to every other step and only steps on the doubled stride are kept from then on.
"""

from __future__ import annotations

import time

from ..control.state import Phase
from ..protocol import STEP_RECORD, ControllerCallback, Restore, Step, step_record
from .summary import segments_dicts


class Recorder:
    def started(self) -> None: ...
    def event(self, event: dict) -> None: ...
    def step(self, host: int, segment: int, record: dict, speaker: bool) -> None: ...
    def resumed(self, step: int, reported: dict) -> None: ...
    def status(self, **fields) -> None: ...
    def due(self) -> bool:
        return False

    def flush(self, force: bool = False) -> None: ...
    def close(self) -> None: ...


class FleetRecorder(Recorder):
    def __init__(self, store, job, *, cluster: str, metrics=None, flush_interval_s: float = 1.0, step_rows: int = 4096,
                 submission: str = ""):  # fmt: skip
        """`store`: a FleetStore; `metrics`: a RayMetrics for the job-wide gauges, or None;
        `submission`: the id the run was submitted under."""
        self.store, self.job, self.cluster, self.metrics = store, job, cluster, metrics
        self.submission = submission
        self.flush_interval_s = flush_interval_s
        self.step_rows = step_rows
        self._stride = 1  # rows are kept at steps divisible by it, and at each segment's first
        self._kept: set[int] = set()  # the steps kept since the last thinning (at most step_rows)
        self._firsts: dict[int, int] = {}  # segment -> its first step, whose rows are all kept
        self._events: list[dict] = []
        self._steps: list[dict] = []
        self._status: dict = {}
        self._last_flush = 0.0

    def started(self) -> None:
        self.run = self.store.start_run(
            self.job.name, cluster=self.cluster, steps=self.job.steps, submission=self.submission
        )

    def event(self, event: dict) -> None:
        """A summary event, its `at` in wall-clock seconds."""
        self._events.append(event)
        if event["kind"] == "host_lost" and self.metrics:
            self.metrics.inc("remesh_host_losses_total", job=self.job.name)

    def step(self, host: int, segment: int, record: dict, speaker: bool) -> None:
        """One host's step (`protocol.step_record`); `speaker` when this host speaks for the group
        (the loss gauge)."""
        step = record["step"]
        if step % self._stride == 0 or self._firsts.setdefault(segment, step) == step:
            self._steps.append({"host": host, "segment": segment, **{k: record.get(k) for k in STEP_RECORD}})
            self._kept.add(step)
            if len(self._kept) > self.step_rows:
                self._thin()
        if speaker and self.metrics:
            self.metrics.set("remesh_loss", record["loss"], job=self.job.name)

    def resumed(self, step: int, reported: dict) -> None:
        """A resume from the checkpoint of `step`. A controller killed between two flushes of its
        store loses the rows it buffered, among them the steps up to that checkpoint, which this
        run will not compute again; the checkpoint keeps its steps' reports past the commit before
        it (`reported`: their segment and the reports), and the earlier run that got furthest gets
        those it lacks, as host 0's rows."""
        earlier = [r["run"] for r in self.store.runs(self.job.name) if r["run"] != self.run]
        if not earlier:
            return
        last, run = max((self.store.last_step(r), r) for r in earlier)
        rows = [
            {"host": 0, "segment": reported["segment"], **{k: r.get(k) for k in STEP_RECORD}}
            for r in reported["steps"]
            if last < r["step"] <= step
        ]
        if rows:
            self.store.add(run, steps=rows)
            self.store.update_run(run, steps_completed=rows[-1]["step"])

    def _thin(self) -> None:
        self.flush(force=True)
        self._stride *= 2
        self.store.thin_steps(self.run, self._stride)
        self._kept = {s for s in self._kept if s % self._stride == 0}

    def status(self, **fields) -> None:
        self._status.update(fields)
        if self.metrics:
            if fields.get("goodput_ratio") is not None:
                self.metrics.set("remesh_goodput_ratio", fields["goodput_ratio"], job=self.job.name)
            for kind, seconds in fields.get("goodput", {}).get("badput_seconds", {}).items():
                self.metrics.set("remesh_badput_seconds", seconds, job=self.job.name, kind=kind)
            if fields.get("devices"):
                self.metrics.set("remesh_devices", fields["devices"], job=self.job.name)

    def due(self) -> bool:
        return time.monotonic() - self._last_flush >= self.flush_interval_s

    def flush(self, force: bool = False) -> None:
        if not (force or self.due()):
            return
        self._last_flush = time.monotonic()
        if self._events or self._steps:
            self.store.add(self.run, events=self._events, steps=self._steps)
            self._events, self._steps = [], []
        if self._status:
            self.store.update_run(self.run, **self._status)
            self._status = {}

    def close(self) -> None:
        self.flush(force=True)
        self.store.close()


class RecorderCallback(ControllerCallback):
    """Feeds a `Recorder` (the fleet store and Ray's job-wide metrics): every host's steps, the
    run summary's events, and the job's status, at each new segment, about once a second and at
    the end: the segments as the controller keeps them, the figures as `goodput` and `summary`
    have them so far (it changes neither, and needs no order among them)."""

    def __init__(self, recorder: Recorder, goodput, summary):
        self.recorder, self.goodput, self.summary = recorder, goodput, summary

    def on_start(self, view) -> None:
        self.recorder.started()

    def on_state(self, view, previous, state) -> None:
        queued = Phase.QUEUED in (state.phase, previous.phase)
        if (state.phase is Phase.RUNNING and previous.phase is Phase.STARTING) or queued:
            self._status(view)
            self.recorder.flush()

    def on_report(self, view, host, report, speaker) -> None:
        if isinstance(report, Step):
            self.recorder.step(host, len(view.segments), step_record(report), speaker=speaker)
        elif isinstance(report, Restore) and speaker and report.reported:
            self._unreported(view.step_reached, report)

    def _unreported(self, done: int, report: Restore) -> None:
        """Steps up to the restored one whose reports never came: a group that went before its
        last steps were polled, or, on a resume, a controller killed before it stored them. The
        store counts segments from 1, specs from 0."""
        reported = report.reported
        if done == 0:  # a resume: they belong to an earlier run
            self.recorder.resumed(report.step, {**reported, "segment": reported["segment"] + 1})
            return
        for r in report.unreported(done):
            self.recorder.step(0, reported["segment"] + 1, r, speaker=False)

    def on_event(self, view, event) -> None:
        e = event.to_dict()
        self.recorder.event({**e, "at": view.started_wall + e["at"]})  # the store keeps wall-clock times

    def on_poll(self, view) -> None:
        if self.recorder.due():  # medians over every step: not at every poll
            self._status(view)
            self.recorder.flush()

    def on_end(self, view) -> None:
        self._status(view)
        self.recorder.close()

    def _status(self, view) -> None:
        segment, summary = view.segment, self.summary.summary
        goodput = summary.goodput or self.goodput.breakdown(view)
        recent = self.goodput.throughput.recent(20)  # "now" on the dashboard: the last 20 steps, not the run
        held = segment is not None and view.phase is not Phase.QUEUED
        self.recorder.status(
            state=view.phase.value,
            steps_completed=view.step_reached,
            mesh=segment.mesh if held else {},
            hosts=segment.hosts if held else 0,
            devices=segment.devices if held else 0,
            reason=_reason(view, summary),
            cluster_hosts=view.cluster.cluster_hosts(),
            tokens_per_second=recent["tokens_per_second"],
            mfu=recent["mfu"],
            goodput_ratio=goodput["goodput_ratio"],
            goodput=goodput,
            throughput=summary.throughput or self.goodput.throughput.summary(),
            segments=segments_dicts(view.segments, self.goodput.segment_medians()),
        )


def _reason(view, summary) -> str:
    """What the job's status says beside its state: why it waits (queued), why it runs on fewer
    hosts than it could (a shared cluster's grant), or how it ended."""
    if view.phase is Phase.QUEUED:
        return view.state.reason
    if view.phase is Phase.RUNNING and (status := view.scaling_status()):
        return status
    return summary.reason or ""
