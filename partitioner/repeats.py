"""Repeated layers in an op sequence (TAP's folding): maximal runs of identical blocks, found in
near-linear time from the gaps between recurring op signatures."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from .ir import Graph
from .memo import PerGraph


@dataclasses.dataclass(frozen=True)
class Repeat:
    """`count` consecutive copies of a block of `period` ops starting at op `start`: an unrolled
    stack of identical layers (forward or backward). Planned once, applied to every copy."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count


def signature_ids(graph: Graph) -> list[int]:
    """Per op, an integer equal for ops with equal `Op.signature` (computed once per graph)."""
    return _SIGNATURES.get(graph, lambda: _signature_ids(graph))


_SIGNATURES = PerGraph("signature ids")


def _signature_ids(graph: Graph) -> list[int]:
    ids: dict[tuple, int] = {}
    return [ids.setdefault(op.sig if op.sig is not None else op.signature(graph.values), len(ids)) for op in graph.ops]


def find_repeats(
    graph: Graph, min_count: int = 2, min_period: int = 1, hints: Mapping[int, int] | None = None
) -> list[Repeat]:
    """Maximal runs of identical op blocks, longest coverage first, non-overlapping (`repeats`
    over op signatures, a matmul's marking a layer). In a compact graph, the two copies built
    before each replayed block are a candidate whatever their ops; so is each of `hints`
    (period -> a start)."""
    hints = dict(hints or {})
    for c in graph.copies:
        period, start = len(c.template), c.template[0] - len(c.template)
        if start >= 0:
            hints[period] = min(hints.get(period, start), start)
    return repeats(
        signature_ids(graph), [op.primitive == "dot_general" for op in graph.ops], min_count, min_period, hints
    )


def repeats(
    seq: Sequence[int],
    anchor: Sequence[bool],
    min_count: int = 2,
    min_period: int = 1,
    hints: dict[int, int] | None = None,
) -> list[Repeat]:
    """Maximal runs of identical blocks in `seq`, those that fold most away first, non-overlapping.

    Candidate periods are the gaps between consecutive occurrences of an anchor's id (each layer
    has its own matmuls) and of any other id that recurs at one gap twice in a row (each leaf of
    a norm its own reduction), and the `hints` given (period -> a start); each candidate is
    checked in one linear pass from where its run begins, so this stays near-linear in the
    length of `seq`."""
    arr = np.asarray(seq, dtype=np.int64)
    starts: dict[int, int] = {}  # period -> first op where it recurs
    if len(arr) > 2:
        # Each occurrence's gap to the previous occurrence of its id, and that one's gap.
        pos = np.lexsort((np.arange(len(arr)), arr))
        same = arr[pos[1:]] == arr[pos[:-1]]
        gap = np.where(same, pos[1:] - pos[:-1], -1)
        last_gap = np.concatenate(([-1], np.where(same[1:], gap[:-1], -1)))
        here, prev = pos[1:], pos[:-1]
        # An anchor seen twice is a layer's; any other id must recur at one gap twice.
        steady = (last_gap == gap) & same
        ok = same & (gap >= min_period) & (steady | np.asarray(anchor, dtype=bool)[here])
        first = np.where(steady, prev - gap, prev)[ok]
        order = np.argsort(here[ok], kind="stable")
        periods, at = np.unique(gap[ok][order], return_index=True)
        starts = dict(zip(periods.tolist(), first[order][at].tolist()))
    for period, start in (hints or {}).items():  # period -> where a known run starts
        if period >= min_period:
            starts[period] = min(starts.get(period, start), start)
    found: list[Repeat] = []
    for period in sorted(starts, reverse=True):
        found += _runs(arr[:-period] == arr[period:], period, max(0, starts[period] - period), min_count)
    chosen: list[Repeat] = []
    for r in sorted(found, key=lambda r: (-r.period * (r.count - 1), r.start)):  # most ops folded away
        if all(r.stop <= c.start or r.start >= c.stop for c in chosen):
            chosen.append(r)
    return sorted(chosen, key=lambda r: r.start)


def _runs(same: np.ndarray, period: int, begin: int, min_count: int) -> list[Repeat]:
    """Blocks of `period` ops repeated at least `min_count` times from op `begin` on, where
    `same[i]` says op i equals op i + period: each maximal stretch of equal ops, from its start
    (or from where the last repeat ended), holds length // period + 1 copies."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], same, [False])).astype(np.int8)))
    out, i = [], begin
    for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):  # same[a:b] all true
        start = max(a, i)
        if b - start < period * (min_count - 1):
            continue
        count = (b - start) // period + 1
        out.append(Repeat(start, period, count))
        i = start + period * count
    return out
