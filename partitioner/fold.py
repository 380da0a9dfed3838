"""Folding (TAP's idea): a step with L identical layers is planned on a graph the size of one layer.

Three kinds of sameness collapse onto one representative:
    layers      consecutive identical blocks of ops (`find_repeats`: a forward or a backward layer);
                copy k's ops and values map to copy 0's, and its weights to copy 0's weights
    mirrors     an input whose key path ends with another input's path below its container (AdamW's
                `mu/layers/3/wq` mirrors `params/layers/3/wq`) joins the class of the one it mirrors
    duplicates  an op with the same signature on the same representative operands (the optimizer's
                per-leaf update chains, one per layer) is the op it repeats
Where copy k reads a value that copy 0 reads in a different form (a layer's input is the previous
layer's output in copy k but the embedding in copy 0), a `tie` op joins the two so propagation
gives them one sharding, the steady state of the unrolled graph.

Every folded op carries its multiplicity, so compute and communication are priced once and counted
L times; peak memory is computed on the unrolled timeline (`memory.peak`), because activations
saved by every layer add up there and nowhere else. A compact capture's replayed copies
(`Graph.copies`) fold onto their template without being walked op by op: their values by their
shift, their outside reads as pairs, their ops as multiplicity of the template's.

`Deepened` is the fold of a deep step made from the folds of two shallow traces (`depth`), priced
through the same interface; it lives here, beside `Fold`, so that what prices a fold imports no JAX
(`helper`'s process).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from . import memory
from .ir import Graph, Op
from .repeats import find_repeats, signature_ids
from .rules import tie_factors

MIN_PERIOD = 8  # blocks shorter than this are elementwise runs, left to duplicate folding


@dataclasses.dataclass
class Fold:
    graph: Graph  # representative ops, then ties; values are the original graph's
    rep: np.ndarray  # original value id -> representative value id
    mult: list[int]  # folded op id -> original ops it stands for (carries, for a tie)
    materialized: set[int]  # representatives of values that reach memory
    original_ops: int
    _life: memory.Liveness = dataclasses.field(repr=False)  # of the unrolled program
    # Per op of the original graph, the folded op that stands for it (-1: none, a constant only
    # folded-away ops read): what a time of the unrolled timeline computes, once folded.
    op_rep: np.ndarray = dataclasses.field(repr=False)

    def of(self, value: int) -> int:
        return int(self.rep[value]) if value >= 0 else value

    def peak_bytes(self, device_bytes: Mapping[int, int], held=frozenset(), copies: bool = False) -> int:
        """Most bytes live on one device over the unrolled program, as XLA lays buffers out
        (`memory.peak`); `device_bytes`: per representative value, its bytes on one device;
        `held`: representatives of values a combined all-reduce keeps until the last is made;
        `copies`: the backend copies a transposed lhs (`Hardware.copies_transposed_lhs`)."""
        return memory.peak(*self._sized(device_bytes, held), copies)

    def heap(self, device_bytes: Mapping[int, int], held=frozenset(), copies: bool = False):
        """`memory.heap` of the unrolled program, as `peak_bytes` reads it."""
        return memory.heap(*self._sized(device_bytes, held), copies)

    def _sized(self, device_bytes: Mapping[int, int], held) -> tuple:
        per_rep = np.zeros(len(self.rep), dtype=np.float64)
        for v, n in device_bytes.items():
            per_rep[v] = n
        reps = self.rep[self._life.values]
        return self._life, per_rep[reps], np.isin(reps, list(held))

    def remat_peak(self, device_bytes: Mapping[int, int], copies: bool = False) -> tuple[int, int] | None:
        """(peak, activation bytes saved) were every repeated layer rematerialised, `jax.checkpoint`
        around it: of the temporaries live at the heap's peak that repeated layers made, each
        layer keeps only what it hands the next (the largest value a tie carries), and one
        layer's share is live again while its backward pass recomputes it. An estimate from the
        unrolled liveness, for saying whether remat would make a plan fit; None where no layer
        repeats."""
        layered = [(op, n) for op, n in zip(self.graph.ops, self.mult) if n > 1 and op.primitive != "tie"]
        if not layered:
            return None
        per_rep = np.zeros(len(self.rep), dtype=np.float64)
        for v, n in device_bytes.items():
            per_rep[v] = n
        life = self._life
        reps = self.rep[life.values]
        sizes = np.where(life.copy & (not copies), 0.0, per_rep[reps])
        temp = ~(life.argument | life.result)
        at = int(np.argmax(memory.heap_profile(life.birth[temp], life.death[temp], sizes[temp], life.end)))
        made = np.isin(reps, [r for op, _ in layered for r in op.results])
        saved = float(sizes[temp & made & (life.birth <= at) & (life.death >= at)].sum())
        layers = max(n for _, n in layered)
        carried = max((per_rep[op.operands[0]] for op in self.graph.ops if op.primitive == "tie"), default=0.0)
        peak = self.peak_bytes(device_bytes, copies=copies)
        kept = min(saved, layers * carried)  # (a layer already rematerialised keeps no more than this)
        return int(peak - saved + kept + saved / layers), int(saved - kept)


def fold(
    graph: Graph,
    keys: Sequence[tuple[str, ...]] | None = None,
    input_ids: Sequence[int] | None = None,
    layers: Sequence[Sequence[int]] = (),
) -> Fold:
    """`keys`: the key path of each argument leaf, `input_ids` their value ids (for mirrors).
    A compact graph's replayed copies (`Graph.copies`) fold onto their template. `layers`: groups
    of argument values known to be one layer's leaf in each layer (or each pattern of layers) of a
    stack (`stacks.layer_groups`), each one weight from the start, and the runs they make found
    where they are read (`_repeats`): a trace of two patterns of alternating layers holds too
    few copies of a pattern for repeats to be found from the op sequence alone.

    Example:
        >>> f = fold(capture(step, state, batch, compact=True))
        >>> len(f.graph.ops), f.original_ops
        (704, 48125)
    """
    parent = _replayed_parents(graph)
    op_parent = list(range(len(graph.ops)))
    pairs: list[tuple[int, int, int]] = []  # (value in copy k, value in copy 0, copies) to tie
    in_copy = np.zeros(len(graph.ops), dtype=bool)
    is_input = set(graph.inputs)
    replayed = np.zeros(len(graph.ops), dtype=np.int64)  # per template op: copies replayed from it
    paths = _key_paths(keys, input_ids)
    _tie_layers(parent, layers)
    for c in graph.copies:  # each copy reads its `free_ids` where the template reads `free`
        replayed[c.template] = len(c.shifts)
        _pair(
            parent,
            pairs,
            is_input,
            c.free_ids.ravel().tolist(),
            np.tile(c.free, len(c.shifts)).tolist(),
            len(c.shifts) + 1,
            paths,
        )
    for r in _repeats(graph, layers):
        copies = r.count - 1 + int(replayed[r.start : r.stop].max())
        for k in range(1, r.count):
            base = r.start + k * r.period
            in_copy[base : base + r.period] = True
            for i in range(r.period):
                op_k, op_0 = graph.ops[base + i], graph.ops[r.start + i]
                op_parent[op_k.id] = op_0.id
                for a, b in zip(op_k.results, op_0.results):
                    parent[a] = b
                _pair(parent, pairs, is_input, op_k.operands, op_0.operands, copies, paths)
    if keys is not None and input_ids is not None:
        _merge_mirrors(graph, parent, keys, input_ids)
        _merge_untouched(graph, parent, keys, input_ids)
    kept, seen = [], {}
    # Constants (ops on literals and other constants only) stay one per use, since each use may
    # want its own sharding; equal ones hash alike, so the ops that read them can still be
    # duplicates. A constant made once for two uses would join them: optax's global norm squares
    # each real leaf's imaginary part, a broadcast zero, and one shared square tied every leaf of
    # one shape to the others' shardings (a column-parallel wq split wo like it).
    const: dict[int, tuple] = {}
    hkey = lambda v: const.get(v) or (_find(parent, v) if v >= 0 else v)
    sigs = signature_ids(graph)
    for op in graph.ops:
        if in_copy[op.id]:
            continue
        if op.body is None and all(v < 0 or v in const for v in op.operands):
            made = (sigs[op.id], tuple(hkey(v) for v in op.operands))
            const.update({r: ("const", made, i) for i, r in enumerate(op.results)})
            kept.append(op)
            continue
        key = (sigs[op.id], tuple(hkey(v) for v in op.operands), id(op.body) if op.body is not None else None)
        if key in seen:
            op_parent[op.id] = seen[key].id
            for a, b in zip(op.results, seen[key].results):
                parent[a] = b
            continue
        seen[key] = op
        kept.append(op)
    return _build(graph, parent, op_parent, kept, pairs, replayed)


def _tie_layers(parent, layers: Sequence[Sequence[int]]) -> None:
    """Each group's values one value: a stack's leaf in each of its layers is one weight."""
    for group in layers:
        for v in group[1:]:
            a, b = _find(parent, v), _find(parent, group[0])
            if a != b:
                parent[a] = b


def _repeats(graph: Graph, layers: Sequence[Sequence[int]]) -> list:
    """`find_repeats`, and where the layers of a stack are known (`fold`'s `layers`), the runs
    their values make wherever they are read. Two copies of a block are found from the op
    sequence alone only where a matmul recurs at the block's period; Gemma's two patterns of a
    local and a global layer hold matmuls that recur a layer apart, and the pattern's period is
    found here instead. Periods are read off where the ops that read one layer's leaf, or a
    value a found run makes in one copy, stand against those that read its twin in the next."""
    found = find_repeats(graph, min_period=MIN_PERIOD)
    if not layers:
        return found
    readers: dict[int, list[int]] = {}
    for op in graph.ops:
        for v in op.operands:
            readers.setdefault(v, []).append(op.id)
    pairs = [(a, b) for group in layers for a, b in zip(group, group[1:])]
    for r in found:
        for i in range(r.start, r.start + r.period):
            pairs += zip(graph.ops[i].results, graph.ops[i + r.period].results)
    hints: dict[int, int] = {}
    for a, b in pairs:
        xs, ys = readers.get(a, ()), readers.get(b, ())
        if len(xs) != len(ys):
            continue  # read differently: which reads correspond is not known
        for x, y in zip(xs, ys):
            if abs(y - x) >= MIN_PERIOD:  # (a backward pass reads its layers in reverse)
                hints[abs(y - x)] = min(hints.get(abs(y - x), x), x, y)
    return find_repeats(graph, min_period=MIN_PERIOD, hints=hints)


def _key_paths(keys, input_ids) -> dict[int, tuple[str, ...]]:
    """Input value id -> its key path."""
    if keys is None or input_ids is None:
        return {}
    return {v: tuple(k) for v, k in zip(input_ids, keys)}


_MEMBER = re.compile(r"^(.*?)(\d+)$")


def _one_layers_leaves(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether two key paths name different leaves of one container: they differ only in the
    leaf's name or its module's (`attn/q` and `attn/k`, `query/kernel` and `out/kernel`), and
    not as members of one stack (`layers_0/kernel` and `layers_1/kernel`). Paths that differ
    higher up (another layer, another optimizer slot) are left to the repeats and mirrors."""
    if len(a) != len(b) or a == b:
        return False
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if differ[0] < len(a) - 2:
        return False
    members = [(_MEMBER.match(a[i]), _MEMBER.match(b[i])) for i in differ]
    return not all(x and y and x.group(1) == y.group(1) for x, y in members)


def _replayed_parents(graph: Graph) -> list[int]:
    """Union-find parents with every replayed copy's values pointing at the template's."""
    parent = np.arange(len(graph.values), dtype=np.int64)
    for c in graph.copies:
        start, stop = c.values
        for shift in c.shifts:
            parent[start + shift : stop + shift] = np.arange(start, stop)
    return parent.tolist()


def _pair(
    parent: list[int],
    pairs: list,
    is_input: set,
    reads_k: Sequence[int],
    reads_0: Sequence[int],
    copies: int,
    paths: Mapping[int, tuple] | None = None,
) -> None:
    """Copy k reads `reads_k` where copy 0 reads `reads_0`: the same weight (layer k's is layer
    0's; the first class a weight joins holds), or two values to tie. Two leaves of one layer
    (`_one_layers_leaves`) are neither: same-shaped ones (T5's q, k, v and o) get identical
    optimizer updates, which repeat like layers, and one class would give them one sharding (a
    column-parallel q would split o by columns). Their updates are priced as the copy's; each
    keeps its own sharding."""
    for a, b in zip(reads_k, reads_0):
        if a < 0 or b < 0 or a == b:
            continue
        if a in is_input and b in is_input:
            pa, pb = (paths or {}).get(a), (paths or {}).get(b)
            if pa is not None and pb is not None and _one_layers_leaves(pa, pb):
                continue
            if parent[a] == a:
                parent[a] = _find(parent, b)
                continue
        pairs.append((a, b, copies))


def _find(parent: list[int], v: int) -> int:
    root = v
    while parent[root] != root:
        root = parent[root]
    while parent[v] != root:
        parent[v], v = root, parent[v]
    return root


def _merge_mirrors(graph: Graph, parent: list[int], keys, input_ids) -> None:
    by_path = {}
    for v, k in zip(input_ids, keys):
        by_path.setdefault((graph.values[v].shape, k[1:]), v)
    classes: dict[tuple, int] = {}
    for v, k in zip(input_ids, keys):
        shape = graph.values[v].shape
        for n in range(len(k) - 1, 0, -1):  # the longest tail that is another leaf's path
            u = by_path.get((shape, k[-n:]))
            if u is not None and u != v:
                cls = (k[: len(k) - n], _find(parent, u))
                if cls in classes:
                    a, b = _find(parent, v), _find(parent, classes[cls])
                    if a != b:
                        parent[a] = b
                else:
                    classes[cls] = v
                break


def _merge_untouched(graph: Graph, parent: list[int], keys, input_ids) -> None:
    """Arguments no op reads (an optimizer's placeholders, returned as they came: Adafactor keeps
    a `(1,)` for each unfactored leaf) join their fellows in the other layers, those at the same
    path but for the layer's index, so that a deeper model holds no more of them once folded."""
    read = {v for op in graph.ops for v in op.operands}
    for c in graph.copies:
        read.update(c.free_ids.ravel().tolist())
    first: dict[tuple, int] = {}
    for v, k in zip(input_ids, keys):
        if v in read:
            continue
        value = graph.values[v]
        u = first.setdefault((value.shape, value.dtype, tuple("#" if n.isdigit() else n for n in k)), v)
        a, b = _find(parent, v), _find(parent, u)
        if a != b:
            parent[a] = b


def _build(graph: Graph, parent, op_parent, kept: list[Op], pairs, replayed: np.ndarray) -> Fold:
    rep = memory.roots(parent)
    rep_list = rep.tolist()
    find = lambda v: rep_list[v] if v >= 0 else v
    read = {find(v) for op in kept for v in op.operands} | {find(v) for v in graph.outputs}
    kept = [
        op
        for op in kept
        if op.body is not None or any(v >= 0 for v in op.operands) or any(r in read for r in op.results)
    ]
    # Each original op counts toward its representative, a scan body's op `trips` times (a
    # constant only its folded-away readers used has no representative left).
    op_roots = memory.roots(op_parent)
    runs = np.bincount(
        op_roots,
        weights=[(op.trips if op.body is None else 1) * (1 + int(n)) for op, n in zip(graph.ops, replayed)],
        minlength=len(graph.ops),
    )
    mult = [int(runs[op.id]) for op in kept]
    new_id = np.full(len(graph.ops), -1, dtype=np.int64)
    new_id[[op.id for op in kept]] = np.arange(len(kept))
    ops = [dataclasses.replace(op, id=i, operands=tuple(find(v) for v in op.operands)) for i, op in enumerate(kept)]
    ties: dict[tuple[int, int], int] = {}
    p = np.array(pairs, dtype=np.int64).reshape(-1, 3)
    ends = rep[p[:, :2]]
    differ = ends[:, 0] != ends[:, 1]  # most pairs are one value once folded
    for (a, b), copies in zip(ends[differ].tolist(), p[differ, 2].tolist()):
        if graph.values[a].shape == graph.values[b].shape != ():  # (a scalar has no sharding to share)
            ties[(a, b)] = max(ties.get((a, b), 0), copies)
    for (a, b), copies in ties.items():
        ops.append(_tie(len(ops), a, b, graph.values[a].shape))
        mult.append(copies)
    inputs = list(dict.fromkeys(find(v) for v in graph.inputs))
    folded = Graph(
        graph.values, ops, inputs, [find(v) for v in graph.outputs], graph.input_paths, graph.unknown, graph.out_shape
    )
    life = memory.liveness(graph)
    materialized = set(rep[life.values[~life.copy]].tolist())
    return Fold(folded, rep, mult, materialized, graph.unrolled_ops, life, new_id[op_roots])


def _tie(op_id: int, a: int, b: int, shape) -> Op:
    return Op(op_id, "tie", (a, b), (), *tie_factors(shape), 0.0)


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
    unmatched: dict[int, int]  # the shallower fold's values (on scalars) no deeper one maps to -> bytes
    depths: tuple[int, int, int]  # the two traced, and the step's
    times: tuple[np.ndarray, np.ndarray]  # times of the two timelines that match (`_matched_times`)
    original_ops: int

    @property
    def materialized(self) -> set[int]:
        return self.deep.materialized

    def of(self, value: int) -> int:
        return self.deep.of(value)

    def _line(self, at_shallow: float, at_deep: float) -> int:
        return int(round(along_depths(at_shallow, at_deep, self.depths)))

    def _mapped(self, device_bytes: Mapping[int, int]) -> dict[int, int]:
        m = self.to_shallow
        return {m[v]: n for v, n in device_bytes.items() if v in m} | self.unmatched

    def peak_bytes(self, device_bytes: Mapping[int, int], held=frozenset(), copies: bool = False) -> int:
        """`Fold.peak_bytes` at the step's depth. The peak itself is not affine in the depth (which
        time holds the most can move, and how many temporaries fit in result buffers not yet
        written), but at each time that both shallow timelines have (`_matched_times`: outside the
        repeated layers, or in the first or last of them) the count of live
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
        profile = along_depths(profile_a[at_a], profile_b[at_b], self.depths)
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


def along_depths(at_a, at_b, depths: tuple[int, int, int]):
    """A quantity at the step's depth, from its values at the two traced depths (numbers or arrays):
    the line through them."""
    a, b, depth = depths
    return at_b + (depth - b) * (at_b - at_a) / (b - a)
