"""The worker's side of fault injection: a host that hangs, straggles or corrupts its copy of the
state, as the controller's `ChaosCallback` asked (a `worker.hooks.FaultHook`)."""

from __future__ import annotations

import random
import threading
import time

from ..protocol import Hang
from ..worker.hooks import FaultHook
from .faults import SLOW_INPUT_SECONDS


class HostFaults(FaultHook):
    """The worker's side: hang as a phase begins or instead of a save (until the controller kills
    the host), read input `SLOW_INPUT_SECONDS` slower from a step on, or do each step's work F
    times as long (a straggler)."""

    def __init__(self, report, hang_in: str | None = None, hang_before_save: int | None = None,
                 slow_input_from: int | None = None, slow_step: tuple[int, float] | None = None,
                 hang_at_step: int | None = None, flip: tuple[int, int] | None = None,
                 flip_grad_at: tuple[int, bool] | None = None, jitter: tuple[int, float] | None = None,
                 stall: tuple[int, float] | None = None):  # fmt: skip
        self.report, self.hang_in, self.hang_at_step = report, hang_in, hang_at_step
        self.flip = flip  # (after step, bit)
        self.flip_grad_at = flip_grad_at  # (step, every time)
        self.jitter, self.stall = jitter, stall  # (from step, share of a step); (after step, seconds)
        self.hang_before_save, self.slow_input_from = hang_before_save, slow_input_from
        self.slow_step = slow_step  # (from step, factor)
        self._step_work: float | None = None  # a healthy step's seconds, read once the slowness begins
        self._stepped = False  # past the group's first step (a hook is made for each group)

    def entering(self, phase: str) -> None:
        if phase == self.hang_in:
            self._hang(phase)

    def saving(self, step: int, store) -> None:
        if step == self.hang_before_save:
            # The previous checkpoint is complete, this one is begun by the other hosts and never
            # finished by this one.
            store.wait()
            self._hang("save", step)

    def input_read(self, step: int) -> None:
        if self.slow_input_from is not None and step >= self.slow_input_from:
            time.sleep(SLOW_INPUT_SECONDS)

    def probe_work(self, seconds: float) -> None:
        if self.slow_step is not None:
            time.sleep((self.slow_step[1] - 1) * seconds)

    def dispatching(self, step: int) -> None:
        if step == self.hang_at_step:
            threading.Event().wait()  # (the actor answers on; the controller's health loop stops it)

    def batch(self, step: int, batch):
        """At the flip-grad's step, this host's rows of the batch corrupted (once a segment)."""
        if self.flip_grad_at is None or step != self.flip_grad_at[0]:
            return batch
        import jax

        self.flip_grad_at = None
        return jax.tree.map(_garbled, batch)

    def corrupt(self, step: int, state):
        """After the flip's step, one bit of one element of this host's copy of a replicated
        floating-point leaf flips (the first leaf with at least three copies: a majority can
        name it)."""
        if self.flip is None or step != self.flip[0]:
            return state
        import jax

        leaves, tree = jax.tree.flatten(state)
        for n, leaf in enumerate(leaves):
            if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and _copies(leaf) >= 3:
                leaves[n] = _flipped(leaf, self.flip[1])
                return jax.tree.unflatten(tree, leaves)
        return state

    def step_work(self, step: int, read_back) -> None:
        """From the slow step on (a group's first step left out), this host finishes each step's
        work (F - 1) healthy steps' time late: the others wait for it in the next step's
        collectives. Jitter adds a random share of a healthy step; a stall, seconds once."""
        extra = 0.0
        if self.stall is not None and step == self.stall[0]:
            time.sleep(self.stall[1])
        first, self._stepped = not self._stepped, True
        for fault, share in ((self.slow_step, lambda f: f - 1), (self.jitter, lambda f: random.uniform(0, 2 * f))):
            # Not from a group's first step: its time is also the restore's and the wait for peers
            # still starting, so read as a healthy step's it would slow the host many times over.
            if fault is not None and step >= fault[0] and not first:
                if self._step_work is None:
                    self._step_work = read_back()  # (the first such step's own time: it begins after it)
                extra += share(fault[1]) * self._step_work
        if extra:
            read_back()
            time.sleep(extra)

    def _hang(self, phase: str, step: int | None = None) -> None:
        self.report(Hang(phase=phase, step=step))
        threading.Event().wait()


def _copies(leaf) -> int:
    """How many devices hold each block of `leaf`."""
    blocks = {}
    for index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).values():
        key = tuple(s.indices(d)[:2] for s, d in zip(index, leaf.shape))
        blocks[key] = blocks.get(key, 0) + 1
    return min(blocks.values())


def _changed(leaf, change):
    """`leaf` with this process's copies of its blocks replaced by `change(n, numpy copy)` (n: the
    copy's place among this process's): the other processes' copies stay as they are."""
    import jax
    import numpy as np

    shards = [jax.device_put(change(n, np.array(s.data)), s.device) for n, s in enumerate(leaf.addressable_shards)]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)


def _flipped(leaf, bit: int):
    """`leaf` with bit `bit` of element 0 of this process's first copy flipped (32-bit words; the
    lower 16 bits of a 16-bit type)."""
    import numpy as np

    def flip(n, data):
        if n == 0:
            words = data.reshape(-1).view({2: np.uint16, 4: np.uint32, 8: np.uint32}[data.dtype.itemsize])
            words[0] ^= words.dtype.type(1 << (bit % (8 * words.dtype.itemsize)))
        return data

    return _changed(leaf, flip)


def _garbled(leaf):
    """`leaf` with this process's rows corrupted: integers XOR 1 (tokens become their neighbours),
    floats times 1000."""
    import numpy as np

    return _changed(leaf, lambda n, d: d ^ 1 if np.issubdtype(d.dtype, np.integer) else (d * 1000).astype(d.dtype))
