"""The 96-to-12-layer ratio of a whole `search(..., level="fast")` call, in one process.

    .venv/bin/python benchmarks/search_depth_ab.py ROOT [REPEATS] [DEVICES]

ROOT is a checkout of this repository (this one, or a `git worktree` of an older commit, so two
commits can be timed in alternating processes on the same machine). The GPT-3-175B-shaped step
of `search_scaling.py`, written as a Python loop, at 12 and 96 layers; each depth's step and
arguments are built once, then the two depths alternate REPEATS times; medians are printed.
"""

import os
import re
import sys
import time


def main() -> None:
    root = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    devices = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, root)
    from examples.targets import gpt
    from partitioner.search import search

    models = {layers: gpt(12288, 96, 49152, 50257, 2048, layers, 128) for layers in (12, 96)}
    runs: dict[int, list[tuple[float, ...]]] = {12: [], 96: []}
    for _ in range(repeats):
        for layers, (step, args) in models.items():
            t = time.perf_counter()
            plan, _ = search(step, *args, devices=devices, hardware="h100", level="fast", memory_limit=10**15)
            total = time.perf_counter() - t
            note = next(n for n in plan.notes if n.startswith("time:"))
            runs[layers].append((total, *(float(x) for x in re.findall(r"(\d+\.\d+) s", note))))
    median = lambda xs: sorted(xs)[len(xs) // 2]
    for layers, rows in runs.items():
        print(
            root,
            layers,
            "total {:.3f} capture {:.3f} fold {:.3f} search {:.3f}".format(
                *(median([r[i] for r in rows]) for i in range(4))
            ),
        )
    print(f"ratio {median([r[0] for r in runs[96]]) / median([r[0] for r in runs[12]]):.2f}")


if __name__ == "__main__":
    main()
