"""remesh.partitioner: plans a single-device JAX function onto a mesh of devices.

    plan = partitioner.plan(step, state, batch, devices=8, hardware="h100")
    mesh = plan.bind(jax.devices())

Plans are data (`Plan.to_json`/`from_json`), computed against an abstract mesh and bound last.
`verify(plan, fn, *args)` compiles a plan and reports the collectives XLA inserted.
"""
from .hardware import PROFILES, Hardware, Link, UnknownHardwareError, profile
from .plan import Cost, Plan, PlanMismatchError
from .search import PlanInputError, PlanMemoryError, plan
from .verify import Collective, Verification, VerifyDevicesError, verify

__all__ = [
    "Cost", "Hardware", "Link", "PROFILES", "Plan", "PlanInputError", "PlanMemoryError",
    "PlanMismatchError", "UnknownHardwareError", "plan", "profile",
    "Collective", "Verification", "VerifyDevicesError", "verify",
]
