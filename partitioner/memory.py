"""Peak memory per device as XLA's buffer assignment lays it out: arguments and results each hold
their own buffer for the whole call, and temporaries share one heap; a temporary may live in a
result's buffer before that result is written, when it fits (XLA reuses a live-out allocation for
values whose live ranges end before the result's begins), otherwise it takes heap space.

    peak = arguments + results + max over time of (temporaries live - those a free result buffer holds)

Gradients reduced by one combined all-reduce (XLA's combiner packs independent all-reduces) all
stay live until the last of them is made.

Values live from the op that makes them to their last use, on the unrolled program's timeline,
an elementwise op fused into a later kernel reading when that kernel runs; which values reach
memory at all is `materialized` (XLA's fusion, below). On a backend whose dot kernels cannot read a transposed lhs
(`Hardware.copies_transposed_lhs`, XLA:CPU) each such lhs has a transposed copy, made beside it
and freed after its dot.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from .ir import FactorKind, Graph, Op
from .rules import ELEMENTWISE

CANDIDATE_TIMES = 6  # the heap peak is sought at the times most temporaries are live


@dataclasses.dataclass(frozen=True)
class Liveness:
    values: np.ndarray  # value ids that reach memory
    birth: np.ndarray  # op index that makes each (0 for arguments)
    death: np.ndarray  # op index of its last use, inclusive (the end for arguments and results)
    argument: np.ndarray  # bool per value
    result: np.ndarray  # bool per value (and not an argument)
    end: int
    copy: np.ndarray  # bool per entry: a dot's transposed lhs (its value id repeated), on some backends only


@dataclasses.dataclass(frozen=True)
class Table:
    """The unrolled program's ops as arrays (a compact graph's replayed copies included): row r
    is an op at `time[r]` on the unrolled timeline, built from `Graph.ops[source[r]]`; `reads`
    and `makes` list every operand and result with its row."""

    time: np.ndarray
    source: np.ndarray
    reads: np.ndarray
    read_row: np.ndarray
    lhs: np.ndarray  # per row: its first operand (-1 if none or a literal)
    makes: np.ndarray
    make_row: np.ndarray
    end: int


def table(graph: Graph) -> Table:
    """Example: `table(capture(step, *args, compact=True)).end` is the unrolled op count."""
    n = len(graph.ops)
    inserted = np.zeros(n + 1, dtype=np.int64)  # replayed ops before each op of the graph
    for c in graph.copies:
        inserted[c.template[-1] + 1] += len(c.template) * len(c.shifts)
    time = np.arange(n, dtype=np.int64) + np.cumsum(inserted)[:n]
    reads = [v for op in graph.ops for v in op.operands]
    makes = [v for op in graph.ops for v in op.results]
    parts = [
        (
            time,
            np.arange(n, dtype=np.int64),
            np.array(reads, dtype=np.int64),
            np.repeat(np.arange(n), [len(op.operands) for op in graph.ops]),
            np.array([op.operands[0] if op.operands else -1 for op in graph.ops], dtype=np.int64),
            np.array(makes, dtype=np.int64),
            np.repeat(np.arange(n), [len(op.results) for op in graph.ops]),
        )
    ]
    rows = n
    for c in graph.copies:
        parts.append(_replayed(graph, c, time[c.template[-1]] + 1, rows))
        rows += len(c.template) * len(c.shifts)
    cat = [np.concatenate(x) for x in zip(*parts)]
    return Table(*cat, end=graph.unrolled_ops)


def _replayed(graph: Graph, c, first_time: int, first_row: int) -> tuple:
    """Rows of a block's replayed copies: copy k's op j is template op j, its values moved."""
    ops = [graph.ops[i] for i in c.template]
    m, copies = len(ops), len(c.shifts)
    base = first_row + m * np.arange(copies)[:, None]  # [copy, 1]
    reads = np.array([v for op in ops for v in op.operands], dtype=np.int64)
    read_j = np.repeat(np.arange(m), [len(op.operands) for op in ops])
    makes = np.array([v for op in ops for v in op.results], dtype=np.int64)
    make_j = np.repeat(np.arange(m), [len(op.results) for op in ops])
    lhs = np.array([op.operands[0] if op.operands else -1 for op in ops], dtype=np.int64)
    shifts = np.asarray(c.shifts, dtype=np.int64)[:, None]
    return (
        (first_time + m * np.arange(copies)[:, None] + np.arange(m)).ravel(),
        np.tile(np.asarray(c.template), copies),
        c.map_all(reads).ravel(),
        (base + read_j).ravel(),
        c.map_all(lhs).ravel(),
        (makes + shifts).ravel(),
        (base + make_j).ravel(),
    )


def liveness(graph: Graph) -> Liveness:

    t = table(graph)
    mat = materialized_mask(graph, t)
    nv = len(graph.values)
    birth = np.full(nv, -1, dtype=np.int64)
    birth[graph.inputs] = 0
    birth[t.makes] = t.time[t.make_row]
    death = np.full(nv + 1, -1, dtype=np.int64)  # (the last slot takes literals' reads)
    death[t.makes] = t.time[t.make_row]  # never used: gone right after it is made
    np.maximum.at(death, t.reads, t.time[t.read_row])
    _read_in_kernel(graph, t, mat, death)
    death = death[:nv]
    arguments = np.zeros(nv, dtype=bool)
    arguments[graph.inputs] = True
    results = np.zeros(nv, dtype=bool)
    results[[v for v in graph.outputs if v >= 0]] = True
    results &= ~arguments
    death[arguments | results] = t.end
    live = np.flatnonzero(mat & (birth >= 0))
    dots = np.flatnonzero(np.array([_transposed_lhs(op) for op in graph.ops], dtype=bool)[t.source])
    dots = dots[np.argsort(t.time[dots], kind="stable")]
    lhs, at = t.lhs[dots], t.time[dots]
    made = np.where(arguments[lhs] | (birth[lhs] < 0), at, birth[lhs])
    copy = np.concatenate([np.zeros(len(live), dtype=bool), np.ones(len(dots), dtype=bool)])
    return Liveness(
        np.concatenate([live, lhs]),
        np.concatenate([birth[live], made]),
        np.concatenate([death[live], at]),
        np.concatenate([arguments[live], np.zeros(len(dots), dtype=bool)]),
        np.concatenate([results[live], np.zeros(len(dots), dtype=bool)]),
        t.end,
        copy,
    )


def _transposed_lhs(op: Op) -> bool:
    """A dot whose lhs is contracted over a dimension major to one it keeps (x^T y)."""
    if op.primitive != "dot_general" or op.operands[0] < 0:
        return False
    reduced = [op.factors[d[0]].kind is FactorKind.REDUCE for d in op.operand_dims[0] if d]
    return any(r and not later for i, r in enumerate(reduced) for later in reduced[i + 1 :])


def _read_in_kernel(graph: Graph, t: Table, mat: np.ndarray, death: np.ndarray) -> None:
    """Move reads by fused ops to when their kernel runs: an elementwise op none of whose results
    reach memory runs inside the fusion that makes the first materialized value downstream, so
    what it reads lives until then (XLA computes a GELU's gradient in one kernel that reads the
    pre-activation, the tanh and the incoming gradient)."""

    fusible = np.array([op.primitive in FUSIBLE for op in graph.ops], dtype=bool)[t.source]
    stored = np.zeros(len(t.time), dtype=bool)
    stored[t.make_row[mat[t.makes]]] = True
    fused = fusible & ~stored
    made, reads = fused[t.make_row], fused[t.read_row]
    make_v, make_r, read_v, read_r = t.makes[made], t.make_row[made], t.reads[reads], t.read_row[reads]
    root = _chain_ends(t, fused, death.shape[0])
    while True:  # pushes along fan-outs, one level a round (chains are one hop, `_chain_ends`)
        kernel = t.time.copy()
        np.maximum.at(kernel, make_r, death[make_v])
        kernel = kernel[root]
        before = death[read_v]
        np.maximum.at(death, read_v, kernel[read_r])
        if np.array_equal(before, death[read_v]):
            return


def _chain_ends(t: Table, fused: np.ndarray, slots: int) -> np.ndarray:
    """Per row, the fused op at the end of its chain: a fused op whose one result only one fused op
    reads runs in that op's kernel (a scalar sum over every gradient is such a chain, as long as
    the model has leaves), found by pointer jumping."""
    rows = len(t.time)
    results = np.bincount(t.make_row, minlength=rows)
    readers = np.bincount(t.reads % slots, minlength=slots)  # (the last slot counts literals, -1)
    reader = np.full(slots, -1, dtype=np.int64)
    reader[t.reads] = t.read_row
    nxt = np.arange(rows)
    one = fused[t.make_row] & (results[t.make_row] == 1) & (readers[t.makes] == 1)
    q = reader[t.makes[one]]
    link = fused[q]
    nxt[t.make_row[one][link]] = q[link]
    return roots(nxt)


def roots(parent) -> np.ndarray:
    """Every element's root in a forest given by each element's parent (a root its own), by
    pointer jumping: log-depth numpy passes."""
    root = np.asarray(parent, dtype=np.int64)
    while True:
        up = root[root]
        if np.array_equal(up, root):
            return root
        root = up


def peak(life: Liveness, sizes: np.ndarray, held: np.ndarray | None = None, copies: bool = False) -> int:
    """`sizes`: bytes on one device of each of `life.values`; `held`: those a combined all-reduce
    reads (gradients), which live until the last of them is made, as the one collective that
    reduces them all waits for it; `copies`: the backend copies a transposed lhs."""
    fixed, profile, live_at = heap(life, sizes, held, copies)
    if profile is None:
        return int(fixed)
    times = np.argpartition(-profile, min(CANDIDATE_TIMES, len(profile) - 1))[:CANDIDATE_TIMES]
    return int(fixed + max(heap_bytes(*(Counter(x.astype(np.int64).tolist()) for x in live_at(int(t)))) for t in times))


def heap(life: Liveness, sizes: np.ndarray, held: np.ndarray | None = None, copies: bool = False):
    """`peak`'s parts: (bytes of the arguments and results, the temporaries' bytes live at each
    time or None where there are none, and per time the sizes of the temporaries live then and
    of the result buffers not yet written, which can hold some of them: `heap_bytes`)."""
    if not copies:
        sizes = np.where(life.copy, 0.0, sizes)
    if held is not None:
        held = held & ~life.copy  # a copy is freed after its dot, whatever its source waits for
    temp = ~(life.argument | life.result)
    fixed = float(sizes[~temp].sum())
    if not temp.any():
        return fixed, None, None
    death = life.death
    if held is not None and held.any():
        death = np.where(held, np.maximum(death, life.birth[held].max()), death)
    t_birth, t_death, t_size = life.birth[temp], death[temp], sizes[temp]
    r_birth, r_size = life.birth[life.result], sizes[life.result]

    def live_at(t: int) -> tuple[np.ndarray, np.ndarray]:
        return t_size[(t_birth <= t) & (t_death >= t)], r_size[r_birth > t]

    return fixed, heap_profile(t_birth, t_death, t_size, life.end), live_at


def heap_bytes(temps: Counter, buffers: Counter) -> float:
    """Heap bytes for temporaries of these sizes (size -> count), less those placed one per
    buffer in result buffers not yet written that are at least as large, largest first, each in
    the smallest that fits."""
    free = sorted(buffers.items())
    heap = 0.0
    for size, count in sorted(temps.items(), reverse=True):
        heap += size * count
        for i, (room, left) in enumerate(free):
            if count == 0:
                break
            if room >= size and left:
                used = min(left, count)
                free[i] = (room, left - used)
                count -= used
                heap -= used * size
    return max(0.0, heap)


def heap_profile(birth: np.ndarray, death: np.ndarray, sizes: np.ndarray, end: int) -> np.ndarray:
    """Bytes of the given temporaries live at each op of the unrolled timeline."""
    slots = end + 2
    return np.cumsum(np.bincount(birth, sizes, slots) - np.bincount(death + 1, sizes, slots))[: max(end, 1)]


# -- fusion: which values reach memory at all -------------------------------------------------

FUSIBLE = ELEMENTWISE | {"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "iota"}


def materialized(graph: Graph) -> set[int]:
    """Values that reach memory: inputs, outputs, whatever a non-fusible op makes or reads, and
    values read more than once unless cheap to recompute. XLA fuses chains of elementwise ops (an
    optimizer update is one kernel), so a value passed once inside such a chain costs no memory
    traffic or space; a cheap elementwise value (no transcendental, no division) read by several
    fusions is recomputed in each of them from what they already read, as XLA duplicates cheap
    producers into their consumers; an expensive one read twice is kept."""
    return set(np.flatnonzero(materialized_mask(graph)).tolist())


def materialized_mask(graph: Graph, rows: Table | None = None) -> np.ndarray:
    """`materialized` as a mask over value ids, on the unrolled program (`table`)."""
    t = rows if rows is not None else table(graph)
    nv = len(graph.values)
    out = np.zeros(nv + 1, dtype=bool)  # (the last slot takes literals, -1)
    out[graph.inputs] = True
    out[[v for v in graph.outputs if v >= 0]] = True
    kind = np.array(
        [0 if op.primitive not in FUSIBLE else 1 if op.primitive in EXPENSIVE else 2 for op in graph.ops], dtype=np.int8
    )[t.source]
    out[t.reads[kind[t.read_row] == 0]] = True
    out[t.makes[kind[t.make_row] == 0]] = True
    consumers = np.bincount(t.reads[t.reads >= 0], minlength=nv)
    cheap = np.zeros(nv, dtype=bool)
    cheap[t.makes[kind[t.make_row] == 2]] = True
    out = out[:nv]
    return out | ((consumers > 1) & ~cheap)


EXPENSIVE = {
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "tan",
    "erf",
    "erfc",
    "erf_inv",
    "pow",
    "sqrt",
    "rsqrt",
    "cbrt",
    "div",
    "rem",
    "atan2",
}
