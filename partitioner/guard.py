"""The compiler as a guard of the choice (`compile_check`): among candidates predicted within
CLOSE of the best, one whose predicted FLOPs and collectives (what a compile shows) are more than
AGREE below the best's is chosen instead (`pick`); where some are within AGREE of each other, a
primitive was planned without a rule, another axis across slices is close, or the fast level's
choice differs from the thorough level's, the best few are compiled on this process's devices and
priced from what XLA produced (`verify`), and the cheapest is chosen (`guarded`). Where no plan
fits by the model's peak but some are near, XLA's memory analysis decides (`fit_by_compiler`).
"""

from __future__ import annotations

import math
import os

import jax

from .analysis import Inputs
from .candidates import Candidate
from .explain import crossing, to_plan
from .hardware import Hardware
from .meshes import fast_mesh
from .plan import Plan, mesh_text

NEAR_LIMIT = 1.05  # a plan predicted within this of the memory limit is compiled before it is refused

MEMORY_CHECKS = 2  # near plans compiled for their memory: the fastest and the smallest


def fit_by_compiler(fn, args, inputs: Inputs, ranked: list[Candidate], devices: int, hw: Hardware, limit: int, check):
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

    plans = [to_plan(inputs, c, args, devices, 0.0, [c], limit, hw) for c in picked]
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


def across_rival(best: Candidate, fitting: list[Candidate], hw: Hardware) -> Candidate | None:
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


def guarded(fn, args, inputs: Inputs, fitting: list[Candidate], devices: int, hw: Hardware, limit: int, check):
    """The choice among the best candidates, and the compiler as a guard (`compile_check`).

    Candidates within CLOSE of the best are not told apart by the roofline, whose memory-bound
    part guesses what XLA will fuse; what a compile of a plan shows, its FLOPs per device and the
    collectives XLA inserts, is predicted exactly where the model reads the program right (to the
    byte on the Llama and Whisper steps of the corpus) and decides where it puts one more than
    AGREE ahead of the roofline's best (`Cost.compiled_view_seconds`, `pick`).
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
    pools = [fitting, [c for c in fitting if fast_mesh(c.mesh, hw) and c.tactic.kind != "exact"]]
    pools = [pool for pool in pools if pool]
    views = [by_compiled_view(pool) for pool in pools]
    picks = [pick(pool[0], view) for pool, view in zip(pools, views)]
    best = picks[0]
    top = min(GUARD_TOP, max(2, os.cpu_count() or 1))
    agree = [[c for c in view[:top] if _view(c) <= AGREE * _view(view[0])] for view in views]
    close = any(len(a) >= 2 for a in agree)
    differ = len(picks) > 1 and picks[1] is not best
    asked = views[0][:top] if check is True or unknown else [c for a in agree for c in a]
    contenders = _same_plans_once(sorted({id(c): c for c in asked + picks}.values(), key=_view))[:top]
    across = across_rival(best, fitting, hw)
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
    plans = [to_plan(inputs, c, args, devices, 0.0, [c], limit, hw) for c in contenders]
    seconds, how = compiled_seconds(fn, args, inputs, plans, hw)
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


def pick(first: Candidate, view: list[Candidate]) -> Candidate:
    """The roofline's best, unless the view puts another more than AGREE ahead of it: within
    AGREE the view cannot tell them apart either, and only a compile may overrule the roofline."""
    return view[0] if _view(first) > AGREE * _view(view[0]) else first


def by_compiled_view(pool: list[Candidate]) -> list[Candidate]:
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


def compiled_seconds(fn, args, inputs: Inputs, plans: list[Plan], hw: Hardware) -> tuple[list[float], str]:
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
