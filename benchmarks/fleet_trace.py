"""Several elastic jobs sharing one cluster: remesh's fleet policy against first-come-first-served
gangs and against elastic jobs without preemption, on a simulated trace.

    .venv/bin/python benchmarks/fleet_trace.py simulate [--start S] [--resize S] [--seeds N]

`simulate`: a synthetic trace (`orchestrator.fleet.simulate.synthetic_trace`: a fifth of the
jobs urgent and inflexible, the rest elastic with min a quarter of max, maxima of 1 host to half
the cluster, lognormal lengths around 1,500 steps, Poisson arrivals offering the cluster's
capacity) replayed at 64 hosts (100 jobs) and 1,024 hosts (400 jobs) under each policy, one
table per size, medians over `--seeds` traces. `--start` and `--resize` default to the figures
measured on this machine for the demo job (BENCHMARKS.md, "Handed over compiled afresh, restored
beside the compile (bf7b158)": a cold start 16.0 s, a recovery onto a resized mesh 1.8 s, medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ((64, 100), (1024, 400))
POLICIES = ("remesh", "no-preempt", "fcfs-gang")


def simulate(start: float, resize: float, seeds: int) -> None:
    from orchestrator.fleet.simulate import Costs, simulate, synthetic_trace

    costs = Costs(start=start, resize=resize)
    for hosts, jobs in SIZES:
        rows = {p: [] for p in POLICIES}
        for seed in range(seeds):
            trace = synthetic_trace(jobs, hosts, seed=seed)
            for policy in POLICIES:
                rows[policy].append(simulate(trace, hosts, policy, costs).row(trace))
        print(f"\n{hosts} hosts, {jobs} jobs, start {start:g} s, resize {resize:g} s, median of {seeds} traces\n")
        keys = [k for k in rows["remesh"][0] if k != "policy"]
        print("| policy | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for policy in POLICIES:
            cells = [statistics.median(r[k] for r in rows[policy]) for k in keys]
            print(f"| {policy} | " + " | ".join(_cell(k, v) for k, v in zip(keys, cells)) + " |")
        base = {k: statistics.median(r[k] for r in rows["fcfs-gang"]) for k in keys}
        mine = {k: statistics.median(r[k] for r in rows["remesh"]) for k in keys}
        print(
            f"\nremesh against fcfs-gang: avg JCT {mine['avg JCT (s)'] / base['avg JCT (s)']:.2f}x, "
            f"p95 {mine['p95 JCT (s)'] / base['p95 JCT (s)']:.2f}x, makespan {mine['makespan (s)'] / base['makespan (s)']:.2f}x"
        )


# -- real: the trace on a `ray start` cluster of 4 hosts -------------------------------------------
# (id, arrival s, priority, min hosts, max hosts, steps): long elastic jobs, short inflexible
# urgent ones, and one urgent job that needs the whole cluster (a suspension).
REAL_TRACE = (
    ("t01", 0, 0, 1, 4, 100),
    ("t02", 15, 0, 2, 2, 40),
    ("t03", 30, 1, 1, 2, 50),
    ("t04", 45, 5, 2, 2, 30),
    ("t05", 60, 0, 1, 1, 30),
    ("t06", 80, 0, 1, 4, 60),
    ("t07", 100, 5, 1, 1, 20),
    ("t08", 120, 1, 2, 4, 50),
    ("t09", 150, 0, 1, 2, 40),
    ("t10", 170, 5, 4, 4, 20),
    ("t11", 200, 0, 1, 2, 30),
    ("t12", 220, 1, 1, 4, 40),
)
REAL_HOSTS, REAL_DEADLINE_S = 4, 3600


def real(out_dir: str) -> None:
    """Run REAL_TRACE for real, measure what each job paid, then replay the same trace in the
    simulator on 4 hosts with those measurements under each policy, and synthetic traces at 64
    and 1,024 hosts with the measured start and resize costs."""
    sys.path.insert(0, ROOT)
    from tests.helpers.jobs import gpt_job
    from tests.helpers.ray_start import RayStartCluster

    os.makedirs(out_dir, exist_ok=True)
    cluster = RayStartCluster(out_dir, workers=REAL_HOSTS, devices_per_host=2)
    try:
        runs = _run_trace(cluster, out_dir, gpt_job)
    finally:
        cluster.shutdown()
    with open(os.path.join(out_dir, "runs.json"), "w") as f:
        json.dump(runs, f, indent=1)
    report(os.path.join(out_dir, "runs.json"))


def _run_trace(cluster, out_dir: str, gpt_job) -> dict:
    store = os.path.join(out_dir, "fleet.db")
    files = {}
    for name, _, priority, low, top, steps in REAL_TRACE:
        files[name] = os.path.join(out_dir, f"{name}.toml")
        with open(files[name], "w") as f:
            f.write(gpt_job(name, steps, max_hosts=top, min_hosts=low, priority=priority,
                            checkpoint_dir=os.path.join(out_dir, f"ckpt-{name}")))  # fmt: skip
    actors = os.path.join(out_dir, "actors.jsonl")
    watch = cluster.watch_host_actors(actors)
    try:
        runs = _submit_and_wait(cluster, out_dir, files, store)
    finally:
        watch.kill()
    with open(actors) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    shared = [s for s in samples if any(len({j for n2, j in s if n2 == n}) > 1 for n, _ in s)]
    return {"runs": runs, "actor_samples": len(samples), "hosts_shared": len(shared), "hosts": REAL_HOSTS}


def _submit_and_wait(cluster, out_dir: str, files: dict, store: str) -> dict:
    runs, t0 = {}, time.time()
    pending = sorted(REAL_TRACE, key=lambda j: j[1])
    deadline = time.monotonic() + REAL_DEADLINE_S
    while time.monotonic() < deadline:
        now = time.time() - t0
        while pending and pending[0][1] <= now:
            name = pending.pop(0)[0]
            summary = os.path.join(out_dir, f"{name}.json")
            proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", files[name], "--address",
                                   cluster.address, "--store", store, "--summary", summary], cwd=ROOT, env=cluster.env,
                                  capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
            runs[name] = {"submitted": time.time() - t0, "submission": proc.stdout.strip().splitlines()[-1],
                          "summary": summary}  # fmt: skip
            print(f"{time.time() - t0:7.1f} s  submitted {name}", flush=True)
        for name, r in runs.items():
            if "finished" not in r and os.path.exists(r["summary"]) and _complete(r["summary"]):
                r["finished"] = time.time() - t0
                print(f"{r['finished']:7.1f} s  {name} ended", flush=True)
        if not pending and len(runs) == len(REAL_TRACE) and all("finished" in r for r in runs.values()):
            break
        time.sleep(1.0)
    else:
        raise TimeoutError(f"the trace did not finish within {REAL_DEADLINE_S} s: {runs}")
    for r in runs.values():
        with open(r["summary"]) as f:
            r["run"] = json.load(f)
    return runs


def _complete(path: str) -> bool:
    try:
        with open(path) as f:
            json.load(f)  # written once, as the run ends
        return True
    except (OSError, ValueError):
        return False  # being written


def report(runs_path: str) -> None:
    """The real run's figures, what it measured, and the simulator fed with them, side by side."""
    from orchestrator.fleet.simulate import Costs, TraceJob, simulate, synthetic_trace

    with open(runs_path) as f:
        data = json.load(f)
    runs = data["runs"]
    m = measure(runs)
    print(f"\nMeasured on the real run ({runs_path}):")
    print(f"  start (submission or admission to first step): median {m['start']:.1f} s of {m['starts']}")
    print(
        f"  shrink (the old group's last save to the first step on fewer): median {m['shrink']:.1f} s of {m['shrinks']}"
    )
    print(f"  grow (the old group's last save to the first step on more): median {m['grow']:.1f} s of {m['grows']}")
    print("  step seconds by hosts (median of segment medians): "
          + ", ".join(f"{n}: {t:.3f}" for n, t in sorted(m["step"].items())))  # fmt: skip
    print(
        f"  no host ran two jobs' host actors: {data['hosts_shared'] == 0} ({data['actor_samples']} samples of Ray's actor table)"
    )
    trace = [
        TraceJob(n, float(a), p, lo, hi, s, m["step"].get(1, min(m["step"].values())))
        for n, a, p, lo, hi, s in REAL_TRACE
    ]
    real_row = _real_row(runs, data["hosts"], trace)
    costs = _measured_costs(m["start"], m["resize"], m["step"])
    rows = [real_row] + [simulate(trace, data["hosts"], p, costs).row(trace) for p in POLICIES]
    names = ["remesh, real"] + [f"{p}, simulated" for p in POLICIES]
    print(f"\nThe trace of {len(trace)} jobs on {data['hosts']} hosts, real and simulated with the measured costs\n")
    _table(names, rows)
    for hosts, jobs in SIZES:
        got = {p: [] for p in POLICIES}
        scale = Costs(start=m["start"], resize=costs.resize)
        for seed in range(3):
            t = synthetic_trace(jobs, hosts, seed=seed, step_seconds=m["step"].get(1, 0.5))
            for p in POLICIES:
                got[p].append(simulate(t, hosts, p, scale).row(t))
        print(f"\n{hosts} hosts, {jobs} jobs, start {scale.start:.1f} s, resize {scale.resize:.1f} s (measured), "
              "efficiency 0.95 per doubling, median of 3 traces\n")  # fmt: skip
        keys = [k for k in got["remesh"][0] if k != "policy"]
        _table(list(POLICIES), [{k: statistics.median(r[k] for r in got[p]) for k in keys} for p in POLICIES])


