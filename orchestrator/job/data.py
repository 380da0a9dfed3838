"""Data that each host loads for itself.

A program's `data` is a random-access dataset: `data[i]` is example i of the job's global order, a
dict of numpy arrays (a Grain `MapDataset` is one, and so is anything with `__getitem__`). Step s
trains on examples `start + s * global_batch ...` of that order, so the examples a step sees do
not depend on how many hosts there are or which rows each holds, and a resume on any mesh goes on
with the same ones. Each process reads only the rows its devices hold (`HostBatches`).

`TokenFiles` is the built-in source: flat token files as nanoGPT and Megatron write them (raw
uint16/uint32, or `.npy`), memory-mapped, cut into fixed-length windows (documents packed as the
file holds them), shuffled with Grain's O(1) index shuffle, reshuffled every epoch.

    program = Program(init=init, step=step, data=TokenFiles(("train.bin",), seq_len=1024).dataset())
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

TOKEN_DTYPES = ("uint16", "uint32", "int32")


class DataError(ValueError):
    """A data source that cannot be read as configured: says what was expected and what was found."""


@dataclasses.dataclass(frozen=True)
class TokenFiles:
    """Flat token files, each a stream of documents already tokenized and concatenated.

    `paths`: raw token files (`dtype` says their integer width) or `.npy` arrays of one dimension.
    Example i is a window of `seq_len + 1` tokens: `inputs` its first `seq_len`, `targets` its
    last `seq_len`. Windows do not overlap and do not cross files. `eos`: a document separator
    token; when given, each example also has `segments`, the index of the document each input
    token belongs to within the window (for attention masks of packed documents)."""

    paths: tuple[str, ...]
    seq_len: int
    dtype: str = "uint16"
    seed: int = 0
    epochs: int | None = None  # None: repeat without end
    eos: int | None = None

    def __post_init__(self):
        if isinstance(self.paths, (str, os.PathLike)):
            object.__setattr__(self, "paths", (os.fspath(self.paths),))
        if not self.paths:
            raise DataError("TokenFiles needs at least one path")
        if self.dtype not in TOKEN_DTYPES:
            raise DataError(f"TokenFiles dtype must be one of {TOKEN_DTYPES}, got {self.dtype!r}")
        if self.seq_len < 1:
            raise DataError(f"TokenFiles seq_len must be at least 1, got {self.seq_len}")

    def dataset(self, windows: Windows | None = None):
        """The examples as a Grain `MapDataset`: windows, shuffled, repeated. `windows`: the files'
        `Windows`, to count what is read."""
        import grain

        windows = windows or self.windows()
        ds = grain.MapDataset.source(windows).shuffle(seed=self.seed)
        ds = ds.repeat(self.epochs)
        return ds.map(_Example(self.seq_len, self.eos))

    def windows(self) -> Windows:
        return Windows(self.paths, self.seq_len, self.dtype)


class Windows(Sequence):
    """Non-overlapping windows of `seq_len + 1` tokens over memory-mapped token files, in file
    order. Counts the bytes it reads (`bytes_read`), for the input benchmarks."""

    def __init__(self, paths: Sequence[str], seq_len: int, dtype: str = "uint16"):
        self.paths, self.seq_len, self.dtype = tuple(map(os.fspath, paths)), seq_len, dtype
        self._arrays: list[np.ndarray] | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0
        counts = [(_token_count(p, dtype) - 1) // seq_len for p in self.paths]
        if sum(counts) == 0:
            raise DataError(
                f"token files {list(self.paths)} hold no window of {seq_len + 1} tokens: "
                "give longer files or a shorter seq_len"
            )
        self._ends = list(np.cumsum(counts))

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        f = bisect.bisect_right(self._ends, index)
        start = (index - (self._ends[f - 1] if f else 0)) * self.seq_len
        window = np.array(self._open()[f][start : start + self.seq_len + 1])
        self.bytes_read += window.nbytes
        return window

    def _open(self) -> list[np.ndarray]:
        # Opened on first use, in the process that reads (a dataset is built on the driver and
        # may travel to hosts).
        with self._lock:
            if self._arrays is None:
                self._arrays = [_mapped(p, self.dtype) for p in self.paths]
        return self._arrays

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_arrays", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _arrays=None, _lock=threading.Lock())


@dataclasses.dataclass(frozen=True)
class _Example:
    seq_len: int
    eos: int | None

    def __call__(self, window: np.ndarray) -> dict[str, np.ndarray]:
        tokens = window.astype(np.int32)
        out = {"inputs": tokens[:-1], "targets": tokens[1:]}
        if self.eos is not None:
            # A document starts after each separator: the separator ends its own document.
            starts = np.concatenate([[0], (tokens[:-2] == self.eos).astype(np.int32)])
            out["segments"] = np.cumsum(starts, dtype=np.int32)
        return out


def _token_count(path: str, dtype: str) -> int:
    if not os.path.exists(path):
        raise DataError(f"token file {path} does not exist")
    if path.endswith(".npy"):
        array = np.load(path, mmap_mode="r")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise DataError(
                f"token file {path} holds a {array.dtype} array of shape {array.shape}; "
                "expected one dimension of integer token ids"
            )
        return int(array.shape[0])
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(
            f"token file {path} is {size} bytes, not a whole number of {dtype} tokens ({itemsize} bytes each): "
            "check TokenFiles(dtype=...) against how the file was written"
        )
    return size // itemsize


def _mapped(path: str, dtype: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype=dtype, mode="r")


def abstract_batch(data, global_batch: int):
    """Shapes and dtypes of a global batch: one example read, nothing built."""
    import jax

    example = data[0]
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((global_batch, *np.shape(x)), np.asarray(x).dtype), example)


def rows_held(shardings, shapes, devices=None) -> list[int]:
    """The global batch rows that `devices` (by default this process's) hold of any leaf, sorted."""
    import jax

    rows: set[int] = set()
    for sharding, shape in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)):
        mine = sharding.addressable_devices if devices is None else set(devices)
        for device, index in sharding.devices_indices_map(shape.shape).items():
            if device in mine:
                rows.update(range(*index[0].indices(shape.shape[0])))
    return sorted(rows)


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where a job's steps fall in the data's global order: step `first_step` begins at example
    `first_example` (where a restored job left off), and each step takes `global_batch`."""

    global_batch: int
    first_step: int = 0
    first_example: int = 0

    def example_index(self, step: int) -> int:
        """The global index of `step`'s first example."""
        return self.first_example + (step - self.first_step) * self.global_batch


