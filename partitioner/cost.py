"""Price a propagated sharding on a hardware profile: roofline compute per device, alpha-beta
communication per collective, and peak memory per device from value liveness.

Peak memory is `memory.peak`: XLA's layout of argument, result and temporary buffers.

Collectives follow the project design (README, "How it works"): an all-reduce of n bytes over p devices costs 2(p-1)/p * n/B plus
the latencies of a ring or a tree, whichever are fewer (`hardware.latency_steps`); an all-gather (a
reshard here) or a reduce-scatter of shards of s bytes costs (p-1) * s/B plus (p-1) latencies. The
link is the slowest one the group crosses: devices of the innermost mesh axes
are neighbours, so a group stays on one host while the axes from its own to the innermost span at
most `devices_per_host` devices.

On slices (`Hardware.sliced`), a group whose axes lie both inside a slice and across slices is
priced level by level, as TPU multi-slice collectives and NCCL's rings over several NVLink
domains run (`hierarchical`): an all-reduce of n bytes reduce-scatters inside the slice,
all-reduces n/p_in across slices and all-gathers inside again; an all-gather (a reduce-scatter
alike) of shards of s bytes moves (p_out-1) s across slices and (p_in-1) p_out s inside.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from . import memory
from .hardware import Hardware, latency_steps
from .ir import Graph
from .memo import PerGraph
from .propagate import Propagation

if TYPE_CHECKING:
    from .fold import Fold


@dataclasses.dataclass(frozen=True)
class Cost:
    """Predicted seconds per call, split into compute and communication, and peak bytes per device."""

    compute_seconds: float
    communication_seconds: float
    collective_bytes: Mapping[str, int]  # collective kind -> bytes moved per device per call
    peak_bytes_per_device: int
    # The same plan's peak as XLA:CPU lays it out (`Hardware.copies_transposed_lhs`): what
    # `verify` compares when it compiles on fake CPU devices.
    cpu_peak_bytes_per_device: int | None = None
    # The FLOPs alone, without the time ops spend moving bytes through memory: with the
    # collectives, what a compiled program shows of a plan (`verify`).
    flop_seconds: float | None = None
    # Bytes each device sends per call over each network level ("host", "slice", "dcn"), where
    # the plan is on slices: a collective whose group spans slices is priced level by level.
    level_bytes: Mapping[str, int] | None = None

    @property
    def total_seconds(self) -> float:
        return self.compute_seconds + self.communication_seconds

    @property
    def compiled_view_seconds(self) -> float:
        """FLOPs and collectives: the part of the prediction a compile of the plan can check."""
        return (self.compute_seconds if self.flop_seconds is None else self.flop_seconds) + self.communication_seconds


def _collective(c, p: int, n: int, mesh, hardware: Hardware, levels: dict | None, combine: bool):
    """What collective `c` (over `p` devices, `n` times) costs: (seconds, kind, bytes sent each
    time, the latency a combined all-reduce pays once per round where it is not the link's own,
    else None). `combine`: an all-reduce XLA combines with others, its latency left out of the
    seconds. On slices, a group both inside and across slices is priced level by level (`Split`),
    its bytes counted per level into `levels`."""
    link = hardware.link(_span(c.axes, mesh))
    if levels is not None:
        split = Split.of(c.axes, mesh, hardware)
        for level, nbytes in split.bytes(c.kind, c.bytes).items():
            levels[level] = levels.get(level, 0) + int(nbytes) * n
        if split.inside > 1 and split.across > 1:
            kind = c.kind if c.kind in ("all-reduce", "reduce-scatter") else "all-gather"
            bandwidth, latency = split.seconds(kind, c.bytes, hardware)
            nbytes = sum(split.bytes(c.kind, c.bytes).values())
            if combine:
                return n * bandwidth, kind, nbytes, latency
            return n * (bandwidth + latency), kind, nbytes, None
    if c.kind == "all-reduce":
        nbytes = 2 * (p - 1) / p * c.bytes
        if combine:
            return n * nbytes / link.bandwidth, "all-reduce", nbytes, None
        return n * (nbytes / link.bandwidth + latency_steps("all-reduce", p) * link.latency), "all-reduce", nbytes, None
    kind = "reduce-scatter" if c.kind == "reduce-scatter" else "all-gather"  # a reshard gathers
    nbytes = (p - 1) * c.bytes  # a reduce-scatter sends as much (each shard to its owner)
    return n * (nbytes / link.bandwidth + latency_steps(kind, p) * link.latency), kind, nbytes, None


def estimate(
    prop: Propagation, hardware: Hardware, fold: Fold | None = None, *, beyond: float = math.inf
) -> Cost | None:
    """Price `prop` on its graph and mesh; on a fold's graph, each op counted as often as it occurs
    unrolled (`fold`). None where compute and communication alone take `beyond` seconds or more:
    a trial that cannot beat what it is measured against is not worth its peak, the dearest part
    to find."""
    graph, mesh = prop.graph, prop.mesh
    if fold is not None:
        mult, mat = fold.mult, fold.materialized
    elif graph.copies:
        raise ValueError(
            "estimate: this graph was captured compact (its repeated layers are `Graph.copies`, not ops); "
            "price it through its fold, `estimate(propagate(fold.graph, ...), hw, fold)`, or capture it with compact=False"
        )
    else:
        mult, mat = [op.trips if op.body is None else 1 for op in graph.ops], memory.materialized(graph)
    work = _work(graph, mat)
    size = prop.device_bytes
    compute, flop_seconds = _compute_seconds(work, prop, hardware, mult)
    comm, sent = 0.0, {"all-reduce": 0, "all-gather": 0}
    levels: dict[str, int] | None = {} if hardware.slice_devices is not None else None
    off_path = _off_the_matmul_path(graph)
    combined: dict[tuple, int] = {}
    once: dict[tuple, float] = {}  # the latency a combined all-reduce over those axes pays per round
    held: set[int] = set()  # values a combined all-reduce waits for
    for c in prop.communication if math.isinf(beyond) else prop.exchanged():
        if compute + comm >= beyond:
            return None  # (every collective adds time: the rest cannot bring it back in reach)
        p = math.prod(mesh[a] for a in c.axes)
        if p == 1 or not mult[c.op]:
            continue
        n = mult[c.op]
        combine = c.kind == "all-reduce" and c.value in off_path  # e.g. weight gradients: XLA combines them
        seconds, kind, nbytes, latency = _collective(c, p, n, mesh, hardware, levels, combine)
        sent[kind] = sent.get(kind, 0) + int(nbytes) * n
        if combine:  # its latency paid once per round, below
            combined[c.axes] = combined.get(c.axes, 0) + int(nbytes) * n
            if latency is not None:
                once[c.axes] = latency
            held.add(c.value)
        comm += seconds
    for axes, nbytes in combined.items():
        p = math.prod(mesh[a] for a in axes)
        rounds = max(1, math.ceil(nbytes / COMBINE_BYTES))
        latency = once.get(axes, latency_steps("all-reduce", p) * hardware.link(_span(axes, mesh)).latency)
        comm += rounds * latency
    if compute + comm >= beyond:
        return None
    if fold is not None:
        peak = fold.peak_bytes(
            dict(zip(work.materialized_ids, size[work.materialized_ids].tolist())), held, hardware.copies_transposed_lhs
        )
    else:
        peak = peak_bytes(prop, held, hardware.copies_transposed_lhs)
    return Cost(compute, comm, sent, peak, flop_seconds=flop_seconds, level_bytes=levels)


COMBINE_BYTES = 32 << 20  # about what XLA's all-reduce combiner packs into one collective


def _off_the_matmul_path(graph: Graph) -> set[int]:
    """Values no matmul depends on (a weight gradient on its way to the optimizer): nothing waits
    for their collectives, so independent ones are combined into few large ones. (Found once
    per graph: every candidate asks.)"""
    return _OFF_PATH.get(graph, lambda: _off_path(graph))


_OFF_PATH = PerGraph("values off the matmul path")
_WORK = PerGraph("ops' work")


def _off_path(graph: Graph) -> set[int]:
    feeds: set[int] = set()
    for _ in range(4):  # a folded graph's ties carry one copy's output into the next copy's ops
        before = len(feeds)
        for op in reversed(graph.ops):
            if (
                op.primitive in ("dot_general", "ragged_dot_general")
                or any(r in feeds for r in op.results)
                or (op.primitive == "tie" and any(v in feeds for v in op.operands))
            ):
                feeds.update(v for v in op.operands if v >= 0)
        if len(feeds) == before:
            break
    return {v for op in graph.ops for v in op.results if v not in feeds}


@dataclasses.dataclass(frozen=True)
class _Work:
    """What pricing the ops' compute reads, found once per graph (every candidate asks): per op its
    flops and a loop body's, and the values it moves through memory (a fusible op only those
    materialized), as one flat array cut by op; ties, which compute nothing, have none of them."""

    materialized: set[int]
    materialized_ids: np.ndarray  # the same, as an array
    flops: np.ndarray  # per op
    body_flops: np.ndarray  # per op: a loop body's, times its trips (priced unsharded: not propagated into)
    values: np.ndarray  # the values each op moves, op after op
    owner: np.ndarray  # per entry of `values`, its op


def _work(graph: Graph, materialized: set[int]) -> _Work:
    work = _WORK.get(graph)
    if work is None or work.materialized is not materialized:
        flops, body, values, owner = [], [], [], []
        for op in graph.ops:
            tie = op.primitive == "tie"
            moved = op.operands + op.results
            if op.primitive in memory.FUSIBLE:
                moved = tuple(v for v in moved if v in materialized)
            moved = [v for v in moved if v >= 0] if not tie else []
            flops.append(0 if tie else op.flops)
            body.append(op.trips * sum(o.flops for o in op.body.ops) if op.body is not None and not tie else 0)
            values += moved
            owner += [op.id] * len(moved)
        work = _Work(
            materialized,
            np.array(sorted(materialized), dtype=np.int64),
            np.array(flops, dtype=np.float64),
            np.array(body, dtype=np.float64),
            np.array(values, dtype=np.int64),
            np.array(owner, dtype=np.int64),
        )
        _WORK.put(graph, work)
    return work


def _compute_seconds(work: _Work, prop: Propagation, hardware: Hardware, mult) -> tuple[float, float]:
    """Roofline time of every op on one device, each counted `mult` times: its flops over the
    devices its factors are split across, or its bytes moved, whichever takes longer; and the
    flops' time alone."""
    shards = np.ones(len(work.flops))
    devices: dict[tuple, int] = {}  # the axes an op's factors are split over -> how many devices
    for op, assigned in prop.factor_axes.items():
        if assigned:
            axes = tuple(assigned.values())
            n = devices.get(axes)
            if n is None:
                n = devices[axes] = math.prod(prop.mesh[a] for a in {a for x in axes for a in x})
            shards[op] = n
    moved = np.bincount(
        work.owner, weights=prop.device_bytes[work.values].astype(np.float64), minlength=len(work.flops)
    )
    split = work.flops / shards / hardware.peak_flops
    body = work.body_flops / hardware.peak_flops
    seconds = np.maximum(split, moved / hardware.memory_bandwidth) + body
    mult = np.asarray(mult, dtype=np.float64)
    return float(np.dot(mult, seconds)), float(np.dot(mult, split + body))


