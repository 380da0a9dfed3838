"""Plan quality as the compiler sees it: the tactic search's chosen plan for residual MLPs and
GPT-style decoders (examples/gpt, attention, layer norm, embeddings) on 8
fake CPU devices, its predicted collectives and peak memory beside what XLA compiles, and how long
the search took.

    .venv/bin/python benchmarks/plan_quality.py
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import jax

    from partitioner import verify
    from partitioner.automap import search
    from examples.residual_mlp import residual_mlp

    rows = []
    models = {f"mlp-{name}": (lambda dims=dims: _mlp(residual_mlp, *dims)) for name, dims in {
        "small-weights": (256, 1024, 2, 65536), "1k": (1024, 4096, 2, 4096),
        "4k": (4096, 16384, 4, 8192), "8k": (8192, 32768, 2, 8192)}.items()}
    models["gpt-example"] = lambda: _gpt(128, 4, 512, 256, 64, 2, 24)
    models["gpt-d8192"] = lambda: _gpt(8192, 64, 32768, 32768, 1024, 2, 8)
    models["llama-gqa-swiglu"] = _llama
    for name, make in models.items():
        step, args = make()
        t = time.perf_counter()
        plan, ranked = search(step, *args, devices=8, hardware="h100")
        seconds = time.perf_counter() - t
        v = verify(plan, step, *args, hardware="h100")
        predicted, compiled = sum(plan.cost.collective_bytes.values()), sum(v.collective_bytes.values())
        rows.append({"model": name, "chosen": plan.notes[0].split()[1], "mesh": plan.mesh, "search_s": round(seconds, 3),
                     "candidates": len(ranked), "predicted_collective_bytes": predicted, "compiled_collective_bytes": compiled,
                     "bytes_ratio": round(compiled / predicted, 4) if predicted else None,
                     "predicted_peak": plan.cost.peak_bytes_per_device, "compiled_peak": v.peak_bytes,
                     "peak_ratio": round(v.peak_bytes / plan.cost.peak_bytes_per_device, 4)})
        print(json.dumps(rows[-1]), flush=True)
    del jax


def _mlp(residual_mlp, d, f, layers, tokens):
    step, state, x = residual_mlp(d, f, layers, tokens)
    return step, (state, x)


def _llama():
    from examples.llama import llama

    return llama()  # d 4096, 32 heads, 8 key/value heads, SwiGLU 14336, vocab 32000, 2 layers, batch 8 x 1024


def _gpt(d, heads, ff, vocab, seq, layers, batch):
    from examples.gpt.model import GPTConfig, make_program
    from orchestrator import check_program

    program = make_program(GPTConfig(vocab=vocab, seq_len=seq, d_model=d, n_heads=heads, n_layers=layers, d_ff=ff, dropout=0.0))
    return program.step, check_program(program, batch)


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
