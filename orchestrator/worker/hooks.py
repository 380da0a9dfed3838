"""What the training loop calls after each step, and where fault injection reaches in.

The loop (segment.py) only reads batches, dispatches steps and reads their metrics back; all
else is a `Hook` run after each step, in order: the evaluation (evaluation.py), the save
(saves.py), compiling ahead (compile.py) and the peer snapshot (snapshots.py). A hook that needs
the state a step produced says so (`wants_state`): the next step donates it, so the loop reads
the step back before the hooks run. Hooks do not reach into each other or into the loop: what one
needs rides on the step's record (`StepDispatched`), and what it held the loop for goes back on it.
Every hook is closed when the segment ends, on an error too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol import HookRef, Stop
from .laps import Reporter


def _nothing_unsaved(upto: int) -> list[dict]:
    return []


@dataclasses.dataclass
class StepDispatched:
    """A step dispatched (its metrics perhaps not read back yet), as the hooks after it see it."""

    step: int
    state: Any  # the state after it, on the devices
    boundary: bool  # a checkpoint boundary (every `checkpoint.every` steps, and the job's last step)
    last: bool  # the job's last step
    stop: Stop = Stop.RUN  # what the group agreed after it
    step_seconds: float = 0.0  # the time of the last step read back
    snapshot_every: int = 0  # the peer-snapshot interval the group agreed on (0: none)
    read_back: Callable[[], float] = lambda: 0.0  # wait for this step, report it; its seconds
    unsaved: Callable[[int], list[dict]] = _nothing_unsaved  # records of the steps past the newest commit
    copied: float = 0.0  # seconds a hook held the loop copying state (charged to the step's report)
    corrupt: bool = False  # the state's copies differed at or before this step: none of it is saved or kept

    @property
    def ends_segment(self) -> bool:
        """The segment ends after this step: the job is done, or a stop asked for it here."""
        return self.last or self.stop is Stop.NOW or (self.stop is Stop.AT_CHECKPOINT and self.boundary)


class Hook:
    def wants_state(self, step: int, boundary: bool) -> bool:
        """This step's state is needed after it (the loop reads the step back before the hooks)."""
        return False

    def after_step(self, done: StepDispatched) -> None: ...

    def close(self) -> None:
        """The segment ends (also on an error): finish what is in flight."""


@contextlib.contextmanager
def closing(hooks: Sequence[Hook]):
    """Close every hook when the block ends. On an error the error goes on and a hook that fails
    to close is left (the segment is over either way); otherwise a hook that fails to close
    raises, once the others are closed."""
    failed: BaseException | None = None
    try:
        yield
    except BaseException:
        for hook in hooks:
            with contextlib.suppress(Exception):
                hook.close()
        raise
    for hook in hooks:
        try:
            hook.close()
        except Exception as e:  # noqa: BLE001 (closed the others first; raised below)
            failed = failed or e
    if failed is not None:
        raise failed


class FaultHook:
    """Where tests inject faults into a segment (orchestrator/chaos/ implements one); here it does
        nothing. A segment calls it as each phase begins, before each save, after each batch and after
    each step's dispatch."""

    def entering(self, phase: str) -> None:
        """`phase` ("start", "compile", "restore") begins."""

    def saving(self, step: int, store) -> None:
        """`step`'s save is about to begin; `store` has settled the save before it."""

    def input_read(self, step: int) -> None:
        """`step`'s batch is read; the time until it is dispatched counts as input time."""

    def probe_work(self, seconds: float) -> None:
        """A probe of this host took `seconds` (`hosts.probe`): a slow host's probe is slow too."""

    def dispatching(self, step: int) -> None:
        """`step`'s compiled program is about to be dispatched (a host that blocks here blocks
        inside the step, as far as its peers can tell)."""

    def batch(self, step: int, batch):
        """`step`'s batch as this host feeds it (a fault may change its rows)."""
        return batch

    def corrupt(self, step: int, state):
        """`step` is dispatched; the state after it, as this host holds it (a fault may change
        its copy)."""
        return state

    def step_work(self, step: int, read_back: Callable[[], float]) -> None:
        """`step` is dispatched; time spent here is this host's own work on it (`read_back()`
        waits for the step and returns its seconds)."""


def load_fault_hook(ref: HookRef | None, report: Reporter) -> FaultHook:
    """The hook a segment spec names (imported by name: the worker imports no test code)."""
    if ref is None:
        return FaultHook()
    module, _, name = ref.factory.partition(":")
    return getattr(importlib.import_module(module), name)(report, **ref.args)
