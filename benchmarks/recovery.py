"""Recovery time after a host loss, for the demo job, over several runs.

    .venv/bin/python benchmarks/recovery.py --runs 3
    .venv/bin/python benchmarks/recovery.py --runs 1 --root /tmp/base   # another checkout, for an A/B

Each run is `remesh run examples/gpt/job.toml --chaos lose@30` (4 emulated hosts x 2 fake CPU
devices, one host killed after step 30). Reports per run: detection latency, the recovery parts
(replan, actor spawn, group start, restore, compile, first step) and recovery_seconds; then medians.
Baseline, measured in the same run: the cold start of the first segment on the same cluster (group
formed, state initialised, compiled, first step), which is what a restart-from-scratch pays
before it even reloads a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(steps: int, lose_at: int, root: str = ROOT) -> dict:
    d = tempfile.mkdtemp(prefix="remesh-bench-")
    summary = os.path.join(d, "summary.json")
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "run",
        "examples/gpt/job.toml",
        "--checkpoint-dir",
        os.path.join(d, "ckpt"),
        "--chaos",
        f"lose@{lose_at}",
        "--summary",
        summary,
    ]
    job = os.path.join(d, "job.toml")
    with open(os.path.join(root, "examples/gpt/job.toml")) as f:
        text = f.read().replace("steps = 120", f"steps = {steps}")
    with open(job, "w") as f:
        f.write(text)
    cmd[4] = job
    # The checkout in `root` runs: `python -m` and the host actors' PYTHONPATH take the working directory.
    subprocess.run(cmd, cwd=root, check=True, capture_output=True, timeout=900)
    with open(summary) as f:
        return json.load(f)


def parts(s: dict) -> dict:
    lost = next(e for e in s["events"] if e["kind"] == "host_lost")
    after = [e for e in s["events"] if e["at"] >= lost["at"]]
    first = {k: next(e for e in after if e["kind"] == k) for k in ("replan", "group_start", "restore", "compile")}
    return {
        "detect_s": lost["seconds"],
        "replan_s": first["replan"]["seconds"],
        "spawn_s": s["segments"][1]["spawn_seconds"],
        "group_start_s": first["group_start"]["seconds"],
        "restore_s": first["restore"]["seconds"],
        "compile_s": first["compile"]["seconds"],
        "recovery_s": s["recovery_seconds"][0],
        # Cold start: the first segment, from forming its group to its first step.
        "cold_start_s": s["segments"][0]["first_step_at"] - s["segments"][0]["started_at"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lose-at", type=int, default=30)
    ap.add_argument("--root", default=ROOT, help="the remesh checkout to run (default: this one)")
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        rows.append(parts(one_run(args.steps, args.lose_at, os.path.abspath(args.root))))
        print(json.dumps({"run": i, **{k: round(v, 2) for k, v in rows[-1].items()}}), flush=True)
    med = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
    print(json.dumps({"median": med, "runs": args.runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
