"""The partitioning IR: a user's step captured from its jaxpr as ops whose dimensions are tied
together by factors, so shardings propagate through it in both directions (as GSPMD and Shardy do).

Every op names its factors (each with a size and a kind) and, for each operand and result
dimension, the factors that dimension is made of, major to minor (a reshape of [B, S, H*D] to
[B, S, H, D] gives dimension 2 the factors (H, D)). Sharding a factor over a mesh axis shards every
dimension that holds it as its major factor; the factor's kind says what that costs:

    PASS       appears in operands and results: sharding it needs no communication (batch, heads)
    REDUCE     contracted or reduced away: results are partial sums, an all-reduce (or
               reduce-scatter) makes them whole (the K of a matmul, a reduced axis)
    GATHER     the indexed dimension of a gather or scatter (an embedding's vocabulary)
    OPAQUE     cannot be sharded without moving data (a sliced, padded, sorted or concatenated dim)

Calls (`jit`, `custom_jvp_call`, `custom_vjp_call`, `checkpoint`) are inlined. A `scan` is inlined
once, its ops marked to run `length` times: each scanned input is read through a `scan_slice` op
(the stacked dimension sequential, the rest passing through), each stacked output is written by a
`scan_stack` op, and `tie` ops join a carry's initial value, its value inside the body and its
next value, so a scanned stack of layers is one layer to propagate and plan. `while` and `cond`
keep their bodies as sub-graphs, priced but not sharded.

A Python loop over layers unrolls into repeated blocks of top-level equations; capture builds two
copies of each and replays the rest from the second (`replay`), so its time grows with depth by
checking and renaming, not by building. `capture(..., compact=True)` keeps the replayed copies as
`Graph.copies` (the fold and the memory model read them so); by default they are expanded into
ops, exactly those capture would have built one by one.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from . import replay
from .replay import Copies


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


@dataclasses.dataclass
class Graph:
    values: list[Value]
    ops: list[Op]
    inputs: list[int]
    outputs: list[int]
    input_paths: list[str]
    unknown: dict[str, int]  # primitives captured as OPAQUE for want of a rule, with counts
    out_shape: Any = None  # the function's output pytree of ShapeDtypeStructs (top-level graph)
    copies: list[Copies] = dataclasses.field(default_factory=list)  # a compact capture's replayed layers
    _signature_ids: list[int] | None = dataclasses.field(default=None, repr=False, compare=False)
    _constants: set[int] | None = dataclasses.field(default=None, repr=False, compare=False)
    _op_info: list | None = dataclasses.field(default=None, repr=False, compare=False)

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


def capture(fn, *args, compact: bool = False) -> Graph:
    """Trace `fn(*args)` (arrays or ShapeDtypeStructs) and build its partitioning graph.

    `compact`: keep later copies of a repeated layer as `Graph.copies` (the fold and the memory
    model read them so) instead of building their ops (`replay`).

    Example:
        >>> g = capture(step, abstract_state, abstract_batch)
        >>> [op.primitive for op in g.ops if op.primitive == "dot_general"][:2]
    """
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as e:
        raise CaptureError(
            f"tracing {getattr(fn, '__name__', fn)} with the given arguments failed: {type(e).__name__}: {e}"
        ) from e
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    graph = _Builder().build(closed.jaxpr, paths, compact)
    graph.out_shape = out_shape
    return graph


class _Builder:
    def __init__(self, replay_layers: bool = True):
        self.values: list[Value] = []
        self.ops: list = []  # Op fields but the id (given once dead ops are dropped), or a `replay.Replay`
        self.replay_layers = replay_layers
        self.unknown: dict[str, int] = {}
        self.memo: dict[tuple, tuple] = {}
        self.sigs: dict[tuple, tuple] = {}
        self.trips = 1  # inside an inlined scan body: how many times its ops run

    def build(self, jaxpr, paths: Sequence[str], compact: bool = False) -> Graph:
        env: dict[Any, int] = {}
        inputs = [self._bind(env, v) for v in list(jaxpr.constvars) + list(jaxpr.invars)]
        if self.replay_layers:
            self._top(jaxpr.eqns, env)
        else:
            self._eqns(jaxpr.eqns, env)
        outputs = [self._read(env, v) for v in jaxpr.outvars]
        consts = [f"const{i}" for i in range(len(jaxpr.constvars))]
        ops, copies = _live_ops(self.ops, outputs, compact)
        return Graph(self.values, ops, inputs, outputs, consts + list(paths), self.unknown, copies=copies)

    def _top(self, eqns, env) -> None:
        """Build the top level, replaying later copies of repeated blocks from their second copy."""
        done = 0
        for start, period, count in replay.blocks(eqns, repeats):
            self._eqns(eqns[done : start + period], env)
            first, values, unknown = len(self.ops), len(self.values), dict(self.unknown)
            second = eqns[start + period : start + 2 * period]
            self._eqns(second, env)
            done = start + 2 * period
            template = replay.Template(
                second,
                env,
                (values, len(self.values)),
                self.ops[first:],
                [j for j, e in enumerate(second) if not _params_free(e)],
            )
            if not template.ok:
                continue
            marker = replay.Replay(template)
            size = len(self.values) - values
            new_unknown = {k: n - unknown.get(k, 0) for k, n in self.unknown.items() if n != unknown.get(k, 0)}
            for k in range(2, count):
                free = template.match(eqns[start + k * period : start + (k + 1) * period], env, len(self.values))
                if free is None:
                    break
                marker.add(len(self.values) - values, free)
                self.values.extend(self.values[values : values + size])  # (shared: a Value's id is unused)
                for name, n in new_unknown.items():
                    self.unknown[name] += n
                done = start + (k + 1) * period
            if marker.shifts:
                self.ops.append(marker)
        self._eqns(eqns[done:], env)

    def _new_value(self, aval) -> int:
        n = len(self.values)
        self.values.append(Value(n, tuple(map(int, aval.shape)), _dtype_name(aval.dtype)))
        return n

    def _bind(self, env, var) -> int:
        env[var] = self._new_value(var.aval)
        return env[var]

    def _read(self, env, atom) -> int:
        return -1 if type(atom) is jcore.Literal else env[atom]  # (`type is`: hot, ~10^5 calls)

    def _eqns(self, eqns, env) -> None:
        for eqn in eqns:
            if eqn.primitive.name == "scan":
                self._scan(eqn, env)
                continue
            inner = _inlined_jaxpr(eqn)
            if inner is not None:
                sub_env = {}
                for var, atom in zip(inner.invars, eqn.invars):
                    sub_env[var] = self._read(env, atom)
                for var, const in zip(inner.constvars, getattr(eqn.params.get("jaxpr"), "consts", ())):
                    sub_env[var] = self._new_value(jcore.get_aval(const))
                self._eqns(inner.eqns, sub_env)
                for var, out in zip(eqn.outvars, inner.outvars):
                    env[var] = self._read(sub_env, out)
                continue
            operands = tuple([-1 if type(a) is jcore.Literal else env[a] for a in eqn.invars])
            results = tuple([self._bind(env, v) for v in eqn.outvars])
            in_shapes = tuple([tuple(a.aval.shape) for a in eqn.invars])  # (lists: ~10^5 calls)
            out_shapes = tuple([tuple(v.aval.shape) for v in eqn.outvars])
            body, trips = self._body(eqn)
            name = eqn.primitive.name
            rule = RULES.get(name)
            if rule is None:
                if name not in ELEMENTWISE:
                    if body is None:
                        self.unknown[name] = self.unknown.get(name, 0) + 1
                    rule = _opaque if body is None else _control_flow
                else:
                    rule = _elementwise
            factors, op_dims, res_dims, flops, sig = self._factors(rule, eqn, in_shapes, out_shapes)
            trips = trips if body is not None else self.trips
            self.ops.append(
                (name, operands, results, factors, op_dims, res_dims, flops, body, trips, sig if body is None else None)
            )

    def _scan(self, eqn, env) -> None:
        body = eqn.params["jaxpr"]
        nc, nk, length = eqn.params["num_consts"], eqn.params["num_carry"], int(eqn.params["length"])
        outer = [self._read(env, a) for a in eqn.invars]
        inner = body.jaxpr.invars
        sub = {var: self._new_value(jcore.get_aval(c)) for var, c in zip(body.jaxpr.constvars, body.consts)}
        for var, v in zip(inner[:nc], outer[:nc]):
            sub[var] = v
        carries = []
        for var, v in zip(inner[nc : nc + nk], outer[nc : nc + nk]):
            sub[var] = self._new_value(var.aval)
            carries.append(sub[var])
            self._raw("tie", (v, sub[var]), (), *tie_factors(var.aval.shape))
        for var, v in zip(inner[nc + nk :], outer[nc + nk :]):
            sub[var] = self._new_value(var.aval)
            self._raw("scan_slice", (v,), (sub[var],), *_stacked(tuple(var.aval.shape), length, stacked_result=False))
        saved, self.trips = self.trips, self.trips * length
        self._eqns(body.jaxpr.eqns, sub)
        self.trips = saved
        outs = [self._read(sub, o) for o in body.jaxpr.outvars]
        for k, (carry, out) in enumerate(zip(carries, outs[:nk])):
            if out >= 0:
                self._raw("tie", (carry, out), (), *tie_factors(self.values[carry].shape))
            env[eqn.outvars[k]] = out if out >= 0 else carry
        for var, out in zip(eqn.outvars[nk:], outs[nk:]):
            result = self._bind(env, var)
            shape = tuple(var.aval.shape)[1:]
            self._raw("scan_stack", (out,), (result,), *_stacked(shape, length, stacked_result=True))

    def _raw(self, name, operands, results, factors, op_dims, res_dims) -> None:
        self.ops.append(
            (name, operands, results, factors, op_dims, res_dims, 0.0, None, 1, (name, factors, op_dims, res_dims))
        )

    def _factors(self, rule, eqn, in_shapes, out_shapes):
        """The rule's answer, memoised: a 96-layer model asks the same question 96 times."""
        try:
            key = (
                rule,
                eqn.primitive.name,
                in_shapes,
                out_shapes,
                tuple(sorted(eqn.params.items())) if rule is not _elementwise else (),
            )
            hash(key)
        except TypeError:  # unhashable params (a jaxpr, an array): no memo
            key = None
        if key is not None and key in self.memo:
            return self.memo[key]
        factors, op_dims, res_dims, flops = rule(eqn, list(in_shapes), list(out_shapes))
        answer = (tuple(factors), tuple(op_dims), tuple(res_dims), float(flops))
        if key is None:
            return answer + (None,)
        # A signature, computed once per memo entry: ops on the same shapes with the same
        # factors are alike whatever their params (a layer's slice of a stack starts elsewhere).
        sig = self.sigs.setdefault((eqn.primitive.name, in_shapes, out_shapes) + answer[:3], ("sig", len(self.sigs)))
        self.memo[key] = answer = answer + (sig,)
        return answer

    def _body(self, eqn):
        name = eqn.primitive.name  # (a scan is inlined by `_scan`)
        if name == "while":
            return _Builder(False).build(eqn.params["body_jaxpr"].jaxpr, []), 1
        if name == "cond":
            return _Builder(False).build(eqn.params["branches"][0].jaxpr, []), 1
        return None, 1


