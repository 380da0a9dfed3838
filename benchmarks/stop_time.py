"""How long a stop takes, and what it keeps: SIGTERM (or a preemption notice file) to `remesh run`
mid-run, timed to the process's exit, with the step reached and the newest committed step.

    .venv/bin/python benchmarks/stop_time.py --runs 3
    .venv/bin/python benchmarks/stop_time.py --runs 3 --notice   # a --stop-file notice instead

Each run starts the demo job (`examples/gpt/job.toml`, a step count it never reaches) on 4
emulated hosts, waits until step 20 is printed and 1 s more (a few steps past that checkpoint),
stops it, and waits for the process to exit. Reported: seconds from the signal to the exit, the summary's step
reached, the newest committed checkpoint step, and whether they are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def one_run(notice: bool, at_step: int = 20, then_s: float = 1.0) -> dict:
    from checkpoint import Store

    d = tempfile.mkdtemp(prefix="remesh-stop-")
    job = os.path.join(d, "job.toml")
    with open(os.path.join(ROOT, "examples/gpt/job.toml")) as f:
        text = f.read().replace("steps = 120", "steps = 100000")
    with open(job, "w") as f:
        f.write(text)
    ckpt, summary, out = os.path.join(d, "ckpt"), os.path.join(d, "summary.json"), os.path.join(d, "out.txt")
    stop_file = os.path.join(d, "preempted")
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", job, "--checkpoint-dir", ckpt, "--summary", summary]
    cmd += ["--store", os.path.join(d, "fleet.db"), "--stop-file", stop_file]
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while f"step  {at_step:>5}/" not in open(out).read():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or hung before step {at_step}:\n{open(out).read()[-3000:]}")
            time.sleep(0.05)
        time.sleep(then_s)  # a few steps past the checkpoint: the step reached is not yet committed
        t = time.monotonic()
        if notice:
            open(stop_file, "w").close()
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        seconds = time.monotonic() - t
    with open(summary) as f:
        s = json.load(f)
    committed = Store(ckpt).steps()[-1]
    return {
        "exit_s": round(seconds, 2),
        "reached": s["steps_completed"],
        "committed": committed,
        "kept": committed >= s["steps_completed"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--notice", action="store_true", help="a preemption notice file instead of SIGTERM")
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        rows.append(one_run(args.notice))
        print(json.dumps({"run": i, **rows[-1]}), flush=True)
    exits = [r["exit_s"] for r in rows]
    print(json.dumps({"median_exit_s": statistics.median(exits), "worst_exit_s": max(exits),
                      "all_kept": all(r["kept"] for r in rows)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
