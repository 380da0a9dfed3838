"""Search time against depth, devices and level, on this machine.

    .venv/bin/python benchmarks/search_scaling.py

A GPT-3-175B-shaped decoder (d_model 12288, 96 heads, d_ff 49152, vocab 50257, sequence 2048,
batch 128 sequences per step) written as examples/gpt writes it (an unrolled Python loop over
layers, AdamW; and with `scan_layers`, stacked layers run by jax.lax.scan), at 12 to 96 layers,
planned for 8, 64 and 1,024 H100s. Times, one run each:
`capture` traces the step and builds the factor graph (two copies of each repeated block of
equations op by op, later copies checked and replayed), `fold`
recognises repeated layers and folds them, `search` is everything after (propagations, pricing,
the ILP at `thorough`). The memory limit is lifted: without activation recomputation or pipeline
stages this model does not fit 80 GB at any of these meshes (the search says so, by how much), and
this benchmark measures search time, not feasibility.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    (12, 1024, "fast", False),
    (24, 1024, "fast", False),
    (48, 1024, "fast", False),
    (96, 1024, "fast", False),
    (12, 8, "fast", False),
    (96, 8, "fast", False),
    (12, 64, "fast", False),
    (96, 64, "fast", False),
    (12, 1024, "thorough", False),
    (96, 1024, "thorough", False),
    (96, 8, "thorough", False),
    (12, 1024, "fast", True),
    (96, 1024, "fast", True),
    (12, 1024, "thorough", True),
    (96, 1024, "thorough", True),
]


def main() -> None:
    from examples.targets import gpt
    from partitioner.search import search

    for layers, devices, level, scan in CASES:
        step, args = gpt(12288, 96, 49152, 50257, 2048, layers, 128, scan=scan)
        t = time.perf_counter()
        plan, ranked = search(step, *args, devices=devices, hardware="h100", level=level, memory_limit=10**15)
        total = time.perf_counter() - t
        timing = next(n for n in plan.notes if n.startswith("time:"))
        capture, fold, searched = (float(x) for x in re.findall(r"(\d+\.\d+) s", timing))
        ops = [int(x) for x in re.findall(r"\((\d+) ops\)", timing)]
        print(
            json.dumps(
                {
                    "layers": layers,
                    "scan": scan,
                    "devices": devices,
                    "level": level,
                    "total_s": round(total, 2),
                    "capture_s": capture,
                    "fold_s": fold,
                    "search_s": searched,
                    "plan_s": round(fold + searched, 2),
                    "ops": ops[0],
                    "folded_ops": ops[1],
                    "candidates": len(ranked),
                    "chosen": plan.notes[0].split("  ")[0].replace("chosen: ", "").strip(),
                    "mesh": plan.mesh,
                    "predicted_step_s": round(plan.cost.total_seconds, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
