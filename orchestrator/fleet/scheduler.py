"""The fleet scheduler: one detached Ray actor per cluster with which every job on it registers.

It keeps the queue and decides with `policy.allocate` whenever a job registers, reports, gives
hosts back or ends, and whenever hosts come and go; it executes the decision by reserving hosts
in Ray. Each host granted to a job is a placement group of one `remesh_host` bundle that this
actor creates: nothing but the scheduler takes `remesh_host`, so a host reserved for a job is
that job's until it gives it back, and a job's host actors (standby ones too) run in its bundles.
A reservation for hosts another job still holds waits in Ray until that job gives them back:
a job is told to run only on reservations Ray has placed, so it never grows into a host before
the host is its own.

A host a job's health loop set aside comes back marked suspect (`release(..., suspect)`): held
and probed until it passes (`suspects.Suspects`), it is nobody's to grant meanwhile.

On a cluster whose hosts say their slices (`hosts.slices.host_slices`), each reservation is
pinned to a host the scheduler chooses (a label selector on Ray's `ray.io/node-id`): a job that
runs whole slices (`Registration.slice_hosts`, a TPU job) gets whole free slices, a slice at a
time; any other job gets hosts packed into the slices it already has, then into slices already
broken into, keeping whole slices free for those that need them. A pinned reservation whose host
died is dropped (Ray cannot place it elsewhere), and the job is granted hosts again.

The controllers speak to it in plain dicts (`protocol.fleet`: `Registration`, `Grant`), so that a scheduler
started by one version of remesh answers another's jobs. A job that stops reporting for
`FleetSchedulerConfig.lost_after_s` (its driver died) is dropped and its hosts freed.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

from ..hosts.probe import ProbeConfig
from ..protocol.fleet import HOST_RESOURCE, Grant, Registration
from .config import check_queue
from .policy import FleetPolicyConfig, JobView, Quota, allocate
from .suspects import Suspects

NAME, NAMESPACE = "remesh-fleet", "remesh"
NODE_LABEL = "ray.io/node-id"  # Ray's own label on every node: pins a reservation to one host
# A job's reservations that hold a host for it: placed (CREATED), or being placed for the first
# time: waiting for a host (PENDING) or between the two phases of Ray's placement (PREPARED).
# RESCHEDULING ones lost their host; Ray places them again where one is free.
RESERVED = ("PENDING", "PREPARED", "CREATED")


@dataclasses.dataclass(frozen=True)
class FleetSchedulerConfig:
    lost_after_s: float = 60.0  # a job silent this long has lost its driver
    quotas: dict = dataclasses.field(default_factory=lambda: {"default": None})  # queue -> hosts or None
    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)  # of a host handed back as suspect


@dataclasses.dataclass
class _Entry:
    reg: Registration
    arrival: int
    seen: float
    target: int = 0
    reason: str = ""
    since_snapshot: int = 0
    smaller_ready: bool = False
    grows: bool = True
    shrink: str = ""  # why it was asked to give hosts back, until it has
    waiting_since: float | None = None  # queued (or suspended) since then
    pgs: dict = dataclasses.field(default_factory=dict)  # placement group id -> handle
    pinned: dict = dataclasses.field(default_factory=dict)  # placement group id -> the node it is pinned to
    unit: int = 1  # hosts it is granted in: its slice's, where it runs whole slices of a sliced cluster


class FleetScheduler:
    """The actor's class (`start` makes the actor)."""

    def __init__(self, config: dict):
        self.config = FleetSchedulerConfig(**{**config, "probe": ProbeConfig(**config.get("probe", {}))})
        self.suspects = Suspects(self.config.probe)
        self.policy = FleetPolicyConfig({q: Quota(n) for q, n in self.config.quotas.items()})
        self.jobs: dict[str, _Entry] = {}
        self._arrivals = itertools.count()

    # -- what controllers call ----------------------------------------------------------------
    def register(self, registration: dict) -> dict:
        reg = Registration(**registration)
        check_queue(self.policy, reg.queue, reg.min_hosts, reg.job)
        _check_slices(reg, _slices(_nodes()))
        held = [e for e in self.jobs.values() if e.reg.checkpoint_dir == reg.checkpoint_dir and e.reg.run != reg.run]
        if held:
            raise ValueError(
                f"checkpoint directory {reg.checkpoint_dir} is in use by run {held[0].reg.run} of job "
                f"{held[0].reg.job!r} on this cluster: one run per checkpoint directory at a time"
            )
        if reg.run not in self.jobs:
            self.jobs[reg.run] = _Entry(reg, next(self._arrivals), time.monotonic())
        return self._decide_and_grant(reg.run)

    def report(self, run: str, since_snapshot: int = 0, smaller_ready: bool = False, grows: bool = True) -> dict:
        """A job's heartbeat, with what a shrink would cost it now and whether growing would pay
        (`fleet.policy.JobView`); returns its grant."""
        entry = self._entry(run)
        entry.seen, entry.since_snapshot, entry.smaller_ready = time.monotonic(), since_snapshot, smaller_ready
        entry.grows = grows
        return self._decide_and_grant(run)

    def release(self, run: str, node_ids: list[str], suspect: dict | None = None) -> dict:
        """The job stopped its host actors on `node_ids`: their reservations end. `suspect`: those
        of them its health loop set aside (node -> {"why", and how to probe it: "env", "hook"}):
        held until a probe passes."""
        entry, suspect = self._entry(run), suspect or {}
        for pg_id, pg in list(entry.pgs.items()):
            node = _node_of(pg)
            if node in suspect and node not in self.suspects:
                # The job's reservation becomes the hold: dropped and made again, another job's
                # waiting one could be placed on the host in between.
                entry.pinned.pop(pg_id, None)
                self.suspects.hold(node, run, suspect[node], entry.pgs.pop(pg_id), time.monotonic())
            elif node in node_ids:
                _drop(entry, pg_id)
        return self._decide_and_grant(run)

    def finish(self, run: str) -> None:
        entry = self.jobs.pop(run, None)
        if entry is not None:
            _remove_all(entry)
            self._decide()

    def queue(self) -> list[dict]:
        """Every job, running first, then waiting in the order it would be admitted, as the last
        decision left them: reading the queue decides nothing and reserves nothing (the next
        heartbeat does)."""
        now, out = time.monotonic(), []
        for e in sorted(self.jobs.values(), key=lambda e: (e.target == 0, -e.reg.priority, e.arrival)):
            out.append(
                {
                    **dataclasses.asdict(e.reg),
                    "state": "running" if e.target else "queued",
                    "hosts": len(_placed(e, _tables(e))),
                    "target": e.target,
                    "reason": e.shrink or e.reason,
                    "waiting_s": round(now - e.waiting_since, 1) if e.waiting_since is not None else 0.0,
                }
            )
        return out

    def quotas(self) -> dict:
        """Each queue's quota of hosts (None: no limit)."""
        return {q: quota.hosts for q, quota in self.policy.quotas.items()}

    def hosts(self) -> dict:
        """Live hosts, and which job holds each (node id -> run, "suspect" where held until its
        probe passes, or "" when idle)."""
        held = {node: run for run, e in self.jobs.items() for node in _placed(e, _tables(e)).values()}
        held.update({node: "suspect" for node in self.suspects})
        return {node: held.get(node, "") for node in _alive_hosts(_nodes())}

    def suspect_hosts(self) -> dict:
        """The hosts held as suspect: node id -> why, by which run, since (seconds ago), and each
        probe's time over its reference's so far."""
        return self.suspects.report(time.monotonic())

    # -- deciding and reserving ---------------------------------------------------------------
    def _entry(self, run: str) -> _Entry:
        try:
            return self.jobs[run]
        except KeyError:
            raise ValueError(
                f"run {run!r} is not registered with the fleet (it ended, or was dropped as lost)"
            ) from None

    def _decide_and_grant(self, run: str) -> dict:
        tables = self._decide()
        e = self.jobs[run]
        hosts = tuple(sorted((node, pg_id) for pg_id, node in _placed(e, tables[run]).items()))
        state = "running" if e.target else "queued"
        return dataclasses.asdict(Grant(run, state, e.target, hosts, e.shrink or e.reason))

    def _decide(self) -> dict[str, dict[str, dict]]:
        """Decide and reserve; returns per run its reservations' entries in Ray's placement group
        table as read for the decision (`_tables`), those dropped by it left out."""
        now = time.monotonic()
        for run in [r for r, e in self.jobs.items() if now - e.seen > self.config.lost_after_s]:
            _remove_all(self.jobs.pop(run))
        # A job holds what it was granted, less reservations whose host died (Ray places them
        # again where a host is free): those being placed for the first time, on hosts another
        # job is still giving back, are its own, never idle hosts to hand to someone else.
        # Each reservation's state, asked of Ray's GCS once per decision.
        nodes = _nodes()  # one read of Ray's node table per decision (every job's heartbeat decides)
        alive, said = _alive_hosts(nodes), _slices(nodes)
        self.suspects.probe(set(alive), now)
        alive = [n for n in alive if n not in self.suspects]  # (held: no job's)
        live = set(alive)
        for e in self.jobs.values():
            e.unit = e.reg.slice_hosts if said and e.reg.slice_hosts else 1
            for pg_id in [pg for pg, node in e.pinned.items() if node not in live]:
                _drop(e, pg_id)  # its host died: Ray cannot place a pinned reservation elsewhere
        tables = {run: _tables(e) for run, e in self.jobs.items()}
        placed = {run: set(_placed(e, tables[run])) for run, e in self.jobs.items()}
        views = [_view(run, e, sum(t["state"] in RESERVED for t in tables[run].values()))
                 for run, e in self.jobs.items()]  # fmt: skip
        decided = allocate(views, _capacity(alive, said, self.jobs.values()), self.policy)
        for run, e in self.jobs.items():
            target, reason = decided.hosts[run], decided.reasons.get(run, "")
            if target < e.target:
                e.shrink = reason  # said until the job has given the hosts back
            if target == 0 and e.waiting_since is None:
                e.waiting_since = now
            elif target > 0:
                e.waiting_since = None
            e.target, e.reason = target, reason
            _trim(e, placed[run], said)
        free = _free(alive, said, self.jobs, tables) if said else {}
        for run, e in self.jobs.items():  # after every trim: the hosts those freed can be chosen
            if said:
                _reserve_pinned(e, free, said)
            else:
                _reserve(e)
            if e.shrink and len(placed[run] & set(e.pgs)) <= e.target:
                e.shrink = ""
        return {run: {pg: t for pg, t in tables[run].items() if pg in e.pgs} for run, e in self.jobs.items()}


