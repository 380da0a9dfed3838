"""Saving: a snapshot of device buffers (the only part that blocks training), then a background
write and an atomic commit.

Every process writes the shards it holds replica 0 of, so a replicated shard is written once.
Process 0 writes every array's metadata, waits until every process has written its shards (through
the `jax.distributed` key-value store, which needs no device collective and so can be used from a
background thread), writes the manifest last and renames the step's `.partial` directory into place.
A crash at any point before that rename leaves only a `.partial` directory, which readers ignore.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from . import layout
from .errors import CheckpointFormatError


@dataclasses.dataclass
class HostCopy:
    path: str
    layout: layout.Layout
    sharding: dict | None
    pieces: list[tuple[layout.Box, np.ndarray]]  # (global index box, host copy) this process writes
    prng_impl: str | None = None


def copy_to_host(state: Any, chunk_bytes: int) -> list[HostCopy]:
    """Copy this process's replica-0 shards to host memory. Copies are started for every leaf
    before any is awaited, so on accelerators they overlap."""
    started = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        path, impl = layout.leaf_path(keypath), None
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array):
            shard_shape = leaf.sharding.shard_shape(leaf.shape)
            pieces = [(s.index, s.data) for s in leaf.addressable_shards if s.replica_id == 0]
            for _, data in pieces:
                data.copy_to_host_async()
            sharding = _describe(leaf.sharding)
        else:
            leaf = np.asarray(leaf)
            shard_shape, sharding = leaf.shape, None
            pieces = [(tuple(slice(0, d) for d in leaf.shape), leaf)] if jax.process_index() == 0 else []
        sharded = tuple(i for i, (d, s) in enumerate(zip(leaf.shape, shard_shape)) if s < d)
        lay = layout.choose_layout(tuple(leaf.shape), leaf.dtype, tuple(shard_shape), chunk_bytes, sharded)
        started.append(HostCopy(path, lay, sharding, pieces, impl))
    for snap in started:
        snap.pieces = [(_full(box, snap.layout.shape), np.array(data, copy=True)) for box, data in snap.pieces]
    return started


def check_savable(abstract_state: Any, chunk_bytes: int = 4 << 20, codec: layout.Codec = layout.Codec.RAW) -> None:
    """Everything a save does to a state short of copying it, on shapes alone: each leaf's path
    (unique), its stored form (typed PRNG keys as their key data), its layout, and an empty array of
    that layout created in memory by the storage driver. Raises CheckpointFormatError naming the
    leaf, so a state that cannot be saved is refused before any host trains on it."""
    seen: dict[str, str] = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        path, where = layout.leaf_path(keypath), jax.tree_util.keystr(keypath)
        if path in seen:
            raise CheckpointFormatError(
                f"state leaves {seen[path]} and {where} would both be saved as {path!r}: "
                "rename one (checkpoint paths join the keys with '/')"
            )
        seen[path] = where
        try:
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.eval_shape(jax.random.key_data, leaf)
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
            lay = layout.choose_layout(shape, dtype, shape, chunk_bytes)
            ts.open(
                {"driver": "zarr3", "kvstore": "memory://", "metadata": lay.zarr_metadata(codec)}, create=True
            ).result()
        except (TypeError, ValueError) as e:
            raise CheckpointFormatError(
                f"state leaf {path} ({leaf.dtype}{list(leaf.shape)}) cannot be saved: {e}. Keep arrays of numeric, "
                "bool or typed PRNG key dtypes in the state"
            ) from e


def _full(box, shape) -> layout.Box:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(box, shape))


def _describe(sharding) -> dict:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return {"mesh": dict(sharding.mesh.shape), "spec": spec}
    return {"kind": type(sharding).__name__, "devices": len(sharding.device_set)}


@dataclasses.dataclass(frozen=True)
class SaveJob:
    root: str
    step: int
    leaves: list[HostCopy]
    plan: dict | None
    meta: dict
    codec: layout.Codec
    sequence: int  # the same on every process: the n-th save of this store
    nonce: str  # the same on every process of one group; new for every group


class Writer:
    """Runs one save at a time in a background thread; `wait` re-raises its failure."""

    def __init__(self, *, on_commit: Callable[[int], None], commit_timeout_s: float):
        self._on_commit = on_commit
        self._timeout_ms = int(commit_timeout_s * 1000)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": True})
        self.last_seconds: float | None = None

    def start(self, job: SaveJob, background: bool) -> None:
        self.wait()
        if background:
            self._thread = threading.Thread(target=self._run, args=(job,), name=f"remesh-save-{job.step}", daemon=True)
            self._thread.start()
        else:
            self._run(job)
            self.wait()

    @property
    def busy(self) -> bool:
        """A save is being written (in the background)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self, job: SaveJob) -> None:
        t = time.perf_counter()
        try:
            partial = os.path.join(job.root, f"{job.step}{layout.PARTIAL}-{job.nonce}-{job.sequence}")
            failure = None
            try:
                self._write_arrays(job, partial)
            except BaseException as e:  # tell process 0, so it does not commit a step missing our shards
                failure = e
            _signal(job, "error: " + repr(failure) if failure else "ok")
            if jax.process_index() == 0:
                try:
                    if failure:
                        raise failure
                    _await_peers(job, self._timeout_ms)
                    _commit(job, partial)
                except BaseException:
                    _discard(job, partial, self._timeout_ms)
                    raise
            elif failure:
                raise failure
            self.last_seconds = time.perf_counter() - t  # written and committed; retention is extra
            if jax.process_index() == 0:
                self._on_commit(job.step)
        except BaseException as e:
            self._error = e

    def _write_arrays(self, job: SaveJob, partial: str) -> None:
        os.makedirs(os.path.join(partial, layout.ARRAYS), exist_ok=True)
        pending = []
        for n, leaf in enumerate(job.leaves):
            spec = {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": os.path.join(partial, layout.ARRAYS, _array_name(n))},
                "metadata": leaf.layout.zarr_metadata(job.codec),
            }
            if jax.process_index() == 0:  # the .partial directory is new: stale ones are removed at open
                spec.update(create=True, open=True)
            else:
                spec.update(assume_metadata=True)
            if not leaf.pieces and jax.process_index() != 0:
                continue
            arr = ts.open(spec, context=self._ctx, write=True).result()
            pending += [arr[box].write(data) for box, data in leaf.pieces]
        for future in pending:
            future.result()


