"""Restore: read exactly the boxes this process's devices need under the target shardings.

The target says everything: each leaf's shape, dtype and sharding under the new plan. For every
addressable device the reader asks TensorStore for that device's box of the saved global array
(resharding happens here, at load time, whatever the saved plan was), through optional mapping
rules (renamed leaves; per-layer leaves stacked into one scanned leaf and back) and an explicit
dtype policy. Reads are pipelined under a byte budget so host memory stays near what the
process must hold anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import enum
import fnmatch
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from . import layout
from .errors import CheckpointCorruptError, CheckpointTargetError
from .sources import LeafInfo, corrupt_error, is_data_loss


class Cast(enum.Enum):
    """What a restore may do when the target's dtype differs from the saved one."""

    EXACT = "exact"  # nothing: any difference is an error
    WIDEN = "widen"  # lossless widening within a kind (bfloat16 -> float32, int8 -> int32)
    LOSSY = "lossy"  # any cast within a kind, such as float32 -> bfloat16; int <-> float never


@dataclasses.dataclass(frozen=True)
class Rename:
    """Target leaves whose path fully matches the regex `target` read the saved leaf `source`, a
    format string filled with the regex's named groups.

        Rename(r"params/(?P<rest>.*)", "model/{rest}")"""

    target: str
    source: str


@dataclasses.dataclass(frozen=True)
class Stack:
    """A target leaf that stacks saved per-layer leaves along `axis` (a scanned model restored from
    an unrolled one); `source` has `{i}`, the layer, and the regex's named groups.

        Stack(r"params/layers/(?P<name>.*)", "params/layer_{i}/{name}")"""

    target: str
    source: str
    axis: int = 0


@dataclasses.dataclass(frozen=True)
class Unstack:
    """A per-layer target leaf read from one saved stacked leaf at index `i` (a named group) of `axis`.

    Unstack(r"params/layer_(?P<i>\\d+)/(?P<name>.*)", "params/layers/{name}")"""

    target: str
    source: str
    axis: int = 0


Rule = Rename | Stack | Unstack


@dataclasses.dataclass(frozen=True)
class RestoreStats:
    step: int
    seconds: float
    leaves: int
    bytes_needed: int  # saved bytes of the unique boxes this process's devices hold
    bytes_read: int  # bytes TensorStore read from files (data, indexes, metadata)
    meta: dict = dataclasses.field(default_factory=dict)  # what the step recorded: data position, seed, ...

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@dataclasses.dataclass
class _LeafRead:
    """How one target leaf is made from saved leaves."""

    path: str
    shape: tuple  # of the target's data (keys: their key data)
    dtype: np.dtype
    sharding: Any
    sources: list[LeafInfo]
    mode: str  # "leaf", "stack", "unstack"
    axis: int = 0
    index: int = 0
    prng_impl: Any = None


def restore(
    step,
    target: Any,
    *,
    include: Sequence[str] | None = None,
    cast: Cast = Cast.EXACT,
    rules: Sequence[Rule] = (),
    budget_bytes: int | None = None,
) -> tuple[Any, RestoreStats]:
    t0 = time.perf_counter()
    read0 = _bytes_read()
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    reads, problems = [], []
    for keypath, leaf in flat:
        path = layout.leaf_path(keypath)
        if include is not None and not any(fnmatch.fnmatchcase(path, p) for p in include):
            reads.append(None)
            continue
        try:
            reads.append(_plan_leaf(step, path, leaf, getattr(leaf, "sharding", None) or local, rules, cast))
        except CheckpointTargetError as e:
            problems.append(str(e))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointTargetError(
            f"cannot restore step {step.step} from {step.dir} onto this target: " + "; ".join(problems[:5]) + more
        )
    broken = step.check_files(_files_read(step, [r for r in reads if r is not None]))
    if broken:
        raise CheckpointCorruptError(f"checkpoint step {step.step} in {step.dir} is damaged: " + "; ".join(broken[:5]))
    values, needed = _read_all(step, [r for r in reads if r is not None], budget_bytes)
    it = iter(values)
    out = [leaf if r is None else next(it) for (_, leaf), r in zip(flat, reads)]
    stats = RestoreStats(
        step.step, time.perf_counter() - t0, len(values), needed, _bytes_read() - read0, dict(step.meta)
    )
    return jax.tree_util.tree_unflatten(treedef, out), stats


