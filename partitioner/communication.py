"""What a sharding assignment must communicate (`communication`): the partial sums a split
contracted dimension leaves (all-reduce, or reduce-scatter where the result is split over the same
axes) and the operands that arrive split otherwise than their op reads them (a reshard); with the
graph's facts it reads, found once per graph (`exchanges`, `constants`, `moved`), and how a
split lands on a dimension that merges several factors (`minor_factors`, `landing`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from .ir import FactorKind, Graph


@dataclasses.dataclass(frozen=True)
class Communication:
    op: int
    kind: str  # "all-reduce" or "reduce-scatter" (partial sums over REDUCE factors), or "reshard"
    value: int
    axes: tuple[str, ...]
    bytes: int  # of the value per device, before the collective


class Products(dict):
    """Mesh axes -> the product of their sizes, computed once per axes."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def __missing__(self, axes):
        self[axes] = n = math.prod(self.mesh[a] for a in axes)
        return n


def minor_factors(sizes: list[int], factors: tuple[int, ...]) -> tuple:
    """A dimension's factors after its major one, each (factor, size, product of those before it)."""
    out, before = [], sizes[factors[0]]
    for f in factors[1:]:
        out.append((f, sizes[f], before))
        before *= sizes[f]
    return tuple(out)


def landing(minor: tuple, t: int) -> int | None:
    """The minor factor that a split of its dimension into `t` contiguous blocks lands on, where
    the major one is too small to hold it: the first whose size `t` divides, where the factors
    before it split whole (their product divides `t`). Eight query heads read as two K/V groups
    of four, split four ways, are 2 x 2 blocks; the groups' factor stands for the split, with the
    same bytes and work per device (named axes cannot be halved). None where it cuts across."""
    for f, n, before in minor:
        if t % before:
            return None
        if n % t == 0:
            return f
    return None


def communication(
    graph: Graph, exchanges, scattered, shardings, factor_axes, size: np.ndarray, sizes: Products
) -> Iterator[Communication]:
    """The collectives an assignment implies: partial sums over REDUCE factors its axes split,
    and operands that arrive split otherwise than their op's factors say (a reshard). `exchanges`
    and `scattered`: the graph's, as `exchanges` and `moved` find them."""
    for op_id, (reduces, reads) in enumerate(exchanges):
        assigned = factor_axes[op_id]
        if assigned and reduces:
            for f, axes in assigned.items():
                if f in reduces:
                    for value in graph.ops[op_id].results:
                        # A result split over the reduced axes needs only its own part of the sums
                        # (a reduce-scatter over those), summed whole over the others (an
                        # all-reduce of that part): HSDP's gradients, split over data inside a
                        # slice and summed across slices.
                        split = {a for dim in shardings.get(value, ()) for a in dim}
                        parted = tuple(a for a in axes if a in split)
                        summed = tuple(a for a in axes if a not in split)
                        if parted:
                            yield Communication(op_id, "reduce-scatter", value, parted, int(size[value]))
                        if summed:
                            yield Communication(op_id, "all-reduce", value, summed, int(size[value]))
        for value, factors in reads:
            given = shardings.get(value)
            if given is None:
                continue
            for axes, slot in zip(given, factors):
                if not axes:
                    continue
                # The axes the op's factors give this dimension split so many ways: its major
                # factor's, or the minor factor's that such a split lands on (`landing`).
                if slot is None:
                    held = ()
                else:
                    factor, n, minor = slot
                    if minor and n % sizes[axes]:
                        factor = landing(minor, sizes[axes])
                    held = assigned.get(factor, ()) if factor is not None else ()
                if axes != held:
                    for moved in scattered.get(value, (value,)):
                        yield Communication(op_id, "reshard", moved, axes, int(size[moved]))
                    break


def exchanges(graph: Graph, constant: set[int]) -> list[tuple[frozenset, tuple]]:
    """Per op, what `communication` reads of it: its REDUCE factors, and each operand that can
    need moving (not a literal, not computed from literals alone: made in any layout, for free)
    with, per dimension, the factors it carries ((major, its size, `minor_factors`); None: none)."""
    out = []
    for op in graph.ops:
        # A gather from a table split along the indexed dim looks up the rows each device holds
        # and sums the parts (XLA's masked local gather, then an all-reduce): as a reduction.
        summed = (FactorKind.REDUCE, FactorKind.GATHER) if op.primitive == "gather" else (FactorKind.REDUCE,)
        reduces = frozenset(f for f, factor in enumerate(op.factors) if factor.kind in summed)
        sizes = [f.size for f in op.factors]
        reads = tuple(
            (v, tuple((fs[0], sizes[fs[0]], minor_factors(sizes, fs)) if fs else None for fs in dims))
            for v, dims in zip(op.operands, op.operand_dims)
            if v >= 0 and v not in constant
        )
        out.append((reduces, reads))
    return out


def constants(graph: Graph) -> set[int]:
    """Values computed from literals alone (a broadcast zero, an iota): XLA makes them in
    whatever sharding their reader wants."""
    out: set[int] = set()
    for op in graph.ops:
        if op.body is None and all(v < 0 or v in out for v in op.operands):
            out.update(op.results)
    return out


def moved(graph: Graph, constant: set[int]) -> dict[int, list[int]]:
    """Values whose resharding moves other values instead."""
    # A scatter-add into a constant buffer (an embedding's or a label lookup's gradient) is
    # made in whatever layout its reader wants by moving its small indices and updates instead.
    moved = {
        op.results[0]: [v for v in op.operands if v >= 0 and v not in constant]
        for op in graph.ops
        if op.primitive == "scatter-add" and op.operands[0] in constant
    }
    # A broadcast (a norm's scale against the activations) is made in whatever layout its reader
    # wants from its operand: moving the operand, not the broadcast value, is what that costs.
    moved.update(
        {
            op.results[0]: [op.operands[0]]
            for op in graph.ops
            if op.primitive == "broadcast_in_dim" and op.operands[0] >= 0 and op.operands[0] not in constant
        }
    )
    return moved
