"""What the planner reads of a step before it plans: the step captured and folded (`Inputs`,
`read_inputs`), its state and batch leaves, and its weights: each state leaf a matmul reads (or a
gather reads as a table), found through the ops that carry a weight unchanged (`Weight`,
`weights_in_order`), which weights feed which (`Inputs.feeders`), stacked experts (`experts`),
and which optimizer-state leaf follows which parameter (`mirror_optimizer_state`).

Everything here is computed once per step and kept on `Inputs` (its cached properties): every
tactic on every mesh, the refinement and the exact level ask for the same answers.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Collection, Mapping
from typing import Any

import jax

from . import depth
from .arguments import abstract_leaf
from .arguments import batch_argnums as batch_argnums_of
from .capture import capture
from .fold import Fold, fold
from .ir import FactorKind, Graph, Op
from .propagate import Sharding
from .stacks import named_leaves


@dataclasses.dataclass(frozen=True, eq=False)  # by identity: what reads it keeps caches keyed by it
class Inputs:
    fold: Fold
    ids: list[int]  # representative value id per argument leaf
    keys: list[tuple[str, ...]]  # each leaf's key path inside its argument
    argnum: list[int]
    batch_argnums: tuple[int, ...]
    seconds: tuple[float, float] = (0.0, 0.0)  # capture, fold
    shallow_steps: tuple = ()  # (fn, args) at the two depths traced, where the step was (`depth.Shallow`)

    @property
    def graph(self) -> Graph:  # folded: one copy of each repeated layer
        return self.fold.graph

    @functools.cached_property
    def mirror_sources(self) -> list[tuple[int, tuple[int, ...]]]:
        """Per state leaf, the leaves whose sharding `mirror_optimizer_state` would give it, in the
        order it looks (built once: a deep model has ~10^4 leaves and every candidate mirrors):
        for each tail of its path, longest first, the leaves with that shape and that path below
        their container, the last first."""
        values = self.graph.values
        below: dict[tuple, list[int]] = {}
        for v, keys in zip(self.ids, self.keys):
            below.setdefault((values[v].shape, keys[1:]), []).append(v)
        out: dict[int, dict[int, None]] = {}  # a folded value stands for a leaf of every layer
        for v, keys, a in zip(self.ids, self.keys, self.argnum):
            if a in self.batch_argnums:
                continue
            shape, found = values[v].shape, out.setdefault(v, {})
            for n in range(len(keys), 0, -1):
                hit = below.get((shape, keys[-n:]))
                if hit:
                    found.update(dict.fromkeys(reversed(hit)))
        return [(v, tuple(found)) for v, found in out.items() if found]

    @functools.cached_property
    def batch_values(self) -> list[int]:
        """The batch's leaves' values, each once, in leaf order (found once: every candidate asks)."""
        return list(dict.fromkeys(v for v, a in zip(self.ids, self.argnum) if a in self.batch_argnums))

    @functools.cached_property
    def state_values(self) -> list[int]:
        """The other leaves' values (parameters, optimizer state), each once, in leaf order."""
        return list(dict.fromkeys(v for v, a in zip(self.ids, self.argnum) if a not in self.batch_argnums))

    @functools.cached_property
    def weights(self) -> list:
        """`weights_in_order`, found once: every tactic on every mesh, the refinement and the exact
        level ask for them."""
        return _find_weights(self)

    @functools.cached_property
    def producer(self) -> dict[int, Op]:
        """Value -> the op of the folded graph that makes it."""
        return {r: op for op in self.graph.ops for r in op.results}

    @functools.cached_property
    def readers(self) -> dict[int, list[Op]]:
        """Value -> the ops of the folded graph that read it, each once."""
        out: dict[int, list[Op]] = {}
        for op in self.graph.ops:
            for v in dict.fromkeys(op.operands):
                if v >= 0:
                    out.setdefault(v, []).append(op)
        return out

    @functools.cached_property
    def weight_operands(self) -> set[tuple[int, int]]:
        """(matmul, operand) pairs that read a state input, directly or through ops that carry a
        weight unchanged (`_source`), backward passes included: a scanned step's backward reads
        each layer's cast weight as a residual its forward stacked."""
        g, state = self.graph, set(state_values(self))
        carries = _CARRIES_WEIGHT | {"scan_stack"}
        return {
            (op.id, k)
            for op in g.ops
            if op.primitive in MATMULS
            for k, v in enumerate(op.operands)
            if v >= 0 and _source(g, self.producer, state, v, carries) is not None
        }

    @functools.cached_property
    def feeders(self) -> dict[int, set[int]]:
        """`_feeders` of the weights, found once."""
        return _feeders(self.graph, self.weights)


