"""Recovery time after a host loss, for the demo job, over several runs.

    .venv/bin/python benchmarks/recovery.py --runs 10                  # lose a host after step 40, add one after 80
    .venv/bin/python benchmarks/recovery.py --runs 1 --root /tmp/base   # another checkout, for an A/B

Each run is `remesh run examples/gpt/job.toml --chaos lose@40,add@80` (4 emulated hosts x 2 fake
CPU devices, one host killed once step 40 is reported, one added once step 80 is). Reports per
run: detection latency (kill to loss detected), the recovery parts (replan, taking or spawning
the host actors, group start, compile and which programs were loaded as compiled ahead, restore
(beyond the compile it runs beside, and in all) and where from, the first step after it),
recovery_seconds (loss detected to the first step completed on the new mesh), the steps computed
again, and the badput the goodput ledger charged to the loss; then medians, p95 and worst.
Baseline, measured in the same run: the cold start of the first segment on the same cluster (group
formed, state initialised, compiled, first step), which is what a restart from scratch pays before
it even reloads a checkpoint. Each run has its own checkpoint directory and compilation cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(steps: int, chaos: str, root: str = ROOT) -> dict:
    d = tempfile.mkdtemp(prefix="remesh-bench-")
    summary = os.path.join(d, "summary.json")
    job = os.path.join(d, "job.toml")
    with open(os.path.join(root, "examples/gpt/job.toml")) as f:
        text = f.read().replace("steps = 120", f"steps = {steps}")
    with open(job, "w") as f:
        f.write(text)
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", job, "--checkpoint-dir", os.path.join(d, "ckpt")]
    cmd += ["--chaos", chaos, "--summary", summary, "--store", os.path.join(d, "fleet.db")]
    # The checkout in `root` runs: `python -m` and the host actors' PYTHONPATH take the working directory.
    subprocess.run(cmd, cwd=root, check=True, capture_output=True, timeout=900)
    with open(summary) as f:
        return json.load(f)


def parts(s: dict) -> dict:
    lost = next(e for e in s["events"] if e["kind"] == "host_lost")
    after = [e for e in s["events"] if e["at"] >= lost["at"]]
    first = {k: next(e for e in after if e["kind"] == k) for k in ("replan", "group_start", "restore", "compile")}
    seg = s["segments"][1]
    return {
        "detect_s": lost["seconds"],
        "replan_s": first["replan"]["seconds"],
        "spawn_s": seg["spawn_seconds"],
        "group_start_s": first["group_start"]["seconds"],
        "compile_s": first["compile"]["seconds"],
        "loaded_ahead": ",".join(first["compile"].get("loaded", [])) or "-",  # handed over, not compiled
        # What the restore took beyond the compile it runs beside, and in all.
        "restore_s": first["restore"]["seconds"],
        "restore_took_s": first["restore"].get("took", first["restore"]["seconds"]),
        "restored_from": first["restore"].get("source", "disk"),
        # The first step's lap ends when it is reported; the restore's is reported before it.
        "first_step_s": seg["first_step_at"] - first["restore"]["at"],
        "recovery_s": s["recovery_seconds"][0],
        # From the events, so that a summary of a revision before `recomputed_steps` reads the same.
        "recomputed_steps": lost["step"] - first["restore"]["step"],
        "loss_badput_s": s["loss_badput"][0]["total"] if s.get("loss_badput") else None,
        # Cold start: the first segment, from forming its group to its first step.
        "cold_start_s": s["segments"][0]["first_step_at"] - s["segments"][0]["started_at"],
        "goodput_ratio": s["goodput"]["goodput_ratio"],
    }


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--chaos", default="lose@40,add@80")
    ap.add_argument("--root", default=ROOT, help="the remesh checkout to run (default: this one)")
    args = ap.parse_args()
    rows, last = [], None
    for i in range(args.runs):
        last = one_run(args.steps, args.chaos, os.path.abspath(args.root))
        rows.append(parts(last))
        print(json.dumps({"run": i, **{k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}}))
    numeric = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
    stats = {
        k: {
            "median": round(statistics.median(r[k] for r in rows), 3),
            "p95": round(p95([r[k] for r in rows]), 3),
            "worst": round(max(r[k] for r in rows), 3),
        }
        for k in numeric
    }
    print(json.dumps({"runs": args.runs, **stats}))
    print(json.dumps({"goodput_of_the_last_run": last["goodput"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
