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
import os
import threading
import time
from collections.abc import Collection, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec as P

from . import exact
from .analysis import Inputs, read_inputs
from .arguments import device_count
from .candidates import Candidate, priced_each
from .cost import compute_floor, estimate
from .depth import Deepened
from .errors import PlanInputError, PlanMemoryError
from .hardware import Hardware, profile
from .meshes import fast_mesh, mesh_shapes
from .plan import Plan, _is_spec, mesh_text
from .pricing import Pricer, start_helper
from .propagate import Sharding
from .refine import refined
from .stacks import key_names
from .tactics import TACTICS, tactic_plans

LEVELS = ("fast", "thorough")


def plan(
    fn,
    *args,
    devices,
    hardware: str | Hardware = "h100",
    memory_limit: int | None = None,
    level: str = "fast",
    batch_argnums: Sequence[int] | None = None,
    compile_check: bool | str = "auto",
    shallow_trace: bool = True,
    slices: int = 1,
) -> Plan:
    """The best plan found for `fn(*args)` on `devices` (a count or a list of devices).
    `compile_check`: "auto" compiles the top candidates where their predicted FLOPs and
    collectives are close or a primitive has no rule (and this process has the devices); True
    always, False never.
    `shallow_trace`: where the arguments hold a deep stack of layers, plan from traces of the
    first 3 and 4 (`depth`); pass False for a step that treats some layers differently by their
    index (every 4th layer global attention), which those traces cannot see.
    `slices`: the devices are that many equal slices (TPU slices, GPU NVLink domains) joined by
    the profile's slower `dcn` link, ordered slice-major; each collective is priced by the
    slowest level its group crosses, and tensor and sequence parallelism stay inside a slice
    unless nothing else fits (`meshes.sliced_meshes`).

    Example:
        >>> p = plan(train_step, state, batch, devices=8, hardware="h100")
        >>> p.mesh, p.notes[0]
    """
    n = device_count(devices)
    return search(
        fn,
        *args,
        devices=n,
        hardware=hardware,
        memory_limit=memory_limit,
        level=level,
        batch_argnums=batch_argnums,
        compile_check=compile_check,
        shallow_trace=shallow_trace,
        slices=slices,
    )[0]


def search(fn, *args, **kwargs) -> tuple[Plan, list[Candidate]]:
    """The cheapest plan that fits, and every candidate priced (best first); see `_search`."""
    return _without_gc(functools.partial(_search, fn, *args, **kwargs))


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

    def plan(self, devices, **options) -> Plan:
        """`plan(fn, *args, devices=devices, **options)`, from the step as first read."""
        n = device_count(devices)
        how = sorted({"batch_argnums", "shallow_trace"} & set(options))
        if how:
            raise PlanInputError(f"{how} say how the step is read: give them to StepPlanner(...), which reads it once")
        with self._lock:
            first = self._inputs is None
            if first:
                start_helper()
                self._inputs = _without_gc(self._read)
        return search(self.fn, *self.args, devices=n, inputs=self._inputs, reused=not first, **options)[0]


