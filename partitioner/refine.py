"""Refinement: the best tensor-parallel candidates improved one weight at a time, each matmul
weight in program order trying every split over model (and none), priced, the cheapest that fits
kept. The tactics read Megatron's alternation from the graph; where a program breaks it (a fused
QKV projection cut by `jnp.split`, a router beside the experts), this finds the split an engineer
would choose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .analysis import Inputs, Weight, mirror_optimizer_state, state_values, weights_in_order
from .candidates import Candidate, Tactic, TacticPlan, _each, priced
from .hardware import Hardware
from .ir import Graph
from .meshes import fast_mesh
from .propagate import Sharding
from .tactics import add_fsdp, batch_shardings, split_over


def refined(
    inputs: Inputs, candidates: list[Candidate], hw: Hardware, limit: int, level: str = "fast"
) -> list[Candidate]:
    """The best tensor-parallel candidates that fit, improved one weight at a time: each matmul
    weight in program order tries every split over model (and none), priced, and keeps the
    cheapest that fits. The tactics read Megatron's alternation from the graph; where a program
    breaks it (a fused QKV projection cut by `jnp.split`, a router beside the experts), this is
    what finds the split an engineer would choose. From the best candidate without FSDP and the
    best with (FSDP kept on every trial) on the best mesh at the fast level, each within
    REFINE_REACH of the best candidate that fits; at the thorough level on each of the REFINED_TP
    best meshes, and on those the fast level would refine."""
    fitting = [c.cost.total_seconds for c in candidates if c.cost.peak_bytes_per_device <= limit]
    reach = REFINE_REACH * min(fitting) if level == "fast" and fitting else math.inf
    tp = sorted(
        (
            c
            for c in candidates
            if c.mesh["model"] > 1 and c.cost.peak_bytes_per_device <= limit and c.cost.total_seconds <= reach
        ),
        key=lambda c: c.cost.total_seconds,
    )
    pools = [(tp, 1)] if level == "fast" else [(tp, REFINED_TP), ([c for c in tp if fast_mesh(c.mesh, hw)], 1)]
    starts: dict[tuple, Candidate] = {}
    for pool, count in pools:
        meshes = list(dict.fromkeys(tuple(c.mesh.items()) for c in pool))[:count]
        for c in pool:
            if tuple(c.mesh.items()) in meshes:
                starts.setdefault((tuple(c.mesh.items()), c.tactic.shards_state), c)
    if level == "fast":
        # Refinement keeps every trial's FSDP: a start slower than its mesh's start without
        # FSDP, which fits too, is not expected to overtake it, and refining it doubles the work.
        starts = {
            k: c
            for k, c in starts.items()
            if not k[1]
            or (k[0], False) not in starts
            or c.cost.total_seconds < starts[(k[0], False)].cost.total_seconds
        }
    return [_refine(inputs, c, hw, limit, fsdp) for (_, fsdp), c in starts.items()]


REFINED_TP = 2  # meshes whose best tensor-parallel candidates the thorough level refines

REFINE_REACH = 1.25  # the fast level refines a start at most this much slower than the best (as `search.CLOSE`)


def _refine(inputs: Inputs, start: Candidate, hw: Hardware, limit: int, fsdp: bool) -> Candidate:
    mesh, g = dict(start.mesh), inputs.graph
    batch, state = batch_shardings(inputs, mesh), state_values(inputs)
    name = Tactic("refined", fsdp, mesh["seq"] > 1)
    model_only = lambda sh: tuple(tuple(a for a in axes if a == "model") for axes in sh)
    weights = weights_in_order(inputs)
    chosen = {w.value: model_only(start.annotations[w.value]) for w in weights if w.value in start.annotations}
    chosen = {v: sh for v, sh in chosen.items() if any(sh)}

    def annotated(tp):
        return {**batch, **(add_fsdp(inputs, tp, state, mesh["data"]) if fsdp and mesh["data"] > 1 else tp)}

    # The start read back is most often the start itself, already priced.
    same = mirror_optimizer_state(inputs, annotated(chosen)) == start.annotations
    best = dataclasses.replace(start, tactic=name) if same else priced(inputs, name, mesh, annotated(chosen), hw, batch)
    moves = [
        (w, d)
        for w in weights
        for d in [None] + [d for d, n in enumerate(w.shape(g)) if n % mesh["model"] == 0 and n >= mesh["model"]]
    ]
    at = 0
    while at < len(moves):
        # The trials from `at` on, each against `chosen`, priced ahead two at a time; once one
        # is kept, those after it are tried again against the new choice.
        trials = [(i, t) for i, (w, d) in enumerate(moves) if i >= at and (t := _moved(chosen, w, d, g)) != chosen]
        plans = [TacticPlan(name, mesh, annotated(t), batch) for _, t in trials]
        priced_ahead = _each(inputs, plans, hw, beyond=best.cost.total_seconds)
        try:
            at = len(moves)
            for (i, trial), c in zip(trials, priced_ahead):
                if (
                    c is not None
                    and c.cost.peak_bytes_per_device <= limit
                    and c.cost.total_seconds < best.cost.total_seconds
                ):
                    best, chosen, at = c, trial, i + 1
                    break
        finally:
            priced_ahead.close()
    return best


def _moved(chosen: Mapping[int, Sharding], w: Weight, d: int | None, g: Graph) -> dict[int, Sharding]:
    """`chosen` with weight `w` split over model along dimension `d` (None: not split)."""
    trial = {k: v for k, v in chosen.items() if k != w.value}
    if d is not None:
        trial[w.value] = w.sharding(split_over(w.shape(g), d, "model"))
    return trial
