"""Two checkouts of remesh side by side, alternating in one script: the demo's recovery from a host
loss (`recovery.py`) and the step loop against a bare jitted loop (`loop_vs_bare.py`).

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_checkouts.py --base /tmp/base --rounds 3

Each round runs both checkouts, in alternating order (base first in even rounds), each from its own
directory with its own scripts: `remesh run examples/gpt/job.toml --chaos lose@40,add@80` (4
emulated hosts x 2 fake CPU devices) and `loop_vs_bare.py --rounds 1` (one process, 8 fake CPU
devices). Prints each run, then the medians of each checkout and their ratio (this / base).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from recovery import one_run, parts  # noqa: E402

FIGURES = ("recovery_s", "detect_s", "compile_s", "restore_s", "first_step_s", "loss_badput_s", "goodput_ratio",
           "loop_steps_per_s", "bare_steps_per_s", "loop_over_bare")  # fmt: skip


def loop_vs_bare(root: str, steps: int) -> dict:
    """One round of `loop_vs_bare.py` as the checkout in `root` has it."""
    cmd = [sys.executable, "benchmarks/loop_vs_bare.py", "--steps", str(steps), "--rounds", "1"]
    out = subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True, timeout=900).stdout
    m = re.search(r"median: remesh ([\d.]+) steps/s, bare ([\d.]+) steps/s, ratio ([\d.]+)", out)
    return {"loop_steps_per_s": float(m[1]), "bare_steps_per_s": float(m[2]), "loop_over_bare": float(m[3])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout (a git worktree of the baseline commit)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop-steps", type=int, default=40)
    args = ap.parse_args()
    checkouts = {"base": os.path.abspath(args.base), "this": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
            root = checkouts[name]
            figures = {**parts(one_run(120, "lose@40,add@80", root)), **loop_vs_bare(root, args.loop_steps)}
            runs[name].append(figures)
            print(json.dumps({"round": r, "checkout": name, **{k: figures[k] for k in FIGURES}}), flush=True)
    medians = {name: {k: statistics.median(f[k] for f in fs) for k in FIGURES} for name, fs in runs.items()}
    for k in FIGURES:
        b, t = medians["base"][k], medians["this"][k]
        print(f"{k:>18}: base {b:9.3f}  this {t:9.3f}  this/base {t / b if b else float('nan'):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
