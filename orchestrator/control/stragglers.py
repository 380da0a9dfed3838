"""A straggler told from what every host reports each step (`Step.wait_seconds`): in SPMD every
host's step takes the same time, so step time names nobody; the time each host spends blocked on
the devices and its peers does: the others wait for the straggler in every step's collectives,
and it waits least. A host's lead on a step is the others' median wait beyond its own, as a share
of the step's time; it is named when its mean lead over the last `window` steps, its largest left
out, is at least `lead`. A single stall (a save, a collection, one slow batch) is one step, left
out; jitter averages out. Slow steps led by different hosts are slowness that follows the data
(an imbalanced batch), not a host: nobody is named. What follows is `health.HealthyScaling`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence

from ..protocol import ControllerCallback, Step


@dataclasses.dataclass(frozen=True)
class StragglerConfig:
    """`mode`: "act" (exclude the host where predicted faster), "warn" (say so only), "off"."""

    mode: str = "act"
    window: int = 6  # the steps a host is judged over
    lead: float = 0.25  # its score at least: the others' wait beyond its own, a share of the step's time
    gain: float = 0.95  # act where the hosts left are predicted at most this share of staying's step time


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A host named: its index in the group, its node, and the evidence."""

    host: int
    node: str
    steps: tuple[int, ...]  # the steps it led
    lead_share: float  # its median lead over those steps, a share of the step's time
    step_seconds: float  # the group's median step time over the window
    others_wait: float  # the others' median wait per step (seconds)
    own_wait: float  # its own
    healthy_seconds: float | None  # the group's median step time over its latest steps nobody led

    def evidence(self) -> dict:
        return {
            "steps": list(self.steps),
            "lead_share": round(self.lead_share, 3),
            "step_seconds": round(self.step_seconds, 4),
            "others_wait_seconds": round(self.others_wait, 4),
            "own_wait_seconds": round(self.own_wait, 4),
            "healthy_step_seconds": None if self.healthy_seconds is None else round(self.healthy_seconds, 4),
        }

    @property
    def pace(self) -> float:
        """A step's seconds were the host not slow: the pace before it was, else the step less the
        others' wait for it."""
        if self.healthy_seconds is not None:
            return self.healthy_seconds
        return max(self.step_seconds - (self.others_wait - self.own_wait), 1e-9)


@dataclasses.dataclass(frozen=True)
class _Judged:
    step: int
    seconds: float
    shares: dict[int, float]  # each host's lead: the others' median wait beyond its own, over the step's time
    waits: dict[int, float]

    @property
    def leader(self) -> int:
        return max(self.shares, key=self.shares.get)


class StragglerWatch(ControllerCallback):
    """Reads every host's step reports; `named()` is the straggler found, if any (once each)."""

    def __init__(self, config: StragglerConfig = StragglerConfig()):
        self.config = config
        self._steps: dict[int, dict[int, Step]] = {}  # step -> host -> report, for the group training now
        self._judged: collections.deque[_Judged] = collections.deque(maxlen=config.window)
        self._healthy: collections.deque[float] = collections.deque(maxlen=9)  # seconds of steps nobody led
        self._segment: int | None = None
        self._named: Straggler | None = None
        self.imbalanced: tuple[int, ...] = ()  # the latest window of slow steps led by different hosts

    def on_report(self, view, host: int, report, speaker: bool) -> None:
        if self.config.mode == "off" or not isinstance(report, Step) or view.group is None:
            return
        segment = view.segment
        if segment is None or segment.first_step is None or report.step <= segment.first_step:
            return  # a group's first step waits for its peers and its compile: no evidence
        if segment.index != self._segment:
            self._segment, self._steps, self._named = segment.index, {}, None
            self._judged.clear()
            self._healthy.clear()
        seen = self._steps.setdefault(report.step, {})
        seen[host] = report
        if len(seen) == view.group.size:
            self._judge(self._steps.pop(report.step), view.group.node_ids)

    def named(self) -> Straggler | None:
        """The straggler named since last asked, if any."""
        named, self._named = self._named, None
        return named

    def _judge(self, reports: dict[int, Step], nodes: Sequence[str]) -> None:
        if len(reports) < 3:
            return  # with two hosts, which of them waits less says nothing of which is slow
        seconds = statistics.median(r.seconds for r in reports.values())
        waits = {h: r.wait_seconds for h, r in reports.items()}
        shares = {h: max(statistics.median(w for o, w in waits.items() if o != h) - waits[h], 0.0) / max(seconds, 1e-9)
                  for h in waits}  # fmt: skip
        judged = _Judged(next(iter(reports.values())).step, seconds, shares, waits)
        self._judged.append(judged)
        if max(shares.values()) < self.config.lead:
            self._healthy.append(seconds)
        self._name(nodes)

    def _score(self, host: int) -> float:
        """A host's lead over the window, its largest step left out: one stall (a collection, a
        save, a slow batch) is one step, and the others may run a step ahead of the slowest and
        wait for it only every other step (the stop agreement's broadcast is not every step)."""
        shares = sorted(j.shares.get(host, 0.0) for j in self._judged)
        return sum(shares[:-1]) / (len(shares) - 1)

    def _name(self, nodes: Sequence[str]) -> None:
        if len(self._judged) < 4:
            return
        scores = {h: self._score(h) for h in self._judged[-1].shares}
        host = max(scores, key=scores.get)
        led = [j for j in self._judged if j.shares[j.leader] >= self.config.lead]
        if scores[host] < self.config.lead:
            if len(led) >= 3 and len({j.leader for j in led}) > 1:
                self.imbalanced = tuple(j.step for j in led)  # slow steps, but not one host's: the data's
            return
        mine = [j for j in led if j.leader == host] or list(self._judged)
        self._named = Straggler(
            host,
            nodes[host],
            tuple(j.step for j in mine),
            statistics.median(j.shares[host] for j in mine),
            statistics.median(j.seconds for j in self._judged),
            statistics.median(statistics.median(w for o, w in j.waits.items() if o != host) for j in mine),
            statistics.median(j.waits[host] for j in mine),
            statistics.median(self._healthy) if self._healthy else None,
        )
        self._judged.clear()  # judged afresh from here: one naming per spell
