"""Depth: a deep stack of identical layers planned from two shallow traces (TAP's folding, moved
before the trace).

JAX traces a Python loop over L layers in time linear in L (a tenth of a second a layer for a
Llama step on one CPU core), so at 96 layers the trace alone outweighs the search. Where the step's
arguments hold the layers as a stack (a list or tuple, or dict entries keyed `0`, `1`, ... or
`layers_0`, `layers_1`, ..., of identically shaped subtrees: the parameters, and the optimizer
state that mirrors them) and the step loops over what it is given, it is traced with the first
3 and the first 4 layers of every stack (`PAIRS`). Both fold to the same graph, one layer planned
for all, op for op (each leaf of a layer one weight in every layer from the start,
`stacks.layer_groups`); every quantity the search prices is then affine in the depth, and the
depth-L fold (`Deepened`) is the deeper shallow fold with each op's multiplicity, and each peak
the memory model computes, extended along the line through the two.

What the step closes over is cut alike where it holds the depth as people hold it
(`stacks.with_free_variables_resized`): Equinox's static half of the model, a Flax NNX graphdef,
a Flax Linen module's or a config's layer count; and so is what the arguments hold outside their
pytree (`stacks.statics_resized`): a Flax TrainState's `apply_fn`, a Linen module's bound `apply`.
A step that reads its depth elsewhere (a module constant) fails to trace shallow, or folds to
different graphs, and is traced whole.

Layers that alternate (local and global attention every other layer) fold to different graphs at
3 and 4 layers, as half patterns do; such a step is traced at whole patterns, 4 layers and 6, and
a real layer's weights planned as those at its place in the last traced pattern. The 4-layer
trace, made first, tells which: folded with each layer's leaves grouped by their place in a pair,
alternating layers fold to fewer ops than grouped as one kind (`_pairs`). The two timelines are
matched where each folded op first and last runs (`_matched_times`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence

import jax
import numpy as np

from . import memory
from .capture import capture
from .fold import Deepened, Fold, along_depths, fold
from .ir import CaptureError, Graph
from .memo import share
from .propagate import first_stages
from .stacks import (
    key_names,
    layer_groups,
    resized,
    source_leaves,
    stacks,
    statics_resized,
    statics_restored,
    with_free_variables_resized,
)

# The layers per stack of the two traces, by the layers in the stack's repeating pattern: one, or
# two alternating (local and global attention in Gemma 2), traced at two and three patterns, the
# first of them the deeper trace of one kind of layer (three and four layers fold alike; two and
# three need not: the runs found in two copies of a layer are not always those found in three).
PAIRS = ((1, (3, 4)), (2, (4, 6)))


@dataclasses.dataclass(frozen=True)
class Shallow:
    """A step planned from shallow traces: the depth-L fold, the arguments as traced at the
    deeper shallow depth, and per leaf of the real arguments the traced leaf standing for it."""

    fold: Deepened
    abstract: tuple  # the arguments, as traced at the deeper depth
    out_shape: object  # the step's output tree, as traced at the deeper depth
    leaves: list[int]  # the deeper trace's value ids of `abstract`'s leaves
    sources: list[int]  # per leaf of the real arguments: index of its stand-in among `abstract`'s
    fold_seconds: float  # of the time taken, how much went to folding the two traces
    # The two shallow steps as traced, (fn, args) at each depth of `fold.depths[:2]`: what the
    # compiler guard compiles in place of the whole step (`search._guarded`).
    steps: tuple = ()


def shallow(fn, abstract: tuple, named: Sequence[tuple] | None = None) -> Shallow | None:
    """`fn(*abstract)` planned from two shallow traces, or None where its arguments hold no stack
    deep enough or the step does not follow them (`depth` module docstring). Layers that alternate
    fold differently at odd and even depths; they are traced to whole patterns (`PAIRS`), the
    deeper trace of one kind of layer kept for them. `named`: `stacks.named_leaves(abstract)`."""
    found = stacks(abstract, named=named)
    depths = {s.depth for s in found}
    if len(depths) != 1:
        return None  # no stack, or stacks of different depths (the line would not be one)
    (depth,) = depths
    traced = _Traced(fn, abstract, found, depth)
    for period, pair in _pairs(depth, traced):
        if all(traced.trace(k) is not None for k in pair):
            out = _traced_pair(traced, pair, period)
            if out is not None:
                return out
    return None


def _pairs(depth: int, traced: _Traced) -> list[tuple[int, tuple[int, int]]]:
    """The (period, pair) of `PAIRS` the stacks are deep enough for, in the order to try them.
    Where both are, the depth they share (4) is traced first and folded both ways: layers that
    alternate fold to fewer ops with each layer's leaves grouped by their place in a pair, and
    are then traced at whole patterns first, without the 3-layer trace that would not fold
    alike (10 layers traced in all, not 13)."""
    pairs = [(period, pair) for period, pair in PAIRS if pair[1] < depth and depth % period == 0]
    if len(pairs) == 2:
        (k,) = set(pairs[0][1]) & set(pairs[1][1])
        one, two = (traced.fold(k, period) for period, _ in pairs)
        if one is not None and two is not None and len(two.graph.ops) < len(one.graph.ops):
            pairs.reverse()
    return pairs


class _Traced:
    """The step's shallow traces (`_trace`), each made once, and their folds by layer period."""

    def __init__(self, fn, abstract: tuple, found, depth: int):
        self.fn, self.abstract, self.found, self.depth = fn, abstract, found, depth
        self.memo = {}  # kept for every trace of `fn` (an NNX graph is merged once for all of them)
        self.traces: dict[int, tuple | None] = {}  # layers -> `_trace`'s
        self.folds: dict[tuple[int, int], tuple] = {}  # (layers, period) -> (args, graph, leaves, fold)
        self.fold_seconds = 0.0

    def trace(self, k: int) -> tuple | None:
        if k not in self.traces:
            self.traces[k] = _trace(self.fn, self.abstract, self.found, self.depth, k, self.memo)
        return self.traces[k]

    def fold(self, k: int, period: int) -> Fold | None:
        got = self.folded(k, period)
        return got[3] if got is not None else None

    def folded(self, k: int, period: int) -> tuple | None:
        """(args, graph, its argument leaves, its fold) of the `k`-layer trace, each leaf of a
        layer one weight with those at its place in every pattern of `period` layers."""
        traced = self.trace(k)
        if traced is None:
            return None
        if (k, period) not in self.folds:
            _, args, _, graph = traced
            keys = [key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
            leaves = graph.inputs[len(graph.inputs) - len(keys) :]
            t = time.perf_counter()
            layers = [[leaves[j] for j in g] for g in layer_groups(keys, self.found, period)]
            self.folds[k, period] = (args, graph, leaves, fold(graph, keys, leaves, layers))
            self.fold_seconds += time.perf_counter() - t
        return self.folds[k, period]


def _trace(fn, abstract: tuple, found, depth: int, k: int, memo: dict) -> tuple | None:
    """The step with its stacks cut to `k` layers, captured: (fn, args, what `statics_resized`
    swapped, graph), or None where it cannot be cut or traced so."""
    args = resized(abstract, found, k)
    if args is None:
        return None
    args, swapped = statics_resized(args, found, depth, k)
    step = with_free_variables_resized(fn, found, depth, k, abstract, memo)
    try:
        return step, args, swapped, capture(step, *args, compact=True)
    except CaptureError:
        return None


def _traced_pair(traced: _Traced, pair: tuple[int, int], period: int) -> Shallow | None:
    """`shallow` from the traces at the two depths in `pair`, or None where they do not fold to the
    same graph or their timelines cannot be matched."""
    abstract, found, depth = traced.abstract, traced.found, traced.depth
    swaps, steps = {}, []
    for k in pair:
        step, args, swapped, _ = traced.trace(k)
        swaps.update(swapped)
        steps.append((step, args))
    (_, g1, _, f1), (args2, g2, leaves2, f2) = (traced.folded(k, period) for k in pair)
    matched = _same_graph(f1.graph, f2.graph)
    times = _matched_times(g1, f1, g2, f2, matched[1]) if matched is not None else None
    if matched is None or times is None:
        return None
    to_shallow, of_shallow = matched
    sources = source_leaves(abstract, args2, found, pair[1], period)
    outputs = _deep_outputs(g1.out_shape, g2.out_shape, f2.graph.outputs, pair, period, depth)
    if sources is None or outputs is None:
        return None
    depths = (*pair, depth)
    line = lambda x1, x2: int(round(along_depths(x1, x2, depths)))  # noqa: E731
    mult = _deep_mult(f1.graph, f2.graph, f1.mult, f2.mult, of_shallow, line)
    if any(m < 0 for m in mult):
        return None
    graph = dataclasses.replace(f2.graph, outputs=outputs[0], out_shape=statics_restored(outputs[1], swaps))
    # The deep graph is the shallow fold's ops with the deep step's outputs: what propagation and
    # pricing found of those ops holds for it, the first stages kept included (one dict for both).
    first_stages(f2.graph)
    share(graph, f2.graph)
    unmatched = _unmatched_scalars(f1.graph, of_shallow)
    deep = Deepened(f1, f2, graph, mult, to_shallow, unmatched, depths, times, line(f1.original_ops, f2.original_ops))
    return Shallow(deep, args2, g2.out_shape, list(leaves2), sources, traced.fold_seconds, tuple(steps))


def _same_graph(g1: Graph, g2: Graph) -> tuple[dict[int, int], list[int | None]] | None:
    """Where two folded graphs are the same computation op for op: (g2's value ids -> g1's, per
    op of g2 the op of g1 it is). Ops on scalars alone may differ: a chain of scalar adds (a
    global norm's sum over every leaf) grows by a few links a layer, and how a fold cuts it
    into periods depends on its length. So may ties (values that only share a sharding), where
    capture replays the layers in other runs at the two depths. Neither computes anything that
    a sharding changes, and g2's have no match."""
    if len(g1.inputs) != len(g2.inputs):
        return None
    ops1, ops2 = g1.ops, g2.ops
    if len(ops1) != len(ops2) or any(_sig(o1, g1) != _sig(o2, g2) for o1, o2 in zip(ops1, ops2)):
        ops1 = [o for o in ops1 if not _may_differ(o, g1)]
        ops2 = [o for o in ops2 if not _may_differ(o, g2)]
    if len(ops1) != len(ops2):
        return None
    out = dict(zip(g2.inputs, g1.inputs))
    of_shallow: list[int | None] = [None] * len(g2.ops)
    for o1, o2 in zip(ops1, ops2):
        if _sig(o1, g1) != _sig(o2, g2):
            return None
        out.update(zip(o2.results, o1.results))
        of_shallow[o2.id] = o1.id
    return out, of_shallow


def _sig(op, graph: Graph) -> tuple:
    return op.signature(graph.values), len(op.results)


def _may_differ(op, graph: Graph) -> bool:
    return op.primitive == "tie" or _on_scalars(op, graph)


def _on_scalars(op, graph: Graph) -> bool:
    return all(graph.values[v].shape == () for v in (*op.operands, *op.results) if v >= 0)


def _unmatched_scalars(g1: Graph, of_shallow: Sequence[int | None]) -> dict[int, int]:
    """The results of g1's ops that no op of g2 matched (ops on scalars alone, a scalar whole on
    every device; ties have none) -> their bytes."""
    matched = set(of_shallow)
    return {v: g1.values[v].nbytes for op in g1.ops if op.id not in matched for v in op.results}


def _deep_mult(
    g1: Graph, g2: Graph, mult1: Sequence[int], mult2: Sequence[int], of_shallow: Sequence[int | None], line
) -> list[int]:
    """Each deeper op's multiplicity at the step's depth: along the line through its match's and
    its own. Ops without a match (`_same_graph`) are counted by signature, the ops of one cost
    alike: each signature's total along the line through its totals, shared among its ops in
    proportion (a scalar chain cut into other links, the schedule's ops once a step)."""
    matched1 = {o for o in of_shallow if o is not None}
    total1, total2 = Counter(), Counter()
    for op in g1.ops:
        if op.id not in matched1:
            total1[_sig(op, g1)] += mult1[op.id]
    for op, o in zip(g2.ops, of_shallow):
        if o is None:
            total2[_sig(op, g2)] += mult2[op.id]
    scale = {s: line(total1[s], n) / n for s, n in total2.items() if n}
    out, running = [], Counter()  # per signature: the deeper trace's multiplicity of its ops so far
    for op, m, o in zip(g2.ops, mult2, of_shallow):
        if o is not None:
            out.append(line(mult1[o], m))
            continue
        s = _sig(op, g2)
        before = round(running[s] * scale.get(s, 1.0))
        running[s] += m
        out.append(round(running[s] * scale.get(s, 1.0)) - before)
    return out


def _matched_times(
    g1: Graph, f1: Fold, g2: Graph, f2: Fold, of_shallow: Sequence[int | None]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The times of two shallow timelines that stand for the same moment of any deeper one: per
    folded op the two folds share, the first time any op it stands for runs and the last. A
    layer's op first runs in the first layer and last in the last, the ops outside the layers
    once, at the same place at both depths; the middle layers' copies differ between depths and
    are left out. Ops the folds do not share (on scalars alone, `_same_graph`) are left out."""
    pairs = np.array([(i, j) for j, i in enumerate(of_shallow) if i is not None], dtype=np.int64).reshape(-1, 2)
    key1, key2 = np.full(len(f1.graph.ops), -1, dtype=np.int64), np.full(len(f2.graph.ops), -1, dtype=np.int64)
    key1[pairs[:, 0]] = key2[pairs[:, 1]] = pairs[:, 1]  # a shared op is named by its id in f2
    k1, k2 = _occurrences(g1, f1, key1), _occurrences(g2, f2, key2)
    common = [k for k in k1 if k in k2]
    if not common:
        return None
    return np.array([k1[k] for k in common], dtype=np.int64), np.array([k2[k] for k in common], dtype=np.int64)


def _occurrences(graph: Graph, f: Fold, key: np.ndarray) -> dict[tuple[int, int], int]:
    """(shared op, 0) -> the first time of `graph`'s unrolled timeline that runs an op it stands
    for, (shared op, 1) -> the last; `key`: per folded op of `f`, its shared id (-1: none)."""
    t = memory.table(graph)
    rep = f.op_rep[t.source]
    k = np.where(rep >= 0, key[np.maximum(rep, 0)], -1)
    ok = k >= 0
    if not ok.any():
        return {}
    order = np.lexsort((t.time[ok], k[ok]))
    k, at = k[ok][order], t.time[ok][order]
    bounds = np.flatnonzero(np.diff(k)) + 1
    firsts, lasts = np.concatenate(([0], bounds)), np.concatenate((bounds, [len(k)])) - 1
    return {(int(k[i]), 0): int(at[i]) for i in firsts} | {(int(k[i]), 1): int(at[i]) for i in lasts}


def _deep_outputs(out1, out2, values2: Sequence[int], pair: tuple[int, int], period: int, depth: int):
    """(value per output leaf, output tree) of the depth-L step: the deeper trace's outputs with
    each stack that grew from one trace to the other (at the depths in `pair`) grown to `depth`
    by whole patterns of `period` layers, as `source_leaves` maps the grown leaves back."""
    a, b = pair
    shallower = stacks(out1, min_depth=a)
    grown = [
        dataclasses.replace(s, depth=depth)
        for s in stacks(out2, min_depth=b)
        if s.depth == b and dataclasses.replace(s, depth=a) in shallower
    ]
    tree = resized(out2, grown, depth, period) if grown else out2
    if tree is None:
        return None
    sources = source_leaves(tree, out2, grown, b, period)
    if sources is None:
        return None
    return [values2[i] for i in sources], tree