def read_inputs(fn, args, batch_argnums, shallow_trace: bool = True) -> Inputs:
    """The step captured and folded: from two shallow traces where its arguments hold a deep stack
    of layers it loops over (`depth.shallow`, unless `shallow_trace` is False), else from one
    trace of the whole step."""
    t0 = time.perf_counter()
    abstract = tuple(jax.tree.map(abstract_leaf, a) for a in args)
    named = named_leaves(abstract)  # each path starts with the argument's index
    argnum = [path[0].idx for path, _, _ in named]
    keys = [names[1:] for _, names, _ in named]
    found = depth.shallow(fn, abstract, named) if shallow_trace else None
    steps = found.steps if found is not None else ()
    if found is not None:
        folded, traced, out_shape = found.fold, found.abstract, found.out_shape
        leaves = [found.leaves[i] for i in found.sources]
        t1 = time.perf_counter() - found.fold_seconds
    else:
        traced = abstract
        graph = capture(fn, *abstract, compact=True)  # the only trace of fn: its output shapes come with the graph
        traced, out_shape = abstract, graph.out_shape
        leaves = graph.inputs[len(graph.inputs) - len(keys) :]
        t1 = time.perf_counter()
        folded = fold(graph, keys, leaves)
    if batch_argnums is None:
        batch_argnums = batch_argnums_of(traced, out_shape)
    seconds = (t1 - t0, time.perf_counter() - t1)
    return Inputs(folded, [folded.of(v) for v in leaves], keys, argnum, tuple(batch_argnums), seconds, steps)


def state_values(inputs: Inputs) -> list[int]:
    return list(inputs.state_values)


@dataclasses.dataclass(frozen=True)
class Weight:
    op: Any  # the matmul that first reads it
    k: int  # which operand
    value: int  # the state input
    dims: tuple[int, ...]  # per dimension of the matmul's operand, the input's dimension it is (-1: none)
    rank: int  # the input's

    @property
    def lookup(self) -> bool:
        """Read as a table by a gather (an embedding), not by a matmul."""
        return self.op.primitive == "gather"

    @property
    def stacked(self) -> bool:
        """Read one layer at a time through a scan (the input's leading dimension is the layer)."""
        return 0 not in self.dims and self.rank > len(self.dims)

    def sharding(self, per_operand: Sharding) -> Sharding:
        """The input's sharding for a split of what the matmul reads."""
        out = [()] * self.rank
        for d, axes in zip(self.dims, per_operand):
            if d >= 0:
                out[d] = tuple(axes)
        return tuple(out)

    def operand_sharding(self, given: Sharding) -> Sharding:
        """What the matmul reads, for a sharding of the input."""
        return tuple(tuple(given[d]) if d >= 0 and d < len(given) else () for d in self.dims)

    def shape(self, g: Graph) -> tuple[int, ...]:
        return g.values[self.op.operands[self.k]].shape


# Ops a weight passes through on its way to a matmul without changing what it holds: a cast (float32
# master weights computed in bfloat16), a copy, a transpose, a reshape that splits or merges heads
# ([embed, heads * head_dim] read as [embed, heads, head_dim]), one layer's slice of a scanned stack.
_CARRIES_WEIGHT = {
    "convert_element_type",
    "copy",
    "copy_p",
    "reduce_precision",
    "transpose",
    "reshape",
    "squeeze",
    "expand_dims",
    "scan_slice",
}


def _source(
    g: Graph, producer: Mapping[int, Op], state: Collection[int], v: int, carries: Collection[str] = _CARRIES_WEIGHT
) -> tuple[int, tuple[int, ...]] | None:
    """The state input `v` is read from, through ops that carry a weight unchanged (`carries`),
    and per dimension of `v` the input's dimension it is (by the factors each op ties them with)."""
    rank = len(g.values[v].shape)
    dims = tuple(range(rank))
    while v not in state:
        op = producer.get(v)
        if op is None or op.primitive not in carries or op.body is not None:
            return None
        (src, src_dims) = next(((o, d) for o, d in zip(op.operands, op.operand_dims) if o >= 0), (None, None))
        if src is None:
            return None
        where = {fs[0]: i for i, fs in enumerate(src_dims) if fs}
        res = op.result_dims[op.results.index(v)]
        dims = tuple(where.get(res[d][0], -1) if d >= 0 and res[d] else -1 for d in dims)
        v = src
    return v, dims