def _search(
    fn,
    *args,
    devices: int,
    hardware: str | Hardware = "h100",
    memory_limit: int | None = None,
    batch_argnums: Sequence[int] | None = None,
    level: str = "fast",
    tactics: Collection[str] | None = None,
    compile_check: bool | str = "auto",
    shallow_trace: bool = True,
    slices: int = 1,
    inputs: Inputs | None = None,
    reused: bool = False,
) -> tuple[Plan, list[Candidate]]:
    """The cheapest plan that fits, and every candidate priced (best first). `tactics` limits
    the search to the named ones (`TACTICS`; "exact" is the thorough level's solver). `inputs`:
    the step as `read_inputs` read it (`StepPlanner`), `reused` where an earlier plan did.

    Example:
        >>> plan, ranked = search(step, state, batch, devices=8, hardware="h100", level="thorough")
        >>> print("\\n".join(c.line() for c in ranked[:3]))
    """
    t0 = time.perf_counter()
    start_helper()  # its imports overlap the tracing
    if level not in LEVELS:
        raise PlanInputError(f"level must be one of {LEVELS}, got {level!r}")
    hw = profile(hardware).sliced(devices, _slices(devices, slices))
    limit = int(memory_limit or hw.memory_bytes)
    if inputs is None:
        inputs = read_inputs(fn, args, batch_argnums, shallow_trace)
    elif not reused:
        t0 -= sum(inputs.seconds)  # read just before, for this plan: its time is this plan's
    t1 = time.perf_counter()
    Pricer(inputs.fold, hw).share()
    meshes = mesh_shapes(devices, inputs, hw, level)
    unknown = set(tactics or ()) - set(TACTICS)
    if unknown:
        raise PlanInputError(f"unknown tactics {sorted(unknown)}: expected some of {TACTICS}")
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
        fitting, said = _fit_by_compiler(fn, args, inputs, ranked, devices, hw, limit, compile_check)
        checked = (said,) if fitting else ()
    if not fitting:
        least = min(candidates, key=lambda c: c.cost.peak_bytes_per_device)
        raise PlanMemoryError(
            f"no plan fits {limit / 2**30:.2f} GiB per device: the smallest needs {least.cost.peak_bytes_per_device / 2**30:.2f} GiB "
            f"({least.tactic} on {dict(least.mesh)}), {(least.cost.peak_bytes_per_device - limit) / 2**30:.2f} GiB over. "
            + (f"{said}. " if said else "")
            + _remat_hint(inputs, least, hw, limit)
            + "Use more devices, a smaller batch, or a larger memory_limit"
        )
    best, guard = _guarded(fn, args, inputs, fitting, devices, hw, limit, compile_check)
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
    plan = _to_plan(inputs, best, args, devices, t2 - t0, ranked, limit, hw, timing, guard)
    return plan, ranked


def _slices(devices: int, slices: int) -> int:
    if not isinstance(slices, int) or isinstance(slices, bool) or slices < 1 or devices % slices:
        raise PlanInputError(
            f"slices must be a whole number of equal slices that divides the devices: got slices={slices!r} for "
            f"{devices} devices; pass a divisor of {devices} (the number of TPU slices or NVLink domains)"
        )
    return slices


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
            if tactics is None or p.name.split("+sequence")[0] in tactics
        ]
        candidates += priced_each(inputs, plans, hw)
    return candidates, floored


def _remat_hint(inputs: Inputs, least: Candidate, hw: Hardware, limit: int) -> str:
    """Whether rematerialising the repeated layers would make the smallest plan fit, and by how much."""
    size = least.propagation.device_bytes
    sizes = {v: int(size[v]) for v in inputs.fold.materialized}
    found = inputs.fold.remat_peak(sizes, hw.copies_transposed_lhs)
    if found is None:
        return ""
    peak, saved = found
    if saved <= 0.01 * least.cost.peak_bytes_per_device:
        return "Its layers keep little more than their inputs for the backward pass: remat would not help. "
    verdict = (
        f"it would fit, with {(limit - peak) / 2**30:.2f} GiB to spare"
        if peak <= limit
        else f"still {(peak - limit) / 2**30:.2f} GiB over"
    )
    return (
        f"Rematerialising each repeated layer (jax.checkpoint around it) would need about {peak / 2**30:.2f} GiB, "
        f"not keeping {saved / 2**30:.2f} GiB of activations for the backward pass: {verdict}. "
    )


NEAR_LIMIT = 1.05  # a plan predicted within this of the memory limit is compiled before it is refused
MEMORY_CHECKS = 2  # near plans compiled for their memory: the fastest and the smallest


def _fit_by_compiler(fn, args, inputs: Inputs, ranked: list[Candidate], devices: int, hw: Hardware, limit: int, check):
    """Where no plan fits by the cost model's peak but some are predicted within NEAR_LIMIT of
    the limit, the prediction is the model's word against the compiler's: the fastest and the
    smallest of those are compiled (on this process's devices; fake CPU devices do) and XLA's
    memory analysis decides. On CPU it is read less what only the CPU backend adds (copies of
    transposed matmul operands, `Hardware.copies_transposed_lhs`), as the model predicts for both.
    Returns those that fit, best first, and what was found, for the notes or the error."""
    near = [c for c in ranked if c.cost.peak_bytes_per_device <= NEAR_LIMIT * limit]
    if not near or check is False:
        return [], ""
    picked = _same_plans_once([near[0], min(near, key=lambda c: c.cost.peak_bytes_per_device)])[:MEMORY_CHECKS]
    need = max(math.prod(c.mesh.values()) for c in picked)
    if len(jax.devices()) < need:
        return [], f"XLA's memory analysis not consulted: {len(jax.devices())} device(s) here, the plans use {need}"
    from .verify import verify_many  # (compiles: only for a near miss)

    plans = [_to_plan(inputs, c, args, devices, 0.0, [c], limit, hw) for c in picked]
    found = verify_many([(p, fn, args) for p in plans], hardware=hw)
    peaks = [_target_peak(v, p, c) for v, p, c in zip(found, plans, picked)]
    said = "XLA's memory analysis of the compiled program: " + ", ".join(
        f"{c.tactic} on {mesh_text(c.mesh)} {peak / 2**30:.3f} GiB (predicted {c.cost.peak_bytes_per_device / 2**30:.3f})"
        for peak, c in zip(peaks, picked)
    )
    fits = [c for peak, c in zip(peaks, picked) if peak <= limit]
    return fits, said + (f"; {fits[0].tactic} fits {limit / 2**30:.3f} GiB by it" if fits else "")


