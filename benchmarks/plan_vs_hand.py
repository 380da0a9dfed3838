"""The search's plans (`fast` and `thorough`) against hand-written expert plans, all measured by
the compiler.

    .venv/bin/python benchmarks/plan_vs_hand.py [MODEL ...]

For each model, on 8 fake CPU devices: the searched plans and the hand-written ones (data parallel
on 8; FSDP on 8, every leaf split on its largest dimension that divides; Megatron TP x DP on
data=2 x model=4 with the classic column/row split by parameter name; for the MoE, experts split
over model (data=2 x model=4) with Megatron attention) are compiled with `partitioner.verify`, and
each is priced the same way from what XLA produced: XLA's FLOPs at the h100 profile's peak plus
the collectives XLA inserted, priced alpha-beta. Peak memory is XLA's.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMN = ("wq", "wk", "wv", "w1", "w_gate", "w_up")
ROW = ("wo", "w2", "w_down")


def hand_plans(fn, args):
    import jax
    from jax.sharding import PartitionSpec as P

    from partitioner import Cost, Plan

    state, batch = args
    zero = Cost(0.0, 0.0, {}, 0)
    metrics = jax.eval_shape(fn, *args)[1]

    def specs(rule):
        state_specs = jax.tree_util.tree_map_with_path(lambda path, x: rule(jax.tree_util.keystr(path), x.shape), state)
        batch_specs = jax.tree.map(lambda x: P("data"), batch)
        return (state_specs, batch_specs), (state_specs, jax.tree.map(lambda _: P(), metrics))

    def fsdp(path, shape):
        dims = [i for i, d in enumerate(shape) if d % 8 == 0]
        if not dims:
            return P()
        i = max(dims, key=lambda k: shape[k])
        return P(*[("data" if k == i else None) for k in range(len(shape))])

    def megatron(path, shape):
        name = path.rstrip("']").split("'")[-1]
        if name in COLUMN and len(shape) == 2 and shape[1] % 4 == 0:
            return P(None, "model")
        if name in ROW and len(shape) == 2 and shape[0] % 4 == 0:
            return P("model")
        if name == "b1" and shape[0] % 4 == 0:
            return P("model")
        return P()

    def experts(path, shape):
        name = path.rstrip("']").split("'")[-1]
        return P("model") if name in ("w_in", "w_out") else megatron(path, shape)

    rules = [
        ("hand dp", {"data": 8}, lambda p, s: P()),
        ("hand fsdp", {"data": 8}, fsdp),
        ("hand megatron", {"data": 2, "model": 4}, megatron),
    ]
    if any("w_in" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]):
        rules.append(("hand expert", {"data": 2, "model": 4}, experts))
    out = {}
    for name, mesh, rule in rules:
        ins, outs = specs(rule)
        out[name] = Plan(mesh=mesh, in_specs=ins, out_specs=outs, cost=zero, search_seconds=0.0, devices=8)
    return out


def main() -> None:
    from examples.targets import TARGETS
    from partitioner import verify
    from partitioner.hardware import profile
    from partitioner.search import search

    hw = profile("h100")
    names = sys.argv[1:] or ["mlp-small-weights", "mlp-4k", "gpt-example", "gpt-d8192", "llama-gqa-swiglu", "moe-8x"]
    for name in names:
        fn, args = TARGETS[name]()
        plans = {}
        for level in ("fast", "thorough"):
            searched, _ = search(fn, *args, devices=8, hardware="h100", level=level)
            plans[f"{level} (" + searched.notes[0].split()[1] + ")"] = searched
        plans.update(hand_plans(fn, args))
        row = {"model": name}
        for label, plan in plans.items():
            v = verify(plan, fn, *args, hardware="h100")
            row[label] = {
                "seconds": v.compute_seconds + v.communication_seconds,
                "compute_s": v.compute_seconds,
                "comm_s": v.communication_seconds,
                "peak_bytes": v.peak_bytes,
                "fits": v.peak_bytes <= hw.memory_bytes,
                "mesh": dict(plan.mesh),
            }
        hand = [v["seconds"] for k, v in row.items() if k.startswith("hand") and v["fits"]]
        for level in ("fast", "thorough"):
            mine = next(v for k, v in row.items() if k.startswith(level))
            row[f"{level}_over_best_hand"] = mine["seconds"] / min(hand) if hand else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(8, unless_set=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
