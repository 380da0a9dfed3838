"""Whether two checkouts choose and price the same plans: for every benchmark model (8 H100s), one
JSON line with the chosen tactic, mesh, predicted collective bytes, both predicted peaks and the
predicted step time, each checkout in a fresh process of its own (`_harness.run_code`); then the
lines that differ.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/compare_plans.py --base /tmp/base
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import ROOT, ab_parser, run_code  # noqa: E402

LIST = """
import json
from examples.targets import TARGETS
from partitioner.search import search
for name, make in TARGETS.items():
    step, args = make()
    plan, _ = search(step, *args, devices=8, hardware="h100")
    print(json.dumps([name, plan.notes[0].split()[1], plan.mesh, dict(plan.cost.collective_bytes),
                      plan.cost.peak_bytes_per_device, plan.cost.cpu_peak_bytes_per_device,
                      round(plan.cost.total_seconds, 6)]), flush=True)
"""


def main() -> int:
    ap = ab_parser(__doc__, rounds=None)
    args = ap.parse_args()
    lines = {name: run_code(root, LIST, devices=8).splitlines() for name, root in (("base", args.base), ("this", ROOT))}
    differ = [(b, t) for b, t in zip(lines["base"], lines["this"]) if b != t]
    for b, t in differ:
        print(f"base {b}\nthis {t}")
    print(f"{len(lines['this'])} plans, {len(differ)} differ")
    return 1 if differ or len(lines["base"]) != len(lines["this"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
