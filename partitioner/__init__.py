"""partitioner: plans a single-device JAX function onto a mesh of devices.

    plan = partitioner.plan(step, state, batch, devices=8, hardware="h100", level="fast")
    mesh = plan.bind(jax.devices())

Plans are data (`Plan.to_json`/`from_json`), computed against an abstract mesh and bound last.
`plan` searches the program's folded factor graph (`search.py`; its `search` also returns every
candidate priced; `StepPlanner` plans one step for several device counts, read once);
`plan_by_shapes` is the shapes-only baseline (`shapes.py`). `verify(plan, fn,
*args)` compiles a plan and reports the collectives XLA inserted; `verify_many` compiles several
at once.

Modules, in the order a plan is made: `capture` (a jaxpr into the IR of `ir`, factors from
`rules`), `replay` and `repeats` (repeated layers), `fold` (one copy of each), `propagate`,
`cost` and `memory` (pricing; `helper` prices candidates two at a time, one of them in a
helper process on a second core), `analysis` (the step's leaves and weights), `meshes`,
`tactics`, `candidates` (a tactic's plan priced), `refine` and `exact` (better candidates),
`search`, `plan`, `verify`.
A search starts the helper; `PlanOptions(pricing_helper=False)` prices without it. `PlanOptions`
holds the options `plan`, `search` and `StepPlanner.plan` share.
"""

from .candidates import Candidate
from .errors import PlanInputError, PlanMemoryError
from .hardware import PROFILES, Hardware, Link, UnknownHardwareError, profile
from .options import LEVELS, PlanOptions
from .plan import Cost, Plan, PlanMismatchError, mesh_text
from .search import StepPlanner, plan
from .shapes import plan_by_shapes
from .tactics import TACTICS
from .verify import Collective, Verification, VerifyDevicesError, verify, verify_many

__all__ = [
    "Candidate",
    "Collective",
    "Cost",
    "Hardware",
    "LEVELS",
    "Link",
    "PROFILES",
    "Plan",
    "PlanInputError",
    "PlanMemoryError",
    "PlanMismatchError",
    "PlanOptions",
    "StepPlanner",
    "TACTICS",
    "UnknownHardwareError",
    "Verification",
    "VerifyDevicesError",
    "plan",
    "plan_by_shapes",
    "profile",
    "mesh_text",
    "verify",
    "verify_many",
]
