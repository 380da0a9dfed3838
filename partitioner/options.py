"""How to plan a step: one frozen `PlanOptions` that `plan`, `search` and `StepPlanner.plan`
share, each option checked once, where the devices are known.

Example:
    >>> options = PlanOptions(hardware="tpu-v5p", level="thorough", slices=2)
    >>> plan, ranked = search(step, state, batch, devices=16, options=options)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .errors import PlanInputError
from .hardware import Hardware

LEVELS = ("fast", "thorough")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    hardware: str | Hardware = "h100"
    memory_limit: int | None = None  # bytes per device; None: the profile's memory
    level: str = "fast"  # `LEVELS`: Rhino's two levels (search.py)
    # "auto": compile the top candidates where their predicted FLOPs and collectives are close or
    # a primitive has no rule (and this process has the devices); True always, False never.
    compile_check: bool | str = "auto"
    # The devices are this many equal slices (TPU slices, GPU NVLink domains) joined by the
    # profile's slower link, slice-major (`meshes.sliced_meshes`).
    slices: int = 1
    tactics: Collection[str] | None = None  # only these (`tactics.TACTICS`); None: every one
    # Price every other candidate in a helper process on a second core (`helper`): the same
    # prices, in the same order; off, every candidate is priced in this process.
    pricing_helper: bool = True
    # How the step is read (a `StepPlanner` reads it once, with its own): the arguments that hold
    # the batch (None: found from the outputs), and whether a deep stack of layers is planned from
    # traces of its first few (`depth`); False for a step that treats layers by their index.
    batch_argnums: Sequence[int] | None = None
    shallow_trace: bool = True
    # Pipeline the step's layer scan (`pipelines`): "auto" where predicted cheaper, "off", or a
    # number of stages (the nearest that fits the layers and devices).
    pipeline: str | int = "auto"

    @classmethod
    def of(cls, options: PlanOptions | None, fields: Mapping[str, Any]) -> PlanOptions:
        """`options` (or the defaults) with `fields` replaced; an unknown name is an error that
        lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise PlanInputError(f"unknown plan options {unknown}: expected some of {sorted(known)}")
        return dataclasses.replace(options or cls(), **fields)

    def checked(self, devices: int, tactics: Collection[str]) -> PlanOptions:
        """These options, or an error naming the one that does not fit `devices`."""
        if self.level not in LEVELS:
            raise PlanInputError(f"level must be one of {LEVELS}, got {self.level!r}")
        s = self.slices
        if not isinstance(s, int) or isinstance(s, bool) or s < 1 or devices % s:
            raise PlanInputError(
                f"slices must be a whole number of equal slices that divides the devices: got slices={s!r} for "
                f"{devices} devices; pass a divisor of {devices} (the number of TPU slices or NVLink domains)"
            )
        p = self.pipeline
        if p not in ("auto", "off") and (not isinstance(p, int) or isinstance(p, bool) or p < 2):
            raise PlanInputError(
                f"pipeline must be 'auto', 'off' or a number of stages of at least 2, got {p!r}; "
                "pass pipeline='auto' to let the planner choose"
            )
        unknown = set(self.tactics or ()) - set(tactics)
        if unknown:
            raise PlanInputError(f"unknown tactics {sorted(unknown)}: expected some of {tuple(tactics)}")
        return self
