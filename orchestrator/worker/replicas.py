"""The state's copies compared every few steps (`job.replicas`): a hook after the step, before the
save and the peer snapshot, so that nothing whose copies differ is committed or kept.

How often: `SegmentSpec.digest_every` steps, or (0) as often as costs 1% of a step: the first
comparison, a few steps in, is timed against the step, and the interval follows from it. Every
checkpoint boundary is compared too, before its save. Once copies differ, every later step of the
segment is marked corrupt (`StepDispatched.corrupt`): the controller's health loop decides what
follows, and until it acts nothing more is saved.
"""

from __future__ import annotations

import math
import time

from ..protocol import ReplicasDiffer
from .hooks import Hook, StepDispatched

BUDGET = 0.01  # of a step's time, with digest_every = 0
FIRST_AFTER = 3  # steps into a segment before the first (timed) comparison


class ReplicaCheck(Hook):
    """`program()`: `job.replicas.compile_replica_sums`'s, for `abstract` (the state with its
    shardings), compiled on first use; `first`: the step the segment starts after (restored: its
    copies agree); `agreed()`: the interval every process agreed on (`StopAgreement`), where
    `every` is 0 (measured: `measured` is this process's proposal)."""

    def __init__(self, program, abstract, every: int, first: int, report, agreed=lambda: 0):
        self._program, self._abstract, self._report, self._agreed = program, abstract, report, agreed
        self._fixed = every
        self._first = first
        self.measured = 0  # this process's interval, from its timed first comparison
        self.clean = first  # the newest step whose copies agreed
        self.tainted = False

    @property
    def every(self) -> int:
        return self._fixed if self._fixed > 0 else self._agreed()

    def _due(self, step: int, boundary: bool) -> bool:
        if self._fixed < 0 or self.tainted:
            return False
        timing = self._fixed == 0 and step == self._first + FIRST_AFTER  # (the same step on every process)
        return boundary or timing or (self.every > 0 and step % self.every == 0)

    def wants_state(self, step: int, boundary: bool) -> bool:
        return self._due(step, boundary)

    def after_step(self, done: StepDispatched) -> None:
        if self.tainted:
            done.corrupt = True
            return
        if not self._due(done.step, done.boundary):
            return
        import jax
        import numpy as np

        from ..job.replicas import disagreements

        program = self._program()
        t = time.perf_counter()
        table = np.asarray(program(*jax.tree.leaves(done.state)).addressable_data(0))
        seconds = time.perf_counter() - t
        if self._fixed == 0 and not self.measured:
            self.measured = max(1, math.ceil(seconds / (BUDGET * max(done.step_seconds, 1e-6))))
        found = disagreements(table, self._abstract)
        if not found:
            self.clean = done.step
            return
        self.tainted = done.corrupt = True
        self._report(ReplicasDiffer(step=done.step, clean_step=self.clean, every=self.every,
                                    disagreements=[d.to_dict() for d in found]))  # fmt: skip
