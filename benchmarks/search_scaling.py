"""Search time of the tactic search against depth and device count, on this machine.

    .venv/bin/python benchmarks/search_scaling.py

The GPT example at d_model 8192 (64 heads, d_ff 32768, vocab 32768, batch 8 x 1024), unrolled
Python layers, AdamW; capture (jaxpr -> factor graph) and search timed separately, one run each.
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from examples.gpt.model import GPTConfig, make_program
    from orchestrator import check_program
    from partitioner.automap import search
    from partitioner.ir import capture

    for layers, devices in [(2, 8), (4, 8), (8, 8), (12, 8), (2, 64), (2, 1024)]:
        program = make_program(GPTConfig(vocab=32768, seq_len=1024, d_model=8192, n_heads=64, n_layers=layers,
                                         d_ff=32768, dropout=0.0))
        state, batch = check_program(program, 8 if devices <= 8 else devices)
        t = time.perf_counter()
        graph = capture(program.step, state, batch)
        captured = time.perf_counter() - t
        t = time.perf_counter()
        plan, ranked = search(program.step, state, batch, devices=devices, hardware="h100")
        print(json.dumps({"layers": layers, "devices": devices, "ops": len(graph.ops), "capture_s": round(captured, 2),
                          "search_s": round(time.perf_counter() - t, 2), "candidates": len(ranked),
                          "chosen": plan.notes[0].split("  ")[0].replace("chosen: ", "").strip(), "mesh": plan.mesh}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
