"""The search's plans against exhaustive search over the same space, measured by the compiler.

    .venv/bin/python benchmarks/plan_vs_exhaustive.py [MODEL ...]

The space, on 8 devices: every (data, model) mesh; on each, every weight of the folded graph
(a repeated layer's weights decided once for all layers, as the search decides them) either
replicated or split over model along one of its dimensions that divides, each assignment with and
without FSDP on the data axis; plus data parallelism and FSDP on data=8. Every point is priced by
the cost model, where that is feasible here (at most `FEASIBLE` points; a model with 8 matmul
weights per layer has 3^8 assignments per mesh, which is reported instead). Where the space is small (the MLPs: a few hundred points) every point is compiled
with `partitioner.verify` and priced from what XLA produced (XLA's FLOPs at the h100 peak plus the
collectives XLA inserted, alpha-beta); otherwise the exhaustive side is the best compiled cost
among the cost model's best `TOP` points. The searched plans (`fast`, `thorough`) are compiled and
priced the same way.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = 12
COMPILE_ALL_BELOW = 200
FEASIBLE = 8000  # points priced (about 25 ms each here): larger spaces are reported, not searched


def size(inputs) -> int:
    from partitioner import analysis, meshes
    from partitioner.hardware import profile

    g, n = inputs.graph, 0
    found = analysis.weights_in_order(inputs)
    for mesh in meshes.mesh_shapes(8, inputs, profile("h100"), "fast"):
        t = mesh["model"]
        per = math.prod(1 + sum(1 for d in w.shape(g) if d % t == 0 and d >= t) for w in found)
        n += 2 if t == 1 else 2 * (per - 1)
    return n


def space(inputs):
    """Every point of the space, priced."""
    from partitioner import analysis, candidates, meshes, tactics
    from partitioner.hardware import profile

    hw = profile("h100")
    g = inputs.graph
    found = analysis.weights_in_order(inputs)
    out = []
    for mesh in meshes.mesh_shapes(8, inputs, hw, "fast"):
        batch = tactics.batch_shardings(inputs, mesh)
        t, d = mesh["model"], mesh["data"]
        if t == 1:
            out.append(candidates.priced(inputs, candidates.Tactic("dp"), mesh, batch, hw, batch))
            if d > 1:
                state = {v: s for v in analysis.state_values(inputs) if (s := tactics.fsdp(g.values[v].shape, d))}
                out.append(candidates.priced(inputs, candidates.Tactic("fsdp"), mesh, {**batch, **state}, hw, batch))
            continue
        options = [[None] + [k for k, n in enumerate(w.shape(g)) if n % t == 0 and n >= t] for w in found]
        for choice in itertools.product(*options):
            tp = {
                w.value: w.sharding(analysis.split_over(w.shape(g), k, "model"))
                for w, k in zip(found, choice)
                if k is not None
            }
            if not tp:
                continue
            out.append(candidates.priced(inputs, candidates.Tactic("split"), mesh, {**batch, **tp}, hw, batch))
            if d > 1:
                fsdp = tactics.add_fsdp(inputs, tp, analysis.state_values(inputs), d)
                out.append(
                    candidates.priced(inputs, candidates.Tactic("split", fsdp=True), mesh, {**batch, **fsdp}, hw, batch)
                )
    return out


def compiled(plan, fn, args):
    from partitioner import verify

    v = verify(plan, fn, *args, hardware="h100")
    return v.compute_seconds + v.communication_seconds, v.peak_bytes


def main() -> None:
    from examples.targets import TARGETS
    from partitioner import analysis, explain
    from partitioner import search as search_mod
    from partitioner.hardware import profile

    limit = profile("h100").memory_bytes
    for name in sys.argv[1:] or [
        "mlp-small-weights",
        "mlp-1k",
        "mlp-4k",
        "gpt-example",
        "gpt-d8192",
        "llama-gqa-swiglu",
        "moe-8x",
    ]:
        fn, args = TARGETS[name]()
        inputs = analysis.read_inputs(fn, args, None)
        if size(inputs) > FEASIBLE:
            print(json.dumps({"model": name, "points": size(inputs), "feasible": False}), flush=True)
            continue
        t = time.perf_counter()
        points = space(inputs)
        priced_s = time.perf_counter() - t
        fitting = sorted(
            (p for p in points if p.cost.peak_bytes_per_device <= limit), key=lambda p: p.cost.total_seconds
        )
        chosen = fitting if len(fitting) <= COMPILE_ALL_BELOW else fitting[:TOP]
        best, best_s = None, float("inf")
        for p in chosen:
            plan = explain.to_plan(inputs, p, args, 8, 0.0, [p], limit, profile("h100"))
            seconds, peak = compiled(plan, fn, args)
            if peak <= limit and seconds < best_s:
                best, best_s = p, seconds
        row = {
            "model": name,
            "points": len(points),
            "fitting": len(fitting),
            "compiled": len(chosen),
            "all_compiled": len(chosen) == len(fitting),
            "pricing_s": round(priced_s, 1),
            "exhaustive": {
                "tactic": best.tactic,
                "mesh": best.mesh,
                "compiled_s": best_s,
                "model_best_s": fitting[0].cost.total_seconds,
            },
        }
        for level in ("fast", "thorough"):
            plan, _ = search_mod.search(fn, *args, devices=8, hardware="h100", level=level)
            seconds, _ = compiled(plan, fn, args)
            row[level] = {
                "chosen": plan.notes[0].split_over()[1],
                "mesh": dict(plan.mesh),
                "compiled_s": seconds,
                "over_exhaustive": seconds / best_s,
            }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(8, unless_set=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
