"""Silent data corruption, as the controller hears of it: copies of the state that should be equal
and are not (`ReplicasDiffer`, from `job.replicas`), and a loss spike (a corruption that reached
every copy alike). What follows is `health.HealthyScaling`'s.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from ..protocol import ControllerCallback, ReplicasDiffer, Step


class CorruptionWatch(ControllerCallback):
    """Reads what the group's comparison of the state's copies found (`ReplicasDiffer`, from the
    host that speaks for the group: every process compares the same table); `found()` is the
    newest disagreement not yet acted on."""

    def __init__(self):
        self._found: ReplicasDiffer | None = None

    def on_report(self, view, host: int, report, speaker: bool) -> None:
        if speaker and isinstance(report, ReplicasDiffer):
            self._found = report

    def found(self) -> ReplicasDiffer | None:
        found, self._found = self._found, None
        return found


@dataclasses.dataclass(frozen=True)
class SpikeConfig:
    """A loss is a spike when it is not finite, or above the loss before it by more than
    max(`floor`, `spread` x the median relative change of the `window` steps before): past the
    first `warmup` steps, when a loss changes little from step to step."""

    warmup: int = 20
    window: int = 20
    floor: float = 0.1
    spread: float = 5.0


@dataclasses.dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    before: float  # the loss of the step before
    allowed: float  # the relative rise allowed

    def evidence(self) -> dict:
        return {"step": self.step, "loss": self.loss, "before": self.before, "allowed_rise": round(self.allowed, 4)}


class LossWatch(ControllerCallback):
    """Reads the loss of every step (from the host that speaks for the group) and finds a spike:
    a corruption that reached every copy alike (a wrong gradient before its reduction) leaves the
    copies equal and moves the loss. Each time a step spikes, computed again or not, it is found
    (the policy tells a fault that comes back from the data's)."""

    def __init__(self, config: SpikeConfig = SpikeConfig()):
        self.config = config
        self._losses: dict[int, float] = {}
        self._found: Spike | None = None

    def on_report(self, view, host: int, report, speaker: bool) -> None:
        if not speaker or not isinstance(report, Step):
            return
        spike = self._judge(report.step, report.loss)
        if spike is None:
            self._losses[report.step] = report.loss  # (a spike's loss is not the next step's reference)
            for old in [s for s in self._losses if s < report.step - 4 * self.config.window]:
                del self._losses[old]  # (a long job's history stays a few windows: no memory per step)
        else:
            self._found = spike

    def _judge(self, step: int, loss: float) -> Spike | None:
        c = self.config
        before = [self._losses[s] for s in range(step - c.window - 1, step) if s in self._losses]
        if step <= c.warmup or len(before) < c.window // 2 or (step - 1) not in self._losses:
            return None
        previous = self._losses[step - 1]
        changes = [abs(b - a) / max(abs(a), 1e-12) for a, b in zip(before, before[1:])]
        allowed = max(c.floor, c.spread * statistics.median(changes)) if changes else c.floor
        if math.isfinite(loss) and loss <= previous * (1 + allowed):
            return None
        return Spike(step, loss, previous, allowed)

    def found(self) -> Spike | None:
        found, self._found = self._found, None
        return found


def corrupted_hosts(found: ReplicasDiffer) -> tuple[int, ...]:
    """The hosts whose copies the majority of their block's copies named; () where no majority
    named any (two copies that differ: either may be the bad one)."""
    return tuple(sorted({p for d in found.disagreements if d["majority"] for p in d["processes"]}))