def tie_factors(shape):
    """Factors and dims of an op joining two values of one shape, dimension by dimension (a scan's
    carry and its next value; in a folded graph, a copy's input and the previous copy's output)."""
    factors = tuple(Factor(int(n), FactorKind.PASS) for n in shape)
    dims = tuple((i,) for i in range(len(shape)))
    return factors, (dims, dims), ()


def _stacked(shape, length: int, stacked_result: bool):
    """One slice of a scanned array and the array: the stacked dimension is sequential."""
    factors = tuple(Factor(int(n), FactorKind.PASS) for n in shape) + (Factor(length, FactorKind.OPAQUE),)
    rest = tuple((i,) for i in range(len(shape)))
    whole = ((len(shape),),) + rest
    return (factors, (rest,), (whole,)) if stacked_result else (factors, (whole,), (rest,))


@functools.cache
def _dtype_name(dtype) -> str:
    return "key" if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).name


def _live_ops(ops: list, outputs: list[int], compact: bool) -> tuple[list[Op], list[Copies]]:
    """Drop ops whose results nothing needs (a loss computed under `grad` but not returned):
    XLA removes them too, and their collectives would be priced for nothing. Replayed copies stay
    compact where asked and where each keeps the same ops as its template, else they are built."""
    markers = [m for m in ops if type(m) is replay.Replay]
    if markers and not compact:
        return _live_ops([o for m in ops for o in (m.expand() if type(m) is replay.Replay else (m,))], outputs, False)
    needed = set(outputs)  # (-1, a literal, is no result: harmless here)
    keep = []
    for op in reversed(ops):
        if type(op) is replay.Replay:
            op.sweep(needed)
        elif not needed.isdisjoint(op[2]) or op[0] == "tie":  # a carry feeds the next iteration
            keep.append(op)
            needed.update(op[1])
    kept = {id(op): i for i, op in enumerate(reversed(keep))}
    copies = []
    for m in markers:
        live = tuple(j for j, op in enumerate(m.template.ops) if id(op) in kept)
        if any(p != live for p in m.patterns):  # an edge copy keeps other ops: build them all
            return _live_ops(ops, outputs, False)
        if live:
            copies.append(m.copies([kept[id(m.template.ops[j])] for j in live]))
    return [Op(i, *op) for i, op in enumerate(reversed(keep))], copies


