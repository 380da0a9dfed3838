"""A segment's batches: each process reads the rows its devices hold, one step ahead."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from ..job.data import DataPosition, HostBatches


def batches(program, position: DataPosition, shardings, shapes):
    """step -> that step's global batch on the devices: each process reading the rows it holds
    of `program.data`, or slicing its rows out of `program.batch`'s whole batch."""
    if program.data is not None:
        return HostBatches(program.data, position, shardings, shapes)
    return lambda step: _global_batch(program.batch(step, position.global_batch), shardings)


def _global_batch(host_batch: Any, shardings: Any):
    """The whole global batch, built on every process (`Program.batch`), placed on the devices:
    each process hands over only the slices its devices hold."""
    import jax
    import numpy as np

    # dtype given: a process whose devices the plan leaves out holds no shard to infer it from.
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            np.shape(x), s, lambda idx: np.asarray(x)[idx], dtype=np.asarray(x).dtype
        ),
        host_batch,
        shardings,
    )


class Prefetch:
    """The next step's batch is read and laid out on the devices while this step runs; the time
    a step waits for it is its input time."""

    def __init__(self, batches, first: int, end: int):
        self._batches, self._end = batches, end
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-input")
        self._upcoming = self._pool.submit(batches, first) if first < end else None

    def take(self, step: int):
        """Step `step + 1`'s batch (the batch of the step at index `step`), and begin the next one."""
        batch = self._upcoming.result()
        self._upcoming = self._pool.submit(self._batches, step + 1) if step + 1 < self._end else None
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