def _target_peak(v, plan: Plan, c: Candidate) -> int:
    """A compiled peak as the profile's hardware would have it: XLA:CPU's, less what the model
    predicts the CPU backend alone adds."""
    if jax.devices()[0].platform != "cpu" or plan.cost.cpu_peak_bytes_per_device is None:
        return v.peak_bytes
    return v.peak_bytes - max(0, plan.cost.cpu_peak_bytes_per_device - c.cost.peak_bytes_per_device)


CLOSE = 1.25  # candidates predicted within this factor of the best are not told apart by the roofline
AGREE = 1.05  # candidates whose FLOPs and collectives are predicted within this are compiled to tell apart
GUARD_TOP = 3  # candidates compiled by the guard, at most; no more than compile at once (one per CPU)


def _across_rival(best: Candidate, fitting: list[Candidate], hw: Hardware) -> Candidate | None:
    """On slices: the best plan that fits and puts another axis across them than `best` does,
    where it is predicted within CLOSE of it."""
    if hw.slice_devices is None:
        return None
    mine = crossing(best.mesh, hw)
    return next(
        (
            c
            for c in fitting
            if crossing(c.mesh, hw) != mine and c.cost.total_seconds <= CLOSE * best.cost.total_seconds
        ),
        None,
    )


def _guarded(fn, args, inputs: Inputs, fitting: list[Candidate], devices: int, hw: Hardware, limit: int, check):
    """The choice among the best candidates, and the compiler as a guard (`compile_check`).

    Candidates within CLOSE of the best are not told apart by the roofline, whose memory-bound
    part guesses what XLA will fuse; what a compile of a plan shows, its FLOPs per device and the
    collectives XLA inserts, is predicted exactly where the model reads the program right (to the
    byte on the Llama and Whisper steps of the corpus) and decides where it puts one more than
    AGREE ahead of the roofline's best (`Cost.compiled_view_seconds`, `_pick`).
    The guard compiles on this process's devices, on as many threads as there are CPUs, the best
    of those whose FLOPs and collectives are predicted within AGREE of each other (at most
    GUARD_TOP, one per distinct plan), and chooses the one XLA makes cheapest, priced by `verify`
    with the same hardware profile; and the best few where some primitive was planned without a
    rule. On slices, also the best plan that puts another axis across them, where it is within
    CLOSE: what crosses the slow link decides the most, and XLA lowers a reduction over a group
    that spans slices its own way (FSDP's gradients inside a slice with data parallelism across
    (HSDP) it reduces over every device before slicing them, gathering whole tables over the slow
    link where the plan reduces slice by slice). Skipped, and said why, where there are fewer
    devices here than the plans use."""
    unknown = sorted(inputs.fold.graph.unknown.items())
    ruleless = f"planned without a rule: {', '.join(f'{k} x{n}' for k, n in unknown)}" if unknown else ""
    # Fast's own pool among them (the same at thorough), so thorough weighs what fast weighs.
    pools = [fitting, [c for c in fitting if fast_mesh(c.mesh, hw) and not c.tactic.startswith("exact")]]
    pools = [pool for pool in pools if pool]
    views = [_by_compiled_view(pool) for pool in pools]
    picks = [_pick(pool[0], view) for pool, view in zip(pools, views)]
    best = picks[0]
    top = min(GUARD_TOP, max(2, os.cpu_count() or 1))
    agree = [[c for c in view[:top] if _view(c) <= AGREE * _view(view[0])] for view in views]
    close = any(len(a) >= 2 for a in agree)
    differ = len(picks) > 1 and picks[1] is not best
    asked = views[0][:top] if check is True or unknown else [c for a in agree for c in a]
    contenders = _same_plans_once(sorted({id(c): c for c in asked + picks}.values(), key=_view))[:top]
    across = _across_rival(best, fitting, hw)
    if across is not None:  # these two first, whatever else fits in the top
        contenders = _same_plans_once([best, across, *contenders])[:top]
    roofline = fitting[0]
    weighed = (
        f"chose {best.tactic} on {mesh_text(best.mesh)} over {roofline.tactic} on {mesh_text(roofline.mesh)}, at "
        f"{best.cost.total_seconds / roofline.cost.total_seconds:.3f}x its roofline time, for its FLOPs and collectives: "
        f"{_view(best) * 1e3:.3f} ms against {_view(roofline) * 1e3:.3f} ms"
        if best is not roofline
        else ""
    )
    if check is False or len(contenders) < 2:
        return best, tuple(n for n in (ruleless, weighed) if n)
    here = len(jax.devices())
    need = max(math.prod(c.mesh.values()) for c in contenders)
    if here < need:
        why = f"compile check skipped: {here} device(s) in this process, the candidates use {need}"
        return best, tuple(n for n in (ruleless, weighed, why) if n)
    plans = [_to_plan(inputs, c, args, devices, 0.0, [c], limit, hw) for c in contenders]
    seconds, how = _compiled_seconds(fn, args, inputs, plans, hw)
    priced = list(zip(seconds, contenders))
    chosen = min(priced, key=lambda t: t[0])[1]
    said = ", ".join(f"{c.tactic} on {mesh_text(c.mesh)} {sec * 1e3:.3f} ms" for sec, c in priced)
    why = next(
        w
        for w, yes in (
            ("close predictions", close),
            ("primitives without a rule", unknown),
            ("another axis across slices is predicted close", across is not None),
            ("the fast level's best differs", differ),
            ("asked", True),
        )
        if yes
    )
    note = f"compiled the top {len(priced)} ({why}{how}): {said}; chose {chosen.tactic} on {mesh_text(chosen.mesh)}"
    return chosen, tuple(n for n in (ruleless, note) if n)


