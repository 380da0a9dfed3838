"""The controller fed step reports from many hosts: time per report and memory, first to last.

    .venv/bin/python benchmarks/controller_reports.py [--hosts 64] [--reports 100000]

The controller state machine (`JobController`) with an injected host group that answers every
poll with one step report from each of 64 hosts (no Ray, no devices), its status written at every
poll (the worst case: in a real run at most once a second; `--status-every`), until 100,000
reports. Per window of
1,000 reports: seconds per report and the memory the process holds (tracemalloc). Beside it, in
the same run, the baseline: the same controller with the previous bookkeeping (every step's
throughput figures in lists, medians by sorting them all at each status; per-step losses and
metrics in dicts).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Status:
    def __init__(self, reports):
        self.reports, self.done, self.error = reports, False, None


def run(hosts: int, reports: int, throughput_cls, summary_cls, status_every: int = 1) -> list[tuple[float, float]]:
    """(seconds per report, MiB held) per window of 1,000 reports."""
    from orchestrator import parse_job
    from orchestrator.control.controller import ControllerConfig, JobController
    from orchestrator.control.planning import PlanCache
    from orchestrator.hosts.interface import Cluster
    from orchestrator.protocol import from_dict
    from orchestrator.telemetry import goodput, summary
    from orchestrator.telemetry.recorder import Recorder, RecorderCallback
    from partitioner import Cost, Plan

    steps = reports // hosts + 10
    job = parse_job(
        {
            "name": "bench",
            "program": "m:p",
            "steps": steps,
            "global_batch": hosts,
            "hosts": {"min": hosts, "max": hosts, "devices_per_host": 1},
            "checkpoint": {"dir": "/tmp/remesh-bench", "every": 1000},
        }
    )
    ticks = itertools.count()
    now = lambda: float(next(ticks)) * 0.01  # noqa: E731
    fed = [0]

    class Group:
        def __init__(self, size, config, standby=None, placements=None, nodes=None):
            self.size, self.node_ids, self.step = size, [f"n{i}" for i in range(size)], 0
            self.places = [{"ip": "127.0.0.1", "port": 1, "pid": 0}] * size

        def start(self, spec_for, snapshots=None, executables=None):
            pass

        def poll(self):
            self.step += 1
            r = {"kind": "step", "step": self.step, "loss": 1.0 / self.step, "seconds": 0.1, "at": now(),
                 "tokens_per_second": 10.0 + self.step % 7, "mfu": 0.5, "input_seconds": 0.0, "wait_seconds": 0.0}  # fmt: skip
            fed[0] += self.size
            return [_Status([from_dict(r)]) for _ in range(self.size)]

        def request_stop(self, now=False):
            pass

        def compile_ahead(self, plan_json):
            pass

        def shutdown(self):
            pass

    class Hosts(Cluster):
        def alive_hosts(self):
            return [f"n{i}" for i in range(hosts)]

    class AlwaysDue(Recorder):
        polls = 0

        def due(self):
            self.polls += 1
            return self.polls % status_every == 0

    plan = Plan(
        mesh={"data": hosts},
        in_specs=((), ()),
        out_specs=(),
        devices=hosts,
        search_seconds=0.0,
        cost=Cost(0.0, 0.0, {}, 0),
    )
    goodput.Throughput, summary.RunSummary = throughput_cls, summary_cls  # the bookkeeping measured
    gp = goodput.GoodputCallback()
    sm = summary.SummaryCallback(gp)
    c = JobController(
        job,
        Hosts(),
        plans=PlanCache(lambda devices: plan, "f"),
        config=ControllerConfig(poll_interval_s=0, host_check_interval_s=1e9),
        callbacks=[gp, sm, RecorderCallback(AlwaysDue(), gp, sm)],
        group_cls=Group,
        clock=now,
        wall=now,
        sleep=lambda s: None,
        committed=lambda: 0,
    )
    windows, mark, t = [], 0, time.perf_counter()
    tracemalloc.start()
    while fed[0] < reports:
        c.step()
        if fed[0] - mark >= 1000:
            now_t = time.perf_counter()
            windows.append(((now_t - t) / (fed[0] - mark), tracemalloc.get_traced_memory()[0] / 2**20))
            mark, t = fed[0], now_t
    tracemalloc.stop()
    return windows


class ListThroughput:
    """The previous bookkeeping: every step's figures in lists, medians by sorting them all."""

    def __init__(self, model_flops_per_step: float = 0.0, a=None, b=None, c=None):
        self.model_flops_per_step = model_flops_per_step
        self.step_seconds, self.tokens_per_second, self.mfu = a or [], b or [], c or []

    def add(self, report):
        self.step_seconds.append(report.seconds)
        self.tokens_per_second.append(report.tokens_per_second)
        self.mfu.append(report.mfu)

    def recent(self, n):
        return ListThroughput(
            self.model_flops_per_step, self.step_seconds[-n:], self.tokens_per_second[-n:], self.mfu[-n:]
        ).summary()

    def summary(self):
        med = lambda xs: round(statistics.median(xs), 6) if xs else None  # noqa: E731
        return {
            "steps_measured": len(self.step_seconds),
            "step_seconds": med(self.step_seconds),
            "tokens_per_second": med(self.tokens_per_second),
            "mfu": med(self.mfu),
            "model_flops_per_step": self.model_flops_per_step,
        }


def dict_summary():
    """The previous per-step bookkeeping of the run summary: a dict entry per step and metric."""
    import dataclasses

    from orchestrator.telemetry.summary import RunSummary

    @dataclasses.dataclass
    class DictSummary(RunSummary):
        losses: dict = dataclasses.field(default_factory=dict)
        metrics: dict = dataclasses.field(default_factory=dict)

        def record_step(self, step, loss, metrics=None):
            self.losses[step] = loss
            for name, value in (metrics or {}).items():
                self.metrics.setdefault(name, {})[step] = value
            self.reached(step)

    return DictSummary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=64)
    parser.add_argument("--reports", type=int, default=100_000)
    parser.add_argument("--status-every", type=int, default=1, help="polls between status writes")
    args = parser.parse_args()
    from orchestrator.telemetry.goodput import Throughput
    from orchestrator.telemetry.summary import RunSummary

    now = run(args.hosts, args.reports, Throughput, RunSummary, args.status_every)
    before = run(args.hosts, args.reports, ListThroughput, dict_summary(), args.status_every)
    print("| reports | µs per report | MiB held | baseline µs per report | baseline MiB held |")
    print("|---|---|---|---|---|")
    for i in sorted({0, 1, 9, 24, 49, len(now) // 2, len(now) - 1}):
        if i < len(now):
            print(
                f"| {(i + 1) * 1000:,} | {now[i][0] * 1e6:.1f} | {now[i][1]:.2f} "
                f"| {before[i][0] * 1e6:.1f} | {before[i][1]:.2f} |"
            )
    first, last = now[1:11], now[-10:]
    ratio = statistics.median(x for x, _ in last) / statistics.median(x for x, _ in first)
    base = statistics.median(x for x, _ in before[-10:]) / statistics.median(x for x, _ in before[1:11])
    print(f"time per report, last 10 windows / windows 2-11: {ratio:.2f} (baseline {base:.2f})")
    grown = (now[-1][1] - now[0][1]) * 2**20 / (len(now) * 1000 / args.hosts)
    grown_before = (before[-1][1] - before[0][1]) * 2**20 / (len(before) * 1000 / args.hosts)
    print(
        f"memory held, growth per step from the first window to the last: {grown:.0f} B (baseline {grown_before:.0f} B)"
    )


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
