"""The fleet's policy: which jobs run, on how many hosts each, and who gives hosts up.

A pure function of the jobs and the cluster's size, with no Ray and no clock: the scheduler actor
(scheduler.py) executes what it decides, and the simulator (benchmarks/fleet_trace.py) replays
traces through the same code at sizes no test cluster has.

The rules, in order:
1. Jobs are ordered by priority (higher first), then by arrival.
2. A waiting job (queued, or suspended earlier) is admitted with its minimum when that many hosts
   are idle, or can be made idle by taking hosts from running jobs of *lower* priority: first
   down to their minimums (a shrink: they go on with fewer), then, only if that is not enough,
   whole jobs (a suspension: committed, queued, resumed later on any size). Victims are taken
   lowest priority first, then the cheapest to resize (fewest steps since their last snapshot,
   a plan and executables for the smaller mesh ready), then the latest arrived. Jobs of equal
   priority never take hosts from each other: the later one waits.
   A job that holds fewer hosts than its minimum (one of them died) is a waiting job again.
3. A queue's jobs hold at most its quota of hosts; a job whose minimum would pass it waits.
4. Idle hosts go to running jobs up to their maximums, higher priority first and round-robin
   among equals (a slice at a time where a job runs whole slices), except the hosts that a waiting job ahead of them (higher priority, or equal
   and earlier) needs for its minimum: those stay idle for it, so that growth never starves a
   waiting job of the hosts it is waiting for. A running job grows only where it says that
   growing pays for its resize in the steps it has left.
A running job is never shrunk to grow another: resizes cost steps, and only admissions pay for them.
A job that runs whole slices (TPU slices: `JobView.unit` hosts each) holds, gains and gives up
hosts a slice at a time; which hosts make a slice is the scheduler's to choose.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

WAITING = "waiting for hosts: "  # how a reason begins when hosts, not a quota or the cluster's size, hold a job back


@dataclasses.dataclass(frozen=True)
class Quota:
    hosts: int | None = None  # the most hosts the queue's jobs hold at once; None: no limit


@dataclasses.dataclass(frozen=True)
class FleetPolicyConfig:
    quotas: Mapping[str, Quota] = dataclasses.field(default_factory=lambda: {"default": Quota()})
    # Whether an admission may shrink or suspend jobs of lower priority (rule 2); without it a job
    # waits for idle hosts whatever its priority (the baseline the simulator compares against).
    preempt: bool = True


@dataclasses.dataclass(frozen=True)
class JobView:
    """A job as the policy sees it."""

    id: str
    priority: int
    queue: str
    min_hosts: int
    max_hosts: int
    arrival: int  # submission order
    held: int = 0  # hosts it holds now; 0: waiting (queued or suspended)
    since_snapshot: int = 0  # steps a shrink now would compute again
    smaller_ready: bool = False  # a plan and executables for fewer hosts are ready
    # Growing would pay for itself: the time more hosts save over the steps left exceeds what a
    # resize costs it. A job near its end stays on what it has, leaving idle hosts to others.
    grows: bool = True
    unit: int = 1  # hosts it holds them in: a slice that runs whole (its minimum and maximum are multiples)

    @property
    def rank(self) -> tuple:
        return (-self.priority, self.arrival)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Hosts per job (0: waiting), and why each job holds fewer than its maximum."""

    hosts: dict[str, int]
    reasons: dict[str, str]


def allocate(jobs: Sequence[JobView], total_hosts: int, config: FleetPolicyConfig = FleetPolicyConfig()) -> Allocation:
    """The hosts each job should hold on a cluster of `total_hosts` (rules in the module's doc)."""
    book = _Book(jobs, total_hosts, config)
    waiting = [j for j in book.order if book.hosts[j.id] == 0 and not _admit(j, book)]
    _grow(book, waiting)
    reasons = {j.id: _why(j, book) for j in book.order if book.hosts[j.id] < j.max_hosts}
    return Allocation(book.hosts, reasons)


class _Book:
    """The allocation being made: hosts per job, idle hosts and hosts per queue kept up to date,
    and the jobs in the orders the rules read them (a fleet of thousands of jobs is decided at
    every arrival and completion)."""

    def __init__(self, jobs: Sequence[JobView], total: int, config: FleetPolicyConfig):
        self.total, self.config = total, config
        # A job holding fewer than its minimum (a host of its died) cannot run on what it holds:
        # it is admitted again in its turn, or waits and gives them back. Nor on a slice with a
        # host missing: it holds its whole slices.
        whole = {j.id: j.held - j.held % j.unit for j in jobs}
        self.hosts = {j.id: whole[j.id] if whole[j.id] >= j.min_hosts else 0 for j in jobs}
        self.order = sorted(jobs, key=lambda j: j.rank)
        # Victims first: lowest priority, then the cheapest to resize, then the latest arrived.
        self.by_cost = sorted(jobs, key=lambda j: (j.priority, j.since_snapshot, not j.smaller_ready, -j.arrival))
        self.idle = total - sum(self.hosts.values())
        self.used: dict[str, int] = {}
        self._below: dict[int, int] | None = None
        for j in jobs:
            self.used[j.queue] = self.used.get(j.queue, 0) + self.hosts[j.id]

    def set(self, job: JobView, n: int) -> None:
        change = n - self.hosts[job.id]
        self.hosts[job.id] = n
        self.idle -= change
        self.used[job.queue] += change

    def held_below(self, priority: int) -> int:
        """Hosts held by jobs of lower priority (asked once the allocation is made: cached)."""
        if self._below is None:
            self._below = {}
            for j in self.by_cost:
                self._below[j.priority] = self._below.get(j.priority, 0) + self.hosts[j.id]
        return sum(n for p, n in self._below.items() if p < priority)

    def room(self, queue: str) -> int | None:
        limit = self.config.quotas[queue].hosts
        return None if limit is None else limit - self.used.get(queue, 0)