def _view(c: Candidate) -> float:
    return c.cost.compiled_view_seconds


def _pick(first: Candidate, view: list[Candidate]) -> Candidate:
    """The roofline's best, unless the view puts another more than AGREE ahead of it: within
    AGREE the view cannot tell them apart either, and only a compile may overrule the roofline."""
    return view[0] if _view(first) > AGREE * _view(view[0]) else first


def _by_compiled_view(pool: list[Candidate]) -> list[Candidate]:
    """The candidates within CLOSE of the pool's best on as many devices (one per tactic and
    mesh), cheapest FLOPs and collectives first. A plan on fewer devices sends less by doing more
    on each, and the memory-bound part of that work is what the compiled view cannot see: those
    are weighed by the roofline alone."""
    best = pool[0]
    used = math.prod(best.mesh.values())
    close = [
        c
        for c in _distinct(pool)
        if c.cost.total_seconds <= CLOSE * best.cost.total_seconds and math.prod(c.mesh.values()) == used
    ]
    return sorted(close, key=_view)


def _compiled_seconds(fn, args, inputs: Inputs, plans: list[Plan], hw: Hardware) -> tuple[list[float], str]:
    """Each plan's seconds as XLA compiles it (`verify`), all compiled at once. A deep stack of
    layers is compiled at the two depths depth planning traced, and priced along the line through
    them (what a layer adds is the same at every depth): the guard's cost does not grow with the
    model. Returns the seconds and how they were found, for the notes."""
    from .verify import verify_many  # (compiles: only when the guard runs)

    total = lambda v: v.compute_seconds + v.communication_seconds  # noqa: E731
    if not inputs.shallow_steps:
        return [total(v) for v in verify_many([(p, fn, args) for p in plans], hardware=hw, ranking=True)], ""
    (a, b, depth) = inputs.fold.depths
    jobs = [(p, step, step_args) for step, step_args in inputs.shallow_steps for p in plans]
    found = [total(v) for v in verify_many(jobs, hardware=hw, ranking=True)]
    at_a, at_b = found[: len(plans)], found[len(plans) :]
    return [y + (depth - b) * (y - x) / (b - a) for x, y in zip(at_a, at_b)], f"; at {a} and {b} of {depth} layers"


