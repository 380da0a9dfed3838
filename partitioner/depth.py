"""Depth: a deep stack of identical layers planned from two shallow traces (TAP's folding, moved
before the trace).

JAX traces a Python loop over L layers in time linear in L (a tenth of a second a layer for a
Llama step on one CPU core), so at 96 layers the trace alone outweighs the search. Where the step's
arguments hold the layers as a stack (a list or tuple, or dict entries keyed `0`, `1`, ... or
`layers_0`, `layers_1`, ..., of identically shaped subtrees: the parameters, and the optimizer
state that mirrors them) and the step loops over what it is given, it is traced with the first
SHALLOW[0] and the first SHALLOW[1] layers of every stack. Both fold to the same graph, one layer
planned for all, op for op; every quantity the search prices is then affine in the depth, and the
depth-L fold (`Deepened`) is the deeper shallow fold with each op's multiplicity, and each peak
the memory model computes, extended along the line through the two.

A step that reads its depth elsewhere (a closed-over Flax NNX graphdef or Equinox static part, a
range over a config's layer count) fails to trace shallow, or folds to different graphs, and is
traced whole.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from . import memory
from .arguments import key_name
from .capture import capture
from .fold import MIN_PERIOD, Fold, fold
from .ir import CaptureError, Graph
from .repeats import find_repeats, repeats, signature_ids

SHALLOW = (3, 4)  # layers per stack in the two traces
MIN_DEPTH = 8  # a shallower stack is traced whole: the two traces would cost as much

_MEMBER = re.compile(r"^(.*?)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Stack:
    """Members 0..depth-1 of a container at `path` (key names): a sequence's items
    (`prefix` None) or a dict's entries named `prefix` + index."""

    path: tuple[str, ...]
    prefix: str | None
    depth: int


def stacks(tree, min_depth: int = MIN_DEPTH) -> list[Stack]:
    """The outermost stacks of identically shaped members in `tree` (a pytree of arrays or
    ShapeDtypeStructs), at least `min_depth` deep."""
    members: dict[tuple, dict[int, list]] = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = _names(keys)
        for j, k in enumerate(keys):
            slot = _slot(k)
            if slot is not None:
                prefix, index = slot
                rest = (names[j + 1 :], tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None))
                members.setdefault((names[:j], prefix), {}).setdefault(index, []).append(rest)
    found = []
    for (path, prefix), by_index in members.items():
        n = len(by_index)
        first = by_index.get(0)
        if n >= min_depth and set(by_index) == set(range(n)) and all(by_index[i] == first for i in range(n)):
            found.append(Stack(path, prefix, n))
    return [s for s in found if not any(_inside(s, t) for t in found if t is not s)]


def _slot(key) -> tuple[str | None, int] | None:
    """(prefix, index) where `key` names a stack member: a sequence index, or a dict key that is
    an integer or ends in one."""
    if isinstance(key, jax.tree_util.SequenceKey):
        return None, key.idx
    if isinstance(key, jax.tree_util.DictKey):
        if isinstance(key.key, int):
            return "", key.key
        m = _MEMBER.match(str(key.key))
        if m:
            return m.group(1), int(m.group(2))
    return None


def _inside(s: Stack, t: Stack) -> bool:
    """Whether `s` lies within a member of `t`."""
    return len(s.path) > len(t.path) and s.path[: len(t.path)] == t.path and _index(t, s.path[len(t.path)]) is not None


def _index(s: Stack, name: str) -> int | None:
    """The member index a key name denotes in `s`'s container, or None."""
    if s.prefix is None:
        return int(name) if name.isdigit() else None
    m = _MEMBER.match(name)
    return int(m.group(2)) if m and m.group(1) == s.prefix else None


def resized(tree, found: Sequence[Stack], depth: int):
    """`tree` with every stack in `found` cut to its first `depth` members, or grown to `depth`
    by repeating its last. None where a stack's container is of a kind this cannot rebuild (only
    lists, tuples and dicts are)."""
    try:
        return _resized(tree, found, depth, ())
    except _Unbuildable:
        return None


class _Unbuildable(Exception):
    pass


