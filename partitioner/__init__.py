"""partitioner: plans a single-device JAX function onto a mesh of devices.

    plan = partitioner.plan(step, state, batch, devices=8, hardware="h100", level="fast")
    mesh = plan.bind(jax.devices())

Plans are data (`Plan.to_json`/`from_json`), computed against an abstract mesh and bound last.
`plan` searches the program's folded factor graph (`search.py`; its `search` also returns every
candidate priced; `StepPlanner` plans one step for several device counts, read once);
`plan_by_shapes` is the shapes-only baseline (`shapes.py`). `verify(plan, fn,
*args)` compiles a plan and reports the collectives XLA inserted; `verify_many` compiles several
at once.

How a plan is made, module by module:

    capture     the step's jaxpr into the IR of `ir`: ops whose dimensions are tied by factors,
                each primitive's factors from `rules`
    depth       a deep stack of layers held in the arguments (a list, or entries numbered
                `layers_0`, `layers_1`, ...; `stacks` finds them) planned from traces of its
                first 3 and 4 layers (4 and 6 where layers alternate, as Gemma's local and global
                attention do), with what the step closes over cut alike (an Equinox model's static
                half, a Flax NNX graphdef, a Linen module's or a config's layer count);
                `shallow_trace=False` traces the whole step, for one that treats layers by index
    replay, repeats   repeated layers found; `fold` folds them, mirrored optimizer state and
                per-leaf update chains onto one representative (TAP)
    propagate   a few annotations spread GSPMD-style; `communication` says what an assignment
                must send
    cost, memory  a plan priced: roofline, alpha-beta collectives level by level on slices,
                liveness and XLA's fusion on the unrolled timeline; `helper` prices candidates two
                at a time, every other one in a process on a second core that holds a copy of the
                folded graph and imports no JAX (the same prices, in the same order)
    analysis    the step's leaves and weights, read once: which state leaf each matmul reads,
                stacked experts, which optimizer-state leaf follows which parameter
    meshes      the (data, seq, model) meshes searched, (replica, data, seq, model) on slices
    tactics     candidates on each mesh: dp, fsdp (`fsdp`: the one rule), Megatron read from the
                graph through casts and multi-axis kernels, experts, sequence parallelism;
                `candidates` prices a tactic's plan (`Tactic`, `Candidate`)
    refine      the best tensor-parallel candidates improved one weight at a time
    exact       an ILP (HiGHS) over every weight's split, at the thorough level
    layerscan   the layer scan (`jax.lax.scan` over stacked weights) found, and whether its body
                keeps examples apart
    pipelines   pipelined candidates: one stage's plan searched, composed with a stage axis and
                priced (bubble, sends, memory); `pipeline` the pipelined scan in one SPMD program
    search      the choice (`options.PlanOptions` says how), `guard` compiling the top candidates
                where the cost model cannot tell them apart, `explain` the plan and its notes
    plan        `Plan`: data, bound to devices last; `Plan.program(step)` (`program`) the step as
                the plan runs it; `verify` shows what XLA really compiles

`StepPlanner(fn, *args).plan(N, ...)` plans one step for several device counts, captured and
folded once: how a job plans at start, ahead and at each resize. A search starts the pricing
helper; `PlanOptions(pricing_helper=False)` prices without it.
"""

from .candidates import Candidate
from .errors import PlanInputError, PlanMemoryError
from .hardware import PROFILES, Hardware, Link, UnknownHardwareError, profile
from .options import LEVELS, PlanOptions
from .pipeline import Pipeline
from .plan import Cost, Plan, PlanMismatchError, mesh_text
from .program import ScanLayout
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
    "Pipeline",
    "ScanLayout",
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
