"""remesh.checkpoint: a universal checkpoint store that restores onto any mesh and plan.

    store = checkpoint.Store(path)
    store.save(step, state, plan=plan, meta={"data_position": step})
    state = store.restore(target=abstract_state_with_new_shardings)
"""
from .store import CheckpointNotFoundError, CheckpointTargetError, Store, StoreConfig

__all__ = ["CheckpointNotFoundError", "CheckpointTargetError", "Store", "StoreConfig"]
