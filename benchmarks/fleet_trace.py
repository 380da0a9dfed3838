"""Several elastic jobs sharing one cluster: remesh's fleet policy against first-come-first-served
gangs and against elastic jobs without preemption, on a simulated trace.

    .venv/bin/python benchmarks/fleet_trace.py simulate [--start S] [--resize S] [--seeds N]

`simulate`: a synthetic trace (`orchestrator.testing.fleet_sim.synthetic_trace`: a fifth of the
jobs urgent and inflexible, the rest elastic with min a quarter of max, maxima of 1 host to half
the cluster, lognormal lengths around 1,500 steps, Poisson arrivals offering the cluster's
capacity) replayed at 64 hosts (100 jobs) and 1,024 hosts (400 jobs) under each policy, one
table per size, medians over `--seeds` traces. `--start` and `--resize` default to the figures
measured on this machine for the demo job (BENCHMARKS.md, "Handed over compiled afresh, restored
beside the compile (bf7b158)": a cold start 16.0 s, a recovery onto a resized mesh 1.8 s, medians).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ((64, 100), (1024, 400))
POLICIES = ("remesh", "no-preempt", "fcfs-gang")


def simulate(start: float, resize: float, seeds: int) -> None:
    from orchestrator.testing.fleet_sim import Costs, simulate, synthetic_trace

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


def _cell(key: str, value: float) -> str:
    if key == "utilisation":
        return f"{value:.2f}"
    return f"{value:,.0f}"


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["simulate"])
    parser.add_argument("--start", type=float, default=16.0)
    parser.add_argument("--resize", type=float, default=1.8)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    simulate(args.start, args.resize, args.seeds)
