"""The 96-to-12-layer ratio of a whole `search(..., level="fast")` call, in two checkouts.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/search_depth_ab.py --base /tmp/base [--rounds 3] [--devices 1024]

The GPT-3-175B-shaped step of `search_scaling.py`, written as a Python loop, at 12 and 96 layers:
each round, each checkout in a fresh process of its own builds both depths once and times one
search of each (`_harness.ab`: the checkouts alternate which goes first); medians and their ratio.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import ROOT, ab, ab_parser, run_code  # noqa: E402

TIMED = """
import json, re, time
from examples.targets import gpt
from partitioner.search import search
out = {{}}
for layers in (12, 96):
    step, args = gpt(12288, 96, 49152, 50257, 2048, layers, 128)
    t = time.perf_counter()
    plan, _ = search(step, *args, devices={devices}, hardware="h100", level="fast", memory_limit=10**15)
    out[f"total_{{layers}}"] = time.perf_counter() - t
    note = next(n for n in plan.notes if n.startswith("time:"))
    out[f"search_{{layers}}"] = float(re.findall(r"search (\\d+\\.\\d+) s", note)[0])
out["ratio"] = out["total_96"] / out["total_12"]
print(json.dumps(out))
"""
FIGURES = ("total_12", "total_96", "search_12", "search_96", "ratio")


def main() -> int:
    ap = ab_parser(__doc__)
    ap.add_argument("--devices", type=int, default=1024)
    args = ap.parse_args()
    import json

    measure = lambda root: json.loads(run_code(root, TIMED.format(devices=args.devices)).splitlines()[-1])
    ab({"base": os.path.abspath(args.base), "this": ROOT}, args.rounds, measure, FIGURES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
