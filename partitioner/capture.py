"""Capture: a user's step traced to a jaxpr and built into the partitioning IR (`ir.Graph`), each
primitive's factors from its rule (`rules.RULES`).

Calls (`jit`, `custom_jvp_call`, `custom_vjp_call`, `checkpoint`) are inlined. A `scan` is inlined
once, its ops marked to run `length` times: each scanned input is read through a `scan_slice` op
(the stacked dimension sequential, the rest passing through), each stacked output is written by a
`scan_stack` op, and `tie` ops join a carry's initial value, its value inside the body and its
next value, so a scanned stack of layers is one layer to propagate and plan. A `cond` is inlined
as its costliest branch (the worst case, which XLA partitions with the cond's own shardings); a
`while` keeps its body as a sub-graph, priced but not sharded.

A Python loop over layers unrolls into repeated blocks of top-level equations; capture builds two
copies of each and replays the rest from the second (`replay`), so its time grows with depth by
checking and renaming, not by building. `capture(..., compact=True)` keeps the replayed copies as
`Graph.copies` (the fold and the memory model read them so); by default they are expanded into
ops, exactly those capture would have built one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from . import replay
from .ir import CaptureError, Copies, Graph, Op, RawOp, Value
from .repeats import repeats
from .rules import ELEMENTWISE, PARAMS_FREE, RULES, control_flow, elementwise, opaque, stacked, tie_factors


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
        self.ops: list[RawOp | replay.Replay] = []
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
            inner, consts, invars = _inlined(eqn)
            if inner is not None:
                sub_env = {}
                for var, atom in zip(inner.invars, invars):
                    sub_env[var] = self._read(env, atom)
                for var, const in zip(inner.constvars, consts):
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
                    rule = opaque if body is None else control_flow
                else:
                    rule = elementwise
            factors, op_dims, res_dims, flops, sig = self._factors(rule, eqn, in_shapes, out_shapes)
            trips = trips if body is not None else self.trips
            self.ops.append(
                RawOp(
                    name,
                    operands,
                    results,
                    factors,
                    op_dims,
                    res_dims,
                    flops,
                    body,
                    trips,
                    sig if body is None else None,
                )
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
            self._raw("scan_slice", (v,), (sub[var],), *stacked(tuple(var.aval.shape), length, stacked_result=False))
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
            self._raw("scan_stack", (out,), (result,), *stacked(shape, length, stacked_result=True))

    def _raw(self, name, operands, results, factors, op_dims, res_dims) -> None:
        self.ops.append(
            RawOp(name, operands, results, factors, op_dims, res_dims, 0.0, None, 1, (name, factors, op_dims, res_dims))
        )

    def _factors(self, rule, eqn, in_shapes, out_shapes):
        """The rule's answer, memoised: a 96-layer model asks the same question 96 times."""
        try:
            key = (
                rule,
                eqn.primitive.name,
                in_shapes,
                out_shapes,
                tuple(sorted(eqn.params.items())) if rule is not elementwise else (),
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
        return None, 1


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
        elif not needed.isdisjoint(op.results) or op.primitive == "tie":  # a carry feeds the next iteration
            keep.append(op)
            needed.update(op.operands)
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
    if name in ("scan", "while") or _inlined(eqn)[0] is not None:
        return False
    return RULES.get(name) in PARAMS_FREE  # (None: elementwise or opaque)


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


def _inlined(eqn):
    """(jaxpr, its constants, the operands it reads) of an equation built inline: a call, or a
    cond's costliest branch (most matmuls, then most equations). A cond is planned as that
    branch, as XLA partitions every branch with the cond's own shardings: the results of an
    optimizer step behind `optax.MultiSteps` then follow the weights."""
    if eqn.primitive.name == "cond":
        branches = eqn.params["branches"]
        cost = lambda b: (sum(e.primitive.name == "dot_general" for e in b.jaxpr.eqns), len(b.jaxpr.eqns))
        branch = max(branches, key=cost)
        return branch.jaxpr, branch.consts, eqn.invars[1:]  # (the first operand picks the branch)
    inner = _inlined_jaxpr(eqn)
    if inner is None:
        return None, (), ()
    return inner, getattr(eqn.params.get("jaxpr"), "consts", ()), eqn.invars


def _inlined_jaxpr(eqn):
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if j is not None:
            return getattr(j, "jaxpr", j)
    return None
