"""Fault injection for tests, the demo and the fault storm: `--chaos lose@40,add@80,lose-in-save@50:0`.

Two parts, and nothing else of remesh knows of either: `ChaosCallback` is a controller callback
that kills, stops and adds hosts as faults fall due and attaches a `HostFaults` test hook to the
hosts that must hang or straggle; `HostFaults` is that hook in the worker (worker/hooks.py).

lose@S[:H[+H]]        after step S is reported, kill host H's node (default: the last host);
                      `lose@S:0+2` kills hosts 0 and 2 at once
lose-in-save@S[:H]    host H hangs instead of saving checkpoint S; its node is killed mid-save
lose-in-start@S[:H]   host H of the first group started after step S hangs as that group starts
lose-in-compile@S[:H] (before joining jax.distributed), compiles, or restores; its node is
lose-in-restore@S[:H] killed there, while the rest of the group waits on it
lose-slice@S[:K]      after step S is reported, kill every host of the group's slice K at once
                      (default: its last slice; a job laid out in slices, `hosts_per_slice`)
add@S                 after step S is reported, add one host to the cluster
add-in-recovery@S     the first recovery from a host loss after step S gets one host added to the
                      cluster while its new group starts
freeze@S[:H]          after step S is reported, stop host H's process (SIGSTOP): a hung host, alive
                      to Ray, that answers nothing
slow@S[:H]            from step S on, host H's input takes SLOW_INPUT_SECONDS longer each step:
                      a straggler (works on any cluster: nothing is killed)
hang@S[:H]            host H blocks as it dispatches step S, its actor still answering polls: a
                      step that never finishes (the health loop finds it; fires once)
flip@S[:H][xB]        after step S, bit B (default 30, a high exponent bit of a float32) of one
                      element of host H's copy of a replicated parameter flips: silent data
                      corruption in one copy (fires once)
flip-grad@S[:H][xN]   host H's rows of step S's batch are corrupted (integers XOR 1, floats x 1000)
                      as it feeds them: its local gradient is wrong before the reduction, and the
                      update reaches every copy alike (a loss spike). Once (N = 1, the default),
                      or every time its node computes step S (N = 0: a bad host)
heal@S                after step S is reported, every slow-step host computes at full speed again
                      (its probe passes, and the health loop takes it back)
jitter@S[xF]          from step S on, every host's work on each step takes a random extra
                      0 to 2F (0.2) of a healthy step: healthy hosts that vary (no straggler)
stall@S[:H][xT]       after step S, host H stops for T (5) seconds once: a pause, not a straggler
slow-step@S[:H][xF]   from step S on, host H's work on each step takes F times as long (default
                      3): a slow host, the slowness its own, not its input's; it follows the
                      node (a group without it runs at full speed), on any cluster
"""

from __future__ import annotations

import dataclasses
import random
import re
import threading
import time
from collections.abc import Callable

from .control.state import Phase
from .hosts.interface import EmulatedHosts
from .protocol import ControllerCallback, EventKind, Hang, HookRef
from .worker.hooks import FaultHook

PHASES = ("start", "compile", "restore")  # where a `lose-in-<phase>` host hangs, in a group's order
KINDS = ("lose", "lose-slice", "lose-in-save", *(f"lose-in-{p}" for p in PHASES), "add", "add-in-recovery", "freeze",
         "slow", "slow-step", "hang", "flip", "flip-grad", "jitter", "stall", "heal")  # fmt: skip
SLOW_INPUT_SECONDS = 0.3
SLOW_STEP_FACTOR = 3.0
ANY_CLUSTER = (
    "slow",
    "slow-step",
    "hang",
    "flip",
    "flip-grad",
    "jitter",
    "stall",
)  # kinds that need no control over the cluster's nodes
FLIP_BIT = 30
_FAULT = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<hosts>\d+(?:\+\d+)*))?(?:x(?P<factor>\d+(?:\.\d+)?))?$")
_FACTOR = (
    "slow-step",
    "flip",
    "jitter",
    "stall",
    "flip-grad",
)  # take xF (flip: the bit; stall: seconds; flip-grad: times)
_NO_HOST = ("add", "add-in-recovery", "jitter", "heal")