def compute_floor(graph: Graph, fold: Fold | None, hardware: Hardware, devices: int) -> float:
    """The least compute time any sharding over `devices` devices can be priced at: each op's
    flops and bytes split `devices` ways, its loop body's not at all (`_compute_seconds` splits an
    op over at most the mesh's devices and prices a body unsharded). A bound, not an estimate:
    what a mesh of that many devices cannot beat, however its weights are split."""
    mult, mat = (fold.mult, fold.materialized) if fold is not None else (None, memory.materialized(graph))
    if mult is None:
        mult = [op.trips if op.body is None else 1 for op in graph.ops]
    work = _work(graph, mat)
    nbytes = np.fromiter((v.nbytes for v in graph.values), dtype=np.float64, count=len(graph.values))
    moved = np.bincount(work.owner, weights=nbytes[work.values], minlength=len(work.flops))
    whole = np.maximum(work.flops / hardware.peak_flops, moved / hardware.memory_bandwidth)
    return float(np.dot(np.asarray(mult, dtype=np.float64), whole / devices + work.body_flops / hardware.peak_flops))


@dataclasses.dataclass(frozen=True)
class Split:
    """A collective's group split at the slow link between slices: `inside` devices of one slice
    (spanning `inner_span` consecutive devices, on network level `inner_level`) times `across`
    slices."""

    inside: int
    across: int
    inner_span: int
    inner_level: str

    @classmethod
    def of(cls, axes, mesh: Mapping[str, int], hw: Hardware) -> Split:
        """An axis whose devices lie in several slices (devices slice-major) counts its devices
        within one slice inside and the rest across: `data=8` on 2 slices of 4 is 4 x 2."""
        names, inside, across, extent = list(mesh), 1, 1, 1
        for a in axes:
            stride = math.prod(mesh[n] for n in names[names.index(a) + 1 :])
            within = min(mesh[a], max(1, hw.slice_devices // stride)) if hw.slice_devices else mesh[a]
            inside, across, extent = inside * within, across * (mesh[a] // within), max(extent, stride * within)
        return cls(inside, across, extent, hw.level(extent))

    def bytes(self, kind: str, nbytes: float) -> dict[str, float]:
        """Bytes one device sends over each level ("host", "slice", "dcn") for a collective of
        `nbytes` (an all-reduce's buffer; an all-gather's or reduce-scatter's shard)."""
        p_in, p_out = self.inside, self.across
        if kind == "all-reduce":
            inside, across = 2 * (p_in - 1) / p_in * nbytes, 2 * (p_out - 1) / p_out * nbytes / p_in
        else:
            inside, across = (p_in - 1) * p_out * nbytes, (p_out - 1) * nbytes
        out = {self.inner_level: inside, "dcn": across}
        return {k: v for k, v in out.items() if v > 0}

    def seconds(self, kind: str, nbytes: float, hw: Hardware) -> tuple[float, float]:
        """(bandwidth, latency) seconds, level by level: inside at the inner group's link,
        across at the slow one."""
        p_in, p_out = self.inside, self.across
        inner, outer = hw.link(self.inner_span), hw.dcn or hw.inter
        latency = latency_steps(kind, p_in) * inner.latency + latency_steps(kind, p_out) * outer.latency
        if kind == "all-reduce":
            return 2 * (p_in - 1) / p_in * nbytes / inner.bandwidth + 2 * (
                p_out - 1
            ) / p_out * nbytes / p_in / outer.bandwidth, latency
        return (p_in - 1) * p_out * nbytes / inner.bandwidth + (p_out - 1) * nbytes / outer.bandwidth, latency


def _span(axes, mesh: Mapping[str, int]) -> int:
    names = list(mesh)
    outermost = min(names.index(a) for a in axes)
    return math.prod(mesh[n] for n in names[outermost:])


def peak_bytes(prop: Propagation, held=frozenset(), copies: bool = False) -> int:
    """The most bytes live on one device at once, as XLA lays buffers out (`memory.peak`);
    `held`: values a combined all-reduce keeps until the last of them is made; `copies`: the
    backend copies a transposed dot lhs (`Hardware.copies_transposed_lhs`)."""
    life = memory.liveness(prop.graph)
    sizes = prop.device_bytes[life.values].astype(np.float64)
    return memory.peak(life, sizes, np.isin(life.values, list(held)), copies)