def _resized(tree, found: Sequence[Stack], depth: int, path: tuple[str, ...]):
    here = [s for s in found if s.path == path]
    if here:
        return _resized_container(tree, here[0], found, depth, path)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)
    if len(flat) == 1 and flat[0][0] == ():
        return tree  # a leaf
    children = [_resized(child, found, depth, path + (key_name(keys[0]),)) for keys, child in flat]
    return jax.tree_util.tree_unflatten(treedef, children)


def _resized_container(tree, s: Stack, found, depth: int, path):
    if s.prefix is None and type(tree) in (list, tuple):
        items = list(tree[:depth]) + [tree[-1]] * max(0, depth - len(tree))
        return type(tree)(_resized(c, found, depth, path + (str(i),)) for i, c in enumerate(items))
    if s.prefix is None or type(tree) is not dict:
        raise _Unbuildable(path)
    members = {_index(s, str(k)): k for k in tree if _index(s, str(k)) is not None}
    last = members[max(members)]
    name = (lambda i: i) if isinstance(last, int) else (lambda i: f"{s.prefix}{i}")
    out = {
        k: _resized(child, found, depth, path + (str(k),))
        for k, child in tree.items()
        if _index(s, str(k)) is None or _index(s, str(k)) < depth
    }
    for i in range(len(members), depth):
        out[name(i)] = _resized(tree[last], found, depth, path + (str(name(i)),))
    return out


def source_leaves(full, shallow, found: Sequence[Stack], depth: int) -> list[int] | None:
    """Per leaf of `full`, the index of the leaf of `shallow` (the same tree with its stacks
    `depth` deep) that stands for it: a member beyond the shallow ones is its last member."""
    index = {_names(keys): i for i, (keys, _) in enumerate(jax.tree_util.tree_flatten_with_path(shallow)[0])}
    out = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(full)[0]:
        names = list(_names(keys))
        for s in found:
            n = len(s.path)
            if tuple(names[:n]) == s.path and len(names) > n:
                i = _index(s, names[n])
                if i is not None and i >= depth:
                    names[n] = names[n][: len(names[n]) - len(str(i))] + str(depth - 1)
        src = index.get(tuple(names))
        if src is None:
            return None
        out.append(src)
    return out


def _names(keys) -> tuple[str, ...]:
    return tuple(map(_name, keys))


_name = functools.lru_cache(maxsize=1 << 16)(key_name)  # (a deep model's ~10^4 leaves share a few hundred keys)


