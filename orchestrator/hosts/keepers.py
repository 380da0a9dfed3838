"""Peer snapshots: the train state in host memory, each host's share held by two hosts.

Every few steps (as many as a budget of step time allows; every step where copying is cheap) each
process of a group copies its shards of the state to the host (`checkpoint.take_snapshot`) and
hands them, off the training thread, to two keepers: its own host's and the next host's. A keeper
is a small Ray actor per host, outside any `jax.distributed` group, so it outlives the group's
processes; a host loss takes one keeper with it and the other still holds that host's share.
After a loss the controller finds the newest step whose every share a live keeper holds
(`Keepers.newest`); the new group restores it through the checkpoint reader, resharded onto the
new plan, and reads the disk only when no complete snapshot is newer than the last commit.

Memory: a keeper holds, for each process whose share it keeps (its host's and its peer's), the
newest two steps of the newest two segments: at most 8 shares, where a share is the state's bytes
divided by the group's hosts (replicated leaves are kept once, by the process holding replica 0).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Any

import numpy as np
import ray

Key = tuple[int, int, int]  # (segment, step, process)


class Keeper:
    """Holds snapshot shares in this host's memory (one Ray actor per host)."""

    def __init__(self, keep_steps: int = 2, keep_segments: int = 2):
        self._keep_steps, self._keep_segments = keep_steps, keep_segments
        self._held: dict[Key, tuple[dict, list[np.ndarray]]] = {}

    def put(self, key: Key, index: dict, arrays: list[np.ndarray]) -> None:
        # Copied out of Ray's shared buffers, which belong to the sender: a share must outlive it.
        self._held[tuple(key)] = (index, [np.array(a) for a in arrays])
        self._prune(tuple(key))

    def _prune(self, key: Key) -> None:
        segment, _, process = key
        steps = sorted(s for g, s, p in self._held if (g, p) == (segment, process))
        segments = sorted({g for g, _, _ in self._held})
        for k in list(self._held):
            g, s, p = k
            stale = (g, p) == (segment, process) and s not in steps[-self._keep_steps :]
            if stale or g not in segments[-self._keep_segments :]:
                del self._held[k]

    def held(self) -> list[dict]:
        return [
            {"segment": g, "step": s, "process": p, "processes": index["processes"]}
            for (g, s, p), (index, _) in self._held.items()
        ]

    def index(self, key: Key) -> dict:
        if tuple(key) not in self._held:
            raise LookupError(f"no share {tuple(key)} here")
        return self._held[tuple(key)][0]

    def get(self, key: Key, numbers: list[int]) -> list[np.ndarray]:
        if tuple(key) not in self._held:
            raise LookupError(f"no share {tuple(key)} here")
        arrays = self._held[tuple(key)][1]
        return [arrays[n] for n in numbers]


@dataclasses.dataclass(frozen=True)
class SnapshotSource:
    """A complete snapshot to restore: its step, the segment that took it, and for each process of
    that segment a keeper that holds its share."""

    step: int
    segment: int
    sources: dict[int, Any]  # process -> keeper handle


@dataclasses.dataclass(frozen=True)
class HostSnapshots:
    """What one process of a group is given (picklable: it crosses Ray to the host actor)."""

    keepers: tuple  # this host's keeper, then its peer's (one where the group has one host)
    segment: int
    process: int
    processes: int
    restore: SnapshotSource | None = None

    def open(self) -> PeerSnapshots:
        return PeerSnapshots(self)


