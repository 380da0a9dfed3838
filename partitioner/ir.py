"""The partitioning IR: a user's step as ops whose dimensions are tied together by factors, so
shardings propagate through it in both directions (as GSPMD and Shardy do). `capture` builds it
from a jaxpr, with `rules` giving each primitive's factors; `repeats` finds repeated layers in it.

Every op names its factors (each with a size and a kind) and, for each operand and result
dimension, the factors that dimension is made of, major to minor (a reshape of [B, S, H*D] to
[B, S, H, D] gives dimension 2 the factors (H, D)). Sharding a factor over a mesh axis shards every
dimension that holds it as its major factor; the factor's kind says what that costs:

    PASS       appears in operands and results: sharding it needs no communication (batch, heads)
    REDUCE     contracted or reduced away: results are partial sums, an all-reduce (or
               reduce-scatter) makes them whole (the K of a matmul, a reduced axis)
    GATHER     the indexed dimension of a gather or scatter (an embedding's vocabulary)
    OPAQUE     cannot be sharded without moving data (a sliced, padded, sorted or concatenated dim)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class FactorKind(enum.Enum):
    PASS = "pass"
    REDUCE = "reduce"
    GATHER = "gather"
    OPAQUE = "opaque"


@dataclasses.dataclass(frozen=True)
class Factor:
    size: int
    kind: FactorKind


Dims = tuple[tuple[int, ...], ...]  # per dimension: factor indices, major to minor


# Values and ops are not frozen: a 96-layer step makes ~10^5 of them, and a frozen dataclass's
# __init__ (object.__setattr__ per field) was a fifth of capture. Nothing mutates them.
@dataclasses.dataclass(eq=False)
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property
    def nbytes(self) -> int:
        return (
            math.prod(self.shape) * np.dtype(self.dtype).itemsize if self.dtype != "key" else 8 * math.prod(self.shape)
        )


@dataclasses.dataclass
class Copies:
    """Copies of a repeated layer that a compact capture did not build op by op: each is the
    template (ops `template` of `Graph.ops`, one copy of the layer) with every value it makes moved
    by that copy's shift, and every value it reads from outside the layer (`free`, sorted)
    replaced by that copy's own (`free_ids`). They run right after the template, in order."""

    template: list[int]  # op ids, in order
    values: tuple[int, int]  # the template's value ids: [start, stop)
    shifts: list[int]  # per copy: added to the template's value ids
    free: np.ndarray  # value ids outside the template that it reads
    free_ids: np.ndarray  # [copy, len(free)]: what each copy reads in their place

    def map_all(self, ids: np.ndarray) -> np.ndarray:
        """[copy, len(ids)]: each copy's value ids where the template has `ids` (-1, a literal,
        stays -1)."""
        start, stop = self.values
        inside = (ids >= start) & (ids < stop)
        out = np.where(inside, ids + np.asarray(self.shifts, dtype=np.int64)[:, None], ids)
        outside = ~inside & (ids >= 0)
        if outside.any():
            out[:, outside] = self.free_ids[:, np.searchsorted(self.free, ids[outside])]
        return out


class RawOp(NamedTuple):
    """An op while the step is captured: `Op`'s fields but the id, given once the ops no result
    is needed from are dropped (a tuple: ~10^5 of them are made, copied and shifted)."""

    primitive: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    factors: tuple[Factor, ...]
    operand_dims: tuple[Dims, ...]
    result_dims: tuple[Dims, ...]
    flops: float
    body: Graph | None
    trips: int
    sig: Any


@dataclasses.dataclass(eq=False, slots=True)
class Op:
    id: int
    primitive: str
    operands: tuple[int, ...]  # value ids (-1: a literal)
    results: tuple[int, ...]
    factors: tuple[Factor, ...]
    operand_dims: tuple[Dims, ...]
    result_dims: tuple[Dims, ...]
    flops: float
    body: Graph | None = None  # scan / while / cond: the captured body (first branch for cond)
    trips: int = 1  # runs per call: a scan's length for ops of its inlined body; a loop's body trips
    sig: Any = None  # equal for ops the capture built from the same rule, shapes and params (cheap to hash)

    def signature(self, values: Sequence[Value]) -> tuple:
        """Equal for the same computation on the same shapes, whatever the value ids: used to
        recognise repeated layers."""
        shapes = tuple(values[v].shape if v >= 0 else () for v in self.operands)
        return (
            self.primitive,
            shapes,
            tuple(values[v].shape for v in self.results),
            self.factors,
            self.operand_dims,
            self.result_dims,
        )


@dataclasses.dataclass(eq=False)  # by identity: what reads a graph keeps its caches keyed by it (`memo`)
class Graph:
    values: list[Value]
    ops: list[Op]
    inputs: list[int]
    outputs: list[int]
    input_paths: list[str]
    unknown: dict[str, int]  # primitives captured as OPAQUE for want of a rule, with counts
    out_shape: Any = None  # the function's output pytree of ShapeDtypeStructs (top-level graph)
    copies: list[Copies] = dataclasses.field(default_factory=list)  # a compact capture's replayed layers

    def flops(self, primitive: str | None = None) -> float:
        """FLOPs of one call (loop bodies and inlined scan bodies times their trips); of one
        primitive if named."""
        per_op = [
            (op.flops * (op.trips if op.body is None else 1) if primitive in (None, op.primitive) else 0.0)
            + (op.body.flops(primitive) * op.trips if op.body else 0.0)
            for op in self.ops
        ]
        return sum(per_op) + sum(len(c.shifts) * sum(per_op[i] for i in c.template) for c in self.copies)

    @property
    def unrolled_ops(self) -> int:
        """Ops of the unrolled program, replayed copies included."""
        return len(self.ops) + sum(len(c.shifts) * len(c.template) for c in self.copies)


class CaptureError(ValueError):
    """The function could not be traced to a jaxpr with the arguments given."""