def _array_name(n: int) -> str:
    return f"{n:05d}"


def _kv_key(job: SaveJob, process: int) -> str:
    root = hashlib.sha1(job.root.encode()).hexdigest()[:12]
    return f"remesh/ckpt/{root}/{job.nonce}/{job.sequence}/{process}"


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _signal(job: SaveJob, status: str) -> None:
    if jax.process_count() > 1:
        _client().key_value_set(_kv_key(job, jax.process_index()), status)


def _await_peers(job: SaveJob, timeout_ms: int) -> None:
    for p in range(1, jax.process_count()):
        status = _client().blocking_key_value_get(_kv_key(job, p), timeout_ms)
        if status != "ok":
            raise RuntimeError(
                f"process {p} failed to write its shards of step {job.step}: {status}; the step was not committed"
            )


def _discard(job: SaveJob, partial: str, timeout_ms: int) -> None:
    """A save that failed on some process (a full disk, say) is never committed; once every process
    has said it is done writing, its partial directory goes, freeing what it took."""
    for p in range(1, jax.process_count()):
        try:
            _client().blocking_key_value_get(_kv_key(job, p), timeout_ms)
        except Exception:  # noqa: BLE001 (a process that never answers: leave its leftovers to the next commit)
            return
    shutil.rmtree(partial, ignore_errors=True)


def _commit(job: SaveJob, partial: str) -> None:
    files = {rel: {"size": size} for rel, size in layout.list_files(partial).items()}
    for rel, entry in files.items():
        if rel.endswith("zarr.json"):
            entry["sha256"] = layout.sha256_file(os.path.join(partial, rel))
    doc = {
        "format": layout.FORMAT,
        "step": job.step,
        "created_at": time.time(),
        "processes": jax.process_count(),
        "codec": job.codec.value,
        "plan": job.plan,
        "meta": job.meta,
        "files": files,
        "leaves": [
            {
                "path": l.path,
                "array": _array_name(n),
                "shape": list(l.layout.shape),
                "dtype": l.layout.dtype,
                "shard_shape": list(l.layout.shard_shape),
                "chunk_shape": list(l.layout.chunk_shape),
                "sharding": l.sharding,
                **({"prng_impl": l.prng_impl} if l.prng_impl else {}),
            }
            for n, l in enumerate(job.leaves)
        ],
    }
    doc["checksum"] = layout.manifest_checksum(doc)
    for root, _, _ in os.walk(partial, topdown=False):
        layout.fsync_dir(root)  # file data is synced by TensorStore; make the names durable too
    layout.write_json_durably(os.path.join(partial, layout.MANIFEST), doc)
    layout.fsync_dir(partial)
    final = os.path.join(job.root, str(job.step))
    if os.path.exists(final):  # the same step saved again: replace it, never leave neither
        old = final + layout.DELETING
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    layout.fsync_dir(job.root)