@dataclasses.dataclass
class Deepened:
    """The fold of the depth-L step, from the folds of two shallow traces that are the same graph
    op for op (`deep` the deeper): each op's multiplicity and each peak extended along the line
    through the two depths. The interface the search prices through (`Fold`'s)."""

    shallow: Fold
    deep: Fold
    graph: Graph  # the deeper fold's, its outputs those of the depth-L step
    mult: list[int]
    to_shallow: dict[int, int]  # the deeper fold's value ids -> the shallower's
    depths: tuple[int, int, int]  # the two traced, and the step's
    times: tuple[np.ndarray, np.ndarray]  # times of the two timelines that match (`_landmarks`)
    original_ops: int

    @property
    def materialized(self) -> set[int]:
        return self.deep.materialized

    def of(self, value: int) -> int:
        return self.deep.of(value)

    def _line(self, at_shallow: float, at_deep: float) -> int:
        return int(round(_along(at_shallow, at_deep, self.depths)))

    def _mapped(self, device_bytes: Mapping[int, int]) -> dict[int, int]:
        m = self.to_shallow
        return {m[v]: n for v, n in device_bytes.items() if v in m}

    def peak_bytes(self, device_bytes: Mapping[int, int], held=frozenset(), copies: bool = False) -> int:
        """`Fold.peak_bytes` at the step's depth. The peak itself is not affine in the depth (which
        time holds the most can move, and how many temporaries fit in result buffers not yet
        written), but at each time that both shallow timelines have (`_landmarks`: outside the
        repeated layers, or in the first or last copy of a run of them) the count of live
        temporaries of each size is, and so is that of the free result buffers: the heap is
        extended there, size by size, and its peak taken as `memory.peak` takes it."""
        fixed_a, profile_a, live_a = self.shallow.heap(
            self._mapped(device_bytes), {self.to_shallow[v] for v in held if v in self.to_shallow}, copies
        )
        fixed_b, profile_b, live_b = self.deep.heap(device_bytes, held, copies)
        fixed = self._line(fixed_a, fixed_b)
        if profile_a is None or profile_b is None:
            return fixed
        at_a, at_b = self.times
        profile = _along(profile_a[at_a], profile_b[at_b], self.depths)
        top = np.argpartition(-profile, min(memory.CANDIDATE_TIMES, len(profile) - 1))[: memory.CANDIDATE_TIMES]
        heaps = []
        for i in top:
            (temps_a, free_a), (temps_b, free_b) = live_a(int(at_a[i])), live_b(int(at_b[i]))
            heaps.append(memory.heap_bytes(self._counts(temps_a, temps_b), self._counts(free_a, free_b)))
        return fixed + int(max(heaps))

    def _counts(self, at_shallow: np.ndarray, at_deep: np.ndarray) -> Counter:
        """Sizes (size -> count) at the step's depth, from the sizes at the two traced depths."""
        a, b = Counter(at_shallow.astype(np.int64).tolist()), Counter(at_deep.astype(np.int64).tolist())
        return Counter({size: n for size in a | b if (n := self._line(a[size], b[size])) > 0})

    def remat_peak(self, device_bytes: Mapping[int, int], copies: bool = False) -> tuple[int, int] | None:
        deep = self.deep.remat_peak(device_bytes, copies)
        shallow = self.shallow.remat_peak(self._mapped(device_bytes), copies)
        if deep is None or shallow is None:
            return None
        return self._line(shallow[0], deep[0]), self._line(shallow[1], deep[1])


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


