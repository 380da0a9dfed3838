"""The per-host worker as a plain function (no Ray) on one GPU: step time, tokens/s and MFU as
remesh reports them, beside the device's measured matmul ceilings.

    python benchmarks/gpu_throughput.py [--steps 40]       # on a machine with a GPU

The example GPT, scaled to fill an H100 (float32 parameters, as the example is written), is
planned for the one device, run by `orchestrator.worker.segment.run_segment` exactly as a host actor runs
it, and its step reports summarised: median step time over the steps without a save, tokens/s, and
MFU against the hardware profile's peak (989 TFLOP/s, bf16 dense) and against the matmul rate
measured here for the dtype the model uses. Full numbers go to $OUT/gpu_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_rate(dtype, n=8192, repeats=10) -> float:
    """FLOP/s of an n x n x n product at the default precision, median of `repeats` timings."""
    import jax

    keys = jax.random.split(jax.random.key(0), 3)
    a, b = (jax.random.normal(k, (n, n), dtype) for k in keys[:2])
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    import jax

    import partitioner
    from examples.gpt.model import GPTConfig, make_program
    from orchestrator import check_program
    from orchestrator.job.jobfile import CheckpointSpec
    from orchestrator.protocol import SegmentSpec
    from orchestrator.worker import run_segment

    cfg = GPTConfig(vocab=32768, seq_len=1024, d_model=2048, n_heads=16, n_layers=8, d_ff=8192, dropout=0.0)
    module = sys.modules["examples.gpt.model"]
    module.bench_program = make_program(cfg)  # a module attribute, as a job's `program` names one
    state, batch = check_program(module.bench_program, args.batch)
    device = jax.devices()[0]
    plan = partitioner.plan(module.bench_program.step, state, batch, devices=1, hardware="h100")
    workdir = tempfile.mkdtemp(prefix="remesh-gpu-")
    spec = SegmentSpec(
        program="examples.gpt.model:bench_program",
        steps=args.steps,
        global_batch=args.batch,
        seed=0,
        checkpoint=CheckpointSpec(os.path.join(workdir, "ckpt"), every=10**6, keep=1),
        plan_json=plan.to_json(),
        coordinator="",
        num_processes=1,
        process_id=0,
        digest=False,
        hardware="h100",
        job="gpu-bench",
    )
    reports: list[dict] = []
    t0 = time.time()
    run_segment(spec, lambda r: reports.append(r.to_dict()))
    wall = time.time() - t0

    steps = [r for r in reports if r["kind"] == "step"]
    compile_ = next(r for r in reports if r["kind"] == "compile")
    steady = steps[5:-1]  # after warm-up, before the final save's step
    median = lambda k: statistics.median(r[k] for r in steady)
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    d, f, L, V, s = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab, cfg.seq_len
    formula = 6 * (L * (4 * d * d + 2 * d * f) + V * d) * args.batch * s + 12 * L * s * d * args.batch * s
    f32, bf16 = matmul_rate(jax.numpy.float32), matmul_rate(jax.numpy.bfloat16)
    result = {
        "device": device.device_kind,
        "jax": jax.__version__,
        "model": {
            "d_model": d,
            "layers": L,
            "d_ff": f,
            "vocab": V,
            "seq_len": s,
            "batch": args.batch,
            "parameters": params,
            "dtype": "float32",
        },
        "plan": plan.describe(),
        "steps_measured": len(steady),
        "wall_seconds": wall,
        "compile_seconds": compile_["seconds"],
        "model_flops_per_step": compile_["model_flops"],
        "formula_flops_per_step": formula,
        "median_step_seconds": median("seconds"),
        "median_tokens_per_second": median("tokens_per_second"),
        "median_mfu_vs_profile_peak": median("mfu"),
        "matmul_f32_default_precision_flops": f32,
        "matmul_bf16_flops": bf16,
        "mfu_vs_measured_f32_matmul": compile_["model_flops"] / median("seconds") / f32,
    }
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_throughput.json"), "w") as fh:
            json.dump({"result": result, "reports": reports}, fh, indent=1)
    print(json.dumps(result, indent=1))
    print(
        f"| {device.device_kind} | {params / 1e6:.0f} M | {args.batch} x {s} | {result['median_step_seconds'] * 1e3:.1f} ms | "
        f"{result['median_tokens_per_second']:,.0f} | {compile_['model_flops'] / 1e12:.2f} ({compile_['model_flops'] / formula:.3f} of formula) | "
        f"{100 * result['median_mfu_vs_profile_peak']:.1f}% | {f32 / 1e12:.0f} / {bf16 / 1e12:.0f} | "
        f"{100 * result['mfu_vs_measured_f32_matmul']:.1f}% |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