def _plan_leaf(step, path: str, leaf: Any, sharding, rules: Sequence[Rule], cast: Cast) -> _LeafRead:
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype) if not _is_key(leaf) else None
    impl = None
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, leaf.dtype))
        # The key dtype knows its implementation; jax.random.key_impl wants a concrete array.
        impl, shape, dtype = leaf.dtype._impl, tuple(data.shape), np.dtype(data.dtype)
        sharding = _data_sharding(sharding)
    rule, match = next(((r, m) for r in rules if (m := re.fullmatch(r.target, path))), (None, None))
    groups = match.groupdict() if match else {}
    if rule is None or isinstance(rule, Rename):
        src = _source(step, rule.source.format(**groups) if rule else path, path)
        _check_shape(path, shape, src.shape, src)
        read = _LeafRead(path, shape, dtype, sharding, [src], "leaf")
    elif isinstance(rule, Stack):
        axis = rule.axis % max(len(shape), 1)
        srcs = [_source(step, rule.source.format(i=i, **groups), path) for i in range(shape[axis])]
        for s in srcs:
            _check_shape(path, shape[:axis] + shape[axis + 1 :], s.shape, s)
        read = _LeafRead(path, shape, dtype, sharding, srcs, "stack", axis=axis)
    else:
        if "i" not in groups:
            raise CheckpointTargetError(f"Unstack rule {rule.target!r} must name the layer index as (?P<i>...)")
        src = _source(step, rule.source.format(**groups), path)
        axis = rule.axis % max(len(src.shape), 1)
        index = int(groups["i"])
        _check_shape(path, shape, src.shape[:axis] + src.shape[axis + 1 :], src)
        if index >= src.shape[axis]:
            raise CheckpointTargetError(
                f"leaf {path}: index {index} is past the {src.shape[axis]} layers of {src.path}"
            )
        read = _LeafRead(path, shape, dtype, sharding, [src], "unstack", axis=axis, index=index)
    for s in read.sources:
        _check_dtype(path, dtype, s, cast)
    read.prng_impl = impl
    return read


def _source(step, source_path: str, target_path: str) -> LeafInfo:
    if source_path in step.leaves:
        return step.leaves[source_path]
    near = difflib.get_close_matches(source_path, list(step.leaves), n=3)
    via = f" (mapped from {target_path})" if source_path != target_path else ""
    raise CheckpointTargetError(
        f"leaf {source_path}{via} is not in the checkpoint; nearest saved leaves: {near or sorted(step.leaves)[:3]}. "
        "Restore a subset with include=..., or map renamed or restacked leaves with rules=[Rename|Stack|Unstack]"
    )


def _check_shape(path: str, want: tuple, have: tuple, src: LeafInfo) -> None:
    if tuple(want) != tuple(have):
        raise CheckpointTargetError(
            f"leaf {path}: the target asks for shape {list(want)} but {src.path} was saved with shape {list(have)}"
        )


def _check_dtype(path: str, want: np.dtype, src: LeafInfo, cast: Cast) -> None:
    have = np.dtype(src.dtype)
    if want == have:
        return
    kind = lambda d: (
        "float" if jax.dtypes.issubdtype(d, np.floating) else "int" if jax.dtypes.issubdtype(d, np.integer) else d.name
    )
    if kind(want) != kind(have):
        raise CheckpointTargetError(
            f"leaf {path}: saved as {have}, the target asks for {want}; a cast between "
            f"{kind(have)} and {kind(want)} is never done on restore: fix the target's dtype"
        )
    lossless = bool(np.can_cast(have, want, casting="safe"))
    if cast is Cast.LOSSY or (cast is Cast.WIDEN and lossless):
        return
    hint = "cast=Cast.WIDEN" if lossless else "cast=Cast.LOSSY (it loses precision)"
    raise CheckpointTargetError(f"leaf {path}: saved as {have}, the target asks for {want}; pass {hint} to allow it")


def _is_key(leaf) -> bool:
    return jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _files_read(step, reads: list[_LeafRead]) -> set[str]:
    """The files this process opens: for a leaf read as saved, the chunks its boxes overlap; for
    one stacked from layers or cut out of a stack, every chunk of its sources."""
    out: set[str] = set()
    for r in reads:
        if r.mode == "leaf":
            out |= step.files_read(r.sources[0].path, list(_boxes(r)))
        else:
            for src in r.sources:
                out |= step.files_read(src.path)
    return out


