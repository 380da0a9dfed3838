"""The search: a step's candidates (`tactics`) on every mesh its level allows, the cheapest that
fits in memory chosen, the runners-up kept with their costs to say why, and the compiler as a
guard where the cost model cannot tell the best apart.

Levels (Rhino's two optimisation levels, https://arxiv.org/abs/2302.08141):
    fast      meshes without seq, model within one host (the hardware's fast links), unless none
              of those uses every device; the tactics and their refinement
    thorough  every mesh; then, on the meshes whose best tactic is within reach of the best
              overall, the exact solver (`exact.solved`, an ILP in HiGHS) chooses a split for
              every weight of the folded graph from unary and pairwise costs measured by
              propagation, and its best answers are priced exactly.

The choice and the guard (`compile_check`): among candidates predicted within CLOSE of the best,
one whose predicted FLOPs and collectives, what a compile shows, are more than AGREE below the
best's is chosen instead; where some are within AGREE of each other, a primitive was planned
without a rule, or the fast level's choice differs from the thorough level's, the best few are
compiled on this process's devices and priced from what XLA produced (`verify`), and the
cheapest is chosen; the plan's notes say which were compiled and why.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import threading
import time
from collections.abc import Sequence

from . import exact, helper, pipelines
from .analysis import Inputs, read_inputs
from .arguments import device_count
from .candidates import Candidate, priced_each
from .cost import compute_floor
from .depth import Deepened
from .errors import PlanInputError, PlanMemoryError
from .explain import remat_hint, to_plan
from .guard import fit_by_compiler, guarded
from .hardware import Hardware, profile
from .helper import Pricer
from .meshes import mesh_shapes
from .options import PlanOptions
from .plan import Plan
from .refine import refined
from .tactics import TACTICS, tactic_plans


def plan(fn, *args, devices, hardware: str | Hardware = "h100", memory_limit: int | None = None,
         level: str = "fast", **options) -> Plan:  # fmt: skip
    """The best plan found for `fn(*args)` on `devices` (a count or a list of devices); `options`:
    the other fields of `PlanOptions` (compile_check, slices, tactics, batch_argnums,
    shallow_trace, pricing_helper).

    Example:
        >>> p = plan(train_step, state, batch, devices=8, hardware="h100")
        >>> p.mesh, p.notes[0]
    """
    fields = dict(hardware=hardware, memory_limit=memory_limit, level=level, **options)
    return search(fn, *args, devices=device_count(devices), **fields)[0]


def search(
    fn, *args, devices: int, options: PlanOptions | None = None, inputs: Inputs | None = None, reused: bool = False,
    **fields,
) -> tuple[Plan, list[Candidate]]:  # fmt: skip
    """The cheapest plan that fits, and every candidate priced (best first): `options`, with any
    of its `fields` given here replaced. `inputs`: the step as `read_inputs` read it
    (`StepPlanner`), `reused` where an earlier plan did.

    Example:
        >>> plan, ranked = search(step, state, batch, devices=8, hardware="h100", level="thorough")
        >>> print("\\n".join(c.line() for c in ranked[:3]))
    """
    options = PlanOptions.of(options, fields).checked(devices, TACTICS)
    with helper.helping(options.pricing_helper):
        return _without_gc(functools.partial(_search, fn, args, devices, options, inputs, reused))


def _without_gc(work):
    """`work()` with the cyclic garbage collector paused: capture and search allocate many small
    objects while an unrolled graph of ~10^5 ops is alive, and each full collection would walk
    all of it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return work()
    finally:
        if enabled:
            gc.enable()


class StepPlanner:
    """Plans of one step for whatever devices a cluster offers, the step captured and folded once:
    the first plan reads it, and every later one (another device count, a plan made ahead, a
    re-plan after a loss) is a search alone, its notes saying the capture was reused. Plans as
    `plan` makes them; two threads may plan at once (a controller and its planning thread), the
    step read by the first of them.

    Example:
        >>> steps = StepPlanner(train_step, state, batch)
        >>> full, smaller = steps.plan(devices=16), steps.plan(devices=12)
    """

    def __init__(self, fn, *args, batch_argnums: Sequence[int] | None = None, shallow_trace: bool = True):
        self.fn, self.args = fn, args
        self._read = functools.partial(read_inputs, fn, args, batch_argnums, shallow_trace)
        self._inputs: Inputs | None = None
        self._lock = threading.Lock()

    def plan(self, devices, options: PlanOptions | None = None, **fields) -> Plan:
        """`plan(fn, *args, devices=devices, ...)` with `options` (and `fields` of `PlanOptions`
        replaced), from the step as first read."""
        n = device_count(devices)
        how = sorted({"batch_argnums", "shallow_trace"} & set(fields))
        if how:
            raise PlanInputError(f"{how} say how the step is read: give them to StepPlanner(...), which reads it once")
        options = PlanOptions.of(options, fields)
        with self._lock:
            first = self._inputs is None
            if first:
                helper.start_helper(enabled=options.pricing_helper)
                self._inputs = _without_gc(self._read)
        return search(self.fn, *self.args, devices=n, options=options, inputs=self._inputs, reused=not first)[0]


