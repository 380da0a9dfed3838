"""A candidate plan and how it is priced: a tactic's annotations on a mesh (`TacticPlan`), with
the optimizer state mirrored from its parameters, propagated with the batch first and priced by
the cost model (`Candidate`); several at a time, two by two with the pricing helper
(`helper.Pricer`), in order, a reader free to stop at any one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from .analysis import Inputs, mirror_optimizer_state
from .cost import Cost
from .hardware import Hardware
from .helper import Pricer, PricingTask
from .plan import mesh_text
from .propagate import Propagation, Sharding, propagate


@dataclasses.dataclass(frozen=True)
class Tactic:
    """What made a candidate: its tactic (`tactics.TACTICS`: "dp", "megatron", "refined", ...),
    whether the state is also sharded FSDP over data, and whether the mesh splits the sequence
    (every tactic is sequence parallel on a mesh with seq > 1). Said as "megatron+fsdp+sequence"."""

    kind: str
    fsdp: bool = False
    sequence: bool = False

    def __str__(self) -> str:
        return self.kind + ("+fsdp" if self.fsdp else "") + ("+sequence" if self.sequence else "")

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    @property
    def named(self) -> str:
        """The name a search's `tactics` option picks it by (sequence parallelism follows the mesh)."""
        return str(dataclasses.replace(self, sequence=False))

    @property
    def shards_state(self) -> bool:
        """The state is sharded over data (FSDP alone, or beside another tactic)."""
        return self.fsdp or self.kind == "fsdp"


@dataclasses.dataclass(frozen=True)
class Candidate:
    tactic: Tactic
    mesh: Mapping[str, int]
    annotations: Mapping[int, Sharding]
    cost: Cost
    # Its propagation, or how to find it again where the pricing helper priced it (`helper`).
    spread: Propagation | Callable[[], Propagation] = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def propagation(self) -> Propagation:
        return self.spread() if callable(self.spread) else self.spread

    def line(self) -> str:
        mesh = mesh_text(self.mesh, every=True)
        c = self.cost
        return (
            f"{self.tactic:<14} {mesh:<18} {c.total_seconds * 1e3:9.3f} ms  (compute {c.compute_seconds * 1e3:.3f}, "
            f"comm {c.communication_seconds * 1e3:.3f})  peak {c.peak_bytes_per_device / 2**30:.2f} GiB/device"
        )


class TacticPlan(NamedTuple):
    """One tactic's annotations on one mesh, to price: `annotations` hold the batch's, which
    `batch` names again so that they spread first."""

    tactic: Tactic
    mesh: Mapping[str, int]
    annotations: Mapping[int, Sharding]
    batch: Mapping[int, Sharding]


def priced(
    inputs: Inputs,
    tactic: Tactic,
    mesh: Mapping[str, int],
    annotations: Mapping[int, Sharding],
    hw: Hardware,
    batch: Mapping[int, Sharding],
    beyond: float = math.inf,
) -> Candidate | None:
    """`annotations` (the batch's among them) with optimizer state mirrored, propagated with the
    batch first, and priced; None where it takes `beyond` seconds or more (`estimate`)."""
    return next(_each(inputs, [TacticPlan(tactic, mesh, annotations, batch)], hw, beyond))


def priced_each(
    inputs: Inputs, plans: Sequence[TacticPlan], hw: Hardware, beyond: float = math.inf
) -> list[Candidate | None]:
    """`priced` for each of `plans`, two at a time (`helper`)."""
    return list(_each(inputs, plans, hw, beyond, whole=True))


def _each(inputs: Inputs, plans: Sequence[TacticPlan], hw: Hardware, beyond: float = math.inf, whole: bool = False):
    """`priced` for each of `plans`, lazily and in order: unless `whole`, a reader may stop at any one."""
    jobs = _Jobs(inputs, plans, beyond)
    for i, (cost, prop) in enumerate(Pricer(inputs.fold, hw).each(jobs, whole)):
        plan, job = jobs.plans[i], jobs[i]
        spread = (
            prop
            if prop is not None
            else functools.partial(propagate, inputs.graph, job.annotations, job.mesh, first=plan.batch)
        )
        yield None if cost is None else Candidate(plan.tactic, job.mesh, job.annotations, cost, spread)


class _Jobs(Sequence):
    """`plans` as pricing jobs, each made (its optimizer state mirrored) when first asked for: a
    refinement that keeps a trial asks again for the trials after it, and prices only some."""

    def __init__(self, inputs: Inputs, plans: Sequence[TacticPlan], beyond: float):
        self.inputs, self.plans, self.beyond, self._made = inputs, list(plans), beyond, {}

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i: int) -> PricingTask:
        if i not in self._made:
            plan = self.plans[i]
            self._made[i] = PricingTask(
                dict(plan.mesh), mirror_optimizer_state(self.inputs, plan.annotations), tuple(plan.batch), self.beyond
            )
        return self._made[i]
