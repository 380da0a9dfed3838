"""The controller's side of fault injection: hosts killed, stopped and added as faults fall due,
and the worker hooks (`host.HostFaults`) of the hosts that must hang or straggle."""

from __future__ import annotations

from collections.abc import Callable

from ..control.state import Phase
from ..hosts.interface import EmulatedHosts
from ..protocol import ControllerCallback, EventKind, Hang, HookRef
from .faults import ANY_CLUSTER, ChaosInjector, ChaosSpecError, Fault, phase_order

HOST_FAULTS = "orchestrator.chaos.host:HostFaults"  # (named, not imported: the worker imports it)


class ChaosCallback(ControllerCallback):
    """Carries out faults as the job reaches them, on `hosts` (the embedded cluster, whose hosts
    it kills, stops and adds; None where only `slow` faults are given). `printer`: where it says
    what it does."""

    def __init__(self, faults: tuple[Fault, ...], printer: Callable[[str], None] | None = None,
                 hosts: EmulatedHosts | None = None):  # fmt: skip
        if hosts is None and any(f.kind not in ANY_CLUSTER for f in faults):
            raise ChaosSpecError(f"faults other than {', '.join(ANY_CLUSTER)} need the embedded cluster's hosts")
        self.injector = ChaosInjector(faults)
        self.hosts = hosts
        self.print = printer or (lambda line: print(line, flush=True))
        self._caused: dict[str, float] = {}  # node id -> when a fault killed or stopped it (controller clock)
        self._nodes: dict[Fault, str] = {}  # a fault that follows its node -> the node (its host in the first group)

    def test_hooks(self, view, hosts: int) -> dict[int, HookRef]:
        """A `HostFaults` hook for each host of a new group that must hang in a phase or straggle.
        A host carrying several phase faults hangs in the first of those phases it reaches."""
        hangs = self.injector.hangs(view.step_reached)
        save = {f.host_in(hosts): f.step for f in hangs if f.phase == "save"}
        phase = {f.host_in(hosts): f.phase for f in sorted(hangs, key=phase_order, reverse=True) if f.phase != "save"}
        slow = {(h if h is not None else hosts - 1): s for h, s in self.injector.slow_hosts().items()}
        pending = self.injector.pending
        # The health loop's faults: HostFaults' argument -> {host: its value}.
        health = {
            "slow_step": self._on_nodes(view, "slow-step", lambda f: (f.step, f.factor)),
            "hang_at_step": {f.host_in(hosts): f.step for f in pending("hang")},
            "flip": {f.host_in(hosts): (f.step, int(f.factor)) for f in pending("flip")},
            "flip_grad_at": self._on_nodes(view, "flip-grad", lambda f: (f.step, f.factor == 0)),
            "jitter": {i: (f.step, f.factor) for f in pending("jitter") for i in range(hosts)},
            "stall": {f.host_in(hosts): (f.step, f.factor) for f in pending("stall")},
        }
        nodes = view.group.node_ids
        for i, (step, factor) in health["slow_step"].items():  # (said each group: which node a slow-step slows)
            self.print(f"chaos slow-step from {step} x{factor:g}: host {i} of {len(nodes)} (node {nodes[i][:8]})")
        hooks = {}
        for i in sorted({*save, *phase, *slow, *(h for found in health.values() for h in found)}):
            args = {"hang_in": phase.get(i), "hang_before_save": save.get(i), "slow_input_from": slow.get(i)}
            args.update({name: found[i] for name, found in health.items() if i in found})
            hooks[i] = HookRef(HOST_FAULTS, args)
        return hooks

    def probe_hook(self, node: str) -> HookRef | None:
        """The hook for a probe of `node` (`hosts.probe`): slow where a slow-step fault slows it."""
        slow = [f for f in self.injector.pending("slow-step") if self._nodes.get(f) == node]
        return HookRef(HOST_FAULTS, {"slow_step": (slow[0].step, slow[0].factor)}) if slow else None

    def _on_nodes(self, view, kind: str, value) -> dict:
        """{its node's index in the group starting now: `value(fault)`} for the pending faults of
        `kind`, which follow their node: host H of the group that reaches the fault's step (until
        then, host H of each group), in every group it is in after. A host carries one fault of a
        kind: one bound to its node before one not yet bound (whose host H is only provisional),
        else the earliest."""
        nodes = list(view.group.node_ids)
        out = {}
        for fault in sorted(self.injector.pending(kind), key=lambda f: (f not in self._nodes, f.step)):
            node = self._nodes.get(fault)
            if node is None:
                out.setdefault(fault.host_in(len(nodes)), value(fault))
            elif node in nodes:
                out.setdefault(nodes.index(node), value(fault))
        return out

    def _bind_nodes(self, view) -> None:
        """Faults that follow their node take host H's of the group that reaches their step."""
        group = view.group
        for fault in (*self.injector.pending("slow-step"), *self.injector.pending("flip-grad")):
            if fault not in self._nodes and fault.step <= view.step_reached + 1 and group is not None:
                self._nodes[fault] = node = group.node_ids[fault.host_in(group.size)]
                self.print(f"chaos {fault}: follows node {node[:8]} (host {fault.host_in(group.size)} of "
                           f"{group.size} at step {view.step_reached})")  # fmt: skip

    def on_state(self, view, previous, state) -> None:
        if state.phase is Phase.RUNNING and previous.phase is Phase.STARTING and state.recovery is not None:
            for fault in self.injector.recovery_adds(state.recovery.step):  # a host joins mid-recovery
                self.print(f"chaos {fault}: adding a host while the new group starts")
                self.hosts.add_host()

    def on_event(self, view, event) -> None:
        found = {EventKind.HANG: ("hang",), EventKind.CORRUPTION: ("flip", "flip-grad")}.get(event.kind, ())
        # A hang's step is the one hung, past the step reached where the step before it was never
        # read back (it is, only once the hung step is dispatched).
        step = event.fields.get("evidence", {}).get("step", event.step) if event.kind == EventKind.HANG else event.step
        due = [f for kind in found for f in self.injector.pending(kind) if f.step <= (step or 0) + 1]
        for fault in due:  # found: not in the next group
            self.print(f"chaos {fault}: found ({event.kind}, {event.fields.get('action')})")
            if not (fault.kind == "flip-grad" and fault.factor == 0):  # (a bad host's fault comes back)
                self.injector.fired(fault)
        if event.kind == EventKind.STRAGGLER:  # (a slow node stays slow: the fault rides on)
            for fault in self.injector.pending("slow-step"):
                if self._nodes.get(fault) == event.fields.get("node"):
                    self.print(f"chaos {fault}: found (straggler, {event.fields.get('action')})")

    def on_report(self, view, host, report, speaker) -> None:
        if isinstance(report, Hang):  # whichever host hangs is the one to kill
            self._kill(view, host, str(self.injector.hung(report.phase, report.step)))

    def on_poll(self, view) -> None:
        group = view.group
        self._bind_nodes(view)
        for fault in self.injector.due(view.step_reached):
            if fault.kind == "lose":
                for host in fault.hosts_in(group.size):
                    self._kill(view, host, str(fault))
            elif fault.kind == "lose-slice":
                for host in self._slice_hosts(view, fault):
                    self._kill(view, host, str(fault))
            elif fault.kind == "freeze":
                host = fault.host_in(group.size)
                node = group.node_ids[host]
                self.print(f"chaos {fault}: stopping host {host}'s process (node {node[:8]}, SIGSTOP)")
                self._caused[node] = view.clock()
                self.hosts.freeze_process(group.places[host]["pid"])
            elif fault.kind == "add":
                self.print(f"chaos {fault}: adding a host")
                self.hosts.add_host()
            elif fault.kind == "heal":
                slow = self.injector.pending("slow-step")
                self.print(f"chaos {fault}: {len(slow)} slow host(s) at full speed again")
                for f in slow:
                    self.injector.fired(f)

    def _slice_hosts(self, view, fault: Fault) -> list[int]:
        """The group's hosts in its slice K (slices in the group's order; K beyond them: the last)."""
        said = view.cluster.slice_of()
        if not said:
            raise ChaosSpecError(f"{fault}: the job is not laid out in slices; set [hosts] hosts_per_slice")
        names = list(dict.fromkeys(said[n] for n in view.group.node_ids))
        name = names[min(fault.hosts[0] if fault.hosts else len(names) - 1, len(names) - 1)]
        return [i for i, n in enumerate(view.group.node_ids) if said[n] == name]

    def _kill(self, view, host: int, why: str) -> None:
        node = view.group.node_ids[host]
        self.print(f"chaos {why}: killing host {host} (node {node[:8]})")
        self._caused[node] = view.clock()
        try:
            self.hosts.kill_host(node)
        except KeyError:  # gone already: a loss not yet seen
            self.print(f"      host {host} (node {node[:8]}) is gone already")

    def lost_at(self, node_ids) -> float | None:
        caused = [self._caused.pop(n) for n in node_ids if n in self._caused]
        return caused[0] if caused else None