def _measured_costs(start: float, resize: float, table: dict):
    """Costs whose step seconds are looked up by host count, as measured (every job of the real
    trace is one model); counts not measured fall back to the model of `Costs`."""
    from orchestrator.fleet.simulate import Costs

    @dataclasses.dataclass(frozen=True)
    class MeasuredCosts(Costs):
        table: dict = dataclasses.field(default_factory=dict)

        def step_seconds(self, job, hosts: int) -> float:
            return self.table.get(hosts) or super().step_seconds(job, hosts)

    return MeasuredCosts(start=start, resize=resize, table=table)


def measure(runs: dict) -> dict:
    """What the real run paid: a start (from submission, or from admission after a wait, to the
    first step), each resize (from the old group's last save, its step reached committed, to the
    first step on the new mesh), and step seconds by hosts (each segment's median)."""
    costs, steps = {"start": [], "shrink": [], "grow": []}, {}
    for r in runs.values():
        run = r["run"]
        driver = (r["finished"] - r["submitted"]) - run["wall_seconds"]  # submission to the run's clock starting
        events = run["events"]
        for i, seg in enumerate(s for s in run["segments"] if s.get("first_step_at") is not None):
            before = [e for e in events if e["at"] <= seg["started_at"] + 1e-3]
            why = next((e for e in reversed(before) if e["kind"] in ("admitted", "shrink", "grow", "suspend")), None)
            if why is None and i == 0:
                costs["start"].append(driver + seg["first_step_at"])
            elif why is not None and why["kind"] == "admitted":
                costs["start"].append(seg["first_step_at"] - why["at"])
            elif why is not None and why["kind"] in ("shrink", "grow"):
                saved = [e["at"] for e in before if e["kind"] == "checkpoint" and e["at"] >= why["at"]]
                costs[why["kind"]].append(seg["first_step_at"] - (saved[-1] if saved else seg["started_at"]))
            if seg.get("median_step_seconds"):
                steps.setdefault(seg["hosts"], []).append(seg["median_step_seconds"])
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {k: med(v) for k, v in costs.items()} | {k + "s": len(v) for k, v in costs.items()}
    out["resize"] = med(costs["shrink"] + costs["grow"])
    return out | {"step": {n: med(v) for n, v in steps.items()}}


