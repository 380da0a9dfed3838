"""Replaying repeated layers while the jaxpr is read (TAP's folding, moved into capture).

A Python loop over L identical layers unrolls to L copies of the same equations, and building
and folding them op by op was most of the search time of a deep model. Capture finds repeated
blocks among the top-level equations (`blocks`), builds the first two copies of each op by op,
and checks every later copy against the second, the template (`Template.match`): the same
primitives, shapes and dtypes, the parameters the factor rules read, literals in the same places
and the same dataflow inside the copy. A copy that matches is recorded by what differs, its
value ids (a shift) and the values it reads from outside (`ir.Copies`); the first copy that does not
match, and every later one, is built op by op.

A compact graph keeps the replayed copies as `Graph.copies`; `expand` rebuilds their ops, which
are exactly the ops capture would have built one by one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from .ir import Copies, RawOp

MIN_EQUATIONS = 8  # a shorter block of equations costs less to build than to check


def blocks(eqns: Sequence[Any], repeats) -> list[tuple[int, int, int]]:
    """(start, period, count) of runs of at least three identical-looking blocks of equations
    (primitive, operand count and first result's shape; `Template.match` checks the rest)."""
    ids: dict[tuple, int] = {}
    seq = [
        ids.setdefault((e.primitive, len(e.invars), e.outvars[0].aval.shape if e.outvars else None), len(ids))
        for e in eqns
    ]
    anchor = [e.primitive.name == "dot_general" for e in eqns]
    return [(r.start, r.period, r.count) for r in repeats(seq, anchor, 3, MIN_EQUATIONS)]


class Template:
    """The second copy of a block, as read: what a later copy must match to be replayed."""

    def __init__(self, eqns: Sequence[Any], env: dict, values: tuple[int, int], ops: list[RawOp], checked: list[int]):
        self.prims = [e.primitive for e in eqns]
        outs = [v for e in eqns for v in e.outvars]
        ins = [a for e in eqns for a in e.invars]
        self.shapes, self.dtypes = [v.aval.shape for v in outs], [v.aval.dtype for v in outs]
        literal = [type(a) is jcore.Literal for a in ins]
        self.n_in, self.literal_at = len(ins), [i for i, lit in enumerate(literal) if lit]
        var_at = [i for i, lit in enumerate(literal) if not lit]
        self.params = [(i, eqns[i].params) for i in checked]
        self.values = values
        start, stop = values
        self.out_ids = np.array([env[v] for v in outs], dtype=np.int64)
        read = np.array([env[ins[i]] for i in var_at], dtype=np.int64)
        self.inside = (read >= start) & (read < stop)
        self.read = read[self.inside]
        self.free, self.group = np.unique(read[~self.inside], return_inverse=True)
        # What a copy's shapes are checked by: made inside, its producer's results; else here.
        free_at = [i for i, inside in zip(var_at, self.inside) if not inside]
        self.free_shapes = [ins[i].aval.shape for i in free_at]
        self._vars, self._free = _getter(var_at), _getter(free_at)
        self.ops = ops
        op_reads = np.array([v for op in ops for v in op.operands if v >= 0 and not start <= v < stop], dtype=np.int64)
        # Replayable: everything it binds is made inside it (no result passed straight through
        # from outside) and its ops read from outside only through its equations' operands.
        self.ok = (
            bool(len(ops))
            and bool(((self.out_ids >= start) & (self.out_ids < stop)).all())
            and bool(np.isin(op_reads, self.free).all())
        )

    def match(self, eqns: Sequence[Any], env: dict, start: int) -> np.ndarray | None:
        """The values copy `eqns` (whose values would start at id `start`) reads in place of the
        template's `free`, its results bound in `env`; None if it is not a copy of the template."""
        if [e.primitive for e in eqns] != self.prims:
            return None
        outs = [v for e in eqns for v in e.outvars]
        ins = [a for e in eqns for a in e.invars]
        avals = [v.aval for v in outs]
        if (
            [a.shape for a in avals] != self.shapes
            or [a.dtype for a in avals] != self.dtypes
            or len(ins) != self.n_in
            or any(type(ins[i]) is not jcore.Literal for i in self.literal_at)
            or [a.aval.shape for a in self._free(ins)] != self.free_shapes
            or any(eqns[i].params != p for i, p in self.params)
        ):
            return None
        shift = start - self.values[0]
        env.update(zip(outs, (self.out_ids + shift).tolist()))
        try:
            read = np.fromiter(map(env.__getitem__, self._vars(ins)), dtype=np.int64)
        except (KeyError, TypeError):  # a literal where the template reads a value
            return None
        if not np.array_equal(read[self.inside], self.read + shift):
            return None
        got = read[~self.inside]
        free = np.empty(len(self.free), dtype=np.int64)
        free[self.group] = got
        if not np.array_equal(free[self.group], got) or (len(got) and got.max() >= start):
            return None  # one outside value read as two, or a read of the copy's own values there
        return free


def _getter(at: list[int]):
    """A list's items at `at`, as a sequence (itemgetter returns a bare item for one index)."""
    if not at:
        return lambda xs: ()
    if len(at) == 1:
        return lambda xs: (xs[at[0]],)
    return operator.itemgetter(*at)


class Replay:
    """While building: a template and the copies replayed from it; it stands in the builder's op
    list right after the template's ops."""

    def __init__(self, template: Template):
        self.template = template
        self.shifts: list[int] = []
        self.free_ids: list[np.ndarray] = []
        self.patterns: list[tuple[int, ...]] = []  # per copy, last first: template ops alive in it
        self._memo: dict[tuple, tuple] = {}

    def add(self, shift: int, free: np.ndarray) -> None:
        self.shifts.append(shift)
        self.free_ids.append(free)

    def sweep(self, needed: set) -> None:
        """Dead-op removal through the copies, last first: a copy keeps the template's ops that
        make what is needed after it (or feed those), and what they read is needed before it."""
        start, _ = self.template.values
        results = [r for op in self.template.ops for r in op.results]
        for k in range(len(self.shifts) - 1, -1, -1):
            shift = self.shifts[k]
            wanted = tuple(r for r in results if r + shift in needed)
            live, inside, free_at = self._pattern(wanted)
            self.patterns.append(live)
            needed.update((inside + shift).tolist())
            needed.update(self.free_ids[k][free_at].tolist())
        self.patterns.reverse()

    def _pattern(self, wanted: tuple) -> tuple:
        if wanted not in self._memo:
            start, stop = self.template.values
            need, live = set(wanted), []
            for j in range(len(self.template.ops) - 1, -1, -1):
                op = self.template.ops[j]
                if op.primitive == "tie" or not need.isdisjoint(op.results):
                    live.append(j)
                    need.update(op.operands)
            reads = np.array([v for j in live for v in self.template.ops[j].operands if v >= 0], dtype=np.int64)
            inside = (reads >= start) & (reads < stop)
            self._memo[wanted] = (
                tuple(reversed(live)),
                reads[inside],
                np.searchsorted(self.template.free, reads[~inside]),
            )
        return self._memo[wanted]

    def expand(self) -> list[RawOp]:
        """The copies' ops, as the builder would have made them."""
        start, stop = self.template.values
        out = []
        for shift, free in zip(self.shifts, self.free_ids):
            outside = dict(zip(self.template.free.tolist(), free.tolist()))
            for op in self.template.ops:
                operands = tuple(v + shift if start <= v < stop else outside.get(v, v) for v in op.operands)
                out.append(op._replace(operands=operands, results=tuple(r + shift for r in op.results)))
        return out

    def copies(self, template_ids: list[int]) -> Copies:
        return Copies(
            template_ids,
            self.template.values,
            list(self.shifts),
            self.template.free,
            np.array(self.free_ids, dtype=np.int64).reshape(len(self.shifts), len(self.template.free)),
        )
