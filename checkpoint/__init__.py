"""remesh.checkpoint: a universal checkpoint store that restores onto any mesh and plan.

    store = checkpoint.Store(path)
    store.save(step, state, plan=plan, meta={"data_position": step})   # blocks for the host copy only
    state = store.restore(target=abstract_state_with_new_shardings)     # reads only what it needs
    report = store.verify(step)                                          # every chunk's checksum

Steps written by plain Orbax restore through the same `restore`. A snapshot of the state in host
memory (`take_snapshot`, `MemoryStep`) restores through `restore_step` the same way.
"""

from .errors import CheckpointCorruptError, CheckpointFormatError, CheckpointNotFoundError, CheckpointTargetError
from .layout import Codec, leaf_path
from .reader import Cast, Rename, RestoreStats, Stack, Unstack
from .reader import restore as restore_step
from .snapshot import MemoryStep
from .snapshot import seal as seal_snapshot
from .snapshot import take as take_snapshot
from .store import Store, StoreConfig, VerifyReport
from .writer import check_savable

__all__ = [
    "Cast",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointTargetError",
    "Codec",
    "MemoryStep",
    "Rename",
    "RestoreStats",
    "Stack",
    "Store",
    "StoreConfig",
    "Unstack",
    "VerifyReport",
    "check_savable",
    "leaf_path",
    "restore_step",
    "seal_snapshot",
    "take_snapshot",
]
