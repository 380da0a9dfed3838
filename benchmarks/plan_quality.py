"""Plan quality as the compiler sees it: the tactic search's chosen plan for residual MLPs and
GPT-style decoders (examples/gpt, attention, layer norm, embeddings) on 8
fake CPU devices, its predicted collectives and peak memory beside what XLA compiles, and how long
the search took. Peak memory is predicted for the H100 and for XLA:CPU's layout of the same plan
(what these CPU compiles are compared with: `Verification.predicted_peak_bytes`).

    .venv/bin/python benchmarks/plan_quality.py
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from examples.targets import TARGETS
    from partitioner import verify
    from partitioner.search import search

    rows = []
    for name, make in TARGETS.items():
        step, args = make()
        t = time.perf_counter()
        plan, ranked = search(step, *args, devices=8, hardware="h100")
        seconds = time.perf_counter() - t
        v = verify(plan, step, *args, hardware="h100")
        predicted, compiled = sum(plan.cost.collective_bytes.values()), sum(v.collective_bytes.values())
        rows.append(
            {
                "model": name,
                "chosen": plan.notes[0].split()[1],
                "mesh": plan.mesh,
                "search_s": round(seconds, 3),
                "candidates": len(ranked),
                "predicted_collective_bytes": predicted,
                "compiled_collective_bytes": compiled,
                "bytes_ratio": round(compiled / predicted, 4) if predicted else None,
                "predicted_peak": plan.cost.peak_bytes_per_device,
                "predicted_peak_xla_cpu": v.predicted_peak_bytes,
                "compiled_peak": v.peak_bytes,
                "peak_ratio": round(v.peak_bytes / v.predicted_peak_bytes, 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(8, unless_set=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
