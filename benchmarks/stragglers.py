"""A slow host, with the health loop on and off, against the healthy run: the demo job (4 emulated
hosts x 2 fake CPU devices) with `--chaos slow-step@20:2x3` (host 2's work on each step three
times as long from step 20), run as `remesh run` legs in turn, side by side in one script.

    .venv/bin/python benchmarks/stragglers.py [--rounds 3] [--steps 60]
    .venv/bin/python benchmarks/stragglers.py --false-alarm    # 300 healthy steps, jittered, one stall

Legs, each round in this order:
    healthy              no fault, every check on (the defaults: stragglers = "act", the state's
                         copies compared as often as costs 1% of a step)
    healthy, checks off  no fault, stragglers = "off", digest_every = -1: what the checks cost
    slow, off            the slow host, stragglers = "off": training at the straggler's pace
    slow, act            the slow host, stragglers = "act": named, excluded, the job on 3 hosts

`--false-alarm`: the demo job for 300 steps with every check on, every host's step work jittered
by a random 0 to 40% of a healthy step from step 10 (`jitter@10x0.2`: +-20% around its mean) and
host 1 stopped once for 5 s after step 150 (`stall@150:1x5`); reported: every straggler, hang and
corruption event (none is the pass), and the segments.

Reported per leg: the median step seconds over the steps after acting (from step `--from` on, the
segment's first step left out), throughput against the healthy leg of the same round, when the
straggler was named and what was done, and the largest loss difference against the healthy leg.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEGS = {  # ([health] stragglers, digest_every, --chaos)
    "jittered, one stall": ("act", 0, "jitter@10x0.2,stall@150:1x5"),  # (--false-alarm only)
    "healthy": ("act", 0, None),
    "healthy, checks off": ("off", -1, None),
    "slow, off": ("off", 0, "slow-step@20:2x3"),
    "slow, act": ("act", 0, "slow-step@20:2x3"),
}


def job_text(steps: int, ckpt: str, stragglers: str, digest_every: int) -> str:
    """The demo job file, `steps` long, checkpointing into `ckpt`, with the health loop as given."""
    with open(os.path.join(ROOT, "examples/gpt/job.toml")) as f:
        text = f.read()
    text = re.sub(r"(?m)^steps = \d+", f"steps = {steps}", text)
    text = re.sub(r'(?m)^dir = ".*"', f'dir = "{ckpt}"', text)
    return text + f'\n[health]\nstragglers = "{stragglers}"\ndigest_every = {digest_every}\n'


def leg(name: str, steps: int, start: int, where: str) -> dict:
    stragglers, digest_every, chaos = LEGS[name]
    d = tempfile.mkdtemp(prefix="stragglers-", dir=where)
    job = os.path.join(d, "job.toml")
    with open(job, "w") as f:
        f.write(job_text(steps, os.path.join(d, "ckpt"), stragglers, digest_every))
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", job, "--summary", f"{d}/summary.json",
           "--store", f"{d}/fleet.db"] + (["--chaos", chaos] if chaos else [])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(
            f"{name}: remesh run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    with open(f"{d}/summary.json") as f:
        summary = json.load(f)
    with sqlite3.connect(f"{d}/fleet.db") as db:
        rows = db.execute("SELECT segment, step, seconds FROM steps WHERE host = 0 ORDER BY step").fetchall()
    firsts = {seg: min(step for s, step, _ in rows if s == seg) for seg, _, _ in rows}
    seconds = [sec for seg, step, sec in rows if step >= start and step != firsts[seg]]
    slow = [e for e in summary["events"] if e["kind"] == "straggler"]
    health = [{k: e.get(k) for k in ("kind", "step", "host", "action", "reason")} for e in summary["events"]
              if e["kind"] in ("straggler", "hang", "corruption")]  # fmt: skip
    return {
        "health_events": health,
        "leg": name,
        "median_step_seconds": statistics.median(seconds),
        "losses": summary["losses"],
        "hosts": [s["hosts"] for s in summary["segments"]],
        "named": [(e["host"], e["evidence"]["steps"][-1], e["action"]) for e in slow],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--from", dest="start", type=int, default=30, help="median step time from this step on")
    ap.add_argument("--false-alarm", action="store_true", help="300 healthy steps, jittered, one 5 s stall")
    args = ap.parse_args()
    where = tempfile.mkdtemp(prefix="remesh-stragglers-")
    if args.false_alarm:
        got = leg("jittered, one stall", 300, args.start, where)
        print(json.dumps({k: v for k, v in got.items() if k != "losses"}, indent=1))
        return
    legs = [name for name in LEGS if name != "jittered, one stall"]
    results: dict[str, list[dict]] = {name: [] for name in legs}
    for r in range(args.rounds):
        for name in legs:
            got = leg(name, args.steps, args.start, where)
            results[name].append(got)
            print(json.dumps({"round": r, **{k: v for k, v in got.items() if k != "losses"}}), flush=True)
    print(f"\n| leg | median step s (from step {args.start}) | x healthy throughput | hosts | named (host, step, action) "
          "| max loss diff vs healthy |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        ratios = [h["median_step_seconds"] / x["median_step_seconds"] for h, x in zip(results["healthy"], runs)]
        diff = max(
            max(abs(a - b) / abs(b) for a, b in zip(x["losses"], h["losses"])) for h, x in zip(results["healthy"], runs)
        )
        print(f"| {name} | {statistics.median(x['median_step_seconds'] for x in runs):.3f} | "
              f"{statistics.median(ratios):.2f} ({', '.join(f'{q:.2f}' for q in ratios)}) | {runs[0]['hosts']} | "
              f"{'; '.join(str(x['named']) for x in runs)} | {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