class ChaosSpecError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    hosts: tuple[int, ...] = ()  # indices within the running group; () means the last host
    factor: float = 0.0  # slow-step's: how many times as long the host's step work takes

    def host_in(self, size: int) -> int:
        """The one host this fault names, in a group of `size` hosts (one beyond it: the last)."""
        return self.hosts_in(size)[0]

    def hosts_in(self, size: int) -> list[int]:
        return sorted({min(h, size - 1) for h in self.hosts}) if self.hosts else [size - 1]

    @property
    def phase(self) -> str | None:
        """For `lose-in-<phase>`: the phase (save, start, compile, restore) the host hangs in."""
        return self.kind.removeprefix("lose-in-") if self.kind.startswith("lose-in-") else None

    def __str__(self) -> str:
        hosts = (":" + "+".join(map(str, self.hosts))) if self.hosts else ""
        return f"{self.kind}@{self.step}{hosts}" + (f"x{self.factor:g}" if self.kind in _FACTOR else "")


def parse_chaos(text: str | None) -> tuple[Fault, ...]:
    if not text:
        return ()
    faults = []
    for item in text.split(","):
        m = _FAULT.match(item.strip())
        if not m or m["kind"] not in KINDS:
            raise ChaosSpecError(
                f"bad fault {item.strip()!r}: expected KIND@STEP[:HOST[+HOST]][xFACTOR] with KIND one of {KINDS}, "
                "e.g. lose@40,add@80, lose-in-save@50:0 or slow-step@20:2x3"
            )
        hosts = tuple(int(h) for h in m["hosts"].split("+")) if m["hosts"] else ()
        if m["factor"] and m["kind"] not in _FACTOR:
            raise ChaosSpecError(f"bad fault {item.strip()!r}: only {', '.join(_FACTOR)} takes xFACTOR")
        default = {"slow-step": SLOW_STEP_FACTOR, "flip": float(FLIP_BIT), "jitter": 0.2, "stall": 5.0,
                   "flip-grad": 1.0}.get(m["kind"], 0.0)  # fmt: skip
        factor = float(m["factor"]) if m["factor"] else default
        if m["kind"] == "slow-step" and factor <= 1:
            raise ChaosSpecError(f"bad fault {item.strip()!r}: xFACTOR must be above 1 (how many times as long)")
        if m["kind"] == "flip" and (factor != int(factor) or not 0 <= factor < 32):
            raise ChaosSpecError(f"bad fault {item.strip()!r}: flip's xBIT must be a bit of a 32-bit word, 0 to 31")
        if m["kind"] == "flip-grad" and factor not in (0, 1):
            raise ChaosSpecError(f"bad fault {item.strip()!r}: flip-grad's xN is 1 (once) or 0 (every time)")
        if hosts and m["kind"] in _NO_HOST:
            raise ChaosSpecError(f"bad fault {item.strip()!r}: {m['kind']}@STEP takes no host")
        if len(hosts) > 1 and m["kind"] != "lose":
            raise ChaosSpecError(f"bad fault {item.strip()!r}: only lose@STEP takes several hosts (H+H)")
        if len(set(hosts)) != len(hosts):
            raise ChaosSpecError(f"bad fault {item.strip()!r}: a host is named twice")
        faults.append(Fault(m["kind"], int(m["step"]), hosts, factor))
    return tuple(sorted(faults, key=lambda f: f.step))


