"""Two checkouts of remesh side by side, alternating in one script: the demo's recovery from a host
loss (`recovery.py`) and the step loop against a bare jitted loop (`loop_vs_bare.py`).

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_checkouts.py --base /tmp/base --rounds 3

Each round runs both checkouts (`_harness.ab`: alternating order, base first in even rounds), each
from its own directory with its own scripts: `remesh run examples/gpt/job.toml --chaos lose@40,add@80` (4
emulated hosts x 2 fake CPU devices) and `loop_vs_bare.py --rounds 1` (one process, 8 fake CPU
devices). Prints each run, then the medians of each checkout and their ratio (this / base).
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from _harness import ab, ab_parser, run_in  # noqa: E402
from recovery import one_run, parts  # noqa: E402

FIGURES = ("recovery_s", "detect_s", "compile_s", "restore_s", "first_step_s", "loss_badput_s", "goodput_ratio",
           "loop_steps_per_s", "bare_steps_per_s", "loop_over_bare")  # fmt: skip


def loop_vs_bare(root: str, steps: int) -> dict:
    """One round of `loop_vs_bare.py` as the checkout in `root` has it."""
    out = run_in(root, ["benchmarks/loop_vs_bare.py", "--steps", str(steps), "--rounds", "1"], timeout=900)
    m = re.search(r"median: remesh ([\d.]+) steps/s, bare ([\d.]+) steps/s, ratio ([\d.]+)", out)
    return {"loop_steps_per_s": float(m[1]), "bare_steps_per_s": float(m[2]), "loop_over_bare": float(m[3])}


def main() -> int:
    ap = ab_parser(__doc__)
    ap.add_argument("--loop-steps", type=int, default=40)
    args = ap.parse_args()
    trees = {"base": os.path.abspath(args.base), "this": ROOT}
    measure = lambda root: {**parts(one_run(120, "lose@40,add@80", root)), **loop_vs_bare(root, args.loop_steps)}
    ab(trees, args.rounds, measure, FIGURES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