class PeerSnapshots:
    """The worker's side, in the host process: `offer` a snapshot, `restore_step` to read one.
    `run_segment` takes any object with these methods (or None), so it stays free of Ray."""

    def __init__(self, plan: HostSnapshots):
        self.plan = plan
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-snapshot")
        self._sending: collections.deque = collections.deque()  # sends submitted, oldest first
        self.last_sent: int | None = None  # the newest step every keeper acknowledged
        self.failed = 0  # sends a keeper did not acknowledge (its host gone, say)

    def offer(self, step: int, index: dict, arrays: list[np.ndarray], meta: dict, digest=None) -> None:
        """Send this process's share of `step` in the background, after the ones before it. Every
        process sends the same steps (a step is restorable only if all its shares arrive), so a
        share is never dropped: with two already waiting, this waits for the oldest, which keeps
        host memory bounded (one share on its way, one queued, this one)."""
        while self._sending and self._sending[0].done():
            self._sending.popleft()
        if len(self._sending) >= 2:
            self._sending.popleft().result()
        self._sending.append(self._pool.submit(self._send, step, index, arrays, meta, digest))

    def _send(self, step: int, index: dict, arrays: list[np.ndarray], meta: dict, digest) -> None:
        """`digest`: a function that waits for the state's digest (`digest.digest_later`), or None."""
        from checkpoint import seal_snapshot

        meta = {**meta, "digest": digest()} if digest is not None else meta
        index = {**seal_snapshot(index, arrays), "meta": meta, "processes": self.plan.processes}
        key = (self.plan.segment, step, self.plan.process)
        refs = [k.put.remote(key, index, arrays) for k in self.plan.keepers]
        try:
            ray.get(refs)
            self.last_sent = step
        except ray.exceptions.RayError:  # a keeper's host is gone: the other may still hold it
            self.failed += 1

    def restore_step(self):
        """The snapshot to restore, readable by `checkpoint.restore_step`; None if none is given."""
        from checkpoint import CheckpointNotFoundError, MemoryStep

        r = self.plan.restore
        if r is None:
            return None
        try:
            indexes = dict(
                zip(r.sources, ray.get([k.index.remote((r.segment, r.step, p)) for p, k in r.sources.items()]))
            )
        except ray.exceptions.RayError as e:
            raise CheckpointNotFoundError(f"snapshot step {r.step}: a keeper is gone ({type(e).__name__})") from e
        meta = indexes[min(indexes)]["meta"]

        def fetch(keys: list[tuple[int, int]]) -> list[np.ndarray]:
            by_process: dict[int, list[int]] = {}
            for process, number in keys:
                by_process.setdefault(process, []).append(number)
            refs = {p: r.sources[p].get.remote((r.segment, r.step, p), numbers) for p, numbers in by_process.items()}
            try:
                got = {p: iter(ray.get(ref)) for p, ref in refs.items()}
            except ray.exceptions.RayError as e:
                raise CheckpointNotFoundError(f"snapshot step {r.step}: a keeper is gone ({type(e).__name__})") from e
            return [next(got[p]) for p, _ in keys]

        return MemoryStep(r.step, meta, indexes, fetch, where=f"host memory (segment {r.segment})")

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclasses.dataclass(frozen=True)
class KeepersConfig:
    env_vars: dict = dataclasses.field(default_factory=dict)  # the keepers' environment (PYTHONPATH)
    answer_timeout_s: float = 5.0  # a keeper that does not say what it holds within this is passed over


class Keepers:
    """The controller's side: one keeper per host node, started once and kept across segments."""

    def __init__(self, config: KeepersConfig = KeepersConfig()):
        self.config = config
        self._keepers: dict[str, Any] = {}  # node id -> keeper handle

    def ensure(self, node_ids: list[str]) -> list:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = ray.remote(num_cpus=0, max_restarts=0)(Keeper)
        for node in node_ids:
            if node not in self._keepers:
                self._keepers[node] = actor.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    runtime_env={"env_vars": dict(self.config.env_vars)},
                ).remote()
        return [self._keepers[n] for n in node_ids]

    def placements(
        self, node_ids: list[str], segment: int, restore: SnapshotSource | None, slice_of: dict[str, str] | None = None
    ) -> list[HostSnapshots]:
        """Each process keeps its share on its own host and on the next one; in slices, on the
        next one in another slice, so that a slice lost whole loses no share (`slice_of`: node
        id -> slice; with one slice, the next host)."""
        keepers = self.ensure(node_ids)
        n = len(node_ids)
        return [
            HostSnapshots(
                tuple(dict.fromkeys([keepers[i], keepers[peer(i, node_ids, slice_of)]])), segment, i, n, restore
            )
            for i in range(n)
        ]

    def newest(self, alive: set[str], after: int, at_most: int | None = None) -> SnapshotSource | None:
        """The newest snapshot, at step `after` or later (and `at_most` or earlier, where given),
        whose every share a live keeper holds."""
        for node in [n for n in self._keepers if n not in alive]:
            del self._keepers[node]
        nodes = list(self._keepers)
        refs = [self._keepers[n].held.remote() for n in nodes]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.answer_timeout_s)
        sources: dict[tuple[int, int], dict[int, Any]] = {}
        processes: dict[tuple[int, int], int] = {}
        for node, ref in zip(nodes, refs):
            if ref not in ready:
                continue
            try:
                held = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            for e in held:
                sources.setdefault((e["segment"], e["step"]), {}).setdefault(e["process"], self._keepers[node])
                processes[(e["segment"], e["step"])] = e["processes"]
        latest = at_most if at_most is not None else float("inf")
        complete = [(s, g) for (g, s), got in sources.items()
                    if after <= s <= latest and len(got) == processes[(g, s)]]  # fmt: skip
        if not complete:
            return None
        step, segment = max(complete)
        return SnapshotSource(step, segment, sources[(segment, step)])

    def shutdown(self) -> None:
        for k in self._keepers.values():
            ray.kill(k, no_restart=True)
        self._keepers.clear()


def peer(i: int, node_ids: list[str], slice_of: dict[str, str] | None) -> int:
    """The host that keeps process i's second copy: the next one, or the next in another slice."""
    n = len(node_ids)
    if slice_of:
        mine = slice_of.get(node_ids[i])
        for k in range(1, n):
            j = (i + k) % n
            if slice_of.get(node_ids[j]) != mine:
                return j
    return (i + 1) % n
