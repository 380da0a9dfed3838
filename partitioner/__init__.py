"""remesh.partitioner: plans a single-device JAX function onto a mesh of devices.

    plan = partitioner.plan(step, state, batch, devices=8, hardware="h100", level="fast")
    mesh = plan.bind(jax.devices())

Plans are data (`Plan.to_json`/`from_json`), computed against an abstract mesh and bound last.
`plan` searches the program's folded factor graph (`automap.py`); `search` returns every
candidate priced as well; `plan_by_shapes` is the shapes-only baseline. `verify(plan, fn, *args)`
compiles a plan and reports the collectives XLA inserted.
"""

from .automap import LEVELS, TACTICS, Candidate, plan, search
from .hardware import PROFILES, Hardware, Link, UnknownHardwareError, profile
from .plan import Cost, Plan, PlanMismatchError
from .search import PlanInputError, PlanMemoryError, plan_by_shapes
from .verify import Collective, Verification, VerifyDevicesError, verify

__all__ = [
    "Cost",
    "Hardware",
    "Link",
    "PROFILES",
    "Plan",
    "PlanInputError",
    "PlanMemoryError",
    "PlanMismatchError",
    "UnknownHardwareError",
    "plan",
    "plan_by_shapes",
    "profile",
    "search",
    "Candidate",
    "LEVELS",
    "TACTICS",
    "Collective",
    "Verification",
    "VerifyDevicesError",
    "verify",
]
