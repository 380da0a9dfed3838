"""The health loop: faults that do not crash, found from what the hosts report, and acted on
through the transitions a host loss or a resize already takes.

Two parts, as everywhere in the controller. Watches are callbacks that read the reports and say
what they found, with its evidence: `stragglers.StragglerWatch` (a host slower than its peers),
`hangs.HangWatch` (a step that never finishes while every host answers; it writes every host's
stacks first), `corruption.CorruptionWatch` (copies of the state that should be equal and are
not, `job.replicas`), `corruption.LossWatch` (a loss spike: a corruption that reached every copy
alike).
`HealthyScaling` is the scaling policy that decides what follows, and otherwise asks the job's
own: a straggler is excluded where the planner prices the hosts left faster than staying (else
warned of), a hung or corrupt host is set aside and the job recovers without it, from the newest
state that is known good, and a spike's step is computed again. A host set aside stays in the
`quarantine.Quarantine` (a view of the cluster without it) until a straggler passes its probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..hosts.probe import Probation, ProbeConfig
from ..protocol import EventKind, ReplicasDiffer
from . import policies
from .corruption import CorruptionWatch, LossWatch, Spike, corrupted_hosts
from .hangs import HangWatch, Hung
from .quarantine import Quarantine
from .stragglers import Straggler, StragglerWatch


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
                 probing: ProbeConfig | None = None):  # fmt: skip
        """`probe`: a `hosts.probe.HostProbe` (None: a straggler set aside stays aside)."""
        self.inner, self.watch, self.quarantine, self.predict, self.min_hosts = (
            inner, watch, quarantine, predict, min_hosts,
        )  # fmt: skip
        self.hangs, self.corruption, self.losses = hangs, corruption, losses
        self.probe, self.probing = probe, probing or ProbeConfig()
        self._probation: dict[str, Probation] = {}
        self._strikes: dict[str, int] = {}  # node -> times set aside as a straggler
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
        # Named while a resize waits for its boundary: acted on all the same, unless the resize is
        # this host's own exclusion (named again before the group stopped).
        if found is None or found.node in self.quarantine.excluded:
            return self.inner.while_running(view, state, alive)
        decided = self._decide(view, state, found)
        fields = {"host": found.host, "node": found.node, "evidence": found.evidence(), "action": decided.action,
                  "staying_seconds": round(decided.staying, 4)}  # fmt: skip
        if decided.without is not None:
            fields["without_seconds"] = round(decided.without, 4)
        if decided.action == "warned":
            return policies.Warn(EventKind.STRAGGLER, self._why(found, decided), fields)
        handed = self._set_aside(found.node, f"straggler at step {found.steps[-1]}")
        if self.probe is not None and not handed:  # (a fleet that took it probes it)
            # A host taken back that straggles again waits twice as long as the time before: a
            # probe passed by a host still slow (an idle host beside a busy peer) costs less each time.
            self._strikes[found.node] = strikes = self._strikes.get(found.node, 0) + 1
            wait = min(self.probing.first_after_s * 2 ** (strikes - 1), self.probing.max_wait_s)
            self._probation[found.node] = Probation.begin(found.node, self.probing, view.clock(), wait)
        return policies.Resize(state.target - 1, self._why(found, decided), EventKind.STRAGGLER, at_once=True,
                               fields=fields)  # fmt: skip

    def _set_aside(self, node: str, why: str) -> bool:
        """`node` out of the job's groups; True where the job's scaling policy handed it on (a
        shared cluster's fleet marks it suspect and probes it itself)."""
        self.quarantine.exclude(node, why)
        probe = self.probe.spec(node) if self.probe is not None else {"env": {}, "hook": None}
        return self.inner.set_aside(node, why, probe)

    def _evict(self, hung: Hung) -> policies.Evict:
        """A hung group cannot stop itself: its processes go, and the job recovers on the hosts
        left as after a host loss, the host the others waited on set aside."""
        if hung.host is None:
            why = (f"step {hung.step} has not finished in {hung.waited:.1f} s (more than {hung.threshold:.1f} s) and "
                   "every host returned from its dispatch: the group restarts on the same hosts")  # fmt: skip
            return policies.Evict((), why, EventKind.HANG, {"host": None, "evidence": hung.evidence(),
                                                             "action": "restarted"})  # fmt: skip
        self._set_aside(hung.node, f"hung at step {hung.step}")
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
            self._set_aside(node, f"its copy of the state differed after step {found.step}")
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
        waiting), and takes back the first whose probes passed: the job's scaling policy then
        sees one more host, as a host added."""
        if not self._probation:
            return None
        group, now = view.group, view.clock()
        for p in list(self._probation.values()):
            peers = [n for n in group.node_ids if n != p.node] if group is not None else []
            if not p.poll(self.probe, now, peers[0] if peers else None):
                continue
            del self._probation[p.node]
            self.quarantine.release(p.node)
            why = (f"node {p.node[:8]}, set aside as a straggler, passed its probe ({p.ratios[-1]:.2f}x a peer's "
                   f"time, at most {self.probing.healthy:.2f}x): taken back")  # fmt: skip
            fields = {"host": None, "node": p.node, "action": "taken back",
                      "evidence": {"probe_ratios": p.ratios, "tries": len(p.ratios)}}  # fmt: skip
            return policies.Warn(EventKind.STRAGGLER, why, fields)
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
            self._set_aside(node, f"the loss spike at step {traced.step} follows it")
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
