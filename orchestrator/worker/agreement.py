"""Every process of a group stops after the same step and takes peer snapshots after the same steps."""

from __future__ import annotations

from collections.abc import Callable

from ..protocol import Stop


class StopAgreement:
    """A request reaches each host at a different moment, so it is acted on only at steps that all
    processes agree to check, by one small broadcast from process 0: every checkpoint boundary, and
    in between about every `check_seconds` of steps (process 0 proposes the interval with the
    flag), so the collective costs a bounded share of step time however short the steps are. The
    same broadcast carries process 0's snapshot interval (`propose_snapshots`, measured by its
    `SnapshotPace`): a snapshot is complete only if every process takes it at the same step; and
    whether process 0's state-digest program is compiled (`propose_digest`): the digest, a program
    with collectives of its own, is dispatched with a snapshot only once agreed, by every process
    at the same step (a process whose compile is behind waits for it), or processes that dispatch
    it and processes that do not would wait on each other's collectives for ever. Likewise the
    interval of the comparison of the state's copies (`propose_replica_every`, process 0's
    measure; worker/replicas.py).

    `broadcast`: process 0's int32 array to every process (`multihost_utils.broadcast_one_to_all`
    by default; a test passes its own)."""

    def __init__(
        self,
        should_stop: Callable[[], Stop],
        processes: int,
        check_seconds: float = 0.5,
        propose_snapshots: Callable[[], int] = lambda: 0,
        broadcast: Callable | None = None,
        propose_digest: Callable[[], bool] = lambda: False,
        propose_replica_every: Callable[[], int] = lambda: 0,
    ):
        self._should_stop = should_stop
        self._processes = processes
        self._check_seconds = check_seconds
        self._propose_snapshots = propose_snapshots
        self._broadcast = broadcast
        self._propose_digest = propose_digest
        self._propose_replica_every = propose_replica_every
        self.snapshot_every = 0  # agreed: snapshot after steps divisible by this (0: none yet)
        # Agreed: compare the state's copies after steps divisible by this (0: not yet measured).
        # A program with collectives too, so every process runs it at the same steps.
        self.replica_every = 0
        self.digest_ready = False  # agreed: snapshots carry the state's digest from now on
        # The next step to check at. Not a segment's first step: the broadcast's own first run
        # compiles a small program, which would delay the step a recovery waits for.
        self._next: int | None = None

    def agree(self, step: int, boundary: bool, step_seconds: float) -> Stop:
        if self._processes == 1:
            self.snapshot_every = self._propose_snapshots()
            self.digest_ready = self.digest_ready or self._propose_digest()
            self.replica_every = self.replica_every or self._propose_replica_every()
            return self._should_stop()
        if self._next is None:
            self._next = step + 1
        if not (boundary or step >= self._next):
            return Stop.RUN
        import numpy as np

        interval = max(1, int(self._check_seconds / max(step_seconds, 1e-6)))
        proposal = np.array(
            [int(self._should_stop()), interval, self._propose_snapshots(), int(self._propose_digest()),
             self._propose_replica_every()], np.int32,
        )  # fmt: skip
        agreed = self._broadcast_one_to_all(proposal)
        self._next = step + int(agreed[1])
        self.snapshot_every = int(agreed[2])
        self.digest_ready = self.digest_ready or bool(agreed[3])
        self.replica_every = self.replica_every or int(agreed[4])
        return Stop(int(agreed[0]))

    def _broadcast_one_to_all(self, proposal):
        if self._broadcast is not None:
            return self._broadcast(proposal)
        from jax.experimental import multihost_utils

        return multihost_utils.broadcast_one_to_all(proposal)
