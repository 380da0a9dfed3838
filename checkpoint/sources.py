"""Readable checkpoint steps: remesh's own format and plain Orbax layouts, behind one interface.

A step exposes its leaves (slash path -> shape, dtype, inner chunk shape), its metadata, and an
open TensorStore per leaf; the restore and verify code above it never asks which format it reads.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from . import layout
from .errors import CheckpointCorruptError, CheckpointFormatError

ORBAX_METADATA = "_METADATA"


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    location: str  # where its bytes live, for error messages
    saved_sharding: dict | None = None  # {"mesh": {...}, "spec": [...]} when saved by remesh


def _context() -> ts.Context:
    # A small chunk cache: when one chunk straddles two device boxes of this process, the second
    # box reuses the decoded chunk instead of reading it from disk again. Boxes of one leaf are
    # read one after another, so a cache of a few chunks' size is enough.
    return ts.Context({"cache_pool": {"total_bytes_limit": CHUNK_CACHE_BYTES}})


CHUNK_CACHE_BYTES = 32 << 20


class RemeshStep:
    kind = "remesh"

    def __init__(self, step_dir: str, step: int):
        self.dir, self.step = step_dir, step
        self.manifest = layout.read_manifest(step_dir)
        self.leaves = {
            l["path"]: LeafInfo(
                l["path"],
                tuple(l["shape"]),
                _dtype(l["dtype"]),
                tuple(l["chunk_shape"]),
                os.path.join(layout.ARRAYS, l["array"]),
                l.get("sharding"),
            )
            for l in self.manifest["leaves"]
        }
        self._arrays = {l["path"]: l for l in self.manifest["leaves"]}
        self._opened: dict[str, Any] = {}
        self._ctx = _context()

    @property
    def meta(self) -> dict:
        return self.manifest["meta"]

    @property
    def plan(self) -> dict | None:
        return self.manifest["plan"]

    def check_files(self, only: set[str] | None = None) -> list[str]:
        """Cheap structural checks (no data read): every file present (or every file in `only`,
        those a restore opens: `files_read`), of its recorded size, and every array's metadata
        as written. Returns the problems found."""
        problems = []
        for rel, want in self.manifest["files"].items():
            if only is not None and rel not in only:
                continue
            full = os.path.join(self.dir, rel)
            try:
                size = os.path.getsize(full)
            except OSError:
                problems.append(f"{self._owner(rel)}: file {rel} is missing")
                continue
            if size != want["size"]:
                problems.append(f"{self._owner(rel)}: file {rel} holds {size} bytes, {want['size']} were written")
            elif "sha256" in want and layout.sha256_file(full) != want["sha256"]:
                problems.append(f"{self._owner(rel)}: metadata file {rel} does not match its checksum")
        return problems

    def open(self, path: str):
        if path not in self._opened:
            entry = self._arrays[path]
            self._opened[path] = ts.open(
                {
                    "driver": "zarr3",
                    "kvstore": {"driver": "file", "path": os.path.join(self.dir, layout.ARRAYS, entry["array"])},
                    "open": True,
                },
                context=self._ctx,
                read=True,
            ).result()
        return self._opened[path]

    def files_read(self, path: str, boxes: Sequence[tuple] | None = None) -> set[str]:
        """The files a read of leaf `path` opens: its array's metadata and the chunk files that
        the boxes ((start, stop) per dimension) overlap; every chunk file where `boxes` is None."""
        base = os.path.join(layout.ARRAYS, self._arrays[path]["array"])
        chunk, shape = self.leaves[path].chunk_shape, self.leaves[path].shape
        if boxes is None:
            boxes = [tuple((0, d) for d in shape)]
        out = {os.path.join(base, "zarr.json")}
        for box in boxes:
            spans = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunk)]
            out.update(os.path.join(base, "c", *map(str, grid)) for grid in itertools.product(*spans))
        return out

    def shard_boxes(self, path: str) -> list[layout.Box]:
        """The saved shards (one file each), for verification a file at a time."""
        info = self.leaves[path]
        shard = self._arrays[path]["shard_shape"]
        return _grid(info.shape, tuple(shard))

    def _owner(self, rel: str) -> str:
        for path, entry in self._arrays.items():
            if rel.startswith(os.path.join(layout.ARRAYS, entry["array"]) + os.sep):
                return f"leaf {path}"
        return "checkpoint"


class OrbaxStep:
    """A checkpoint written by plain Orbax (`StandardCheckpointer`, or one item of a
    `CheckpointManager` step). Orbax stores no data checksums; verify can only read every byte."""

    kind = "orbax"

    def __init__(self, item_dir: str, step: int, meta: dict | None = None):
        self.dir, self.step = item_dir, step
        doc = layout.read_json(os.path.join(item_dir, ORBAX_METADATA), "Orbax's tree metadata")
        self._use_ocdbt = doc.get("use_ocdbt", True)
        self._driver = "zarr3" if doc.get("use_zarr3") else "zarr"
        self._names: dict[str, str] = {}
        for key, entry in doc["tree_metadata"].items():
            keys = (
                [str(k["key"]) for k in entry["key_metadata"]]
                if "key_metadata" in entry
                else list(ast.literal_eval(key))
            )
            if entry.get("value_metadata", {}).get("skip_deserialize"):
                continue
            self._names["/".join(keys)] = ".".join(keys)
        self._ctx = _context()
        self._opened: dict[str, Any] = {}
        self.meta = dict(meta or {})
        self.plan = None
        self.leaves = {}
        for p in self._names:
            arr = self.open(p)
            chunk = arr.chunk_layout.read_chunk.shape
            self.leaves[p] = LeafInfo(
                p,
                tuple(arr.shape),
                arr.dtype.numpy_dtype,
                tuple(chunk) if chunk is not None else tuple(arr.shape),
                self._names[p],
            )

    def check_files(self, only: set[str] | None = None) -> list[str]:
        return []  # OCDBT checks its own manifests when opened; data has no checksums

    def files_read(self, path: str, boxes: Sequence[tuple] | None = None) -> set[str]:
        return set()

    def open(self, path: str):
        if path not in self._opened:
            name = self._names[path]
            if self._use_ocdbt:
                kv = {"driver": "ocdbt", "base": f"file://{self.dir}", "path": name}
            else:
                kv = {"driver": "file", "path": os.path.join(self.dir, name)}
            self._opened[path] = ts.open(
                {"driver": self._driver, "kvstore": kv, "open": True}, context=self._ctx, read=True
            ).result()
        return self._opened[path]

    def shard_boxes(self, path: str) -> list[layout.Box]:
        info = self.leaves[path]
        return [tuple(slice(0, d) for d in info.shape)]


def open_step(step_dir: str, step: int):
    """The readable step in `step_dir`: remesh's manifest, an Orbax step, or an Orbax item."""
    if os.path.exists(os.path.join(step_dir, layout.MANIFEST)):
        return RemeshStep(step_dir, step)
    if os.path.exists(os.path.join(step_dir, ORBAX_METADATA)):
        return OrbaxStep(step_dir, step)
    items = sorted(d for d in os.listdir(step_dir) if os.path.exists(os.path.join(step_dir, d, ORBAX_METADATA)))
    if not items:
        raise CheckpointFormatError(
            f"{step_dir} is neither a remesh checkpoint ({layout.MANIFEST}) nor an Orbax checkpoint "
            f"({ORBAX_METADATA} in it or in one item directory); it contains {sorted(os.listdir(step_dir))[:8]}"
        )
    item = "state" if "state" in items else "default" if "default" in items else items[0] if len(items) == 1 else None
    if item is None:
        raise CheckpointFormatError(
            f"the Orbax step {step_dir} has several array items {items}; remesh restores an item named "
            "'state' or 'default', or the only one. Rename the item directory you want to 'state'"
        )
    return OrbaxStep(os.path.join(step_dir, item), step, meta=_orbax_json_meta(step_dir))


