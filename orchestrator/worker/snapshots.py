"""Peer snapshots from the training loop: how often to take one, and taking it.

Every few steps each process copies its shards of the state to the host and hands them to its
`PeerSnapshots` (hosts/keepers.py), which sends them to keepers off the training thread.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable

from ..protocol import CheckpointMeta
from .hooks import Hook, StepDispatched


class SnapshotPace:
    """How often to take a peer snapshot: after every step whose copy to the host fits the budget
    (a share of step time), measured as it goes: a copy (with any wait for queued sends) taking
    `c` seconds beside steps of `t` seconds is taken every `ceil(c / (budget * t))` steps.
    Process 0's interval is the group's (`StopAgreement`). `fixed`: every so many steps instead,
    whatever the copies take."""

    def __init__(self, budget: float, peers, window: int = 5, fixed: int = 0):
        self.interval = (fixed or 1) if peers is not None and budget > 0 else 0  # 0: never
        self._budget, self._fixed = budget, fixed
        self.index: dict | None = None  # the snapshot index, made by the first take
        # The medians of the last few: one copy slowed by something else (a compile beside
        # training) does not stretch the interval for long.
        self._copies: collections.deque = collections.deque(maxlen=window)
        self._steps: collections.deque = collections.deque(maxlen=window)

    def took(self, copy_seconds: float, step_seconds: float) -> None:
        if not self.interval or self._fixed or step_seconds <= 0:
            return
        self._copies.append(copy_seconds)
        self._steps.append(step_seconds)
        copy, step = statistics.median(self._copies), statistics.median(self._steps)
        self.interval = max(1, math.ceil(copy / (self._budget * step)))


def take_snapshot(peers, state, meta: CheckpointMeta, pace: SnapshotPace, digest, with_digest: bool) -> float:
    """Copy this process's shards of the state after `meta.step` to the host and hand them to
    `peers` (sent in the background); returns the seconds the copy held the training loop. With the
    state's digest where the group agreed its program is compiled (`with_digest`,
    `StopAgreement.digest_ready`; never waited for here but by a process whose compile is
    behind): a restore checks it."""
    import jax

    from checkpoint import take_snapshot as copy_to_host

    from ..job.digest import digest_later

    jax.block_until_ready(state)  # the step's own time is not the copy's
    t = time.perf_counter()
    pace.index, arrays = copy_to_host(state, pace.index)
    # The digest is dispatched now and read by the send thread: the loop does not wait for it.
    program = digest.get() if with_digest else None
    later = digest_later(program, state) if program is not None else None
    peers.offer(meta.step, pace.index, arrays, meta.to_dict(), later)  # waits only while two earlier ones are queued
    return time.perf_counter() - t


class SnapshotHook(Hook):
    """Takes a peer snapshot after the steps the group agreed on (`StopAgreement.snapshot_every`),
    with the records of the steps since the newest commit, which a restore hands back."""

    def __init__(self, peers, pace: SnapshotPace, position, spec, digest, with_digest: Callable[[], bool]):
        self.peers, self.pace, self.position, self.spec, self.digest = peers, pace, position, spec, digest
        self.with_digest = with_digest  # the group's agreement that every process can dispatch it

    def after_step(self, done: StepDispatched) -> None:
        every = done.snapshot_every
        if done.ends_segment or not every or done.step % every or done.corrupt:
            return
        seconds = done.read_back()  # the copy waits for the step anyway; its report goes with it
        meta = CheckpointMeta(
            data_position=done.step,
            examples_seen=self.position.example_index(done.step),
            segment=self.spec.segment,
            step=done.step,
            step_records=tuple(done.unsaved(done.step)),
        )
        copy = take_snapshot(self.peers, done.state, meta, self.pace, self.digest, self.with_digest())
        self.pace.took(copy, seconds)
        done.copied += copy