class ChaosInjector:
    """Tracks which faults have fired; the callback asks what is due and carries it out."""

    def __init__(self, faults: tuple[Fault, ...]):
        self._pending = list(faults)

    def due(self, completed_step: int) -> list[Fault]:
        """`lose`, `add` and `freeze` faults whose step has been reached (each fires once)."""
        fired = [
            f
            for f in self._pending
            if f.kind in ("lose", "lose-slice", "add", "freeze", "heal") and f.step <= completed_step
        ]
        self._pending = [f for f in self._pending if f not in fired]
        return fired

    def hangs(self, completed_step: int) -> list[Fault]:
        """`lose-in-<phase>` faults a group started now carries (they fire when the host reports
        that it hangs): every save fault still to fire, and start, compile and restore faults whose
        step is reached."""
        return [f for f in self._pending if f.phase == "save" or (f.phase in PHASES and f.step <= completed_step)]

    def hung(self, phase: str, step: int) -> Fault:
        """The fault a host that reports hanging in `phase` (at `step`, for a save) carries out."""
        fault = next(f for f in self._pending if f.phase == phase and (phase != "save" or f.step == step))
        self.fired(fault)
        return fault

    def recovery_adds(self, completed_step: int) -> list[Fault]:
        """`add-in-recovery` faults due in a recovery from a loss after `completed_step`."""
        fired = [f for f in self._pending if f.kind == "add-in-recovery" and f.step <= completed_step]
        self._pending = [f for f in self._pending if f not in fired]
        return fired

    def slow_hosts(self) -> dict[int | None, int]:
        """`slow` faults (they never fire: they ride in every segment's spec): host -> from step."""
        return {(f.hosts[0] if f.hosts else None): f.step for f in self._pending if f.kind == "slow"}

    def pending(self, kind: str) -> list[Fault]:
        """Faults of `kind` not fired yet. The health loop's ride in every group until what they
        cause is found (`hang`, `flip`, `flip-grad`), or for ever (`slow-step`, `jitter`, `stall`)."""
        return [f for f in self._pending if f.kind == kind]

    def fired(self, fault: Fault) -> None:
        self._pending = [f for f in self._pending if f != fault]


def _phase_order(fault: Fault) -> int:
    return PHASES.index(fault.phase) if fault.phase in PHASES else len(PHASES)


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
        phase = {f.host_in(hosts): f.phase for f in sorted(hangs, key=_phase_order, reverse=True) if f.phase != "save"}
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
            hooks[i] = HookRef(f"{__name__}:HostFaults", args)
        return hooks

    def probe_hook(self, node: str) -> HookRef | None:
        """The hook for a probe of `node` (`hosts.probe`): slow where a slow-step fault slows it."""
        slow = [f for f in self.injector.pending("slow-step") if self._nodes.get(f) == node]
        return HookRef(f"{__name__}:HostFaults", {"slow_step": (slow[0].step, slow[0].factor)}) if slow else None

    def _on_nodes(self, view, kind: str, value) -> dict:
        """{its node's index in the group starting now: `value(fault)`} for the pending faults of
        `kind`, which follow their node: host H of the group that reaches the fault's step (until
        then, host H of each group), in every group it is in after."""
        nodes = list(view.group.node_ids)
        out = {}
        for fault in self.injector.pending(kind):
            node = self._nodes.get(fault)
            if node is None:
                out[fault.host_in(len(nodes))] = value(fault)
            elif node in nodes:
                out[nodes.index(node)] = value(fault)
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
        due = [f for kind in found for f in self.injector.pending(kind) if f.step <= (event.step or 0) + 1]
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


