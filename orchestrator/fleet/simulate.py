"""A fleet simulator: a trace of elastic jobs replayed on a cluster of N hosts under a scheduling
policy, with step times and resize costs measured on a real cluster, at sizes no test has.

Event-driven: between events every training job advances at its step rate on the hosts it holds;
at each arrival, completion or end of a transition the policy decides again and its changes are
applied with their costs. A job admitted or resumed pays `Costs.start` (plan, group, restore,
compile) before its first step; a shrink pays `Costs.resize` and computes one step again (the step
in flight: remesh stops at the next step boundary with the step reached kept in a peer snapshot
or a commit); a grow runs on until its next checkpoint boundary, then pays `Costs.resize`; a
suspension keeps every step (a stop commits the step reached) and pays `Costs.start` on resuming.

Policies: "remesh" (`fleet.policy.allocate`: priorities, shrink and suspend, growth), "no-preempt"
(the same without shrinking or suspending others: a job waits for idle hosts whatever its
priority), and "fcfs-gang" (first come first served, each job on its maximum as one gang, the
queue's head blocking those behind it: what a batch scheduler without elasticity does).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from .policy import FleetPolicyConfig, JobView, allocate


@dataclasses.dataclass(frozen=True)
class TraceJob:
    id: str
    arrival: float  # seconds from the trace's start
    priority: int
    min_hosts: int
    max_hosts: int
    steps: int
    host_step_seconds: float  # seconds per step on one host; on n hosts `Costs.step_seconds`
    queue: str = "default"


@dataclasses.dataclass(frozen=True)
class Costs:
    start: float  # admission (or resumption) to the first step
    resize: float  # a shrink or a grow: from the step boundary to the first step on the new mesh
    efficiency: float = 0.95  # the parallel efficiency kept at each doubling of hosts
    checkpoint_every: int = 10  # steps; a grow waits for the next boundary

    def step_seconds(self, job: TraceJob, hosts: int) -> float:
        return job.host_step_seconds / hosts / self.efficiency ** math.log2(hosts)


@dataclasses.dataclass
class _Job:
    spec: TraceJob
    held: int = 0  # hosts reserved for it (the policy's latest decision)
    running_on: int = 0  # hosts it trains on now (0: waiting or in a transition)
    done_steps: float = 0.0
    busy_until: float = -1.0  # in a transition (starting, resizing) until then
    grow_at: float | None = None  # runs on `running_on` until this boundary, then resizes to `held`
    finished: float | None = None
    resizes: int = 0
    suspensions: int = 0


@dataclasses.dataclass(frozen=True)
class Result:
    policy: str
    completion: dict[str, float]  # job id -> seconds from arrival to finish
    makespan: float
    utilisation: float  # host-seconds spent training over hosts x makespan
    resizes: int
    suspensions: int

    def row(self, trace: Sequence[TraceJob]) -> dict:
        jct = np.array([self.completion[j.id] for j in trace])
        top = max(j.priority for j in trace)
        urgent = np.array([self.completion[j.id] for j in trace if j.priority == top])
        return {
            "policy": self.policy,
            "avg JCT (s)": float(jct.mean()),
            "p95 JCT (s)": float(np.percentile(jct, 95)),
            "avg JCT, top priority (s)": float(urgent.mean()),
            "makespan (s)": self.makespan,
            "utilisation": self.utilisation,
            "resizes": self.resizes,
            "suspensions": self.suspensions,
        }


Policy = Callable[[Sequence[JobView], int], dict[str, int]]


def policies(config: FleetPolicyConfig | None = None) -> dict[str, Policy]:
    config = config or FleetPolicyConfig()
    no_preempt = dataclasses.replace(config, preempt=False)
    return {
        "remesh": lambda jobs, n: allocate(jobs, n, config).hosts,
        "no-preempt": lambda jobs, n: allocate(jobs, n, no_preempt).hosts,
        "fcfs-gang": _fcfs_gang,
    }


def _fcfs_gang(jobs: Sequence[JobView], total: int) -> dict[str, int]:
    out = {j.id: j.held for j in jobs}
    idle = total - sum(out.values())
    for j in sorted(jobs, key=lambda j: j.arrival):
        if out[j.id]:
            continue
        want = min(j.max_hosts, total)
        if want > idle:
            break  # the head of the queue blocks the rest
        out[j.id], idle = want, idle - want
    return out


def simulate(trace: Sequence[TraceJob], hosts: int, policy: str, costs: Costs, decide: Policy | None = None) -> Result:
    decide = decide or policies()[policy]
    jobs = {j.id: _Job(j) for j in trace}
    arrivals = sorted(trace, key=lambda j: j.arrival)
    order = {j.id: i for i, j in enumerate(arrivals)}
    now, nxt, busy_host_seconds = 0.0, 0, 0.0
    while any(j.finished is None for j in jobs.values()):
        at = _next_event(jobs.values(), now, arrivals[nxt].arrival if nxt < len(arrivals) else math.inf, costs)
        busy_host_seconds += _advance(jobs.values(), at - now, costs)
        now = at
        while nxt < len(arrivals) and arrivals[nxt].arrival <= now:
            nxt += 1
        _settle(jobs.values(), now, costs)
        present = [j for j in jobs.values() if j.spec.arrival <= now and j.finished is None]
        views = [_view(j, order[j.spec.id], costs) for j in present]
        targets = decide(views, hosts)
        if sum(targets.values()) > hosts or any(0 < targets[v.id] < v.min_hosts for v in views):
            raise RuntimeError(
                f"policy {policy!r} at {now:.1f} s: {targets} on {hosts} hosts breaks a job's minimum or the cluster"
            )
        _apply(targets, present, now, costs)
    finish = max(j.finished for j in jobs.values())
    return Result(
        policy,
        {j.spec.id: j.finished - j.spec.arrival for j in jobs.values()},
        finish - arrivals[0].arrival,
        busy_host_seconds / (hosts * (finish - arrivals[0].arrival)),
        sum(j.resizes for j in jobs.values()),
        sum(j.suspensions for j in jobs.values()),
    )


def _view(j: _Job, arrival: int, costs: Costs) -> JobView:
    s = j.spec
    since = int(j.done_steps) % costs.checkpoint_every
    return JobView(s.id, s.priority, s.queue, s.min_hosts, s.max_hosts, arrival, j.held, since, False, _grows(j, costs))


def _grows(j: _Job, costs: Costs) -> bool:
    """As the controller judges it (`JobController._grows`): the steps left, shortened in
    proportion to hosts on the job's maximum, save more than a resize costs."""
    if not j.running_on:
        return True
    step = costs.step_seconds(j.spec, j.running_on)
    return (j.spec.steps - j.done_steps) * step * (1 - j.running_on / j.spec.max_hosts) > costs.resize


