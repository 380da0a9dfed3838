"""The per-host SPMD worker: one process of one `jax.distributed` group, training one segment.

Runs the same under a Ray host actor, in a bare process without Ray (`python -m
orchestrator.worker SPEC.json`, as on a GPU machine) or in a test; imports no Ray.

    segment.py     run_segment: join, load, compile beside the restore, the loop
    process.py     joining the group, compiling once per group
    restore.py     a peer snapshot, else the newest intact commit, else init
    hooks.py       what runs after each step, and the fault hook tests inject through
    saves.py       checkpoint saves (one in flight, failures bounded)
    snapshots.py   peer snapshots (their pace, taking one)
    evaluation.py  the program's evaluation
    compile.py     step FLOPs, the digest's program, compiling ahead, loading what was compiled ahead
    agreement.py   every process stops (and snapshots) after the same step
    progress.py    where the loop is (for naming the host a hung step waits on), every thread's stack
    inputs.py      each host's rows of each batch, one step ahead
    laps.py        reports that cover a host's time back to back
"""

from .restore import RestoredStateMismatchError
from .saves import MAX_FAILED_SAVES, CheckpointSaveError
from .segment import run_segment

__all__ = ["MAX_FAILED_SAVES", "CheckpointSaveError", "RestoredStateMismatchError", "run_segment"]
