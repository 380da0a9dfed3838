"""remesh.partitioner: plans a single-device JAX function onto a mesh of devices.

    plan = partitioner.plan(step, state, batch, devices=8, hardware="h100")
    mesh = plan.bind(jax.devices())

Plans are data (`Plan.to_json`/`from_json`), computed against an abstract mesh and bound last.
"""
from .hardware import PROFILES, Hardware, Link, UnknownHardwareError, profile
from .plan import Cost, Plan, PlanMismatchError
from .search import PlanInputError, PlanMemoryError, plan

__all__ = [
    "Cost", "Hardware", "Link", "PROFILES", "Plan", "PlanInputError", "PlanMemoryError",
    "PlanMismatchError", "UnknownHardwareError", "plan", "profile",
]