class HostBatches:
    """Global batches of `data`, each process reading only the rows its devices hold. `shapes`:
    the abstract global batch, where the caller has it (else one example is read for it)."""

    def __init__(self, data, position: DataPosition, shardings, shapes=None):
        self.data, self.position, self.shardings = data, position, shardings
        self.shapes = shapes if shapes is not None else abstract_batch(data, position.global_batch)
        self.rows = rows_held(shardings, self.shapes)

    def host_rows(self, step: int) -> dict[int, Any]:
        """This process's rows of `step`'s global batch: row -> example."""
        start = self.position.example_index(step)
        return {r: self.data[start + r] for r in self.rows}

    def __call__(self, step: int):
        """`step`'s global batch as jax Arrays laid out by the shardings."""
        return self.assemble(self.host_rows(step))

    def assemble(self, held: dict[int, Any]):
        import jax

        leaves = {r: jax.tree.leaves(example) for r, example in held.items()}  # in `shapes`' leaf order

        def leaf(n, spec, sharding):
            def shard(index):
                rows = range(*index[0].indices(spec.shape[0]))
                block = np.stack([leaves[r][n] for r in rows]) if len(rows) else np.zeros((0, *spec.shape[1:]))
                return block.astype(spec.dtype, copy=False)[(slice(None), *index[1:])]

            return jax.make_array_from_callback(spec.shape, sharding, shard, dtype=spec.dtype)

        specs, treedef = jax.tree.flatten(self.shapes)
        shardings = treedef.flatten_up_to(self.shardings)
        return treedef.unflatten([leaf(n, spec, sh) for n, (spec, sh) in enumerate(zip(specs, shardings))])
