"""A checkpoint store on orbax-checkpoint: asynchronous saves, atomic commits, target-driven restore.

Each step is one Orbax checkpoint with two items: `state` (the train state's global arrays, stored
per global array, never per rank, so any mesh can read them) and `meta` (versioned JSON: step, the
plan it was saved under, and the caller's metadata such as the data position). Orbax writes into a
temporary directory and renames it on commit, so a crash at any point leaves every earlier step
intact; uncommitted directories are invisible to `steps()` and cleaned at the next open.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp

META_FORMAT = "remesh.checkpoint/1"


class CheckpointNotFoundError(FileNotFoundError):
    pass


class CheckpointTargetError(ValueError):
    """The restore target does not match what was saved."""


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    keep_last: int | None = 3  # None keeps every step
    async_save: bool = True

    def create(self, path: str | os.PathLike) -> "Store":
        return Store(path, config=self)


class Store:
    """Example:
        >>> store = Store("/ckpt")
        >>> store.save(100, state, meta={"data_position": 100})
        >>> store.wait()
        >>> target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, new_shardings)
        >>> state = store.restore(target=target)
    """

    def __init__(self, path: str | os.PathLike, *, config: StoreConfig = StoreConfig()):
        self.path = os.path.abspath(os.fspath(path))
        self.config = config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_last,
            enable_async_checkpointing=config.async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.path, options=options)

    def save(self, step: int, state: Any, *, plan=None, meta: Mapping | None = None) -> None:
        """Returns once device buffers are copied to host; the write goes on in the background."""
        doc = {
            "format": META_FORMAT,
            "step": int(step),
            "plan": plan.to_dict() if plan is not None else None,
            "leaves": [
                {"path": jax.tree_util.keystr(p), "shape": list(x.shape), "dtype": str(x.dtype)}
                for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
            ],
            "meta": dict(meta or {}),
        }
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(doc))
        self._manager.save(int(step), args=args)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def metadata(self, step: int | None = None) -> dict:
        return self._read_metadata(self._resolve(step))

    def _read_metadata(self, step: int) -> dict:
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def restore(self, step: int | None = None, *, target: Any) -> Any:
        """Restore onto `target`, a pytree of jax.ShapeDtypeStruct carrying the new shardings.

        A leaf without a sharding is restored whole onto this process's first device."""
        step = self._resolve(step)
        self._check_target(step, self._read_metadata(step), target)
        local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda x: x if getattr(x, "sharding", None) is not None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=local),
            target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
        return self._manager.restore(step, args=args)["state"]

    def close(self) -> None:
        self._manager.close()

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.path}")
            return steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} in {self.path}; committed steps: {steps}")
        return step

    def _check_target(self, step: int, meta: dict, target: Any) -> None:
        saved = {l["path"]: l for l in meta["leaves"]}
        wanted = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        missing = sorted(set(wanted) - set(saved))
        if missing:
            raise CheckpointTargetError(
                f"restore target has leaves that step {step} does not: {missing[:5]}; the checkpoint "
                f"holds {len(saved)} leaves such as {next(iter(saved), '-')}"
            )
        for key, x in wanted.items():
            if list(x.shape) != saved[key]["shape"] or str(x.dtype) != saved[key]["dtype"]:
                raise CheckpointTargetError(
                    f"leaf {key}: checkpoint step {step} holds shape {saved[key]['shape']} dtype "
                    f"{saved[key]['dtype']}, but the target asks for shape {list(x.shape)} dtype {x.dtype}"
                )
