"""Train-state snapshots in host memory: taken from the devices as pieces, restored like a step.

    index, arrays = snapshot.take(state)            # this process's pieces: one replica of each shard
    index = snapshot.seal(index, arrays)            # each piece's crc32, off the training thread
    step = snapshot.MemoryStep(step, meta, indexes, fetch)
    state, stats = checkpoint.restore_step(step, target)   # onto any plan, like a saved step

A piece is one device shard of one leaf, held by no one but the process that took it; the pieces
of all processes cover every leaf once. Where the pieces are kept (another host's memory, say) is
the caller's business: `MemoryStep` only asks `fetch` for them, in batches, and checks each one's
crc32 when it arrives, so a piece damaged or mixed up on the way fails like a corrupt checkpoint.
"""

from __future__ import annotations

import collections
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import layout
from .errors import CheckpointCorruptError
from .sources import LeafInfo, _dtype

PieceKey = tuple[int, int]  # (the process that took it, its number in that process's index)


def take(state: Any, index: dict | None = None) -> tuple[dict, list[np.ndarray]]:
    """This process's pieces of `state`: a copy on the host of every addressable shard that is
    replica 0 of its box, and an index saying which leaf and box each is. Blocks until the state
    is computed; the copies are the caller's (the state may be donated right after). `index`: the
    one an earlier `take` of a state laid out the same returned, so it is not made again."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    values = [jax.random.key_data(x) if _is_key(x) else x for _, x in flat]
    shards = [[s.data for s in x.addressable_shards if s.replica_id == 0] for x in values]
    for group in shards:  # every copy under way before the first is waited on
        for data in group:
            data.copy_to_host_async()
    # Copies: on CPU np.asarray would alias a buffer the next step donates.
    arrays = [np.array(data) for group in shards for data in group]
    return index or _index(flat, values), arrays


def _index(flat: list, values: list) -> dict:
    leaves, pieces = {}, []
    for (keypath, _), x in zip(flat, values):
        path = layout.leaf_path(keypath)
        leaves[path] = {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
        for s in x.addressable_shards:
            if s.replica_id == 0:
                pieces.append({"path": path, "box": [list(sl.indices(d)[:2]) for sl, d in zip(s.index, x.shape)]})
    return {"leaves": leaves, "pieces": pieces}


def seal(index: dict, arrays: Sequence[np.ndarray]) -> dict:
    """The index with each piece's crc32 (its bytes as taken), checked when it is read back."""
    pieces = [{**p, "crc32": _crc(a)} for p, a in zip(index["pieces"], arrays)]
    return {**index, "pieces": pieces}


class MemoryStep:
    """A snapshot taken by every process of a group, readable like a checkpoint step (sources.py).

    `indexes`: process -> its sealed index. `fetch(keys)` returns the pieces named by (process,
    piece number) keys, in order; it is called once per batch of reads, not once per box."""

    kind = "memory"

    def __init__(
        self,
        step: int,
        meta: dict,
        indexes: dict[int, dict],
        fetch: Callable[[list[PieceKey]], list[np.ndarray]],
        where: str = "host memory",
    ):
        self.step, self.dir, self.plan = step, where, None
        self.meta = dict(meta)
        self._fetch = fetch
        self.leaves: dict[str, LeafInfo] = {}
        self._pieces: dict[str, list[tuple[PieceKey, tuple, int]]] = collections.defaultdict(list)
        for process, index in sorted(indexes.items()):
            for path, leaf in index["leaves"].items():
                shape = tuple(leaf["shape"])
                self.leaves.setdefault(path, LeafInfo(path, shape, _dtype(leaf["dtype"]), shape, where))
            for n, p in enumerate(index["pieces"]):
                self._pieces[p["path"]].append(((process, n), tuple(map(tuple, p["box"])), p["crc32"]))
        self._crc = {key: crc for pieces in self._pieces.values() for key, _, crc in pieces}
        self._wanted: dict[PieceKey, int] = collections.Counter()  # reads issued and not finished
        self._held: dict[PieceKey, np.ndarray] = {}

    def check_files(self, only: set[str] | None = None) -> list[str]:
        return []  # no files: each piece's crc32 is checked as it arrives

    def files_read(self, path: str, boxes: Sequence[tuple] | None = None) -> set[str]:
        return set()

    def open(self, path: str) -> _Leaf:
        return _Leaf(self, path)

    def _overlapping(self, path: str, box: tuple) -> list[tuple[PieceKey, tuple, int]]:
        return [p for p in self._pieces[path] if all(a < d and c < b for (a, b), (c, d) in zip(box, p[1]))]

    def _issue(self, path: str, box: tuple) -> None:
        for key, _, _ in self._overlapping(path, box):
            self._wanted[key] += 1

    def _assemble(self, path: str, box: tuple) -> np.ndarray:
        """The box of leaf `path`, copied out of the pieces that overlap it (fetched in one batch
        with every other read issued so far)."""
        missing = [k for k in self._wanted if k not in self._held]
        if missing:
            for key, value in zip(missing, self._fetch(missing)):
                if _crc(value) != self._crc[key]:
                    raise CheckpointCorruptError(
                        f"snapshot step {self.step} in {self.dir}: piece {key[1]} of process {key[0]} fails its "
                        "crc32; the job falls back to the newest committed checkpoint"
                    )
                self._held[key] = value
        info = self.leaves[path]
        out = np.empty([b - a for a, b in box], info.dtype)
        covered = 0
        for key, pbox, _ in self._overlapping(path, box):
            cut = tuple(slice(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, pbox))
            dst = tuple(slice(s.start - a, s.stop - a) for s, (a, _) in zip(cut, box))
            src = tuple(slice(s.start - c, s.stop - c) for s, (c, _) in zip(cut, pbox))
            out[dst] = self._held[key].reshape([d - c for c, d in pbox])[src]
            covered += math.prod(s.stop - s.start for s in cut)
            self._wanted[key] -= 1
            if self._wanted[key] == 0:  # no read left that needs it: let it go
                del self._wanted[key], self._held[key]
        if covered != out.size:
            raise CheckpointCorruptError(
                f"snapshot step {self.step} in {self.dir}: leaf {path} box {list(box)} is covered by {covered} of "
                f"its {out.size} elements; the snapshot is incomplete"
            )
        return out


class _Leaf:
    def __init__(self, step: MemoryStep, path: str):
        self._step, self._path = step, path

    def __getitem__(self, index: tuple) -> _Read:
        if not all(isinstance(s, slice) for s in index):
            raise TypeError(f"a snapshot leaf is read by boxes of slices, got {index!r}")
        shape = self._step.leaves[self._path].shape
        return _Read(self._step, self._path, tuple(tuple(s.indices(d)[:2]) for s, d in zip(index, shape)))


class _Read:
    """TensorStore's read-then-result shape: `read()` says the box will be wanted (so one fetch
    serves every box issued before the first `result()`), `result()` assembles it."""

    def __init__(self, step: MemoryStep, path: str, box: tuple):
        self._step, self._path, self._box = step, path, box

    def read(self) -> _Read:
        self._step._issue(self._path, self._box)
        return self

    def result(self) -> np.ndarray:
        return self._step._assemble(self._path, self._box)


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