def weights_in_order(inputs: Inputs) -> list[Weight]:
    """Weights in program order, first use only, read directly or through a cast, a transpose, a
    reshape or a layer at a time from a scanned stack: by a matmul, or as a table by a gather (an
    embedding read by `table[ids]`, `jnp.take` or `take_along_axis`; `Weight.lookup`)."""
    return inputs.weights


# Primitives that read a weight, and how many of their leading operands may be one: a matmul
# either, a gather only its operand (the table; the indices are data).
_READS_WEIGHT = {"dot_general": 2, "ragged_dot_general": 2, "gather": 1}

MATMULS = ("dot_general", "ragged_dot_general")  # (a ragged one: experts over tokens sorted by expert)


def _find_weights(inputs: Inputs) -> list[Weight]:
    g, producer = inputs.graph, inputs.producer
    state = set(state_values(inputs))
    seen, out = set(), []
    for op in g.ops:
        if op.primitive not in _READS_WEIGHT:
            continue
        for k, v in enumerate(op.operands[: _READS_WEIGHT[op.primitive]]):
            if v < 0 or len(g.values[v].shape) < 2:
                continue
            found = _source(g, producer, state, v)
            if found is None or found[0] in seen:
                continue
            src, dims = found
            seen.add(src)
            out.append(Weight(op, k, src, dims, len(g.values[src].shape)))
    return out


def _feeders(g: Graph, weights: list[Weight]) -> dict[int, set[int]]:
    """Per weight's matmul, the weights' matmuls whose results reach its activation through ops
    that multiply by no weight (attention, norms, a split, a residual add), and are at least as
    large as it (the stream it consumes, not a router's gates beside it)."""
    out = {}
    for w, reached in zip(weights, _reaching(g, weights)):
        size = g.values[w.op.operands[1 - w.k]].nbytes
        out[w.op.id] = {op.id for op, v in reached if g.values[v].nbytes >= size}
    return out


def _reaching(g: Graph, weights: list[Weight]) -> list[list[tuple[Op, int]]]:
    """Per weight, the nearest weights' matmuls its activation is computed from, each with the
    value it made on the way."""
    mine = {w.op.id for w in weights}
    producer = {r: op for op in g.ops for r in op.results}
    out = []
    for w in weights:
        found, seen, stack = [], set(), [w.op.operands[1 - w.k]]
        while stack:
            v = stack.pop()
            if v < 0 or v in seen or v not in producer:
                continue
            seen.add(v)
            op = producer[v]
            if op.id in mine:
                found.append((op, v))
                continue
            stack.extend(op.operands)
        out.append(found)
    return out


def experts(inputs: Inputs, mesh: dict[str, int], axis: str = "model") -> dict[int, Sharding]:
    """Weights whose dimension is a batch factor (PASS, shared with the activation) of their matmul:
    stacked experts. Split them over `axis` along it."""
    g, t = inputs.graph, mesh[axis]
    out = {}
    for weight in weights_in_order(inputs):
        if weight.lookup:
            continue
        op, k = weight.op, weight.k
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        shared = {f for dims in x_dims for f in dims[:1]}
        shape = weight.shape(g)
        for d, dims in enumerate(w_dims):
            if dims and dims[0] in shared and op.factors[dims[0]].kind is FactorKind.PASS and shape[d] % t == 0:
                out[weight.value] = weight.sharding(split_over(shape, d, axis))
                break
    return out


def mirror_optimizer_state(inputs: Inputs, annotations: Mapping[int, Sharding]) -> dict[int, Sharding]:
    """A state leaf with the same shape as an annotated one and the same path below its container
    (`opt/0/mu/layer0/w1` mirrors `params/layer0/w1`) gets the same sharding."""
    out = dict(annotations)
    for v, sources in inputs.mirror_sources:
        if v not in out:
            hit = next((annotations[s] for s in sources if s in annotations), None)
            if hit is not None:
                out[v] = hit
    return out


def split_over(shape, dim: int, axis: str) -> Sharding:
    return tuple((axis,) if i == dim else () for i in range(len(shape)))