def _next_event(jobs, now: float, arrival: float, costs: Costs) -> float:
    t = arrival
    for j in jobs:
        if j.finished is not None:
            continue
        if j.busy_until > 0:
            t = min(t, j.busy_until)
        if j.grow_at is not None:
            t = min(t, j.grow_at)
        if j.running_on:
            rate = 1 / costs.step_seconds(j.spec, j.running_on)
            t = min(t, now + (j.spec.steps - j.done_steps) / rate)
    return t


def _advance(jobs, dt: float, costs: Costs) -> float:
    """Every training job's steps over `dt` seconds; returns the host-seconds spent training."""
    busy = 0.0
    for j in jobs:
        if j.finished is None and j.running_on and dt > 0:
            j.done_steps = min(j.spec.steps, j.done_steps + dt / costs.step_seconds(j.spec, j.running_on))
            busy += dt * j.running_on
    return busy


def _settle(jobs, now: float, costs: Costs) -> None:
    """Finish jobs that reached their last step, end transitions that are due, start due grows."""
    for j in jobs:
        if j.finished is not None:
            continue
        if j.done_steps >= j.spec.steps - 1e-9:
            j.finished, j.held, j.running_on = now, 0, 0
            continue
        if 0 < j.busy_until <= now + 1e-9:
            j.busy_until, j.running_on = -1.0, j.held
        if j.grow_at is not None and j.grow_at <= now + 1e-9:
            j.grow_at, j.running_on, j.busy_until = None, 0, now + costs.resize


def _apply(targets: dict[str, int], present: Sequence[_Job], now: float, costs: Costs) -> None:
    for j in present:
        new = targets[j.spec.id]
        if new == j.held:
            continue
        if new == 0:  # suspended: the stop commits the step reached
            j.suspensions += j.held > 0
            j.held, j.running_on, j.busy_until, j.grow_at = 0, 0, -1.0, None
        elif j.held == 0:  # admitted or resumed
            j.held, j.running_on, j.busy_until = new, 0, now + costs.start
        elif new < j.held:  # shrunk at the next step boundary: the step in flight is computed again
            j.resizes += 1
            j.done_steps = max(0.0, math.floor(j.done_steps) - 1) if j.running_on else j.done_steps
            j.held, j.running_on, j.grow_at, j.busy_until = new, 0, None, now + costs.resize
        else:  # grown at the next checkpoint boundary, on the hosts it holds until then
            j.resizes += 1
            j.held = new
            if j.running_on:
                left = costs.checkpoint_every - j.done_steps % costs.checkpoint_every
                j.grow_at = now + left * costs.step_seconds(j.spec, j.running_on)


def synthetic_trace(
    jobs: int, hosts: int, *, seed: int = 0, load: float = 1.0, step_seconds: float = 0.5, efficiency: float = 0.95
) -> list[TraceJob]:
    """`jobs` jobs of mixed sizes, priorities and lengths arriving at random (Poisson) so that the
    work offered is `load` times what the cluster does in the time they take to arrive. A job's
    maximum is 1 host to half the cluster (powers of two, uniformly); a fifth are urgent (priority
    5) and inflexible (min = max), the rest elastic (min a quarter of max); lengths are lognormal
    around 1,500 steps, each step taking `step_seconds` on the job's maximum."""
    rng = np.random.default_rng(seed)
    drawn, work = [], 0.0
    for i in range(jobs):
        top = int(2 ** rng.integers(0, max(1, int(math.log2(hosts)))))
        urgent = bool(rng.random() < 0.2)
        steps = max(50, int(rng.lognormal(mean=math.log(1500), sigma=0.8)))
        drawn.append((i, urgent, top if urgent else max(1, top // 4), top, steps))
        work += steps * step_seconds * top
    times = np.sort(rng.uniform(0, work / (hosts * load), size=jobs))
    return [
        TraceJob(
            f"job{i:04d}",
            float(t),
            5 if urgent else 0,
            low,
            top,
            steps,
            step_seconds * top * efficiency ** math.log2(top),
        )  # fmt: skip
        for (i, urgent, low, top, steps), t in zip(drawn, times)
    ]
