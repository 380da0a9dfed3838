"""Plans at the scale remesh is for: a Llama-7B- or 13B-shaped step on 4 slices of 8 fake devices, the fast
plan (pipelines searched) against hand-written plans, each compiled as it runs (`Plan.program`)
and priced from the optimized HLO: every loop body's matmuls and collectives once per trip, each
collective on the link level its replica groups cross (`partitioner.verify`).

    .venv/bin/python benchmarks/pipeline_scale.py [--profiles tpu-v5e h100] [--models llama_scan llama_maxtext] [--sizes 7b 13b]
    .venv/bin/python benchmarks/pipeline_scale.py --plantime     # pipelines searched against "off"

Experts, on 32 devices in 4 slices:
    fsdp, inputs only       FSDP over all 32 devices, only the step's inputs sharded (XLA decides the rest)
    hsdp, inputs only       data parallel across slices, FSDP inside (replica=4 x data=8)
    hsdp, constrained       the same with the layer scan's activations constrained as MaxText does
    gpipe                   one stage per slice (stage=4 x data=8), FSDP inside, 4 microbatches,
                            each stage's weights gathered once per step
    gpipe, remat            the same with each stage's forward computed again in its backward pass
    gpipe x megatron+fsdp   the GPipe with Megatron over 2 of a stage's devices (data=4 x model=2)
    gpipe, per microbatch   the GPipe with each stage's weights gathered layer by layer at each
                            microbatch, as the stage applies them (MaxText's default)
    hsdp x megatron+fsdp    replica=4 x data=4 x model=2, constrained (its tensor-parallel rule)

Peak memory: the planner's prediction is for the accelerator's layout (bfloat16 as bfloat16); the
compile here is XLA:CPU's, which widens bfloat16 to float32 and lays buffers out its own way, so
its peaks compare between plans, not with the prediction.

`llama_scan` applies its layers with `jax.lax.scan`; `llama_maxtext` in a Python loop (remat on each
layer, as MaxText's `remat_policy="full"`), for which the constrained and pipelined experts do not
exist (no scan to constrain or to pipeline) and its hsdp x megatron+fsdp is its inputs' shardings.

An expert's predicted peak is the planner's memory model's (its leaves annotated on the step's
graph and priced as a candidate is; a GPipe's, its stage's plan so priced and the pipeline over it
as the planner prices one): "x best expert predicted to fit" leaves out those over the profile's
memory, which a compile on CPU cannot tell. `--experts NAME ...` compiles only those; `--memory
GiB` plans for less memory than the profile's, and judges the experts' fit by it.

The profiles' batches: tpu-v5e 32 sequences of 2,048 tokens, h100 32 of 8,192 (as issue 42 says).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time

from _harness import fake_devices

SEQ = {"tpu-v5e": 2048, "h100": 8192}
SIZES = {"7b": ("SEVEN_B", 32), "13b": ("THIRTEEN_B", 40)}  # the model's shape, and its layers


def experts(module, fn, args, scanned: bool, layers: int, names=None):
    from jax.sharding import PartitionSpec as P

    from partitioner import Pipeline, ScanLayout
    from tests.corpus.common import Expert, expert_plan

    batch = args[1]["inputs"].shape[0]
    none = lambda path, shape: None  # noqa: E731
    stacked = lambda path, shape: ("stage",) + (None,) * (len(shape) - 1) if "/layers/" in path else None  # noqa: E731

    def staged_tp(path, shape):  # the stage axis on the layer dimension, Megatron's rule on the rest
        if "/layers/" not in path:
            return None
        return ("stage", *(module.tensor_parallel(path, shape) or (None,) * len(shape))[1:])

    tp = lambda path, shape: module.tensor_parallel(path, shape) if "/layers/" in path else None  # noqa: E731
    made = {
        "fsdp, inputs only": (Expert("fsdp", {"data": 32}, none, fsdp=True), None, None),
        "hsdp, inputs only": (Expert("hsdp", {"replica": 4, "data": 8}, none, fsdp=True), None, None),
        "hsdp, constrained": (Expert("hsdp", {"replica": 4, "data": 8}, none, fsdp=True), ("replica", "data"), None),
        "hsdp x megatron+fsdp": (
            Expert("tp", {"replica": 4, "data": 4, "model": 2}, tp, fsdp=True), ("replica", "data"), None,
        ),
        "gpipe": (Expert("gpipe", {"stage": 4, "data": 8}, stacked, fsdp=True), ("data",),
                  Pipeline(4, 4, layers=layers, gather_once=True)),
        "gpipe, remat": (Expert("gpipe", {"stage": 4, "data": 8}, stacked, fsdp=True), ("data",),
                         Pipeline(4, 4, layers=layers, gather_once=True, remat=True)),
        "gpipe x megatron+fsdp": (Expert("gpipe", {"stage": 4, "data": 4, "model": 2}, staged_tp, fsdp=True),
                                  ("data",), Pipeline(4, 4, layers=layers, gather_once=True)),
        "gpipe, per microbatch": (Expert("gpipe", {"stage": 4, "data": 8}, stacked, fsdp=True), ("data",),
                                  Pipeline(4, 4, layers=layers, gather_once=False)),
    }  # fmt: skip
    if not scanned:  # a Python loop of layers: no scan to constrain or pipeline by hand either
        made = {k: (e, None, None) for k, (e, carry, pipe) in made.items() if carry is None or k.startswith("hsdp x")}
    out = {}
    for name, (expert, carry, pipe) in made.items():
        if names and name not in names:
            continue
        plan = expert_plan(expert, fn, args, slices=4)
        if pipe is not None:  # the batch split over stages too, outside the pipeline
            plan = dataclasses.replace(plan, in_specs=(plan.in_specs[0], {k: P(("stage", "data")) for k in args[1]}))
        layout = ScanLayout(layers, batch, (carry,), (1,)) if carry else None
        out[name] = dataclasses.replace(plan, devices=32, layer_scan=layout, pipeline=pipe)
    return out


def one(model: str, hardware: str, size: str = "7b", names=None, memory: float | None = None) -> list[str]:
    from partitioner import plan, verify_many
    from partitioner.analysis import read_inputs
    from partitioner.hardware import profile
    from partitioner.layerscan import find_layer_scan

    module = importlib.import_module(f"tests.corpus.{model}")
    shape, layers = SIZES[size]
    c = dict(getattr(module, shape), seq=SEQ[hardware])
    remat = {"remat": True} if "remat" in module.build.__code__.co_varnames else {}  # (MaxText's remat_policy="full")
    fn, args = module.build(layers=layers, c=c, **remat)
    scanned = find_layer_scan(fn, args, (1,))[0] is not None
    t = time.perf_counter()
    limit = int(memory * 2**30) if memory else profile(hardware).memory_bytes
    mine = plan(fn, *args, devices=32, slices=4, hardware=hardware, compile_check=False, memory_limit=limit)
    seconds = time.perf_counter() - t
    hand = experts(module, fn, args, scanned, layers, names)
    inputs = read_inputs(fn, args, None)
    peaks = {name: predicted_peak(p, fn, args, hardware, inputs) for name, p in hand.items()}
    found = verify_many([(p, fn, args) for p in [mine, *hand.values()]], hardware=hardware, threads=1)
    price = lambda v: v.compute_seconds + v.communication_seconds  # noqa: E731
    best_name, best = min(zip(hand, found[1:]), key=lambda x: price(x[1]))
    fits = [(n, x) for n, x in zip(hand, found[1:]) if peaks[n] <= limit]
    fit_name, fit_best = min(fits, key=lambda x: price(x[1]))
    v = found[0]
    rows = [
        f"| {model} {size} | {hardware} | {mine.tactic} {mine.describe()} | {seconds:.2f} | "
        f"{mine.cost.compiled_view_seconds:.3f} | {price(v):.3f} | {price(v) / price(best):.2f} | "
        f"{best_name} {price(best):.3f} | {price(v) / price(fit_best):.2f} ({fit_name}) | {_levels(v)} | "
        f"{f'{mine.pipeline.bubble:.0%}' if mine.pipeline else '-'} | "
        f"{mine.cost.peak_bytes_per_device / 2**30:.1f} / {v.peak_bytes / 2**30:.1f} |"
    ]
    rows += [f"|  | | {name} | | | {price(x):.3f} | {price(x) / price(best):.2f} | | | {_levels(x)} | "
             f"{f'{hand[name].pipeline.bubble:.0%}' if hand[name].pipeline else '-'} | "
             f"{peaks[name] / 2**30:.1f} / {x.peak_bytes / 2**30:.1f} |"
             for name, x in zip(hand, found[1:])]  # fmt: skip
    return rows


def predicted_peak(plan, fn, args, hardware: str, inputs) -> int:
    """A hand-written plan's peak bytes per device as the planner's memory model predicts it (the
    plan's leaves annotated on the step's graph, propagated and priced as a candidate is): what
    says whether it fits the profile's memory, which a compile on CPU cannot. A pipeline: its
    stage's plan (the specs without the stage axis, on a stage's devices) priced so, and the
    pipeline over it as the planner prices one (`pipelines.cost_of`)."""
    from partitioner.hardware import profile
    from partitioner.layerscan import find_layer_scan
    from partitioner.pipelines import cost_of

    hw = profile(hardware).sliced(plan.devices, plan.slices)
    if plan.pipeline is not None:
        s = plan.pipeline.stages
        stage = dataclasses.replace(
            plan,
            mesh={k: v for k, v in plan.mesh.items() if k != "stage"},
            in_specs=tuple(_unstaged(x) for x in plan.in_specs),
            pipeline=None,
            devices=plan.devices // s,
            slices=max(plan.slices // s, 1),
        )
        inner = _candidate(stage, args, inputs, hw.sliced(stage.devices, stage.slices))
        scan, _ = find_layer_scan(fn, args, inputs.batch_argnums)
        return cost_of(plan.pipeline, scan, inner, inputs, plan.devices, hw).peak_bytes_per_device
    return _candidate(plan, args, inputs, hw).cost.peak_bytes_per_device


def _unstaged(tree):
    """Specs without the stage axis."""
    import jax
    from jax.sharding import PartitionSpec as P

    from partitioner.pipelines import _drop

    return jax.tree.map(lambda s: P(*(_drop(e, "stage") for e in s)), tree, is_leaf=lambda x: isinstance(x, P))


def _candidate(plan, args, inputs, hw):
    """`plan`'s leaves annotated on the step's graph, propagated and priced as a candidate is."""
    import jax
    from jax.sharding import PartitionSpec as P

    from partitioner.candidates import Tactic, TacticPlan, priced_each

    specs = [
        s
        for a, arg in enumerate(args)
        for s in jax.tree.leaves(plan.specs_like(arg, argnum=a), is_leaf=lambda x: isinstance(x, P))
    ]
    values = inputs.graph.values
    annotations = {}
    for v, spec in zip(inputs.ids, specs):
        entries = [tuple(e) if isinstance(e, tuple) else ((e,) if e else ()) for e in spec]
        annotations.setdefault(v, tuple(entries + [()] * (len(values[v].shape) - len(entries))))
    batch = {v: annotations[v] for v in inputs.batch_values}
    task = TacticPlan(Tactic("expert"), dict(plan.mesh), annotations, batch)
    (candidate,) = priced_each(inputs, [task], hw)
    return candidate


def _levels(v) -> str:
    return ", ".join(f"{k} {b / 1e9:.2f}" for k, b in sorted((v.level_bytes or {}).items()))


PLANTIME = ((1024, 16, 1024), (65536, 64, 16384))  # devices, slices, batch


def plantime(rounds: int = 5) -> None:
    """`plan(...)` of the 96-layer scanned Llama-7B-shaped step on tpu-v5p, pipelines searched
    ("auto") and not ("off"), alternating which goes first, the step captured afresh each call:
    medians of `rounds`."""
    import statistics

    from partitioner import plan
    from tests.corpus import llama_scan

    print("| devices | slices | off s (median) | auto s (median) | auto / off | auto's plan |")
    print("|---|---|---|---|---|---|")
    for devices, slices, batch in PLANTIME:
        fn, args = llama_scan.build(layers=96, c=dict(llama_scan.SEVEN_B, batch=batch))
        times, chosen = {"off": [], "auto": []}, None
        for r in range(rounds):
            for pipe in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
                t = time.perf_counter()
                p = plan(
                    fn, *args, devices=devices, slices=slices, hardware="tpu-v5p", compile_check=False, pipeline=pipe
                )
                times[pipe].append(time.perf_counter() - t)
                chosen = p if pipe == "auto" else chosen
        off, auto = statistics.median(times["off"]), statistics.median(times["auto"])
        print(
            f"| {devices} | {slices} | {off:.2f} | {auto:.2f} | {auto / off:.2f} | {chosen.tactic} {chosen.describe()} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="*", default=["tpu-v5e", "h100"])
    ap.add_argument("--models", nargs="*", default=["llama_scan"])
    ap.add_argument("--sizes", nargs="*", default=["7b"], choices=sorted(SIZES))
    ap.add_argument("--experts", nargs="*", help="only these hand plans (by name), to time fewer compiles")
    ap.add_argument(
        "--memory", type=float, help="GiB per device the plan and the experts must fit (default: the profile's)"
    )
    ap.add_argument("--plantime", action="store_true", help="plan time with pipelines searched against off")
    a = ap.parse_args()
    if a.plantime:
        plantime()
        return
    print(
        "| model | profile | plan | plan s | predicted s (FLOPs + collectives) | compiled s | x best expert | "
        "best expert, compiled s | x best expert predicted to fit | GB per device by level (compiled) | bubble | "
        "peak GiB predicted / CPU compile |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in a.models:
        for size in a.sizes:
            for hardware in a.profiles:
                print("\n".join(one(model, hardware, size, a.experts, a.memory)), flush=True)


if __name__ == "__main__":
    fake_devices(32)
    sys.path.insert(0, __import__("_harness").ROOT)
    main()
