"""The faults `--chaos` names (the package's docstring lists them): parsed from their spelling,
and handed out as the job reaches them (`ChaosInjector`)."""

from __future__ import annotations

import dataclasses
import re

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


def phase_order(fault: Fault) -> int:
    return PHASES.index(fault.phase) if fault.phase in PHASES else len(PHASES)