def _same_plans_once(ranked: list[Candidate]) -> list[Candidate]:
    """The first of candidates that annotate alike (a refinement that kept its start): one plan,
    compiled once."""
    out: dict[tuple, Candidate] = {}
    for c in ranked:
        out.setdefault((tuple(c.mesh.items()), tuple(sorted(c.annotations.items()))), c)
    return list(out.values())


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """The best candidate of each tactic and mesh, in order."""
    out: dict[tuple, Candidate] = {}
    for c in ranked:
        out.setdefault((c.tactic, tuple(c.mesh.items())), c)
    return list(out.values())


def _to_plan(
    inputs: Inputs,
    best: Candidate,
    args,
    devices: int,
    seconds: float,
    ranked: list[Candidate],
    limit: int,
    hw: Hardware,
    timing: str = "",
    guard: tuple[str, ...] = (),
) -> Plan:
    g = inputs.graph
    spec = _Specs(best.propagation)  # (a deep model's ~10^4 leaves stand for a few hundred values)
    it = iter([spec[v] for v in inputs.ids])
    in_specs = tuple(jax.tree.map(lambda _: next(it), a) for a in args)
    outs = iter([spec[v] for v in g.outputs])
    out_specs = _carried(jax.tree.map(lambda _: next(outs), g.out_shape), g.out_shape, in_specs, args)
    c = best.cost
    cpu_peak = (
        c.peak_bytes_per_device
        if hw.copies_transposed_lhs
        else estimate(
            best.propagation, dataclasses.replace(hw, copies_transposed_lhs=True), inputs.fold
        ).peak_bytes_per_device
    )
    cost = dataclasses.replace(c, collective_bytes=dict(c.collective_bytes), cpu_peak_bytes_per_device=cpu_peak)
    # Why: the best candidate of every other tactic, and the next best of the chosen one.
    seen, runners = {best.tactic}, [r for r in ranked if r is not best and r.tactic == best.tactic][:1]
    for r in ranked:
        if r.tactic not in seen:
            seen.add(r.tactic)
            runners.append(r)
    used = math.prod(best.mesh.values())
    lost = (_unused(inputs, devices, best, ranked, limit),) if used < devices else ()
    slices = devices // hw.slice_devices if hw.slice_devices else 1
    across = (_slow_link_note(best, ranked, hw, limit),) if slices > 1 else ()
    notes = (
        (f"chosen: {best.line()}",)
        + lost
        + across
        + tuple(
            f"runner-up: {r.line()}" + ("" if r.cost.peak_bytes_per_device <= limit else "  (over the memory limit)")
            for r in sorted(runners, key=lambda r: r.cost.total_seconds)
        )
        + guard
        + ((timing,) if timing else ())
    )
    mesh = {k: v for k, v in best.mesh.items() if v > 1} or {"data": 1}
    return Plan(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        cost=cost,
        search_seconds=seconds,
        devices=devices,
        notes=notes,
        tactic=best.tactic,
        slices=slices,
    )


ROLES = {
    "replica": "data parallel",
    "seq": "sequence parallel",
    "model": "tensor parallel",
    "expert": "expert parallel",
}


def crossing(mesh: Mapping[str, int], hw: Hardware) -> tuple[str, ...]:
    """The mesh axes whose groups cross the slow link between slices (devices slice-major)."""
    names = [a for a in mesh if mesh[a] > 1]
    return tuple(a for i, a in enumerate(names) if hw.level(math.prod(mesh[n] for n in names[i:])) == "dcn")


def _slow_link_note(best: Candidate, ranked: list[Candidate], hw: Hardware, limit: int) -> str:
    """Which axis crosses the slow link, and why: the best plan that puts something else there."""
    mine = crossing(best.mesh, hw)
    slow, fast = hw.dcn or hw.inter, hw.link(hw.slice_devices)
    fsdp = "fsdp" in best.tactic
    role = lambda a: (  # noqa: E731
        "data parallel, FSDP over data inside each slice (HSDP)" if a == "replica" and fsdp
        else ROLES.get(a) or ("FSDP" if fsdp else "data parallel")
    )  # fmt: skip
    said = ", ".join(f"{a}={best.mesh[a]} ({role(a)})" for a in mine) or "nothing"
    head = (
        f"across slices ({slow.bandwidth / 1e9:.3g} GB/s per device, {fast.bandwidth / slow.bandwidth:.0f}x slower "
        f"than within one): {said}"
    )
    other = next((c for c in ranked if crossing(c.mesh, hw) != mine and c.cost.peak_bytes_per_device <= limit), None)
    if other is None:
        return head + "; no plan that fits puts anything else there"
    theirs = ", ".join(crossing(other.mesh, hw)) or "nothing"
    return head + (
        f"; the best with {theirs} across slices ({other.tactic} on {mesh_text(other.mesh)}) is predicted "
        f"{other.cost.total_seconds / best.cost.total_seconds:.2f}x slower"
    )