class HostFaults(FaultHook):
    """The worker's side: hang as a phase begins or instead of a save (until the controller kills
    the host), read input `SLOW_INPUT_SECONDS` slower from a step on, or do each step's work F
    times as long (a straggler)."""

    def __init__(self, report, hang_in: str | None = None, hang_before_save: int | None = None,
                 slow_input_from: int | None = None, slow_step: tuple[int, float] | None = None,
                 hang_at_step: int | None = None, flip: tuple[int, int] | None = None,
                 flip_grad_at: tuple[int, bool] | None = None, jitter: tuple[int, float] | None = None,
                 stall: tuple[int, float] | None = None):  # fmt: skip
        self.report, self.hang_in, self.hang_at_step = report, hang_in, hang_at_step
        self.flip = flip  # (after step, bit)
        self.flip_grad_at = flip_grad_at  # (step, every time)
        self.jitter, self.stall = jitter, stall  # (from step, share of a step); (after step, seconds)
        self.hang_before_save, self.slow_input_from = hang_before_save, slow_input_from
        self.slow_step = slow_step  # (from step, factor)
        self._step_work: float | None = None  # a healthy step's seconds, read once the slowness begins

    def entering(self, phase: str) -> None:
        if phase == self.hang_in:
            self._hang(phase)

    def saving(self, step: int, store) -> None:
        if step == self.hang_before_save:
            # The previous checkpoint is complete, this one is begun by the other hosts and never
            # finished by this one.
            store.wait()
            self._hang("save", step)

    def input_read(self, step: int) -> None:
        if self.slow_input_from is not None and step >= self.slow_input_from:
            time.sleep(SLOW_INPUT_SECONDS)

    def probe_work(self, seconds: float) -> None:
        if self.slow_step is not None:
            time.sleep((self.slow_step[1] - 1) * seconds)

    def dispatching(self, step: int) -> None:
        if step == self.hang_at_step:
            threading.Event().wait()  # (the actor answers on; the controller's health loop stops it)

    def batch(self, step: int, batch):
        """At the flip-grad's step, this host's rows of the batch corrupted (once a segment)."""
        if self.flip_grad_at is None or step != self.flip_grad_at[0]:
            return batch
        import jax

        self.flip_grad_at = None
        return jax.tree.map(_garbled, batch)

    def corrupt(self, step: int, state):
        """After the flip's step, one bit of one element of this host's copy of a replicated
        floating-point leaf flips (the first leaf with at least three copies: a majority can
        name it)."""
        if self.flip is None or step != self.flip[0]:
            return state
        import jax

        leaves, tree = jax.tree.flatten(state)
        for n, leaf in enumerate(leaves):
            if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and _copies(leaf) >= 3:
                leaves[n] = _flipped(leaf, self.flip[1])
                return jax.tree.unflatten(tree, leaves)
        return state

    def step_work(self, step: int, read_back) -> None:
        """From the slow step on, this host finishes each step's work (F - 1) healthy steps'
        time late: the others wait for it in the next step's collectives. Jitter adds a random
        share of a healthy step; a stall, seconds once."""
        extra = 0.0
        if self.stall is not None and step == self.stall[0]:
            time.sleep(self.stall[1])
        for fault, share in ((self.slow_step, lambda f: f - 1), (self.jitter, lambda f: random.uniform(0, 2 * f))):
            if fault is not None and step >= fault[0]:
                if self._step_work is None:
                    self._step_work = read_back()  # (the first such step's own time: it begins after it)
                extra += share(fault[1]) * self._step_work
        if extra:
            read_back()
            time.sleep(extra)

    def _hang(self, phase: str, step: int | None = None) -> None:
        self.report(Hang(phase=phase, step=step))
        threading.Event().wait()


def _copies(leaf) -> int:
    """How many devices hold each block of `leaf`."""
    blocks = {}
    for index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).values():
        key = tuple(s.indices(d)[:2] for s, d in zip(index, leaf.shape))
        blocks[key] = blocks.get(key, 0) + 1
    return min(blocks.values())


def _changed(leaf, change):
    """`leaf` with this process's copies of its blocks replaced by `change(n, numpy copy)` (n: the
    copy's place among this process's): the other processes' copies stay as they are."""
    import jax
    import numpy as np

    shards = [jax.device_put(change(n, np.array(s.data)), s.device) for n, s in enumerate(leaf.addressable_shards)]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)


def _flipped(leaf, bit: int):
    """`leaf` with bit `bit` of element 0 of this process's first copy flipped (32-bit words; the
    lower 16 bits of a 16-bit type)."""
    import numpy as np

    def flip(n, data):
        if n == 0:
            words = data.reshape(-1).view({2: np.uint16, 4: np.uint32, 8: np.uint32}[data.dtype.itemsize])
            words[0] ^= words.dtype.type(1 << (bit % (8 * words.dtype.itemsize)))
        return data

    return _changed(leaf, flip)


def _garbled(leaf):
    """`leaf` with this process's rows corrupted: integers XOR 1 (tokens become their neighbours),
    floats times 1000."""
    import numpy as np

    return _changed(leaf, lambda n, d: d ^ 1 if np.issubdtype(d.dtype, np.integer) else (d * 1000).astype(d.dtype))