def _params_free(eqn) -> bool:
    """The factor rule reads only the equation's shapes (its params only move data around)."""
    name = eqn.primitive.name
    if name in ("scan", "while", "cond") or _inlined_jaxpr(eqn) is not None:
        return False
    return RULES.get(name) in (
        None,
        _elementwise,
        _same_where_unchanged,
        _reshape,
        _fresh,
    )  # (None: elementwise or opaque)


_CALLS = {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "checkpoint",
    "remat",
    "remat2",
    "custom_lin",
}


def _inlined_jaxpr(eqn):
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if j is not None:
            return getattr(j, "jaxpr", j)
    return None


# -- factor rules --------------------------------------------------------------------------------

ELEMENTWISE = {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "rem",
    "max",
    "min",
    "pow",
    "integer_pow",
    "square",
    "sqrt",
    "rsqrt",
    "cbrt",
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
    "neg",
    "sign",
    "abs",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "erf",
    "erfc",
    "erf_inv",
    "select_n",
    "convert_element_type",
    "eq",
    "ne",
    "lt",
    "gt",
    "le",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "stop_gradient",
    "copy",
    "copy_p",
    "clamp",
    "nextafter",
    "atan2",
    "reduce_precision",
    "bitcast_convert_type",
    "threefry2x32",
    "random_wrap",
    "random_unwrap",
    "random_fold_in",
    "imag",
    "real",
    "conj",
    "population_count",
}


