"""The on-disk format of one remesh checkpoint step, and how its arrays are chunked.

    <root>/<step>/remesh.json            manifest: versioned JSON, written last, checksummed
    <root>/<step>/arrays/<n>/zarr.json   one zarr3 array per leaf, keyed by global array, never by rank
    <root>/<step>/arrays/<n>/c/...       one file per saved shard

Each file holds one shard of the sharding the leaf was saved under (a replicated leaf is one file,
written once), split into small inner chunks by zarr3's `sharding_indexed` codec. Every inner
chunk and every shard index carries a crc32c, so TensorStore checks every byte it decodes; the
manifest records every file's size (a missing chunk would otherwise read as zeros) and a SHA-256 of
every array's metadata. Inner chunks are small and split every dimension, so a restore onto another
sharding reads little more than it needs.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import CheckpointFormatError

FORMAT = "remesh.checkpoint/2"
MANIFEST = "remesh.json"
ARRAYS = "arrays"
PARTIAL = ".partial"
DELETING = ".deleting"
CORRUPT = ".corrupt"
STEP_DIR = re.compile(r"^\d+$")

Box = tuple[slice, ...]


class Codec(enum.Enum):
    """How chunk bytes are encoded. Raw is the default: on a fast disk zstd costs several times the
    write throughput for little saving on float weights (see BENCHMARKS.md)."""

    RAW = "raw"
    ZSTD = "zstd"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one leaf is stored: the saved shard shape (one file each) and the inner chunk shape."""

    shape: tuple[int, ...]
    dtype: str
    shard_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        return self.chunk_shape != self.shard_shape

    def zarr_metadata(self, codec: Codec) -> dict:
        inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if codec is Codec.ZSTD:
            inner.append({"name": "zstd", "configuration": {"level": 1}})
        inner.append({"name": "crc32c"})
        if self.sharded:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk_shape),
                        "codecs": inner,
                        "index_location": "end",
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    },
                }
            ]
        else:
            codecs = inner
        return {
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard_shape)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codecs,
        }


# Degrees a restore commonly shards one dimension by (hosts lost or added, TP and FSDP degrees).
COMMON_DEGREES = (2, 3, 4, 6, 8)


def choose_layout(
    shape: tuple[int, ...],
    dtype: np.dtype,
    shard_shape: tuple[int, ...],
    chunk_bytes: int,
    sharded_dims: tuple[int, ...] = (),
) -> Layout:
    """Split the saved shard into inner chunks. First align: cut each dimension (the ones the save
    sharded first) so chunk edges fall on every boundary of a 2-, 3-, 4-, 6- or 8-way sharding of
    that dimension, as long as chunks stay above chunk_bytes / 16 (small chunks cost throughput) (a resharded restore then reads
    only what it needs). Then cut the largest dimension until a chunk is at most chunk_bytes."""
    shard_shape = tuple(max(int(d), 1) for d in shard_shape) if shape else ()
    chunk = list(shard_shape)
    itemsize = np.dtype(dtype).itemsize
    nbytes = lambda: math.prod(chunk) * itemsize
    order = sorted(range(len(chunk)), key=lambda i: (i not in sharded_dims, -chunk[i]))
    for i in order:
        aligned = math.gcd(chunk[i], shape[i] // math.lcm(*[k for k in COMMON_DEGREES if shape[i] % k == 0] or [1]))
        while chunk[i] > aligned and nbytes() // _smallest_prime_factor(chunk[i] // aligned) >= chunk_bytes // 16:
            chunk[i] //= _smallest_prime_factor(chunk[i] // aligned)
    while chunk and nbytes() > chunk_bytes:
        splittable = [i for i, c in enumerate(chunk) if c > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda j: (chunk[j], -j))
        chunk[i] //= _smallest_prime_factor(chunk[i])
    return Layout(tuple(int(d) for d in shape), np.dtype(dtype).name, shard_shape, tuple(chunk))


def _smallest_prime_factor(n: int) -> int:
    for p in range(2, math.isqrt(n) + 1):
        if n % p == 0:
            return p
    return n


def chunks_touched(box: Box, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> int:
    """How many inner chunks a read of `box` decodes (TensorStore reads whole inner chunks)."""
    count = 1
    for s, _dim, c in zip(_normalize(box, shape), shape, chunk_shape):
        if s.stop <= s.start:
            return 0
        count *= (s.stop - 1) // c - s.start // c + 1
    return count


def box_size(box: Box, shape: tuple[int, ...]) -> int:
    return math.prod(s.stop - s.start for s in _normalize(box, shape))


def _normalize(box: Box, shape: tuple[int, ...]) -> list[slice]:
    return [slice(*s.indices(d)[:2]) for s, d in zip(box, shape)]


def leaf_path(keypath: Iterable[Any]) -> str:
    """A pytree key path as a slash path: `params/layers/0/w`. Patterns and renames use this form."""
    parts = []
    for k in keypath:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def manifest_checksum(doc: dict) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_json_durably(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(step_dir: str) -> dict[str, int]:
    """Every file under the step's arrays, relative path -> size."""
    out = {}
    base = os.path.join(step_dir, ARRAYS)
    for root, _, files in os.walk(base):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, step_dir)] = os.path.getsize(full)
    return out


def read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"cannot read {what} {path}: {e}") from e


def read_manifest(step_dir: str) -> dict:
    path = os.path.join(step_dir, MANIFEST)
    doc = read_json(path, "the manifest")
    if doc.get("format") != FORMAT:
        raise CheckpointFormatError(f"{path} has format {doc.get('format')!r}; this remesh reads {FORMAT!r}")
    if doc.get("checksum") != manifest_checksum(doc):
        raise CheckpointFormatError(f"the manifest {path} does not match its checksum: it was altered or damaged")
    return doc
