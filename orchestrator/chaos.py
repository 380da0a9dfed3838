"""Fault injection for tests and the demo: `--chaos lose@40,add@80,lose-in-save@50:0`.

lose@S[:H]          after step S is reported, kill host H's node (default: the last host)
lose-in-save@S[:H]  host H hangs instead of saving checkpoint S; its node is killed mid-save
add@S               after step S is reported, add one host to the cluster
slow@S[:H]          from step S on, host H's input takes SLOW_INPUT_SECONDS longer each step:
                    a straggler (works on any cluster: nothing is killed)
"""

from __future__ import annotations

import dataclasses
import re

KINDS = ("lose", "lose-in-save", "add", "slow")
SLOW_INPUT_SECONDS = 0.3
ANY_CLUSTER = ("slow",)  # kinds that need no control over the cluster's nodes
_FAULT = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<host>\d+))?$")


class ChaosSpecError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    host: int | None = None  # index within the running group; None means the last host


def parse_chaos(text: str | None) -> tuple[Fault, ...]:
    if not text:
        return ()
    faults = []
    for item in text.split(","):
        m = _FAULT.match(item.strip())
        if not m or m["kind"] not in KINDS:
            raise ChaosSpecError(
                f"bad fault {item.strip()!r}: expected KIND@STEP[:HOST] with KIND one of {KINDS}, "
                "e.g. lose@40,add@80 or lose-in-save@50:0"
            )
        if m["kind"] == "add" and m["host"] is not None:
            raise ChaosSpecError(f"bad fault {item.strip()!r}: add@STEP takes no host")
        faults.append(Fault(m["kind"], int(m["step"]), int(m["host"]) if m["host"] is not None else None))
    return tuple(sorted(faults, key=lambda f: f.step))


class ChaosInjector:
    """Tracks which faults have fired; the controller asks what is due and executes it."""

    def __init__(self, faults: tuple[Fault, ...]):
        self._pending = list(faults)

    def due(self, completed_step: int) -> list[Fault]:
        """`lose` and `add` faults whose step has been reached (each fires once)."""
        fired = [f for f in self._pending if f.kind in ("lose", "add") and f.step <= completed_step]
        self._pending = [f for f in self._pending if f not in fired]
        return fired

    def save_faults(self) -> list[Fault]:
        """`lose-in-save` faults still to fire; they ride in the next segment's spec."""
        return [f for f in self._pending if f.kind == "lose-in-save"]

    def slow_hosts(self) -> dict[int | None, int]:
        """`slow` faults (they never fire: they ride in every segment's spec): host -> from step."""
        return {f.host: f.step for f in self._pending if f.kind == "slow"}

    def fired(self, fault: Fault) -> None:
        self._pending = [f for f in self._pending if f != fault]
