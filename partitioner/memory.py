"""Peak memory per device as XLA's buffer assignment lays it out: arguments and results each hold
their own buffer for the whole call, and temporaries share one heap; a temporary may live in a
result's buffer before that result is written, when it fits (XLA reuses a live-out allocation for
values whose live ranges end before the result's begins), otherwise it takes heap space.

    peak = arguments + results + max over time of (temporaries live - those a free result buffer holds)

Gradients reduced by one combined all-reduce (XLA's combiner packs independent all-reduces) all
stay live until the last of them is made.

Values live from the op that makes them to their last use, on the unrolled program's timeline,
an elementwise op fused into a later kernel reading when that kernel runs; which values reach
memory at all is `cost.materialized`. On a backend whose dot kernels cannot read a transposed lhs
(`Hardware.copies_transposed_lhs`, XLA:CPU) each such lhs has a transposed copy, made beside it
and freed after its dot.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from .ir import FactorKind, Graph, Op

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


def liveness(graph: Graph) -> Liveness:
    from .cost import FUSIBLE, materialized

    mat = materialized(graph)
    end = len(graph.ops)
    birth = {v: 0 for v in graph.inputs}
    death: dict[int, int] = {}
    fused = []  # elementwise ops whose results stay in registers
    for op in graph.ops:  # (a hot loop: ~10^5 ops at 96 layers)
        i = op.id
        for v in op.operands:
            death[v] = i
        for v in op.results:
            birth[v] = death[v] = i  # never used: gone right after it is made
        if op.primitive in FUSIBLE and mat.isdisjoint(op.results):
            fused.append(op)
    _read_in_kernel(fused, death)
    death.pop(-1, None)  # literals
    arguments, results = set(graph.inputs), {v for v in graph.outputs if v >= 0}
    for v in arguments | results:
        death[v] = end
    live = sorted(v for v in mat if v in birth)
    copies = [(op.operands[0], op.id) for op in graph.ops if _transposed_lhs(op)]
    values = live + [v for v, _ in copies]
    made = [birth[v] for v in live] + [dot if v in arguments else birth.get(v, dot) for v, dot in copies]
    return Liveness(np.array(values, dtype=np.int64), np.array(made, dtype=np.int64),
                    np.array([death[v] for v in live] + [dot for _, dot in copies], dtype=np.int64),
                    np.array([v in arguments for v in live] + [False] * len(copies), dtype=bool),
                    np.array([v in results and v not in arguments for v in live] + [False] * len(copies), dtype=bool), end,
                    np.array([False] * len(live) + [True] * len(copies), dtype=bool))


def _transposed_lhs(op: Op) -> bool:
    """A dot whose lhs is contracted over a dimension major to one it keeps (x^T y)."""
    if op.primitive != "dot_general" or op.operands[0] < 0:
        return False
    reduced = [op.factors[d[0]].kind is FactorKind.REDUCE for d in op.operand_dims[0] if d]
    return any(r and not later for i, r in enumerate(reduced) for later in reduced[i + 1:])


def _read_in_kernel(fused: list[Op], death: dict[int, int]) -> None:
    """Move reads by `fused` ops to when their kernel runs: such an op runs inside the fusion that
    makes the first materialized value downstream, so what it reads lives until then (XLA
    computes a GELU's gradient in one kernel that reads the pre-activation, the tanh and the
    incoming gradient). Last first, so a later fused reader has already pushed its reads on."""
    for op in reversed(fused):
        t = op.id
        for r in op.results:
            if death[r] > t:
                t = death[r]
        for v in op.operands:
            if death[v] < t:
                death[v] = t


def peak(life: Liveness, sizes: np.ndarray, held: np.ndarray | None = None, copies: bool = False) -> int:
    """`sizes`: bytes on one device of each of `life.values`; `held`: those a combined all-reduce
    reads (gradients), which live until the last of them is made, as the one collective that
    reduces them all waits for it; `copies`: the backend copies a transposed lhs."""
    if not copies:
        sizes = np.where(life.copy, 0.0, sizes)
    if held is not None:
        held = held & ~life.copy  # a copy is freed after its dot, whatever its source waits for
    temp = ~(life.argument | life.result)
    fixed = float(sizes[~temp].sum())
    if not temp.any():
        return int(fixed)
    slots = life.end + 2
    death = life.death
    if held is not None and held.any():
        death = np.where(held, np.maximum(death, life.birth[held].max()), death)
    t_birth, t_death, t_size = life.birth[temp], death[temp], sizes[temp]
    profile = np.cumsum(np.bincount(t_birth, t_size, slots) - np.bincount(t_death + 1, t_size, slots))[: max(life.end, 1)]
    times = np.argpartition(-profile, min(CANDIDATE_TIMES, len(profile) - 1))[:CANDIDATE_TIMES]
    r_birth, r_size = life.birth[life.result], sizes[life.result]
    heap = 0.0
    for t in times:
        live = t_size[(t_birth <= t) & (t_death >= t)]
        free = r_size[r_birth > t]  # results not written yet: their buffers can hold a temporary
        heap = max(heap, float(live.sum()) - _hosted(live, free))
    return int(fixed + heap)


def _hosted(temps: np.ndarray, buffers: np.ndarray) -> float:
    """Bytes of `temps` placed one per buffer in buffers at least as large, largest first, each in
    the smallest that fits (sizes come in few distinct values, so this runs on their counts)."""
    free = sorted(Counter(buffers.astype(np.int64).tolist()).items())
    hosted = 0.0
    for size, count in sorted(Counter(temps.astype(np.int64).tolist()).items(), reverse=True):
        for i, (room, left) in enumerate(free):
            if count == 0:
                break
            if room >= size and left:
                used = min(left, count)
                free[i] = (room, left - used)
                count -= used
                hosted += used * size
    return hosted