def shallow(fn, abstract: tuple) -> Shallow | None:
    """`fn(*abstract)` planned from two shallow traces, or None where its arguments hold no stack
    deep enough or the step does not follow them (`depth` module docstring)."""
    found = stacks(abstract)
    depths = {s.depth for s in found}
    if len(depths) != 1:
        return None  # no stack, or stacks of different depths (the line would not be one)
    (depth,) = depths
    traced, folding = [], 0.0
    for k in SHALLOW:
        args = resized(abstract, found, k)
        if args is None:
            return None
        try:
            graph = capture(fn, *args, compact=True)
        except CaptureError:
            return None
        keys = [_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
        leaves = graph.inputs[len(graph.inputs) - len(keys) :]
        t = time.perf_counter()
        traced.append((args, graph, leaves, fold(graph, keys, leaves)))
        folding += time.perf_counter() - t
    (_, g1, _, f1), (args2, g2, leaves2, f2) = traced
    to_shallow = _same_graph(f1.graph, f2.graph)
    times = _matched_times(g1, g2)
    if to_shallow is None or times is None:
        return None
    sources = source_leaves(abstract, args2, found, SHALLOW[1])
    outputs = _deep_outputs(g1.out_shape, g2.out_shape, f2.graph.outputs, depth)
    if sources is None or outputs is None:
        return None
    depths = (*SHALLOW, depth)
    line = lambda x1, x2: int(round(_along(x1, x2, depths)))  # noqa: E731
    mult = [line(m1, m2) for m1, m2 in zip(f1.mult, f2.mult)]
    if any(m < 0 for m in mult):
        return None
    graph = dataclasses.replace(f2.graph, outputs=outputs[0], out_shape=outputs[1])
    deep = Deepened(f1, f2, graph, mult, to_shallow, depths, times, line(f1.original_ops, f2.original_ops))
    return Shallow(deep, args2, g2.out_shape, list(leaves2), sources, folding)


def _along(at_a, at_b, depths: tuple[int, int, int]):
    """A quantity at the step's depth, from its values at the two traced depths (numbers or arrays):
    the line through them."""
    a, b, depth = depths
    return at_b + (depth - b) * (at_b - at_a) / (b - a)


def _same_graph(g1: Graph, g2: Graph) -> dict[int, int] | None:
    """Where two folded graphs are the same computation op for op: g2's value ids -> g1's."""
    if len(g1.ops) != len(g2.ops) or len(g1.inputs) != len(g2.inputs):
        return None
    out = dict(zip(g2.inputs, g1.inputs))
    for o1, o2 in zip(g1.ops, g2.ops):
        if o1.signature(g1.values) != o2.signature(g2.values) or len(o1.results) != len(o2.results):
            return None
        out.update(zip(o2.results, o1.results))
    return out


def _matched_times(g1: Graph, g2: Graph) -> tuple[np.ndarray, np.ndarray] | None:
    """The times of two shallow timelines that stand for the same moment of any deeper one: by
    the runs of repeated blocks that capture built and replayed, or else by those found on the
    timelines themselves (the two can cut the same repeats differently)."""
    for landmarks in (_built_landmarks, _timeline_landmarks):
        k1, k2 = landmarks(g1), landmarks(g2)
        if k1 is not None and k2 is not None and k1.keys() == k2.keys():
            return np.array(list(k1.values()), dtype=np.int64), np.array([k2[k] for k in k1], dtype=np.int64)
    return None


def _built_landmarks(graph: Graph) -> dict[tuple, int] | None:
    """`_landmarks` of the runs capture built (`find_repeats`) extended by their replayed
    copies; None where a run is not contiguous in time."""
    t = memory.table(graph)
    at = t.time[: len(graph.ops)]
    runs: dict[int, list[int]] = {}  # last built op -> [start time, period, copies]
    for r in find_repeats(graph, min_period=MIN_PERIOD):
        if at[r.stop - 1] - at[r.start] + 1 != r.period * r.count:
            return None
        runs[r.stop - 1] = [int(at[r.start]), r.period, r.count]
    for c in graph.copies:  # replayed copies run right after their template, the run's last copy
        run = runs.get(c.template[-1])
        if run is not None and run[1] == len(c.template):
            run[2] += len(c.shifts)
        else:
            runs[c.template[-1]] = [int(at[c.template[0]]), len(c.template), 1 + len(c.shifts)]
    spans = [(start, start + period * copies, period) for start, period, copies in sorted(runs.values())]
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return None
    return _landmarks(spans, t.end)


def _timeline_landmarks(graph: Graph) -> dict[tuple, int]:
    """`_landmarks` of the runs of repeated blocks found on the unrolled timeline."""
    t = memory.table(graph)
    order = np.argsort(t.time, kind="stable")
    sigs = np.asarray(signature_ids(graph), dtype=np.int64)[t.source[order]]
    anchor = [graph.ops[i].primitive == "dot_general" for i in t.source[order].tolist()]
    return _landmarks([(r.start, r.stop, r.period) for r in repeats(sigs, anchor, 2, MIN_PERIOD)], t.end)


def _landmarks(spans: list[tuple[int, int, int]], end: int) -> dict[tuple, int]:
    """Times of a timeline by what they are, given its runs of repeated blocks (start, stop,
    period): the n-th op outside the runs, or op i of the first or last copy of the n-th run (a
    run's middle copies differ between depths)."""
    keys: dict[tuple, int] = {}
    covered = np.zeros(end, dtype=bool)
    for n, (start, stop, period) in enumerate(spans):
        covered[start:stop] = True
        for i in range(period):
            keys[("run", n, "first", i)] = start + i
            keys[("run", n, "last", i)] = stop - period + i
    keys.update({("op", n): time for n, time in enumerate(np.flatnonzero(~covered).tolist())})
    return keys


def _deep_outputs(out1, out2, values2: Sequence[int], depth: int):
    """(value per output leaf, output tree) of the depth-L step: the deeper trace's outputs with
    each stack that grew from one trace to the other grown to `depth`."""
    a, b = SHALLOW
    shallower = stacks(out1, min_depth=a)
    grown = [
        dataclasses.replace(s, depth=depth)
        for s in stacks(out2, min_depth=b)
        if s.depth == b and dataclasses.replace(s, depth=a) in shallower
    ]
    tree = resized(out2, grown, depth) if grown else out2
    if tree is None:
        return None
    sources = source_leaves(tree, out2, grown, b)
    if sources is None:
        return None
    return [values2[i] for i in sources], tree
