"""The program's evaluation on held-out data, every `Evaluation.every` steps."""

from __future__ import annotations

from ..protocol import Eval
from .hooks import Hook, StepDispatched
from .laps import Laps
from .scalars import scalar_metrics


class EvalHook(Hook):
    """Reports an `Eval` lap: the mean of each metric over the held-out batches."""

    def __init__(self, compiled, held_out, evaluation, lap: Laps):
        self._compiled, self._held_out, self._evaluation, self._lap = compiled, held_out, evaluation, lap

    def wants_state(self, step: int, boundary: bool) -> bool:
        return step % self._evaluation.every == 0

    def after_step(self, done: StepDispatched) -> None:
        if not self.wants_state(done.step, done.boundary):
            return
        import jax

        batches = range(self._evaluation.batches)
        results = [scalar_metrics(jax.device_get(self._compiled(done.state, self._held_out(b)))) for b in batches]
        mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        self._lap(Eval, step=done.step, loss=mean.pop("loss"), metrics=mean)
