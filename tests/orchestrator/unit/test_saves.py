"""Saves from the training loop: a failed save is reported and training goes on; failures in a
row are bounded, and a save that works resets the count."""

import pytest

from orchestrator.protocol import CheckpointFailed
from orchestrator.worker.saves import MAX_FAILED_SAVES, CheckpointSaveError, Saves


class Disk:
    """A store whose writes fail (in `wait`, as a background write does) while `full`."""

    def __init__(self):
        self.full, self.committed, self.saving = False, [], False
        self._writing = None

    def wait(self):
        step, self._writing = self._writing, None
        if self.full:
            raise OSError(28, "No space left on device")
        self.committed.append(step)

    def latest(self):
        return self.committed[-1] if self.committed else None

    def save(self, step, steps):
        self._writing = step


def test_failed_saves_are_reported_training_goes_on_and_a_success_resets_the_count():
    disk, reports = Disk(), []
    saves = Saves(disk, reports.append, "/ckpt")
    saves.save(5, lambda steps: disk.save(5, steps))
    saves.settle()
    disk.full = True
    for step in range(10, 10 + 5 * (MAX_FAILED_SAVES - 1), 5):
        saves.save(step, lambda steps, step=step: disk.save(step, steps))
    saves.settle()  # the last of them fails too: MAX_FAILED_SAVES - 1 in a row, still training
    failed = [r for r in reports if isinstance(r, CheckpointFailed)]
    assert [r.step for r in failed] == [10, 15] and {r.newest for r in failed} == {5}
    assert "No space left" in failed[0].error
    disk.full = False
    saves.save(20, lambda steps: disk.save(20, steps))
    saves.settle()
    assert disk.committed == [5, 20] and saves.failed == []


def test_max_failed_saves_in_a_row_end_the_segment_with_what_to_do():
    disk = Disk()
    disk.full = True
    saves = Saves(disk, lambda r: None, "/ckpt")
    with pytest.raises(CheckpointSaveError, match=rf"{MAX_FAILED_SAVES} checkpoint saves in a row failed.*Free space"):
        for step in range(5, 5 * (MAX_FAILED_SAVES + 2), 5):
            saves.save(step, lambda steps, step=step: disk.save(step, steps))
        saves.settle()


def test_a_directory_that_refuses_the_save_counts_as_a_failure():
    reports = []
    saves = Saves(Disk(), reports.append, "/ckpt")

    def refused(steps):
        raise FileExistsError("/ckpt/5.partial exists")

    saves.save(5, refused)
    assert saves.saving is None and [r.step for r in reports] == [5] and "FileExistsError" in reports[0].error


def test_steps_since_the_newest_commit_ride_with_the_next_save():
    from orchestrator.protocol import Step

    disk, kept = Disk(), []
    saves = Saves(disk, lambda r: None, "/ckpt")
    for s in range(1, 8):
        saves.step_done(Step(step=s, loss=1.0 / s, seconds=0.1, at=float(s)))
    saves.save(5, lambda steps: kept.append([r["step"] for r in steps]) or disk.save(5, steps))
    saves.settle()
    assert kept == [[1, 2, 3, 4, 5]] and [r["step"] for r in saves.unsaved(10)] == [6, 7]


def test_the_save_in_flight_settles_and_the_store_closes_when_the_segment_ends_on_an_error():
    from orchestrator.worker.hooks import Hook, closing
    from orchestrator.worker.saves import SaveHook

    class Closing(Disk):
        closed = False

        def close(self):
            self.closed = True

    disk, reports = Closing(), []
    saves = Saves(disk, reports.append, "/ckpt")
    saves.save(10, lambda steps: disk.save(10, steps))  # begun; writing in the background

    class Other(Hook):
        closed = False

        def close(self):
            self.closed = True

    other = Other()
    with pytest.raises(ZeroDivisionError), closing([SaveHook(saves, None, None, None, None, None, None), other]):
        raise ZeroDivisionError("the user's step, at step 11")
    assert disk.committed == [10] and disk.closed and other.closed
