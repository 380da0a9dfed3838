"""The checkpoint store: asynchronous, atomic, checksummed saves; target-driven restores onto any plan.

A store is a directory of steps. remesh writes its own format (`layout.py`); steps written by plain
Orbax (a `CheckpointManager` directory, or a single `StandardCheckpointer` directory, read as step
0) restore through the same `restore`, so a job can resume from them and go on in remesh's format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from . import layout, reader, sources, writer
from .errors import CheckpointFormatError, CheckpointNotFoundError
from .reader import Cast, RestoreStats, Rule


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    keep_last: int | None = 3  # None keeps every step
    keep_every: int | None = None  # also keep every step divisible by this, forever
    async_save: bool = True
    codec: layout.Codec = layout.Codec.RAW
    chunk_bytes: int = 4 << 20  # largest inner chunk; smaller reads less extra on a resharded restore
    commit_timeout_s: float = 600.0  # how long process 0 waits for the others' shards

    def create(self, path: str | os.PathLike) -> Store:
        return Store(path, config=self)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    step: int
    kind: str  # "remesh" or "orbax"
    ok: bool
    problems: list[str]
    bytes_checked: int
    seconds: float


class Store:
    """Example:
    >>> store = Store("/ckpt")
    >>> store.save(100, state, plan=plan, meta={"data_position": 100})   # returns after the host copy
    >>> store.wait()
    >>> target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    ...                       abstract_state, plan.shardings(mesh, abstract_state, argnum=0))
    >>> state = store.restore(target=target)
    >>> params = store.restore(target=target, include=["params/*"])["params"]
    """

    def __init__(self, path: str | os.PathLike, *, config: StoreConfig = StoreConfig()):
        self.path = os.path.abspath(os.fspath(path))
        self.config = config
        self._sequence = 0
        self._nonce: str | None = None
        self._writer = writer.Writer(on_commit=self._after_commit, commit_timeout_s=config.commit_timeout_s)

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, plan=None, meta: Mapping | None = None) -> None:
        """Returns once this process's shards are copied to host; the write goes on in the
        background and commits atomically. Waits first for the previous save, if still writing."""
        if int(step) != step or step < 0:
            raise ValueError(f"a checkpoint step is a non-negative integer, got {step!r}")
        self._writer.wait()
        os.makedirs(self.path, exist_ok=True)
        leaves = writer.copy_to_host(state, self.config.chunk_bytes)
        plan_doc = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan) if plan is not None else None
        job = writer.SaveJob(
            self.path,
            int(step),
            leaves,
            plan_doc,
            dict(meta or {}),
            self.config.codec,
            self._sequence,
            self._group_nonce(),
        )
        self._sequence += 1
        self._writer.start(job, background=self.config.async_save)

    def wait(self) -> None:
        """Block until this process's last save is written (and, on process 0, committed)."""
        self._writer.wait()

    @property
    def saving(self) -> bool:
        """This process's last save is still being written: `wait` would block."""
        return self._writer.busy

    @property
    def last_save_seconds(self) -> float | None:
        return self._writer.last_seconds

    def _group_nonce(self) -> str:
        # Partial directories are unique to one jax.distributed group, so a save never writes into
        # the leftovers of a crashed earlier attempt at the same step.
        if self._nonce is None:
            if jax.process_count() == 1:
                self._nonce = uuid.uuid4().hex[:12]
            else:
                from jax._src import distributed

                client = distributed.global_state.client
                key = "remesh/ckpt/nonce/" + hashlib.sha1(self.path.encode()).hexdigest()[:12]
                if jax.process_index() == 0:
                    client.key_value_set(key, uuid.uuid4().hex[:12])
                self._nonce = client.blocking_key_value_get(key, int(self.config.commit_timeout_s * 1000))
        return self._nonce

    def _after_commit(self, step: int) -> None:
        """Process 0, after each commit: retention, and leftovers of crashed attempts."""
        committed = [s for s in self.steps() if os.path.exists(os.path.join(self.path, str(s), layout.MANIFEST))]
        keep = set(committed if self.config.keep_last is None else committed[-self.config.keep_last :])
        if self.config.keep_every:
            keep |= {s for s in committed if s % self.config.keep_every == 0}
        for s in committed:
            if s not in keep:
                _remove(os.path.join(self.path, str(s)))
        for name in os.listdir(self.path):
            stale_partial = layout.PARTIAL in name and f"-{self._nonce}-" not in name
            if stale_partial or name.endswith(layout.DELETING):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)

    # -- reading ------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first. A partial save is never listed."""
        if _is_orbax_single(self.path):
            return [0]
        if not os.path.isdir(self.path):
            return []
        return sorted(
            int(n)
            for n in os.listdir(self.path)
            if layout.STEP_DIR.match(n) and os.path.isdir(os.path.join(self.path, n))
        )

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def open_step(self, step: int | None = None):
        step = self._resolve(step)
        step_dir = self.path if _is_orbax_single(self.path) else os.path.join(self.path, str(step))
        return sources.open_step(step_dir, step)

    def metadata(self, step: int | None = None) -> dict:
        """Step, plan, caller metadata (data position, fingerprint, ...) and every leaf's path,
        global shape, dtype and saved sharding, without reading any array data."""
        src = self.open_step(step)
        return {
            "kind": src.kind,
            "step": src.step,
            "plan": src.plan,
            "meta": src.meta,
            "dir": src.dir,
            "leaves": [
                {
                    "path": l.path,
                    "shape": list(l.shape),
                    "dtype": l.dtype.name,
                    "chunk_shape": list(l.chunk_shape),
                    "sharding": l.saved_sharding,
                }
                for l in src.leaves.values()
            ],
            "files": getattr(src, "manifest", {}).get("files", {}),
        }

    def restore(
        self,
        step: int | None = None,
        *,
        target: Any,
        include: Sequence[str] | None = None,
        cast: Cast = Cast.EXACT,
        rules: Sequence[Rule] = (),
    ) -> Any:
        """Restore onto `target`, a pytree of jax.ShapeDtypeStruct (or arrays) carrying the new
        shardings; each process reads only the boxes its devices hold. A leaf without a sharding
        is restored whole onto this process's first device.

        include: glob patterns on leaf paths (`params/*`); target leaves that match none are
            returned as given, so a fresh state can take only its parameters from a checkpoint.
        cast: what may happen when the target's dtype differs from the saved one.
        rules: `Rename`, `Stack`, `Unstack` mappings from target leaves to saved leaves.
        `restore_with_stats` also says what the restore read and took."""
        return self.restore_with_stats(step, target=target, include=include, cast=cast, rules=rules)[0]

    def restore_with_stats(
        self,
        step: int | None = None,
        *,
        target: Any,
        include: Sequence[str] | None = None,
        cast: Cast = Cast.EXACT,
        rules: Sequence[Rule] = (),
    ) -> tuple[Any, RestoreStats]:
        """`restore`, and its statistics: bytes needed and read, seconds, and the step's metadata.

        >>> state, stats = store.restore_with_stats(target=target)
        >>> stats.read_amplification, stats.meta["data_position"]"""
        return reader.restore(self.open_step(step), target, include=include, cast=cast, rules=rules)

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read every stored byte of a step and check it: file sizes, metadata checksums, and the
        crc32c of every chunk. Corruption is reported per leaf and chunk, never raised."""
        t = time.perf_counter()
        try:
            src = self.open_step(step)
        except CheckpointFormatError as e:
            return VerifyReport(self._resolve(step), "unknown", False, [str(e)], 0, time.perf_counter() - t)
        problems = src.check_files()
        checked = 0
        for path, info in src.leaves.items():
            arr = src.open(path)
            for box in src.shard_boxes(path):
                try:
                    checked += arr[box].read().result().nbytes
                except ValueError as e:
                    problems.append(
                        str(sources.corrupt_error(src, info, e))
                        if sources.is_data_loss(e)
                        else f"leaf {path}: could not be read: {e}"
                    )
        return VerifyReport(src.step, src.kind, not problems, problems, checked, time.perf_counter() - t)

    def quarantine(self, step: int) -> str:
        """Move a damaged step aside (`<step>.corrupt`), so restores and retention skip it but its
        bytes stay for inspection. Returns the new path."""
        src = os.path.join(self.path, str(step))
        dst = src + layout.CORRUPT
        n = 1
        while os.path.exists(dst):
            dst, n = f"{src}{layout.CORRUPT}{n}", n + 1
        os.rename(src, dst)
        layout.fsync_dir(self.path)
        return dst

    def close(self) -> None:
        self._writer.wait()

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.path}")
            return steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step {step} in {self.path}; committed steps: {steps}"
            )
        return step


def _is_orbax_single(path: str) -> bool:
    return os.path.exists(os.path.join(path, sources.ORBAX_METADATA))


def _remove(step_dir: str) -> None:
    # Rename first, so a crash mid-delete never leaves a half-deleted step that looks committed.
    doomed = step_dir + layout.DELETING
    os.rename(step_dir, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
