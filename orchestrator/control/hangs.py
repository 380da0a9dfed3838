"""A step that does not finish while every host answers its polls (a collective that never
completes, a wedged device): found from the time since the group last reported, named from where
each host's loop is (`worker.progress`), with every host's stacks written first. What follows is
`health.HealthyScaling`'s.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence

from ..protocol import ControllerCallback, LoopAt


@dataclasses.dataclass(frozen=True)
class HangConfig:
    """A step is hung when no host has reported anything for `multiple` x the median step time,
    and at least `floor_s` (every host still answering its polls)."""

    multiple: float = 5.0
    floor_s: float = 5.0
    # Step times a group must have before its median says anything: its first steps compile the
    # stop agreement's broadcast and the digest beside training, and may take seconds each.
    warmup_steps: int = 3
    # Where no host is behind (every one returned from the step's dispatch), the evidence is only
    # time: a step slowed by a loaded machine looks the same for a while. Wait this many times
    # as long before the group is restarted.
    unnamed: float = 3.0


@dataclasses.dataclass(frozen=True)
class Hung:
    """A hung step: the host the others wait on (None where the marks name nobody), and the evidence."""

    host: int | None
    node: str | None
    step: int  # the newest step any host began
    waited: float  # seconds since the group last reported anything
    threshold: float
    progress: tuple[dict | None, ...]  # each host's loop mark
    stacks: str  # the directory the stacks were written to

    def evidence(self) -> dict:
        return {
            "step": self.step,
            "waited_seconds": round(self.waited, 3),
            "threshold_seconds": round(self.threshold, 3),
            "loops": [p and {"step": p["step"], "where": p["where"]} for p in self.progress],
            "stacks": self.stacks,
        }


def waited_on(progress: Sequence[dict | None]) -> int | None:
    """The host a hung step waits on: the one host behind the others, still dispatching the newest
    step or not at it, while every other host returned from its dispatch; None where that is not
    one host (every host dispatched: the devices or the collective hang, and the marks cannot tell)."""
    marks = [(i, p) for i, p in enumerate(progress) if p]
    if len(marks) < len(progress) or not marks:
        return None
    newest = max(p["step"] for _, p in marks)
    behind = [i for i, p in marks if p["step"] < newest or p["where"] != LoopAt.DISPATCHED]
    return behind[0] if len(behind) == 1 else None


class HangWatch(ControllerCallback):
    """Finds a step that does not finish while every host answers its polls: nothing reported for
    max(`multiple` x the median step, `floor_s`) once the group has stepped a few times (a
    restarted group from its first step on, by the steps before it). Before anything is killed it
    writes every host's stacks under `log_dir`; `hung()` is what it found (once)."""

    def __init__(self, log_dir: str, config: HangConfig = HangConfig(), printer: Callable[[str], None] | None = None):
        self.log_dir, self.config, self.print = log_dir, config, printer or (lambda line: None)
        self._last: float | None = None  # controller clock: the group's latest report
        self._segment: int | None = None
        self._median: float | None = None  # the median step of the latest group that stepped enough
        self._found: Hung | None = None
        self._reported = False  # this segment's hang found already
        self._since: tuple[str | None, float | None] = (None, None)  # the host set aside, and its last report
        self._seen: tuple[Hung, float | None] | None = None  # a step seen hung, and the last report before it

    def on_report(self, view, host: int, report, speaker: bool) -> None:
        self._last = view.clock()

    def on_poll(self, view) -> None:
        segment, group = view.segment, view.group
        if segment is None or group is None:
            return
        if segment.index != self._segment:
            self._segment, self._last, self._reported, self._seen = segment.index, view.clock(), False, None
        if self._seen is not None:
            self._confirm()
            return
        threshold = self._threshold(view.recent_step_seconds, segment, group.progress)
        if threshold is None:
            return
        waited = view.clock() - (self._last if self._last is not None else view.clock())
        if self._reported or waited < threshold:
            return
        host = waited_on(group.progress)
        if host is None and waited < self.config.unnamed * threshold:
            return  # every host dispatched: a slow step looks the same for a while, so wait longer
        self._reported = True
        step = max((p["step"] for p in group.progress if p), default=view.step_reached)
        where = self._write_stacks(view, step)
        seen = Hung(host, None if host is None else group.node_ids[host], step, waited, threshold,
                    tuple(group.progress), where)  # fmt: skip
        self._seen = (seen, self._last)

    def _confirm(self) -> None:
        """A step seen hung is found hung only where the group reported nothing more while every
        host's stacks were written (seconds, on a loaded machine): a step that was only slow (a
        save beside hosts starting up) has finished by then, and training goes on."""
        (seen, last), self._seen = self._seen, None
        if self._last == last:
            self._found = seen
            return
        self._reported = False
        self.print(f"hang  step {seen.step} went {seen.waited:.1f} s without a report, then finished while the "
                   f"stacks were written: slow, not hung (stacks kept in {seen.stacks})")  # fmt: skip

    def _threshold(self, seconds, segment, progress) -> float | None:
        """Seconds without a report that make the group's step hung; None: not judged yet."""
        if segment.first_step is not None and len(seconds) >= self.config.warmup_steps:
            self._median = statistics.median(seconds)
            return max(self.config.multiple * self._median, self.config.floor_s)
        if self._median is None:
            return None  # the job's first group: no step seen yet says what one takes
        if segment.first_step is None and not all(p and p["where"] for p in progress):
            return None  # a host still restores or compiles (before its loop): not a step yet
        # A restarted group hung in its first steps (its very first included, once every host's
        # loop began: compiled and restored) is judged by the steps before it, with room for
        # those first steps' compiles of the stop agreement and the digest: `unnamed` times as long.
        return self.config.unnamed * max(self.config.multiple * self._median, self.config.floor_s)

    def hung(self) -> Hung | None:
        found = self._found
        self._found = None
        if found is not None:
            self._since = (found.node, self._last)  # for `lost_at`: when the group last reported
        return found

    def lost_at(self, node_ids) -> float | None:
        """When a host set aside for hanging stopped making progress (the group's last report)."""
        node, since = self._since
        return since if node is not None and node in node_ids else None

    def _write_stacks(self, view, step: int) -> str:
        """Every host's stacks, one file each, in a directory of its own under the log directory."""
        where = os.path.join(self.log_dir, f"hang-step{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(where, exist_ok=True)
        for i, text in enumerate(view.host_stacks()):
            with open(os.path.join(where, f"host{i}.txt"), "w") as f:
                f.write(text or "(did not answer)\n")
        return where