def _view(run: str, e: _Entry, reserved: int) -> JobView:
    held = min(e.target, reserved)
    r = e.reg
    min_hosts, max_hosts = _whole(r.min_hosts, e.unit, up=True), _whole(r.max_hosts, e.unit)
    return JobView(
        run, r.priority, r.queue, min_hosts, max_hosts, e.arrival, held, e.since_snapshot, e.smaller_ready, e.grows,
        e.unit,
    )  # fmt: skip


def _whole(hosts: int, unit: int, up: bool = False) -> int:
    return -(-hosts // unit) * unit if up else hosts // unit * unit


def _trim(e: _Entry, placed: set[str], said: dict[str, str]) -> None:
    """Where `e` has more reservations than its target: pending ones dropped (placed ones it gives
    back itself), the last slice's together where they are pinned."""
    where = lambda pg: (said.get(e.pinned.get(pg, ""), ""), e.pinned.get(pg, ""))  # noqa: E731
    pending = sorted((pg_id for pg_id in e.pgs if pg_id not in placed), key=where)
    while len(e.pgs) > e.target and pending:
        _drop(e, pending.pop())


def _reserve(e: _Entry) -> None:
    """New placement groups where `e` has fewer than its target: Ray places each when a host is free."""
    while len(e.pgs) < e.target:
        _add(e, None)


def _reserve_pinned(e: _Entry, free: dict[str, str], said: dict[str, str]) -> None:
    """New placement groups where `e` has fewer than its target, each pinned to a host chosen
    (`choose_hosts`) among the `free` ones, which are then no longer free."""
    mine = {said.get(node) for node in e.pinned.values()}
    for node in choose_hosts(free, said, e.target - len(e.pgs), e.unit, mine):
        _add(e, node)
        del free[node]


def choose_hosts(free: dict[str, str], said: dict[str, str], count: int, unit: int, mine: set) -> list[str]:
    """`count` of the `free` hosts (node -> slice) for a job: where it runs whole slices (`unit`
    hosts each), slices every host of which is free and that have all of theirs (`said`: every
    live host's slice), as many whole ones as fit; else hosts in the slices it has (`mine`), then
    in slices others already use, fewest free first, then in whole free slices."""
    if count <= 0:
        return []
    by_slice: dict[str, list[str]] = {}
    for node in sorted(free):
        by_slice.setdefault(free[node], []).append(node)
    size = collections.Counter(said.values())
    if unit > 1:
        whole = [s for s in sorted(by_slice) if len(by_slice[s]) == size[s] == unit]
        return [n for s in whole[: count // unit] for n in by_slice[s]]
    order = sorted(by_slice, key=lambda s: (s not in mine, len(by_slice[s]) == size[s], len(by_slice[s]), s))
    return [n for s in order for n in by_slice[s]][:count]


def _add(e: _Entry, node: str | None) -> None:
    from ray.util.placement_group import placement_group

    # Named for whoever reads `ray list placement-groups`; names must be unique.
    name = f"remesh:{e.reg.run}:{len(e.pgs)}:{_tag()}"
    if node is None:
        pg = placement_group([{HOST_RESOURCE: 1}], strategy="STRICT_PACK", name=name)
    else:
        pg = placement_group([{HOST_RESOURCE: 1}], strategy="STRICT_PACK", name=name,
                             bundle_label_selector=[{NODE_LABEL: node}])  # fmt: skip
        e.pinned[pg.id.hex()] = node
    e.pgs[pg.id.hex()] = pg


def _drop(e: _Entry, pg_id: str) -> None:
    import ray

    ray.util.remove_placement_group(e.pgs.pop(pg_id))
    e.pinned.pop(pg_id, None)


def _free(alive: list[str], said: dict[str, str], jobs: dict, tables: dict) -> dict[str, str]:
    """Live hosts no reservation holds or is pinned to (node -> slice); `tables`: per run, its
    reservations as read for the decision (an unpinned placed one holds the host Ray put it on)."""
    taken = set()
    for run, e in jobs.items():
        taken |= set(e.pinned.values())
        taken |= set(_placed(e, tables[run]).values())
    return {node: said[node] for node in alive if node not in taken and node in said}


def _capacity(alive: list[str], said: dict[str, str], entries) -> int:
    """Hosts the policy shares out: every live host, less, where jobs run whole slices, the hosts
    of slices that lost one (no such job can run there)."""
    units = [e.unit for e in entries if e.unit > 1]
    if not units:
        return len(alive)
    size = collections.Counter(said[n] for n in alive if n in said)
    return len(alive) - sum(n for n in size.values() if n < max(units))


def _nodes() -> list[dict]:
    import ray

    return ray.nodes()


def _slices(nodes: list[dict]) -> dict[str, str]:
    from ..hosts.slices import host_slices

    return host_slices(nodes)


def _check_slices(reg: Registration, said: dict[str, str]) -> None:
    """A job that runs whole slices needs a cluster whose hosts say slices of its size."""
    if not reg.slice_hosts:
        return
    from ..hosts.slices import SLICE_LABELS, SLICE_RESOURCE

    if not said:
        raise ValueError(
            f"job {reg.job!r} runs whole slices of {reg.slice_hosts} hosts, but this cluster's hosts say no slice: "
            f"give every host the label {SLICE_LABELS[1]}=NAME or the resource {SLICE_RESOURCE}NAME "
            '(README, "Slices"), or run the job on a profile whose hosts fail one by one'
        )
    big = {s: n for s, n in collections.Counter(said.values()).items() if n > reg.slice_hosts}
    if big:
        name, n = min(big.items())
        raise ValueError(
            f"job {reg.job!r} runs whole slices of {reg.slice_hosts} hosts, but slice {name!r} of this cluster has "
            f"{n}: set [hosts] hosts_per_slice = {n} in the job file, or leave it out to take the cluster's"
        )


def _tag() -> str:
    import secrets

    return secrets.token_hex(3)


def _placed(e: _Entry, tables: dict[str, dict]) -> dict[str, str]:
    """`e`'s reservations Ray has placed (placement group id -> node), from `_tables`."""
    return {
        pg_id: t["bundles_to_node_id"].get(0, "")
        for pg_id, t in tables.items()
        if pg_id in e.pgs and t["state"] == "CREATED"
    }


def _tables(e: _Entry) -> dict[str, dict]:
    """Each reservation's entry in Ray's placement group table, one GCS read each: its state,
    CREATED (placed), PENDING (waiting for a free host, never placed yet), PREPARED (being
    placed) or RESCHEDULING (its host died; being placed again), and the node its bundle is on."""
    from ray.util import placement_group_table

    return {pg_id: placement_group_table(pg) for pg_id, pg in e.pgs.items()}


def _node_of(pg) -> str:
    from ray.util import placement_group_table

    return placement_group_table(pg)["bundles_to_node_id"].get(0, "")


def _remove_all(e: _Entry) -> None:
    import ray

    for pg in e.pgs.values():
        ray.util.remove_placement_group(pg)
    e.pgs.clear()
    e.pinned.clear()


def _alive_hosts(nodes: list[dict]) -> list[str]:
    return sorted(n["NodeID"] for n in nodes if n["Alive"] and n["Resources"].get(HOST_RESOURCE))


def start(config: FleetSchedulerConfig | None = None):
    """The cluster's scheduler: the one running, else one started now (detached, on the head
    node, so that it outlives the job that started it and no host's loss takes it)."""
    import ray

    config = config or FleetSchedulerConfig()
    cls = ray.remote(FleetScheduler)
    return cls.options(
        name=NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        resources={"node:__internal_head__": 0.001},
        scheduling_strategy="DEFAULT",  # not in the placement group of whoever starts it
    ).remote(dataclasses.asdict(config))