def _carried(out_specs, out_shape, in_specs: tuple, args) -> object:
    """Output leaves that are an argument's next value (a step's new state: output i's leaf at
    the path and shape of argument i's) take that argument's spec, as the step is run
    (`Plan.jit(carry=...)`): the state stays where it is from one step to the next."""
    if not isinstance(out_shape, (tuple, list)):
        return out_specs
    specs = list(out_specs)
    for i, (out, spec) in enumerate(zip(out_shape, specs)):
        if i >= len(args):
            break
        theirs = jax.tree.leaves(in_specs[i], is_leaf=_is_spec)
        mine = jax.tree.leaves(spec, is_leaf=_is_spec)
        if jax.tree.structure(out) == jax.tree.structure(args[i]):  # the same paths, leaf for leaf
            pairs = zip(jax.tree.leaves(args[i]), theirs, jax.tree.leaves(out), mine)
            kept = [t if x.shape == getattr(y, "shape", None) else s for x, t, y, s in pairs]
        else:
            kept = _carried_by_path(out, mine, args[i], theirs)
        specs[i] = jax.tree.unflatten(jax.tree.structure(spec, is_leaf=_is_spec), kept)
    if hasattr(out_specs, "_fields"):  # a NamedTuple of outputs keeps its type (and its key paths)
        return type(out_specs)(*specs)
    return type(out_specs)(specs)


def _carried_by_path(out, mine: list, arg, theirs: list) -> list:
    """Per leaf of `out`, the spec of the leaf of `arg` at its path and shape, else its own."""
    given = {key_names(p): (x.shape, t) for (p, x), t in zip(_leaves(arg), theirs)}
    found = [given.get(key_names(p)) for p, _ in _leaves(out)]
    shapes = [getattr(x, "shape", None) for _, x in _leaves(out)]
    return [g[1] if g is not None and g[0] == shape else s for g, shape, s in zip(found, shapes, mine)]


def _leaves(tree) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _unused(inputs: Inputs, devices: int, best: Candidate, ranked: list[Candidate], limit: int) -> str:
    """One line: why the plan leaves devices idle."""
    used = math.prod(best.mesh.values())
    head = f"using {used} of {devices} devices: "
    whole = [r for r in ranked if math.prod(r.mesh.values()) == devices]
    fitting = [r for r in whole if r.cost.peak_bytes_per_device <= limit]
    if fitting:
        return head + (
            f"the best plan on all {devices} ({fitting[0].tactic} on {mesh_text(fitting[0].mesh)}) is predicted "
            f"slower, {fitting[0].cost.total_seconds * 1e3:.3f} ms against {best.cost.total_seconds * 1e3:.3f} ms"
        )
    if whole:
        least = min(whole, key=lambda r: r.cost.peak_bytes_per_device)
        return (
            head
            + f"every plan on all {devices} needs more memory ({least.cost.peak_bytes_per_device / 2**30:.2f} GiB/device)"
        )
    g = inputs.graph
    batch = [
        g.values[v].shape for v, a in zip(inputs.ids, inputs.argnum) if a in inputs.batch_argnums and g.values[v].shape
    ]
    b = math.gcd(*(s[0] for s in batch))
    data = math.gcd(b, devices)
    return head + (
        f"on all {devices}, data can be at most {data} (the batch is {b}) and no weight or sequence splits "
        f"the remaining {devices // data} evenly"
    )


class _Specs(dict):
    """Value id -> its PartitionSpec under a propagation (a literal's: replicated), each found once."""

    def __init__(self, propagation):
        super().__init__()
        self.propagation = propagation

    def __missing__(self, v: int) -> P:
        graph = self.propagation.graph
        self[v] = spec = _spec(self.propagation.of(v, len(graph.values[v].shape))) if v >= 0 else P()
        return spec


def _spec(sharding: Sharding) -> P:
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in sharding]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)