def _own(shape, factors, kind=FactorKind.PASS) -> Dims:
    dims = []
    for d in shape:
        factors.append(Factor(int(d), kind))
        dims.append((len(factors) - 1,))
    return tuple(dims)


def _elementwise(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    shape = max(out_shapes + in_shapes, key=len)
    dims = _own(shape, factors)
    rank = len(shape)
    op_dims = [dims if len(s) == rank and s == shape else _broadcast_dims(s, shape, dims) for s in in_shapes]
    res_dims = [dims[rank - len(s) :] if len(s) <= rank else _own(s, factors) for s in out_shapes]
    return factors, op_dims, res_dims, math.prod(shape)


def _broadcast_dims(s, shape, dims) -> Dims:
    # Rank-0 operands (scalars) and size-1 dims hold no factor.
    if not s:
        return ()
    offset = len(shape) - len(s)
    return tuple(dims[offset + i] if d == shape[offset + i] else () for i, d in enumerate(s))


def _opaque(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    op_dims = [_own(s, factors, FactorKind.OPAQUE) for s in in_shapes]
    res_dims = [_own(s, factors, FactorKind.OPAQUE) for s in out_shapes]
    return factors, op_dims, res_dims, 0.0


def _control_flow(eqn, in_shapes, out_shapes):
    """Outer operands of a loop or cond: carries and constants map to the body's values (kept in
    `Op.body`); here, every dimension is its own factor, the scanned one sequential."""
    factors: list[Factor] = []
    op_dims = [_own(s, factors) for s in in_shapes]
    res_dims = [_own(s, factors) for s in out_shapes]
    return factors, op_dims, res_dims, 0.0


def _broadcast_in_dim(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    res = _own(out_shapes[0], factors)
    bdims = eqn.params["broadcast_dimensions"]
    op = tuple(res[o] if in_shapes[0][i] == out_shapes[0][o] else () for i, o in enumerate(bdims))
    return factors, [op] + [() for _ in in_shapes[1:]], [res], 0.0


def _transpose(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    op = _own(in_shapes[0], factors)
    return factors, [op], [tuple(op[p] for p in eqn.params["permutation"])], 0.0


def _reshape(eqn, in_shapes, out_shapes):
    """Group dimensions whose products match. In a group where one side is a single dimension
    (a merge or a split), the other side's dims are the factors and the single dim holds them
    all, major to minor; a group that reorders on both sides cannot keep a sharding."""
    a, b = list(in_shapes[0]), list(out_shapes[0])
    factors: list[Factor] = []
    da: list[tuple] = []
    db: list[tuple] = []
    for ga, gb in _reshape_groups(a, b):
        if len(ga) == 1 or len(gb) == 1:
            finer, coarse_a = (ga, False) if len(ga) >= len(gb) else (gb, True)
            sizes = [a[k] for k in ga] if not coarse_a else [b[k] for k in gb]
            ids: list[int | None] = []
            for x in sizes:  # a unit dimension holds no factor: nothing to shard there
                ids.append(None if x == 1 else len(factors))
                if x != 1:
                    factors.append(Factor(int(x), FactorKind.PASS))
            whole = tuple(i for i in ids if i is not None)
            fine = [(i,) if i is not None else () for i in ids]
            if coarse_a:
                da += [whole] * len(ga)
                db += fine
            else:
                da += fine
                db += [whole] * len(gb)
        else:
            da += list(_own([a[k] for k in ga], factors, FactorKind.OPAQUE))
            db += list(_own([b[k] for k in gb], factors, FactorKind.OPAQUE))
    return factors, [tuple(da)] + [() for _ in in_shapes[1:]], [tuple(db)], 0.0


def _reshape_groups(a: list[int], b: list[int]) -> list[tuple[list[int], list[int]]]:
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb = ([i] if i < len(a) else []), ([j] if j < len(b) else [])
        pa, pb = (a[i] if ga else 1), (b[j] if gb else 1)
        while pa != pb:
            if pa < pb and ga and ga[-1] + 1 < len(a):
                ga.append(ga[-1] + 1)
                pa *= a[ga[-1]]
            elif pb < pa and gb and gb[-1] + 1 < len(b):
                gb.append(gb[-1] + 1)
                pb *= b[gb[-1]]
            else:
                break
        groups.append((ga, gb))
        i, j = (ga[-1] + 1 if ga else i), (gb[-1] + 1 if gb else j)
    return groups


def _squeeze(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    res = _own(out_shapes[0], factors)
    dropped = set(d % max(len(in_shapes[0]), 1) for d in eqn.params["dimensions"])
    it = iter(res)
    op = tuple(() if i in dropped else next(it) for i in range(len(in_shapes[0])))
    return factors, [op], [res], 0.0


def _expand_dims(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    op = _own(in_shapes[0], factors)
    added = set(eqn.params["dimensions"])
    it = iter(op)
    res = tuple(() if i in added else next(it) for i in range(len(out_shapes[0])))
    return factors, [op], [res], 0.0


def _dot_general(eqn, in_shapes, out_shapes):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = in_shapes
    factors: list[Factor] = []
    ldims: list[tuple] = [()] * len(ls)
    rdims: list[tuple] = [()] * len(rs)
    out = []
    for l, r in zip(lb, rb):
        factors.append(Factor(ls[l], FactorKind.PASS))
        ldims[l] = rdims[r] = (len(factors) - 1,)
        out.append((len(factors) - 1,))
    for _side, dims, shape, skip in ((0, ldims, ls, set(lc) | set(lb)), (1, rdims, rs, set(rc) | set(rb))):
        for d in range(len(shape)):
            if d not in skip:
                factors.append(Factor(shape[d], FactorKind.PASS))
                dims[d] = (len(factors) - 1,)
                out.append((len(factors) - 1,))
    for l, r in zip(lc, rc):
        factors.append(Factor(ls[l], FactorKind.REDUCE))
        ldims[l] = rdims[r] = (len(factors) - 1,)
    flops = 2 * math.prod(f.size for f in factors)
    return factors, [tuple(ldims), tuple(rdims)], [tuple(out)], flops


def _reduce(eqn, in_shapes, out_shapes):
    axes = set(eqn.params["axes"])
    factors: list[Factor] = []
    op = []
    res = []
    for d, size in enumerate(in_shapes[0]):
        factors.append(Factor(size, FactorKind.REDUCE if d in axes else FactorKind.PASS))
        op.append((len(factors) - 1,))
        if d not in axes:
            res.append((len(factors) - 1,))
    return factors, [tuple(op)] + [() for _ in in_shapes[1:]], [tuple(res) for _ in out_shapes], math.prod(in_shapes[0])


def _along_axis(kind_of_axis: FactorKind, param: str):
    """Ops that keep the shape but move data along one axis (cumsum, sort, concat, ...)."""

    def rule(eqn, in_shapes, out_shapes):
        axis = eqn.params[param]
        shape = out_shapes[0]
        factors: list[Factor] = []
        dims = []
        for d, size in enumerate(shape):
            factors.append(Factor(size, kind_of_axis if d == axis else FactorKind.PASS))
            dims.append((len(factors) - 1,))
        op_dims = [
            tuple(dims[d] if d != axis else (_own((s[d],), factors, FactorKind.OPAQUE)[0][0],) for d in range(len(s)))
            if len(s) == len(shape)
            else ()
            for s in in_shapes
        ]
        return factors, op_dims, [tuple(dims) for _ in out_shapes], math.prod(shape)

    return rule


def _same_where_unchanged(eqn, in_shapes, out_shapes):
    """slice, pad, dynamic_slice, rev, ...: a dim whose size is unchanged passes through; a dim
    that is cut or padded cannot be sharded without moving data."""
    shape, src = out_shapes[0], in_shapes[0]
    factors: list[Factor] = []
    op, res = [], []
    for a, b in zip(src, shape):
        if a == b:
            factors.append(Factor(a, FactorKind.PASS))
            op.append((len(factors) - 1,))
            res.append((len(factors) - 1,))
        else:
            op.append(_own((a,), factors, FactorKind.OPAQUE)[0])
            res.append(_own((b,), factors, FactorKind.OPAQUE)[0])
    extra = [
        res
        if s == shape and i == 1 and eqn.primitive.name == "dynamic_update_slice"
        else _own(s, factors, FactorKind.OPAQUE)
        for i, s in enumerate(in_shapes[1:], 1)
    ]
    return factors, [tuple(op)] + extra, [tuple(res)], 0.0


def _gather(eqn, in_shapes, out_shapes):
    """Offset dims of the result come from operand dims taken whole; batch dims from the
    indices; an operand dim that is indexed (an embedding's vocabulary) is a GATHER factor."""
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    operand, indices, out = in_shapes[0], in_shapes[1], out_shapes[0]
    factors: list[Factor] = []
    op_dims: list[tuple] = [()] * len(operand)
    res_dims: list[tuple] = [()] * len(out)
    offset_operand = [
        d
        for d in range(len(operand))
        if d not in dn.collapsed_slice_dims and d not in getattr(dn, "operand_batching_dims", ())
    ]
    for out_d, op_d in zip(dn.offset_dims, offset_operand):
        kind = FactorKind.PASS if sizes[op_d] == operand[op_d] else FactorKind.OPAQUE
        factors.append(Factor(out[out_d], kind))
        res_dims[out_d] = (len(factors) - 1,)
        if kind is FactorKind.PASS:
            op_dims[op_d] = (len(factors) - 1,)
    batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
    index_batch = [d for d in range(len(indices)) if d != len(indices) - 1]
    idx_dims: list[tuple] = [()] * len(indices)
    for out_d, idx_d in zip(batch_out, index_batch):
        factors.append(Factor(out[out_d], FactorKind.PASS))
        res_dims[out_d] = idx_dims[idx_d] = (len(factors) - 1,)
    # Batched gathers (take_along_axis): those operand dims run alongside the indices' batch dims.
    for op_d, idx_d in zip(getattr(dn, "operand_batching_dims", ()), getattr(dn, "start_indices_batching_dims", ())):
        op_dims[op_d] = idx_dims[idx_d]
    for d in range(len(operand)):
        if not op_dims[d]:
            factors.append(Factor(operand[d], FactorKind.GATHER))
            op_dims[d] = (len(factors) - 1,)
    return factors, [tuple(op_dims), tuple(idx_dims)], [tuple(res_dims)], 0.0


def _scatter(eqn, in_shapes, out_shapes):
    """The transpose of a gather: updates scattered into the operand's indexed dim."""
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = in_shapes[0], in_shapes[1], in_shapes[2]
    factors: list[Factor] = []
    op_dims: list[tuple] = [()] * len(operand)
    upd_dims: list[tuple] = [()] * len(updates)
    window_operand = [
        d
        for d in range(len(operand))
        if d not in dn.inserted_window_dims and d not in getattr(dn, "operand_batching_dims", ())
    ]
    for upd_d, op_d in zip(dn.update_window_dims, window_operand):
        kind = FactorKind.PASS if updates[upd_d] == operand[op_d] else FactorKind.OPAQUE
        factors.append(Factor(updates[upd_d], kind))
        upd_dims[upd_d] = (len(factors) - 1,)
        if kind is FactorKind.PASS:
            op_dims[op_d] = (len(factors) - 1,)
    scatter_upd = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    idx_dims: list[tuple] = [()] * len(indices)
    batching = dict(zip(getattr(dn, "scatter_indices_batching_dims", ()), getattr(dn, "operand_batching_dims", ())))
    for upd_d, idx_d in zip(scatter_upd, [d for d in range(len(indices)) if d != len(indices) - 1]):
        # Colliding indices add up (a reduction), except along batching dims, which never collide.
        kind = FactorKind.PASS if idx_d in batching else FactorKind.REDUCE
        factors.append(Factor(updates[upd_d], kind))
        upd_dims[upd_d] = idx_dims[idx_d] = (len(factors) - 1,)
        if idx_d in batching:
            op_dims[batching[idx_d]] = upd_dims[upd_d]
    for d in range(len(operand)):
        if not op_dims[d]:
            factors.append(Factor(operand[d], FactorKind.GATHER))
            op_dims[d] = (len(factors) - 1,)
    return factors, [tuple(op_dims), tuple(idx_dims), tuple(upd_dims)], [tuple(op_dims)], math.prod(updates)


def _conv(eqn, in_shapes, out_shapes):
    """conv_general_dilated: the batch passes from input to output, input features are contracted
    with the kernel's, output features pass from kernel to output; spatial (windowed) dims are
    opaque. Grouped convolutions are opaque throughout."""
    p = eqn.params
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return _opaque(eqn, in_shapes, out_shapes)
    ls, rs, os_ = p["dimension_numbers"]
    (lhs, rhs), out = in_shapes, out_shapes[0]
    factors: list[Factor] = []
    ld: list[tuple] = [()] * len(lhs)
    rd: list[tuple] = [()] * len(rhs)
    od: list[tuple] = [()] * len(out)
    for dims, shape, spec in ((ld, lhs, ls), (rd, rhs, rs), (od, out, os_)):
        for d in spec[2:]:
            dims[d] = _own((shape[d],), factors, FactorKind.OPAQUE)[0]
    factors.append(Factor(lhs[ls[0]], FactorKind.PASS))
    ld[ls[0]] = od[os_[0]] = (len(factors) - 1,)
    factors.append(Factor(lhs[ls[1]], FactorKind.REDUCE))
    ld[ls[1]] = rd[rs[1]] = (len(factors) - 1,)
    factors.append(Factor(rhs[rs[0]], FactorKind.PASS))
    rd[rs[0]] = od[os_[1]] = (len(factors) - 1,)
    flops = 2 * math.prod(out) * lhs[ls[1]] * math.prod(rhs[d] for d in rs[2:])
    return factors, [tuple(ld), tuple(rd)], [tuple(od)], flops


def _split(eqn, in_shapes, out_shapes):
    """split[axis] (`jnp.split`, a fused QKV cut in three): other dims pass through; the cut one
    is opaque in the operand, and each piece's is its own (taking a piece of a replicated operand
    in any layout is free)."""
    axis = eqn.params["axis"]
    factors: list[Factor] = []
    op = list(_own(in_shapes[0], factors))
    op[axis] = _own((in_shapes[0][axis],), factors, FactorKind.OPAQUE)[0]
    res = [tuple(op[:axis]) + _own((s[axis],), factors) + tuple(op[axis + 1 :]) for s in out_shapes]
    return factors, [tuple(op)], res, 0.0


def _top_k(eqn, in_shapes, out_shapes):
    """top_k along the last axis: the leading dims pass through, the last is opaque."""
    factors: list[Factor] = []
    lead = _own(in_shapes[0][:-1], factors)
    op = lead + _own(in_shapes[0][-1:], factors, FactorKind.OPAQUE)
    res = [lead + _own(s[-1:], factors, FactorKind.OPAQUE) for s in out_shapes]
    return factors, [op], res, math.prod(in_shapes[0])


def _stack(eqn, in_shapes, out_shapes):
    """stack[axis]: operands' dims pass through; the new axis (one slot per operand) is opaque."""
    axis = eqn.params["axis"]
    factors: list[Factor] = []
    op = _own(in_shapes[0], factors)
    new = _own((out_shapes[0][axis],), factors, FactorKind.OPAQUE)[0]
    res = op[:axis] + (new,) + op[axis:]
    return factors, [op for _ in in_shapes], [res], 0.0


def _unstack(eqn, in_shapes, out_shapes):
    axis = eqn.params["axis"]
    factors: list[Factor] = []
    res = _own(out_shapes[0], factors)
    new = _own((in_shapes[0][axis],), factors, FactorKind.OPAQUE)[0]
    return factors, [res[:axis] + (new,) + res[axis:]], [res for _ in out_shapes], 0.0


def _fresh(eqn, in_shapes, out_shapes):
    """iota, random bits from a key, ...: results are made here, their dims are free."""
    factors: list[Factor] = []
    return factors, [_own(s, factors) if s else () for s in in_shapes], [_own(s, factors) for s in out_shapes], 0.0


RULES = {
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "expand_dims": _expand_dims,
    "dot_general": _dot_general,
    "reduce_sum": _reduce,
    "reduce_max": _reduce,
    "reduce_min": _reduce,
    "reduce_prod": _reduce,
    "reduce_and": _reduce,
    "reduce_or": _reduce,
    "argmax": _reduce,
    "argmin": _reduce,
    "cumsum": _along_axis(FactorKind.OPAQUE, "axis"),
    "cumprod": _along_axis(FactorKind.OPAQUE, "axis"),
    "cummax": _along_axis(FactorKind.OPAQUE, "axis"),
    "cumlogsumexp": _along_axis(FactorKind.OPAQUE, "axis"),
    "sort": _along_axis(FactorKind.OPAQUE, "dimension"),
    "concatenate": _along_axis(FactorKind.OPAQUE, "dimension"),
    "slice": _same_where_unchanged,
    "pad": _same_where_unchanged,
    "rev": _same_where_unchanged,
    "dynamic_slice": _same_where_unchanged,
    "dynamic_update_slice": _same_where_unchanged,
    "conv_general_dilated": _conv,
    "split": _split,
    "top_k": _top_k,
    "stack": _stack,
    "unstack": _unstack,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
    "iota": _fresh,
    "random_bits": _fresh,
    "random_split": _fresh,
    "random_seed": _fresh,
    "rng_bit_generator": _fresh,
}


# -- repeated layers (TAP) ---------------------------------------------------------------------


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
    if graph._signature_ids is None:
        ids: dict[tuple, int] = {}
        graph._signature_ids = [
            ids.setdefault(op.sig if op.sig is not None else op.signature(graph.values), len(ids)) for op in graph.ops
        ]
    return graph._signature_ids


def find_repeats(graph: Graph, min_count: int = 2, min_period: int = 1) -> list[Repeat]:
    """Maximal runs of identical op blocks, longest coverage first, non-overlapping (`repeats`
    over op signatures, a matmul's marking a layer). In a compact graph, the two copies built
    before each replayed block are a candidate whatever their ops."""
    hints: dict[int, int] = {}
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