def _search(fn, args, devices: int, options: PlanOptions, inputs: Inputs | None, reused: bool):
    """`search`, with the collector paused and the options checked."""
    t0 = time.perf_counter()
    helper.start_helper(enabled=options.pricing_helper)  # its imports overlap the tracing
    level, tactics, compile_check = options.level, options.tactics, options.compile_check
    hw = profile(options.hardware).sliced(devices, options.slices)
    limit = int(options.memory_limit or hw.memory_bytes)
    if inputs is None:
        inputs = read_inputs(fn, args, options.batch_argnums, options.shallow_trace)
    elif not reused:
        t0 -= sum(inputs.seconds)  # read just before, for this plan: its time is this plan's
    t1 = time.perf_counter()
    Pricer(inputs.fold, hw).share()
    meshes = mesh_shapes(devices, inputs, hw, level)
    candidates, floored = _tactic_candidates(inputs, meshes, hw, limit, tactics)
    if tactics is None or "refined" in tactics:
        candidates += refined(inputs, candidates, hw, limit, level)
    if level == "thorough" and (tactics is None or "exact" in tactics):
        candidates += exact.solved(inputs, candidates, hw, limit)
    if not candidates:
        raise PlanInputError(f"no mesh of {devices} devices suits the tactics {sorted(tactics or TACTICS)}")
    ranked = sorted(candidates, key=lambda c: c.cost.total_seconds)
    fitting = [c for c in ranked if c.cost.peak_bytes_per_device <= limit]
    checked: tuple[str, ...] = ()
    if not fitting and hw.slice_devices is not None:  # tensor or sequence parallelism over the slow link
        crossing, _ = _tactic_candidates(
            inputs, mesh_shapes(devices, inputs, hw, level, cross=True), hw, limit, tactics
        )
        ranked = sorted(candidates + crossing, key=lambda c: c.cost.total_seconds)
        fitting = [c for c in ranked if c.cost.peak_bytes_per_device <= limit]
        checked = ("no plan fits with tensor and sequence parallelism inside a slice: they may cross slices",)
    if not fitting:
        fitting, said = fit_by_compiler(fn, args, inputs, ranked, devices, hw, limit, compile_check)
        checked = (said,) if fitting else ()
    if not fitting:
        least = min(candidates, key=lambda c: c.cost.peak_bytes_per_device)
        raise PlanMemoryError(
            f"no plan fits {limit / 2**30:.2f} GiB per device: the smallest needs {least.cost.peak_bytes_per_device / 2**30:.2f} GiB "
            f"({least.tactic} on {dict(least.mesh)}), {(least.cost.peak_bytes_per_device - limit) / 2**30:.2f} GiB over. "
            + (f"{said}. " if said else "")
            + remat_hint(inputs, least, hw, limit)
            + "Use more devices, a smaller batch, or a larger memory_limit"
        )
    best, guard = guarded(fn, args, inputs, fitting, devices, hw, limit, compile_check)
    guard = checked + guard + tuple(floored)
    t2 = time.perf_counter()
    traced = inputs.fold.depths if isinstance(inputs.fold, Deepened) else None
    read = (
        "capture and fold reused from an earlier plan "
        if reused
        else f"capture {inputs.seconds[0]:.2f} s ({inputs.fold.original_ops} ops"
        + (f"; {traced[0]} and {traced[1]} of {traced[2]} layers traced" if traced else "")
        + f"), fold {inputs.seconds[1]:.2f} s "
    )
    timing = f"time: {read}({len(inputs.graph.ops)} ops), search {t2 - t1:.2f} s ({len(candidates)} candidates, level {level})"
    plan = to_plan(inputs, best, args, devices, t2 - t0, ranked, limit, hw, timing, guard)
    # One stage's devices, planned without a pipeline, and without the refinement and the exact
    # solver: a stage's plan is priced for each stage count, and its base tactics decide it. It
    # plans the whole step on a stage's devices, which hold only their stage's layers: its memory
    # limit is the stages' together, and the pipeline's own peak decides what fits.
    within = tuple(t for t in (tactics or TACTICS) if t not in ("refined", "exact"))
    inner = lambda n, slices: _search(  # noqa: E731
        fn, args, n, dataclasses.replace(options, pipeline="off", slices=slices, compile_check=False, tactics=within,
                                         memory_limit=limit * (devices // n)),
        inputs, True,
    )  # fmt: skip
    chosen = pipelines.considered(
        fn, args, inputs, options.pipeline, plan, devices, options.slices, hw, limit, inner, compile_check
    )
    if chosen.pipeline is not None:
        chosen = dataclasses.replace(chosen, search_seconds=time.perf_counter() - t0)
    return chosen, ranked


def _tactic_candidates(inputs: Inputs, meshes, hw: Hardware, limit: int, tactics) -> tuple[list[Candidate], list[str]]:
    """Every tactic's candidate on each mesh, the meshes that use the most devices first; those on
    fewer only where their compute alone (`compute_floor`) could beat the best that fits on more,
    which with a batch that every device divides it seldom can. Also a note per count left out."""
    groups: dict[int, list] = {}
    for mesh in meshes:
        groups.setdefault(math.prod(mesh.values()), []).append(mesh)
    candidates, floored = [], []
    for count in sorted(groups, reverse=True):
        best = min((c.cost.total_seconds for c in candidates if c.cost.peak_bytes_per_device <= limit), default=None)
        floor = compute_floor(inputs.graph, inputs.fold, hw, count) if best is not None else 0.0
        if best is not None and floor > best:
            floored.append(
                f"not priced on {count} devices: their compute alone would take at least {floor * 1e3:.3g} ms, "
                f"more than the best plan that fits on more ({best * 1e3:.3g} ms)"
            )
            continue
        plans = [
            p
            for mesh in groups[count]
            for p in tactic_plans(inputs, mesh)
            if tactics is None or p.tactic.named in tactics
        ]
        candidates += priced_each(inputs, plans, hw)
    return candidates, floored