def _orbax_json_meta(step_dir: str) -> dict:
    """The caller metadata of steps written by remesh 0.1 on Orbax (a JSON item `meta`)."""
    path = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return dict(doc.get("meta", {})) if isinstance(doc, dict) else {}


def is_data_loss(exc: BaseException) -> bool:
    """TensorStore's word for bytes that fail their checksum or cannot be decoded."""
    return "DATA_LOSS" in str(exc)


def corrupt_error(step, info: LeafInfo, exc: BaseException) -> CheckpointCorruptError:
    """TensorStore names the file and the inner chunk; say which leaf, step and chunk that is."""
    text = str(exc)
    where = ""
    file = re.search(r'local file "([^"]+)"', text)
    if file:
        rel = os.path.relpath(file.group(1), step.dir)
        coords = rel.split(f"{os.sep}c{os.sep}", 1)[-1].split(os.sep) if f"{os.sep}c{os.sep}" in rel else []
        where = f", chunk ({', '.join(coords)}) in file {rel}" if coords else f", file {rel}"
    entry = re.search(r"shard entry (\{[^}]*\})/(\{[^}]*\})", text)
    if entry:
        where += f", inner chunk {entry.group(1)} of {entry.group(2)}"
    return CheckpointCorruptError(
        f"checkpoint step {step.step} in {step.dir}: leaf {info.path}{where} failed its checksum ({text}). "
        "Restore an earlier step: `remesh ckpt verify` says which verify"
    )


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))  # bfloat16 and friends are ml_dtypes types


def _grid(shape: tuple[int, ...], shard: tuple[int, ...]) -> list[layout.Box]:
    if not shape:
        return [()]
    ranges = [range(0, d, s) for d, s in zip(shape, shard)]
    return [
        tuple(slice(o, min(o + s, d)) for o, s, d in zip(origin, shard, shape)) for origin in itertools.product(*ranges)
    ]