def _real_row(runs: dict, hosts: int, trace) -> dict:
    jct = [runs[j.id]["finished"] - runs[j.id]["submitted"] for j in trace]
    top = max(j.priority for j in trace)
    urgent = [runs[j.id]["finished"] - runs[j.id]["submitted"] for j in trace if j.priority == top]
    first = min(r["submitted"] for r in runs.values())
    makespan = max(r["finished"] for r in runs.values()) - first
    busy = sum(_training_host_seconds(r["run"]) for r in runs.values())
    events = [e["kind"] for r in runs.values() for e in r["run"]["events"]]
    return {
        "avg JCT (s)": statistics.mean(jct),
        "p95 JCT (s)": float(np.percentile(jct, 95)),
        "avg JCT, top priority (s)": statistics.mean(urgent),
        "makespan (s)": makespan,
        "utilisation": busy / (hosts * makespan),
        "resizes": events.count("shrink") + events.count("grow"),
        "suspensions": events.count("suspend"),
    }


def _training_host_seconds(run: dict) -> float:
    """Hosts x seconds from each segment's first step to its last, as the simulator counts training."""
    total = 0.0
    for s in run["segments"]:
        if s.get("first_step") is not None and s.get("last_step") is not None and s.get("median_step_seconds"):
            total += s["hosts"] * (s["last_step"] - s["first_step"] + 1) * s["median_step_seconds"]
    return total


def _table(names, rows) -> None:
    keys = [k for k in rows[0] if k != "policy"]
    print("| policy | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in zip(names, rows):
        print(f"| {name} | " + " | ".join(_cell(k, row[k]) for k in keys) + " |")


def _cell(key: str, value: float) -> str:
    if key == "utilisation":
        return f"{value:.2f}"
    return f"{value:,.0f}"


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["simulate", "real", "report"])
    parser.add_argument("--out", default="runs/fleet-trace", help="real, report: the run's directory")
    parser.add_argument("--start", type=float, default=16.0)
    parser.add_argument("--resize", type=float, default=1.8)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.what == "simulate":
        simulate(args.start, args.resize, args.seeds)
    elif args.what == "real":
        real(args.out)
    else:
        report(os.path.join(args.out, "runs.json"))
