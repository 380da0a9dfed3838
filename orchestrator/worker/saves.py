"""Checkpoint saves from the training loop: one in flight at a time, failures bounded.

A save that failed (a full disk, a lost mount) is reported and training goes on: nothing committed
is touched, peer snapshots still cover a host loss, and the next boundary saves again.
`MAX_FAILED_SAVES` in a row end the segment with what to do.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from ..job.digest import digest as digest_of
from ..protocol import Checkpoint, CheckpointFailed, CheckpointMeta, SegmentSpec, Step, Stop, step_record
from .hooks import FaultHook, Hook, StepDispatched
from .laps import Laps, Reporter

MAX_FAILED_SAVES = 3
MAX_UNSAVED_STEPS = 1024  # step records kept for the next checkpoint's metadata


class CheckpointSaveError(RuntimeError):
    """Saves failed `MAX_FAILED_SAVES` times in a row: training on would risk more than it keeps."""


class Saves:
    """The save in flight, settled before the next one begins; and the steps done since the
    newest commit, saved with the next one: a controller killed before it stored them (its store
    is written once a second) gets them back on resume."""

    def __init__(self, store, report: Reporter, directory: str):
        self.store, self.report, self.directory = store, report, directory
        self.saving: int | None = None  # the step whose save is in flight
        self.failed: list[str] = []  # saves failed in a row
        self._steps: list[dict] = []

    def step_done(self, step: Step) -> None:
        self._steps.append(step_record(step))
        # The store loses at most a flush interval's rows (about a second); a long interval
        # between checkpoints of fast steps keeps its newest steps only.
        del self._steps[:-MAX_UNSAVED_STEPS]

    def unsaved(self, upto: int) -> list[dict]:
        """The records of the steps past the newest commit, up to step `upto`."""
        return [r for r in self._steps if r["step"] <= upto]

    def save(self, step: int, save: Callable[..., None]) -> None:
        """Settle the save in flight, then begin `step`'s (`save(steps=...)`, given the records of
        the steps past the newest commit once that save is settled)."""
        self.settle()
        try:
            save(steps=self.unsaved(step))
        except OSError as e:  # the directory itself refused (writes fail later, in `settle`)
            self._failed(step, e)
            return
        self.saving = step

    def settle_if_done(self) -> None:
        """A save that finished (or failed) is settled now, not at the next boundary: a failure is
        reported as soon as it has happened."""
        if self.saving is not None and not self.store.saving:
            self.settle()

    def settle(self) -> None:
        saving, self.saving = self.saving, None
        if saving is None:
            return  # nothing in flight (already settled)
        try:
            self.store.wait()
        except Exception as e:  # noqa: BLE001 (whatever the disk raised: it is reported, and bounded)
            self._failed(saving, e)
        else:
            self.failed.clear()
            self._steps = [r for r in self._steps if r["step"] > saving]

    def _failed(self, saving: int, e: Exception) -> None:
        self.failed.append(f"{type(e).__name__}: {e}")
        newest = self.store.latest()
        self.report(CheckpointFailed(step=saving, error=self.failed[-1][:2000], newest=newest))
        if len(self.failed) >= MAX_FAILED_SAVES:
            raise CheckpointSaveError(
                f"{len(self.failed)} checkpoint saves in a row failed (the last, of step {saving}: "
                f"{self.failed[-1][:500]}); the newest committed step in {self.directory} is {newest}. "
                "Free space there or point checkpoint.dir elsewhere, then run the job again: it resumes from it"
            ) from e


class SaveHook(Hook):
    """Saves the state at every checkpoint boundary, and at a stop the step reached, with its
    `CheckpointMeta`; the save's lap (`Checkpoint`) is the time the loop was held."""

    def __init__(self, saves: Saves, plan, digest, position, spec: SegmentSpec, fault: FaultHook, lap: Laps):
        self.saves, self.plan, self.digest, self.position = saves, plan, digest, position
        self.spec, self.fault, self.lap = spec, fault, lap

    def wants_state(self, step: int, boundary: bool) -> bool:
        return boundary

    def after_step(self, done: StepDispatched) -> None:
        self.saves.settle_if_done()
        if done.corrupt:
            return  # (a state whose copies differ is never committed)
        if done.boundary or done.stop is Stop.NOW:
            self.saves.save(done.step, functools.partial(self._save, done.state, done.step))
            self.lap(Checkpoint, step=done.step)

    def close(self) -> None:
        """The save in flight settles (it commits, or is reported failed), and the store closes."""
        try:
            self.saves.settle()
        finally:
            self.saves.store.close()

    def _save(self, state, step: int, steps: list[dict]) -> None:
        store, spec = self.saves.store, self.spec
        self.fault.saving(step, store)
        meta = CheckpointMeta(
            data_position=step,
            examples_seen=self.position.example_index(step),
            segment=spec.segment,
            step_records=tuple(steps),  # this segment's steps past the last commit
            program=spec.program,
            seed=spec.seed,
            program_fingerprint=spec.fingerprint,
            global_batch=spec.global_batch,
            steps=spec.steps,
            options=spec.options,
        )
        if self.digest.enabled:
            meta = dataclasses.replace(meta, digest=digest_of(self.digest.get(), state))
        store.save(step, state, plan=self.plan, meta=meta.to_dict())
