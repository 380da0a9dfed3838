"""Sharding propagation over the factor graph (GSPMD's idea, with Shardy's factors): annotate a
few values, and every other value gets a sharding through the ops' factors, forward and backward,
until nothing changes.

A value's sharding is a tuple with one entry per dimension: the mesh axes that dimension is split
over (major to minor), `()` for replicated. Within one op a factor takes the axes of the largest
value that gives it some (on ties, operands before results on forward sweeps, results first on
backward sweeps); a value at least twice the size of the operand that carries a contested axis
takes it over; an assignment is dropped when the factor's size does not divide by the axes'
product or when an axis is already used by another dimension of the same value. Annotations named
`first` (the batch) spread before the rest, and in each stage broadcasts are followed last. Where a
weight took an axis over, propagation runs again with that op's result split the weight's way from
the start, so the activation and the gradient that flow from it keep that split (as XLA computes
an FSDP matmul whose weight is larger than its input: it moves the input, not the weight).

The result also lists, per op, the communication the assignment implies: a sharded REDUCE factor (or the
indexed GATHER factor of a gather: each device looks up its own rows)
leaves partial sums to all-reduce (or to reduce-scatter, when the result is split over the same
axes); an operand whose given sharding differs from what the op's factors ask must be resharded,
except a value computed from literals alone, and a scatter-add into such a value (a lookup's
gradient), which is made in the layout asked for by moving its indices and updates, and a
broadcast, made so by moving its operand.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import threading
from collections.abc import Collection, Iterator, Mapping

import numpy as np

from .communication import Communication, Products, communication, constants, exchanges, landing, minor_factors, moved
from .ir import Graph, Op
from .memo import PerGraph
from .rules import ELEMENTWISE

Sharding = tuple[tuple[str, ...], ...]


@dataclasses.dataclass
class Propagation:
    graph: Graph = dataclasses.field(repr=False, compare=False)
    mesh: Mapping[str, int]
    shardings: dict[int, Sharding]
    factor_axes: dict[int, dict[int, tuple[str, ...]]]  # op id -> factor -> axes

    def of(self, value: int, rank: int) -> Sharding:
        return self.shardings.get(value, ((),) * rank)

    @functools.cached_property
    def communication(self) -> list[Communication]:
        """What the assignment implies (`communication`): found when first asked, as only a
        priced candidate needs it, not a tactic reading where an axis went."""
        return list(self.exchanged())

    def exchanged(self) -> Iterator[Communication]:
        """`communication` one at a time, in op order: a pricing that stops once a candidate is
        out of reach (`cost.estimate`'s `beyond`) finds no more of it than it reads."""
        if "communication" in self.__dict__:
            return iter(self.communication)
        static = _static(self.graph)
        return communication(self.graph, static.exchanges, static.moved_instead, self.shardings, self.factor_axes,
                             self.device_bytes, Products(self.mesh))  # fmt: skip

    @functools.cached_property
    def device_bytes(self) -> np.ndarray:
        """Per value of the graph, its bytes on one device (int64)."""
        parts = np.ones(len(self.graph.values), dtype=np.int64)
        sizes, split = Products(self.mesh), {}
        for v, sharding in self.shardings.items():
            n = split.get(sharding)
            if n is None:
                n = split[sharding] = max(math.prod(sizes[axes] for axes in sharding), 1)
            parts[v] = n
        return _static(self.graph).nbytes // parts


def propagate(
    graph: Graph,
    annotations: Mapping[int, Sharding],
    mesh: Mapping[str, int],
    *,
    first: Collection[int] = (),
    max_sweeps: int = 8,
) -> Propagation:
    """`annotations`: value id -> sharding (inputs, usually: parameters and batch). Annotated values
    keep their sharding; the rest are filled in. Annotations named in `first` (the batch) spread
    alone before the others join, as a higher priority: where a weight's FSDP split and the
    batch's split want the same axis for one op, the weight is the one gathered, unless it is at
    least twice the size of the activation (then the activation moves, as in XLA).

    Example:
        >>> p = propagate(g, {g.inputs[0]: (("data",), ()), g.inputs[1]: ((), ("model",))}, {"data": 2, "model": 4})
        >>> p.shardings[g.outputs[0]]
    """
    static = _static(graph)
    first = {static.alias.get(v, v) for v in first}
    annotations = _onto_classes(static.alias, annotations)
    stages = [{v: s for v, s in annotations.items() if v in first}, annotations] if first else [annotations]
    touching = static.touching
    shardings, factor_axes, takeovers = _run(graph, stages, mesh, max_sweeps, {}, touching)
    seeds = _seeds(graph, takeovers, annotations)
    if seeds:
        # A weight took an axis over from the batch at some matmuls: XLA then computes that
        # matmul's result split the weight's way, and the values that flow from it (its
        # activation, the gradient coming back) keep that split. Rerun with those results
        # split so from the start, beside the batch.
        shardings, factor_axes, _ = _run(graph, stages, mesh, max_sweeps, seeds, touching)
    _relabelled(graph, static, shardings, factor_axes)
    return Propagation(graph, dict(mesh), shardings, factor_axes)


def _onto_classes(alias: Mapping[int, int], annotations: Mapping[int, Sharding]) -> dict[int, Sharding]:
    """Annotations keyed by the value each one's class stands for (`_aliases`); a value's own
    annotation before one on a relabelling of it."""
    out = {v: tuple(tuple(a) for a in s) for v, s in annotations.items() if v not in alias}
    for v, s in annotations.items():
        if v in alias:
            out.setdefault(alias[v], tuple(tuple(a) for a in s))
    return out


def _relabelled(graph: Graph, static: _Static, shardings: dict, factor_axes: dict) -> None:
    """Each relabelling (`_aliases`) given its class's sharding, and its op the factors that carry it."""
    for v, root in static.alias.items():
        found = shardings.get(root)
        if found is not None:
            shardings[v] = found
    for i in static.relabels:
        op = graph.ops[i]
        found = shardings.get(op.results[0])
        if found is not None:
            factor_axes[i] = {f[0]: axes for f, axes in zip(op.result_dims[0], found) if f and axes}


def _run(graph: Graph, stages, mesh, max_sweeps: int, seeds: Mapping[int, Sharding], touching: Mapping[int, list[int]]):
    # Every candidate on a mesh spreads the same batch first, and the reruns of candidates whose
    # weights took over at the same ops (most of a refinement's trials) spread it beside the same
    # seeds: that stage's outcome is kept on the graph and each later run starts from a copy of it.
    key = None
    if len(stages) > 1:
        key = (tuple(mesh.items()), tuple(sorted(stages[0].items())), tuple(sorted(seeds.items())), max_sweeps)
    kept = None if key is None else _kept(first_stages(graph), key)
    cached = kept is not None
    if cached:
        state = _copied(kept)
        stages = stages[1:]
    else:
        state = _fresh(graph, seeds)
    for n, stage in enumerate(stages):
        _stage(graph, state, stage, n == 0 and not cached, mesh, max_sweeps, touching)
        if key is not None and n == 0 and not cached:
            _keep(first_stages(graph), key, _copied(state))
    shardings, _, factor_axes, _, takeovers = state
    return shardings, factor_axes, takeovers


SEEDED_KEPT = 8  # first stages kept per graph with seeds (a copy of the state each): those last used
_FIRST = PerGraph("kept first stages")
_STATIC = PerGraph("what propagation reads of the ops")


def first_stages(graph: Graph) -> dict:
    """The first stages kept for `graph` (key -> state; `_run`), made empty where none are. Made
    under the lock: two planning threads ask for the same graph's."""
    with _FIRST_STAGES:
        return _FIRST.get(graph, dict)


# A graph's kept first stages are shared by the threads that plan one step: a job's controller
# and its planning thread (`StepPlanner`). What is kept is never changed (each run copies it);
# the lock covers the dict's order and evictions only.
_FIRST_STAGES = threading.Lock()


def _kept(cache: dict, key: tuple):
    """The state kept under `key`, now the most recently used (`_keep`); None where none is."""
    with _FIRST_STAGES:
        kept = cache.pop(key, None)
        if kept is not None:
            cache[key] = kept
        return kept


def _keep(cache: dict, key: tuple, state) -> None:
    """`state` kept under `key`; of those with seeds (key[2]), only the SEEDED_KEPT last used: the
    unseeded ones are one per mesh, the seeded ones as many as the distinct takeovers met (a
    graph is kept for a job's life, `StepPlanner`)."""
    with _FIRST_STAGES:
        cache[key] = state
        if key[2]:
            seeded = [k for k in cache if k[2]]
            for old in seeded[: max(0, len(seeded) - SEEDED_KEPT)]:  # a negative bound would cut from the end
                del cache[old]


def _fresh(graph: Graph, seeds: Mapping[int, Sharding]):
    return (
        dict(seeds),  # not fixed: they only claim their axes first
        set(),
        {op.id: {} for op in graph.ops},  # op id -> factor -> axes
        {op.id: {} for op in graph.ops},  # op id -> factor -> bytes of the operand that set it
        [],  # (op, factor, axes) a larger operand took over
    )


class Spreading:
    """Annotations added a few at a time, each spreading from where those before it left off, as
    `propagate` spreads its `first` stage and then the rest: for a tactic that decides weights
    one at a time and reads, before each decision, where the decisions before it sent an axis
    (`tactics._megatron`). Each addition costs the ops it reaches, not the graph. Unlike
    `propagate`, no rerun follows a takeover: it says where axes go, it is not priced.

    Example:
        >>> s = Spreading(g, {"model": 4})
        >>> s.add({w1: ((), ("model",))})
        >>> s.of(hidden, 2)
    """

    def __init__(self, graph: Graph, mesh: Mapping[str, int], max_sweeps: int = 8):
        self.graph, self.mesh, self.max_sweeps = graph, dict(mesh), max_sweeps
        self._state = _fresh(graph, {})

    def add(self, annotations: Mapping[int, Sharding]) -> None:
        static = _static(self.graph)
        stage = _onto_classes(static.alias, annotations)
        _stage(self.graph, self._state, stage, False, self.mesh, self.max_sweeps, static.touching)

    def of(self, value: int, rank: int) -> Sharding:
        return self._state[0].get(_static(self.graph).alias.get(value, value), ((),) * rank)


def _copied(state):
    shardings, fixed, factor_axes, claims, takeovers = state
    return (
        dict(shardings),
        set(fixed),
        {k: dict(v) for k, v in factor_axes.items()},
        {k: dict(v) for k, v in claims.items()},
        list(takeovers),
    )


def _stage(graph: Graph, state, stage, first: bool, mesh, max_sweeps: int, touching) -> None:
    """Spread one stage's annotations to a fixed point from the ops next to them, and in the
    `first` stage also from those next to the seeds. (An op next to no sharded value finds
    nothing to assign: visiting every op would only add visits that change nothing.)"""
    shardings, fixed, factor_axes, claims, takeovers = state
    info = _static(graph).ops
    starts = [*stage, *shardings] if first else stage
    shardings.update(stage)
    fixed |= set(stage)
    new = {o for v in starts for o in touching.get(v, ())}
    sizes = Products(mesh)
    held: set[int] = set()  # broadcasts that did not read a smaller sharded value in the strict pass
    dirty: set[int] = set()
    work = (shardings, fixed, factor_axes, claims, sizes, takeovers, held)
    for strict in (True, False):
        # Monotone: only ops next to a new annotation, then only the broadcasts that held back.
        dirty = new if strict else held | {i for i in dirty if info[i].broadcasting}
        for sweep in range(max_sweeps):
            dirty = _sweep(graph, info, touching, work, sweep % 2 == 0, strict, dirty)
            if not dirty:
                break


def _sweep(graph: Graph, info, touching, work, forward: bool, strict: bool, dirty: set[int]) -> set[int]:
    """`_step` the dirty ops in program order (or reversed). Only ops that see a value a step
    changed can change anything (the op that changed it has taken everything it can from it):
    one ahead of the op stepped is stepped in this sweep, one behind it in the next. Returns the
    next sweep's."""
    shardings, fixed, factor_axes, claims, sizes, takeovers, held = work
    ops, sign = graph.ops, 1 if forward else -1
    heap = sorted(sign * i for i in dirty)
    queued, later = set(dirty), set()
    while heap:
        i = sign * heapq.heappop(heap)
        queued.discard(i)
        changed = _step(
            ops[i], info[i], shardings, fixed, factor_axes[i], claims[i], sizes, forward, strict, takeovers, held
        )
        for v in changed:
            for o in touching[v]:
                if o == i:
                    continue
                if (o > i) == forward:
                    if o not in queued:
                        queued.add(o)
                        heapq.heappush(heap, sign * o)
                else:
                    later.add(o)
    return later


def _seeds(graph: Graph, takeovers, annotations) -> dict[int, Sharding]:
    """Results of the ops where a larger operand took an axis over, split along the factor it won."""
    seeds: dict[int, list] = {}
    for op_id, factor, axes in takeovers:
        op = graph.ops[op_id]
        for value, dims in zip(op.results, op.result_dims):
            if value < 0 or value in annotations or len(dims) != len(graph.values[value].shape):
                continue
            seed = seeds.setdefault(value, [()] * len(dims))
            for d, factors in enumerate(dims):
                if factors and factors[0] == factor and not seed[d] and not {a for x in seed for a in x} & set(axes):
                    seed[d] = axes
    return {v: tuple(s) for v, s in seeds.items() if any(s)}


@dataclasses.dataclass(frozen=True)
class _OpInfo:
    largest: int  # bytes of the op's largest value
    broadcasting: bool
    operand_bytes: dict  # factor -> bytes of the largest operand that carries it
    # Each value with its dimensions that carry a factor, (d, factor); a value whose rank its
    # dims do not match takes no sharding from the op.
    reads: tuple  # (value, nbytes, ((d, factor, factor size), ...)), largest first (forward order among equals)
    reads_backward: tuple  # (results first among equals)
    writes: tuple  # (value, rank, ((d, factor, dimension size), ...)), operands then results
    writes_backward: tuple  # results then operands


@dataclasses.dataclass(frozen=True)
class _Static:
    """What every propagation on a graph reads and none changes, found once per graph."""

    ops: list[_OpInfo]  # by op id
    touching: dict[int, list[int]]  # value -> the ops that read or make it
    constants: set[int]  # values computed from literals alone (`constants`)
    moved_instead: dict[int, list[int]]  # value -> what resharding it moves (`communication`)
    exchanges: list[tuple[frozenset, tuple]]  # per op, what `communication` reads (`exchanges`)
    nbytes: np.ndarray  # per value, its bytes whole (int64)
    alias: dict[int, int]  # a relabelling's value -> the value its class stands for (`_aliases`)
    relabels: list[int]  # the ops that make them, not stepped


def _static(graph: Graph) -> _Static:
    found = _STATIC.get(graph)
    if found is None:
        alias, relabels = _aliases(graph)
        skipped = set(relabels)
        touching: dict[int, list[int]] = {}
        for op in graph.ops:
            if op.id not in skipped:
                for v in op.operands + op.results:
                    if v >= 0:
                        touching.setdefault(alias.get(v, v), []).append(op.id)
        constant = constants(graph)
        found = _Static(
            [None if op.id in skipped else _info(graph, op, alias) for op in graph.ops],
            touching,
            constant,
            moved(graph, constant),
            exchanges(graph, constant),
            np.array([v.nbytes for v in graph.values], dtype=np.int64),
            alias,
            relabels,
        )
        _STATIC.put(graph, found)
    return found


def _aliases(graph: Graph) -> tuple[dict[int, int], list[int]]:
    """Elementwise ops of one array (a negation, a square root, a scaling by a scalar) whose result
    has its operand's shape and bytes: the result only relabels the operand, and every step of
    propagation gives both the same sharding. Such chains (a third of a UNet's ops, most of an
    optimizer's) are propagated as one value each, their ops not stepped."""
    alias: dict[int, int] = {}
    relabels = []
    values = graph.values
    for op in graph.ops:
        if op.primitive not in ELEMENTWISE or len(op.results) != 1 or op.results[0] < 0:
            continue
        arrays = [(v, d) for v, d in zip(op.operands, op.operand_dims) if v >= 0 and values[v].shape]
        if len(arrays) != 1:
            continue
        (v, dims), r = arrays[0], op.results[0]
        same = values[v].shape == values[r].shape and values[v].nbytes == values[r].nbytes
        if same and dims == op.result_dims[0] and all(len(f) <= 1 for f in dims):
            alias[r] = alias.get(v, v)
            relabels.append(op.id)
    return alias, relabels


def _info(graph: Graph, op: Op, alias: Mapping[int, int]) -> _OpInfo:
    """One op's `_OpInfo`, its values named by their classes (`_aliases`): each value's slots found
    once and read in both orders (hot: once per op of the graph)."""
    values, sizes = graph.values, [f.size for f in op.factors]
    minors: dict[tuple, tuple] = {}
    reads, writes, carried = [], [], {}
    count = len(op.operands)
    for k, (v, dims) in enumerate(zip(op.operands + op.results, op.operand_dims + op.result_dims)):
        if v < 0:  # a literal: it reads nothing, and an axis its factors take is free to move
            reads.append(None)
            writes.append(None)
            for factors in dims if k < count else ():
                for f in factors:
                    carried.setdefault(f, 0)
            continue
        value = values[v]
        shape, nbytes, v = value.shape, value.nbytes, alias.get(v, v)
        slots = []
        for d, factors in enumerate(dims[: len(shape)]):
            if factors:
                minor = minors.get(factors)
                if minor is None:
                    minor = minors[factors] = minor_factors(sizes, factors)
                slots.append((d, factors[0], minor))
        reads.append((v, nbytes, tuple((d, f, sizes[f], minor) for d, f, minor in slots)))
        matched = len(dims) == len(shape) and slots
        writes.append((v, len(shape), tuple((d, f, shape[d], minor) for d, f, minor in slots)) if matched else None)
        if k < count:
            for factors in dims:
                for f in factors:
                    carried[f] = max(carried.get(f, 0), nbytes)
    # Largest first; among equals operands first forward and results first backward.
    backward = list(range(count, len(reads))) + list(range(count))
    by_size = lambda order: tuple(sorted((reads[k] for k in order if reads[k]), key=lambda r: -r[1]))
    reads_forward = by_size(range(len(reads)))
    return _OpInfo(
        reads_forward[0][1] if reads_forward else 0,
        op.primitive in _BROADCASTING,
        carried,
        reads_forward,
        by_size(backward),
        tuple(w for w in writes if w),
        tuple(writes[k] for k in backward if writes[k]),
    )


def _landed(minor: tuple, assigned: Mapping[int, tuple], sizes) -> tuple | None:
    """The axes of the first minor factor given some, where its dimension's split lands on it
    (`landing`)."""
    f, axes = next(((f, assigned[f]) for f, _, _ in minor if f in assigned), (None, None))
    return axes if f is not None and landing(minor, sizes[axes]) == f else None


def _step(
    op: Op,
    info: _OpInfo,
    shardings,
    fixed,
    assigned: dict,
    claims: dict,
    sizes: Products,
    forward: bool,
    strict: bool,
    takeovers: list,
    held: set[int],
) -> list[int]:
    # The largest values choose first, and in the first (strict) pass a value broadcast into a
    # larger elementwise op chooses nothing: a layer norm's sharded scale must not split the
    # activations it scales along the hidden dimension before the batch's sharding arrives
    # (GSPMD likewise propagates through broadcasts last).
    gated = strict and info.broadcasting
    for value, nbytes, slots in info.reads if forward else info.reads_backward:
        sharding = shardings.get(value)
        if sharding is None:
            continue
        if gated and nbytes < info.largest:
            held.add(op.id)
            continue
        for d, factor, size, minor in slots:
            axes = sharding[d]
            if not axes:
                continue
            if size % sizes[axes]:  # the major factor cannot hold the split: a minor one may
                factor = landing(minor, sizes[axes])
                if factor is None:
                    continue
            if factor not in assigned:
                if assigned:
                    wanted = set(axes)
                    taken = [f for f, a in assigned.items() if not wanted.isdisjoint(a)]
                else:
                    taken = None
                # An operand at least twice the size of the one that claimed the axis takes it
                # over, and the smaller one is resharded instead: as GSPMD resolves a matmul whose
                # FSDP-split weight and batch-split activation want the same axis.
                if taken and all(2 * claims.get(f, 0) <= nbytes for f in taken):
                    for f in taken:
                        del assigned[f]
                    taken = None
                    takeovers.append((op.id, factor, axes))
                if not taken:
                    assigned[factor] = axes
                    # What giving the axis up would cost is moving the operand that carries the
                    # factor, not the result that proposed it.
                    claims[factor] = info.operand_bytes.get(factor, nbytes)
    if not assigned:
        return []
    changed = []
    for value, rank, slots in info.writes if forward else info.writes_backward:
        if value in fixed:
            continue
        current = shardings.get(value)
        proposed = None
        for d, factor, n, minor in slots:
            if current is not None and current[d]:
                continue
            axes = assigned.get(factor)
            if axes is None and (not minor or (axes := _landed(minor, assigned, sizes)) is None):
                continue
            if proposed is None:
                proposed = list(current) if current is not None else [()] * rank
                used = {a for axes in proposed for a in axes}
            if used.isdisjoint(axes) and n % sizes[axes] == 0:
                proposed[d] = axes
                used.update(axes)
        if proposed is not None:
            new = tuple(proposed)
            if new != (current if current is not None else ((),) * rank):
                shardings[value] = new
                changed.append(value)
    return changed


_BROADCASTING = ELEMENTWISE | {"broadcast_in_dim"}
