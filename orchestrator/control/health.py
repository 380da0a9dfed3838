"""The health loop: faults that do not crash, found from what the hosts report, and acted on
through the transitions a host loss or a resize already takes.

Two parts, as everywhere in the controller. Watches are callbacks that read the reports and say
what they found, with its evidence: `StragglerWatch` (a host slower than its peers),
`HangWatch` (a step that never finishes while every host answers; it writes every host's stacks
first), `CorruptionWatch` (copies of the state that should be equal and are not,
`job.replicas`), `LossWatch` (a loss spike: a corruption that reached every copy alike).
`HealthyScaling` is the scaling policy that decides what follows, and otherwise asks the job's
own: a straggler is excluded where the planner prices the hosts left faster than staying (else
warned of), a hung or corrupt host is set aside and the job recovers without it, from the newest
state that is known good, and a spike's step is computed again. A host set aside stays in the
`Quarantine` (a view of the cluster without it) for the rest of the run.

How a straggler is told. In SPMD every host's step takes the same time, so step time names
nobody; the time each host spends blocked on the devices and its peers does: the others wait for
the straggler in every step's collectives, and it waits least (`Step.wait_seconds`). A host leads
a step by the others' median wait beyond its own, as a share of the step's time; it is named when
its mean lead over the last `window` steps, its largest left out, is at least `lead`. A single
stall (a save, a collection, one slow batch) is one step, left out; jitter averages out. Slow
steps led by different hosts are slowness that follows the data (an imbalanced batch), not a
host: nobody is named.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from ..hosts.interface import Cluster, Placement
from ..protocol import ControllerCallback, EventKind, LoopAt, ReplicasDiffer, Step
from . import policies


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
    max(`multiple` x the median step, `floor_s`) once the group has stepped a few times. Before anything is
    killed it writes every host's stacks under `log_dir`; `hung()` is what it found (once)."""

    def __init__(self, log_dir: str, config: HangConfig = HangConfig(), printer: Callable[[str], None] | None = None):
        self.log_dir, self.config, self.print = log_dir, config, printer or (lambda line: None)
        self._last: float | None = None  # controller clock: the group's latest report
        self._segment: int | None = None
        self._found: Hung | None = None
        self._reported = False  # this segment's hang found already
        self._since: tuple[str | None, float | None] = (None, None)  # the host set aside, and its last report

    def on_report(self, view, host: int, report, speaker: bool) -> None:
        self._last = view.clock()

    def on_poll(self, view) -> None:
        segment, group = view.segment, view.group
        if segment is None or group is None or segment.first_step is None:
            return  # a group that has not stepped yet compiles and restores: its own timeouts apply
        if segment.index != self._segment:
            self._segment, self._last, self._reported = segment.index, view.clock(), False
        seconds = view.recent_step_seconds
        if len(seconds) < self.config.warmup_steps:
            return
        threshold = max(self.config.multiple * (statistics.median(seconds) if seconds else 0.0), self.config.floor_s)
        waited = view.clock() - (self._last if self._last is not None else view.clock())
        if self._reported or waited < threshold:
            return
        host = waited_on(group.progress)
        if host is None and waited < self.config.unnamed * threshold:
            return  # every host dispatched: a slow step looks the same for a while, so wait longer
        self._reported = True
        step = max((p["step"] for p in group.progress if p), default=view.step_reached)
        where = self._write_stacks(view, step)
        self._found = Hung(host, None if host is None else group.node_ids[host], step, waited, threshold,
                           tuple(group.progress), where)  # fmt: skip

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
        import os
        import time

        where = os.path.join(self.log_dir, f"hang-step{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(where, exist_ok=True)
        for i, text in enumerate(view.host_stacks()):
            with open(os.path.join(where, f"host{i}.txt"), "w") as f:
                f.write(text or "(did not answer)\n")
        return where


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


class Quarantine(Cluster):
    """`cluster` without the hosts set aside: a group is placed on the others. A host set aside
    comes back (`release`) once it passes its probe."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.excluded: dict[str, str] = {}  # node -> why

    def exclude(self, node: str, why: str) -> None:
        self.excluded[node] = why

    def release(self, node: str) -> None:
        self.excluded.pop(node, None)

    def alive_hosts(self) -> list[str]:
        return [n for n in self.cluster.alive_hosts() if n not in self.excluded]

    def live_hosts(self) -> list[str]:
        return self.cluster.live_hosts()  # (an excluded host's keeper still holds its snapshots)

    def slice_of(self) -> dict[str, str]:
        return self.cluster.slice_of()

    def loss_unit(self, hosts: int) -> int:
        return self.cluster.loss_unit(hosts)

    def host_env(self) -> dict[str, str]:
        return self.cluster.host_env()

    def placement(self, hosts: int) -> Placement:
        if not self.excluded:
            return self.cluster.placement(hosts)
        return self.cluster.placement_on(self.alive_hosts()[:hosts])

    def placement_on(self, nodes: Sequence[str]) -> Placement:
        return self.cluster.placement_on(nodes)

    def cluster_hosts(self) -> int:
        return self.cluster.cluster_hosts()

    def shutdown(self) -> None:
        self.cluster.shutdown()


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """A straggler set aside is probed `first_after_s` after, then at twice the wait each time it is
    still slow (at most `max_wait_s`); it is taken back when its probe takes at most `healthy`
    times a peer's."""

    first_after_s: float = 10.0
    max_wait_s: float = 600.0
    healthy: float = 1.25


@dataclasses.dataclass
class _Probation:
    node: str
    next_at: float  # controller clock
    wait_s: float
    tries: int = 0
    probing: object = None  # a probe under way (`hosts.probe.Probing`)
    ratios: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Traced:
    """A loss spike being traced: computed again once on the same hosts, then, where it comes
    back, without each host in turn; the host without which it does not come back is named."""

    step: int
    seen: int = 1
    candidates: list = dataclasses.field(default_factory=list)  # nodes still to leave out
    trying: str | None = None  # the node left out now
    segment: int = 0  # the first segment of the try
    done: bool = False


@dataclasses.dataclass(frozen=True)
class Exclude:
    """What `HealthyScaling` decided of a straggler, for the event that records it."""

    straggler: Straggler
    action: str  # "excluded" | "warned"
    staying: float  # seconds a step, predicted staying on every host
    without: float | None  # seconds a step on the hosts left, predicted (None: not asked)


class HealthyScaling(policies.Scaling):
    """The job's scaling policy (`inner`), with the health loop's decisions first: a straggler
    named by `watch` is excluded from the group (through `quarantine`) where the hosts left are
    predicted faster than staying (`predict(devices)`: a plan's predicted step seconds), else
    warned of."""

    def __init__(self, inner: policies.Scaling, watch: StragglerWatch, quarantine: Quarantine,
                 predict: Callable[[int], float], min_hosts: int, hangs: HangWatch | None = None,
                 corruption: CorruptionWatch | None = None, losses: LossWatch | None = None, probe=None,
                 probing: ProbeConfig = ProbeConfig()):  # fmt: skip
        """`probe`: a `hosts.probe.HostProbe` (None: a straggler set aside stays aside)."""
        self.inner, self.watch, self.quarantine, self.predict, self.min_hosts = (
            inner, watch, quarantine, predict, min_hosts,
        )  # fmt: skip
        self.hangs, self.corruption, self.losses = hangs, corruption, losses
        self.probe, self.probing = probe, probing
        self._probation: dict[str, _Probation] = {}
        self._traced: dict[int, _Traced] = {}

    def attach(self, view) -> None:
        self.inner.attach(view)

    def admit(self, view, wanted: int | None, since: float):
        return self.inner.admit(view, wanted, since)

    def status(self) -> str:
        return self.inner.status()

    def while_running(self, view, state, alive):
        corrupt = self.corruption.found() if self.corruption is not None else None
        if corrupt is not None:
            return self._repair(view, corrupt)
        spike = self.losses.found() if self.losses is not None else None
        if spike is not None:
            return self._recompute(view, spike)
        settled = self._settled(view)
        if settled is not None:
            return settled
        hung = self.hangs.hung() if self.hangs is not None else None
        if hung is not None:
            return self._evict(hung)
        taken = self._probed(view)
        if taken is not None:
            return taken
        found = self.watch.named()
        if found is None or state.resize:
            return self.inner.while_running(view, state, alive)
        decided = self._decide(view, state, found)
        fields = {"host": found.host, "node": found.node, "evidence": found.evidence(), "action": decided.action,
                  "staying_seconds": round(decided.staying, 4)}  # fmt: skip
        if decided.without is not None:
            fields["without_seconds"] = round(decided.without, 4)
        if decided.action == "warned":
            return policies.Warn(EventKind.STRAGGLER, self._why(found, decided), fields)
        self.quarantine.exclude(found.node, f"straggler at step {found.steps[-1]}")
        if self.probe is not None:
            wait = self.probing.first_after_s
            self._probation[found.node] = _Probation(found.node, view.clock() + wait, wait)
        return policies.Resize(state.target - 1, self._why(found, decided), EventKind.STRAGGLER, at_once=True,
                               fields=fields)  # fmt: skip

    def _evict(self, hung: Hung) -> policies.Evict:
        """A hung group cannot stop itself: its processes go, and the job recovers on the hosts
        left as after a host loss, the host the others waited on set aside."""
        if hung.host is None:
            why = (f"step {hung.step} has not finished in {hung.waited:.1f} s (more than {hung.threshold:.1f} s) and "
                   "every host returned from its dispatch: the group restarts on the same hosts")  # fmt: skip
            return policies.Evict((), why, EventKind.HANG, {"host": None, "evidence": hung.evidence(),
                                                             "action": "restarted"})  # fmt: skip
        self.quarantine.exclude(hung.node, f"hung at step {hung.step}")
        why = (f"step {hung.step} has not finished in {hung.waited:.1f} s (more than {hung.threshold:.1f} s); the "
               f"others wait on host {hung.host}: the job goes on without it")  # fmt: skip
        fields = {"host": hung.host, "node": hung.node, "evidence": hung.evidence(), "action": "excluded"}
        return policies.Evict((hung.host,), why, EventKind.HANG, fields)

    def _repair(self, view, found: ReplicasDiffer) -> policies.Evict:
        """Copies that differ: the state goes back to the newest step whose copies agreed (a peer
        snapshot, else the newest commit: every commit was compared first), and the hosts the
        majority named are set aside. Training resumes from there, so nothing the corruption
        touched is kept."""
        hosts = corrupted_hosts(found)
        nodes = [view.group.node_ids[h] for h in hosts] if view.group is not None else []
        for node in nodes:
            self.quarantine.exclude(node, f"its copy of the state differed after step {found.step}")
        leaves = sorted({d["leaf"] for d in found.disagreements})
        named = f"host(s) {list(hosts)}' copies" if hosts else "two copies (no majority to name one)"
        why = (f"after step {found.step} {named} of {', '.join(leaves[:3])}{' ...' if len(leaves) > 3 else ''} "
               f"differ from the others: back to step {found.clean_step}, whose copies agreed"
               + (", without the host(s)" if hosts else ""))  # fmt: skip
        fields = {"host": hosts[0] if len(hosts) == 1 else list(hosts), "nodes": nodes,
                  "evidence": {"found_after_step": found.step, "clean_step": found.clean_step, "every": found.every,
                               "disagreements": found.disagreements},
                  "action": "repaired and excluded" if hosts else "repaired"}  # fmt: skip
        return policies.Evict(hosts, why, EventKind.CORRUPTION, fields, restore_at_most=found.clean_step)

    def _probed(self, view) -> policies.Warn | None:
        """Probes the stragglers set aside that are due (beside a host of the group, without
        waiting), and takes back the first whose probe is healthy: the job's scaling policy then
        sees one more host, as a host added."""
        if not self._probation:
            return None
        group, now = view.group, view.clock()
        for p in list(self._probation.values()):
            if p.probing is None:
                if now >= p.next_at and group is not None and [n for n in group.node_ids if n != p.node]:
                    p.probing = self.probe.start(p.node, next(n for n in group.node_ids if n != p.node))
                continue
            ratio = self.probe.result(p.probing)
            if ratio is False:
                continue  # (still running)
            p.probing, p.tries = None, p.tries + 1
            p.ratios.append(None if ratio is None else round(ratio, 3))
            if ratio is not None and ratio <= self.probing.healthy:
                del self._probation[p.node]
                self.quarantine.release(p.node)
                why = (f"node {p.node[:8]}, set aside as a straggler, passed its probe ({ratio:.2f}x a peer's time, "
                       f"at most {self.probing.healthy:.2f}x): taken back")  # fmt: skip
                fields = {"host": None, "node": p.node, "action": "taken back",
                          "evidence": {"probe_ratios": p.ratios, "tries": p.tries}}  # fmt: skip
                return policies.Warn(EventKind.STRAGGLER, why, fields)
            p.wait_s = min(2 * p.wait_s, self.probing.max_wait_s)
            p.next_at = now + p.wait_s
        return None

    def _recompute(self, view, spike: Spike):
        """A loss spike: the step is computed again from the state before it (a peer snapshot, else
        the newest commit at or before it). The first time on the same hosts; where it comes back,
        without each host in turn, so that the host it follows is named; where it comes back
        without every one of them, it is the data's and training goes on."""
        traced = self._traced.get(spike.step)
        evidence = spike.evidence()
        if traced is None:
            self._traced[spike.step] = _Traced(spike.step)
            why = (f"the loss at step {spike.step} is {spike.loss:.4g}, up from {spike.before:.4g} (more than "
                   f"{spike.allowed:.0%} a step): computed again from the state before it")  # fmt: skip
            return policies.Evict((), why, EventKind.CORRUPTION, {"host": None, "evidence": evidence,
                                                                   "action": "recomputed"}, spike.step - 1)  # fmt: skip
        if traced.done:
            return policies.Continue()
        traced.seen += 1
        if traced.trying is not None:
            self.quarantine.release(traced.trying)  # (the spike came back without it: not this one)
        elif view.group is not None and view.group.size - 1 >= self.min_hosts:
            traced.candidates = list(view.group.node_ids)
        if not traced.candidates:
            traced.done = True
            why = (f"the loss at step {spike.step} is high each time it is computed ({traced.seen} times), whichever "
                   "host is left out: the data's, and training goes on")  # fmt: skip
            return policies.Warn(EventKind.CORRUPTION, why, {"host": None, "evidence": evidence, "action": "accepted"})
        traced.trying, traced.segment = traced.candidates.pop(0), len(view.segments)
        self.quarantine.exclude(traced.trying, f"left out while the loss spike at step {spike.step} is traced")
        why = (f"the loss at step {spike.step} spiked again when computed again ({traced.seen} times): computed "
               f"again without node {traced.trying[:8]}")  # fmt: skip
        fields = {"host": None, "node": traced.trying, "evidence": evidence, "action": "recomputed without a host"}
        return policies.Evict((), why, EventKind.CORRUPTION, fields, spike.step - 1)

    def _settled(self, view) -> policies.Warn | None:
        """A traced spike whose step was computed without it, once a node was left out: that node
        is named, and stays out."""
        segment = view.segment
        for traced in self._traced.values():
            if traced.trying is None or traced.done or segment is None or segment.index < traced.segment:
                continue
            if segment.last_step is None or segment.last_step <= traced.step:
                continue
            traced.done, node = True, traced.trying
            self.quarantine.exclude(node, f"the loss spike at step {traced.step} follows it")
            why = (f"the loss at step {traced.step} spiked each time node {node[:8]} computed it ({traced.seen} "
                   "times) and not without it: set aside")  # fmt: skip
            return policies.Warn(EventKind.CORRUPTION, why, {"host": None, "node": node, "action": "excluded",
                                                              "evidence": {"step": traced.step, "spikes": traced.seen}})  # fmt: skip
        return None

    def _decide(self, view, state, found: Straggler) -> Exclude:
        staying = found.step_seconds
        if self.watch.config.mode != "act" or state.target - 1 < self.min_hosts:
            return Exclude(found, "warned", staying, None)
        devices = view.job.hosts.devices_per_host
        # The step at the pace before the host was slow, scaled as the planner prices the
        # smaller mesh against this one.
        ratio = self.predict((state.target - 1) * devices) / self.predict(state.target * devices)
        without = found.pace * ratio
        action = "excluded" if without <= self.watch.config.gain * staying else "warned"
        return Exclude(found, action, staying, without)

    @staticmethod
    def _why(found: Straggler, decided: Exclude) -> str:
        said = (f"host {found.host} is slow: the others waited {found.lead_share:.0%} of each step for it in "
                f"{len(found.steps)} of the last steps")  # fmt: skip
        if decided.without is None:
            return said
        verdict = "so the job goes on without it" if decided.action == "excluded" else "staying is faster"
        return (f"{said}; predicted {decided.without:.3g} s a step without it against {decided.staying:.3g} s "
                f"staying, {verdict}")  # fmt: skip