def _boxes(read: _LeafRead) -> dict[tuple, list]:
    """Unique boxes (as (start, stop) tuples) -> the addressable devices that hold them."""
    shape = read.shape
    out: dict[tuple, list] = collections.defaultdict(list)
    for device, index in read.sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(d)[:2] for s, d in zip(index, shape))
        out[key].append(device)
    return out


def _start(step, read: _LeafRead, key: tuple) -> tuple[Callable[[], np.ndarray], int]:
    """Issue the TensorStore reads of one box; returns (finish, saved bytes needed)."""
    box = tuple(slice(a, b) for a, b in key)
    src0 = read.sources[0]
    nbytes = math.prod(b - a for a, b in key) * np.dtype(src0.dtype).itemsize
    if read.mode == "leaf":
        return step.open(src0.path)[box].read().result, nbytes
    if read.mode == "unstack":
        index = box[: read.axis] + (read.index,) + box[read.axis :]
        return step.open(src0.path)[index].read().result, nbytes
    rest = box[: read.axis] + box[read.axis + 1 :]
    layers = range(*box[read.axis].indices(len(read.sources))[:2])
    futures = [step.open(read.sources[i].path)[rest].read() for i in layers]
    return (lambda: np.stack([f.result() for f in futures], axis=read.axis)), nbytes


def _place(piece: np.ndarray, devices: list) -> dict:
    # The first device may alias the host buffer where XLA allows it (CPU, 64-byte aligned); replicas
    # always get their own copy, since one of them may be donated later.
    out = {}
    for n, d in enumerate(devices):
        alias = n == 0 and piece.flags.c_contiguous and d.platform == "cpu"
        out[d] = jax.device_put(piece, d, may_alias=True) if alias else jax.device_put(np.array(piece), d)
    return out


def _read_all(step, reads: list[_LeafRead], budget_bytes: int | None) -> tuple[list, int]:
    """Pipeline box reads under a byte budget; put each box on its devices as soon as it lands.

    Each device box is read on its own, so it lands contiguous and goes to its device in one
    copy; a chunk that straddles two boxes of this process is decoded once and served to both
    from the step's small chunk cache (see `sources._context`)."""
    boxes = [_boxes(r) for r in reads]
    work = [(n, key, devices) for n, bx in enumerate(boxes) for key, devices in bx.items()]
    hold = sum(len(d) * math.prod(b - a for a, b in key) * reads[n].dtype.itemsize for n, key, d in work)
    # Bytes in flight exist up to three times (TensorStore's read buffer, the box, the device copy:
    # XLA on CPU aliases only 64-byte aligned host buffers), so a sixteenth of the held bytes in
    # flight keeps a restore's peak under 1.5x what the process must hold.
    budget = budget_bytes if budget_bytes is not None else min(max(16 << 20, hold // 16), 2 << 30)
    placed: list[dict] = [{} for _ in reads]
    remaining = collections.Counter(n for n, _, _ in work)
    values: list[Any] = [None] * len(reads)
    pending: collections.deque = collections.deque()
    inflight = needed = 0

    def land():
        nonlocal inflight
        n, key, devices, finish, nbytes = pending.popleft()
        r = reads[n]
        try:
            data = finish()
        except ValueError as e:
            if is_data_loss(e):
                raise corrupt_error(step, r.sources[0], e) from None
            raise  # anything else is not the checkpoint's fault: never a reason to fall back
        data = data if data.dtype == r.dtype else data.astype(r.dtype)
        placed[n].update(_place(data, devices))
        del data
        inflight -= nbytes
        remaining[n] -= 1
        if remaining[n] == 0:
            values[n] = _assemble(r, placed[n])
            placed[n] = {}

    for n, key, devices in work:
        finish, nbytes = _start(step, reads[n], key)
        pending.append((n, key, devices, finish, nbytes))
        inflight += nbytes
        needed += nbytes
        while inflight > budget and pending:
            land()
    while pending:
        land()
    return values, needed


def _assemble(r: _LeafRead, placed: dict):
    arrays = [placed[d] for d in r.sharding.addressable_devices_indices_map(r.shape)]
    value = jax.make_array_from_single_device_arrays(r.shape, r.sharding, arrays)
    return jax.random.wrap_key_data(value, impl=r.prng_impl) if r.prng_impl else value


def _data_sharding(sharding):
    # Key data has one trailing dimension more than the keys; shard it like the keys, whole along it.
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, None))
    return sharding


def _bytes_read() -> int:
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        return int(m["values"][0].get("value", 0)) if m["values"] else 0
    return 0