def _admit(job: JobView, book: _Book) -> bool:
    """Give `job` its minimum where the rules allow. False where it waits for hosts (not for
    its quota or the cluster's size: those it does not wait on)."""
    need, room, hosts = job.min_hosts, book.room(job.queue), book.hosts
    if need > book.total or (room is not None and need > room):
        return True
    if book.idle >= need:
        book.set(job, need)
        return True
    victims = []
    if book.config.preempt:
        for v in book.by_cost:
            if v.priority >= job.priority:
                break
            if hosts[v.id] > 0:
                victims.append(v)
    spare = sum(max(0, hosts[v.id] - v.min_hosts) for v in victims)
    if book.idle + spare + sum(min(hosts[v.id], v.min_hosts) for v in victims) < need:
        return False
    short = need - book.idle
    for v in victims:  # shrink first: every victim down to its minimum before any is suspended
        take = max(0, min(-(-short // v.unit) * v.unit, hosts[v.id] - v.min_hosts))
        book.set(v, hosts[v.id] - take)
        short -= take
    for v in victims:
        if short <= 0:
            break
        short -= hosts[v.id]
        book.set(v, 0)
    book.set(job, need)
    return True


def _grow(book: _Book, waiting: list[JobView]) -> None:
    """Idle hosts to running jobs, by priority tier, round-robin within a tier, keeping back what
    a waiting job ahead needs."""
    tiers: dict[int, list[JobView]] = {}
    for job in book.order:
        if book.hosts[job.id] > 0 and (job.grows or job.held == 0):  # one admitted now starts on more, free
            tiers.setdefault(job.priority, []).append(job)
    for priority in sorted(tiers, reverse=True):
        growing = tiers[priority]
        kept = _kept(growing, waiting)
        while growing and book.idle > 0:
            still = []
            for job in growing:
                room, more = book.room(job.queue), job.unit
                if book.hosts[job.id] + more > job.max_hosts or book.idle - kept[job.id] < more:
                    continue
                if room is not None and room < more:
                    continue
                book.set(job, book.hosts[job.id] + more)
                still.append(job)
            growing = still


def _kept(growing: list[JobView], waiting: list[JobView]) -> dict[str, int]:
    """Per growing job, the hosts that waiting jobs ranked ahead of it need for their minimums."""
    out, ahead, i = {}, 0, 0
    ranked = sorted(waiting, key=lambda w: w.rank)
    for job in sorted(growing, key=lambda j: j.rank):
        while i < len(ranked) and ranked[i].rank < job.rank:
            ahead += ranked[i].min_hosts
            i += 1
        out[job.id] = ahead
    return out


def _why(job: JobView, book: _Book) -> str:
    """Why `job` holds fewer hosts than its maximum, on the allocation made."""
    held, room, total = book.hosts[job.id], book.room(job.queue), book.total
    limit = book.config.quotas[job.queue].hosts
    if held == 0 and job.min_hosts > total:
        return f"its minimum of {job.min_hosts} hosts exceeds the cluster's {total}"
    if held == 0 and room is not None and job.min_hosts > room:
        return f"queue {job.queue!r} is at its quota: {limit - room} of {limit} hosts held, {job.min_hosts} more needed"
    if held == 0:
        lower = book.held_below(job.priority)
        higher = total - book.idle - lower
        return (
            f"{WAITING}needs {job.min_hosts}, {book.idle} idle, {higher} held by jobs of priority {job.priority} or higher"
            + (f", {lower} by lower-priority jobs at their minimums" if lower else "")
        )
    if room is not None and room < job.unit:
        return f"queue {job.queue!r} is at its quota of {limit} hosts"
    if held < job.held:
        return f"shrunk to {held} of {job.held} hosts for a job of higher priority"
    if not job.grows and job.held and book.idle:
        return f"{held} of at most {job.max_hosts} hosts: growing would not pay for its resize in the steps left"
    return f"{held} of at most {job.max_hosts} hosts: the other {total - held} are held or kept for waiting jobs"
