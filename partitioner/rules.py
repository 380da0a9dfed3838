"""Factor rules: for each primitive, its factors (size and kind, `ir.FactorKind`) and which of
them make up each operand and result dimension, major to minor, and its FLOPs. A primitive with no
rule is elementwise (`ELEMENTWISE`) or opaque: every dimension its own OPAQUE factor, and
`Graph.unknown` counts it (a plan's notes name it).
"""

from __future__ import annotations

import math

from .ir import Dims, Factor, FactorKind


def tie_factors(shape):
    """Factors and dims of an op joining two values of one shape, dimension by dimension (a scan's
    carry and its next value; in a folded graph, a copy's input and the previous copy's output)."""
    factors = tuple(Factor(int(n), FactorKind.PASS) for n in shape)
    dims = tuple((i,) for i in range(len(shape)))
    return factors, (dims, dims), ()


def stacked(shape, length: int, stacked_result: bool):
    """One slice of a scanned array and the array: the stacked dimension is sequential."""
    factors = tuple(Factor(int(n), FactorKind.PASS) for n in shape) + (Factor(length, FactorKind.OPAQUE),)
    rest = tuple((i,) for i in range(len(shape)))
    whole = ((len(shape),),) + rest
    return (factors, (rest,), (whole,)) if stacked_result else (factors, (whole,), (rest,))


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


def elementwise(eqn, in_shapes, out_shapes):
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


def opaque(eqn, in_shapes, out_shapes):
    factors: list[Factor] = []
    op_dims = [_own(s, factors, FactorKind.OPAQUE) for s in in_shapes]
    res_dims = [_own(s, factors, FactorKind.OPAQUE) for s in out_shapes]
    return factors, op_dims, res_dims, 0.0


def control_flow(eqn, in_shapes, out_shapes):
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


def reshape(eqn, in_shapes, out_shapes):
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


def same_where_unchanged(eqn, in_shapes, out_shapes):
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
    operand, indices, out = in_shapes[0], in_shapes[1], out_shapes[0]
    factors: list[Factor] = []
    op_dims: list[tuple] = [()] * len(operand)
    res_dims: list[tuple] = [()] * len(out)
    _windows(
        zip(dn.offset_dims, _window_operand_dims(dn, operand, dn.collapsed_slice_dims)),
        out,
        operand,
        factors,
        op_dims,
        res_dims,
    )
    batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
    index_batch = [d for d in range(len(indices)) if d != len(indices) - 1]
    idx_dims: list[tuple] = [()] * len(indices)
    for out_d, idx_d in zip(batch_out, index_batch):
        factors.append(Factor(out[out_d], FactorKind.PASS))
        res_dims[out_d] = idx_dims[idx_d] = (len(factors) - 1,)
    # Batched gathers (take_along_axis): those operand dims run alongside the indices' batch dims.
    for op_d, idx_d in zip(getattr(dn, "operand_batching_dims", ()), getattr(dn, "start_indices_batching_dims", ())):
        op_dims[op_d] = idx_dims[idx_d]
    _indexed(operand, factors, op_dims)
    return factors, [tuple(op_dims), tuple(idx_dims)], [tuple(res_dims)], 0.0


def _scatter(eqn, in_shapes, out_shapes):
    """The transpose of a gather: updates scattered into the operand's indexed dim."""
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = in_shapes[0], in_shapes[1], in_shapes[2]
    factors: list[Factor] = []
    op_dims: list[tuple] = [()] * len(operand)
    upd_dims: list[tuple] = [()] * len(updates)
    window = _window_operand_dims(dn, operand, dn.inserted_window_dims)
    _windows(zip(dn.update_window_dims, window), updates, operand, factors, op_dims, upd_dims)
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
    _indexed(operand, factors, op_dims)
    return factors, [tuple(op_dims), tuple(idx_dims), tuple(upd_dims)], [tuple(op_dims)], math.prod(updates)


def _window_operand_dims(dn, operand, dropped) -> list[int]:
    """The operand dims a gather's offset dims (a scatter's window dims) take, in order."""
    batching = getattr(dn, "operand_batching_dims", ())
    return [d for d in range(len(operand)) if d not in dropped and d not in batching]


def _windows(pairs, window, operand, factors: list[Factor], op_dims: list, window_dims: list) -> None:
    """Each (window dim, operand dim): passed through where the window takes the operand dim
    whole, opaque where it cuts it."""
    for w_d, op_d in pairs:
        kind = FactorKind.PASS if window[w_d] == operand[op_d] else FactorKind.OPAQUE
        factors.append(Factor(window[w_d], kind))
        window_dims[w_d] = (len(factors) - 1,)
        if kind is FactorKind.PASS:
            op_dims[op_d] = (len(factors) - 1,)


def _indexed(operand, factors: list[Factor], op_dims: list) -> None:
    """The operand dims nothing else placed are indexed: GATHER factors."""
    for d in range(len(operand)):
        if not op_dims[d]:
            factors.append(Factor(operand[d], FactorKind.GATHER))
            op_dims[d] = (len(factors) - 1,)


def _conv(eqn, in_shapes, out_shapes):
    """conv_general_dilated: the batch passes from input to output, input features are contracted
    with the kernel's, output features pass from kernel to output; spatial (windowed) dims are
    opaque. Grouped convolutions (a depthwise conv: Mamba's causal conv, MobileNet's) split their
    features into groups that pass through: the input's feature dim is (group, features in a
    group), the kernel's and the output's (group, outputs per group). A kernel's gradient counts
    its groups in the batch instead (`batch_group_count`): the input's batch dim is (group, rest)."""
    p = eqn.params
    groups, batch_groups = p["feature_group_count"], p["batch_group_count"]
    ls, rs, os_ = p["dimension_numbers"]
    (lhs, rhs), out = in_shapes, out_shapes[0]
    factors: list[Factor] = []
    ld: list[tuple] = [()] * len(lhs)
    rd: list[tuple] = [()] * len(rhs)
    od: list[tuple] = [()] * len(out)
    for dims, shape, spec in ((ld, lhs, ls), (rd, rhs, rs), (od, out, os_)):
        for d in spec[2:]:
            dims[d] = _own((shape[d],), factors, FactorKind.OPAQUE)[0]
    g = _factor(factors, groups * batch_groups, FactorKind.PASS)
    batch = _factor(factors, lhs[ls[0]] // batch_groups, FactorKind.PASS)
    inner = _factor(factors, lhs[ls[1]] // groups, FactorKind.REDUCE)
    outs = _factor(factors, rhs[rs[0]] // (groups * batch_groups), FactorKind.PASS)
    ld[ls[0]] = _dim(factors, g if batch_groups > 1 else None, batch)
    od[os_[0]] = _dim(factors, None, batch)
    ld[ls[1]] = _dim(factors, g if groups > 1 else None, inner)
    rd[rs[1]] = _dim(factors, None, inner)
    rd[rs[0]] = od[os_[1]] = _dim(factors, g, outs)
    flops = 2 * math.prod(out) * (lhs[ls[1]] // groups) * math.prod(rhs[d] for d in rs[2:])
    return factors, [tuple(ld), tuple(rd)], [tuple(od)], flops


def _factor(factors: list[Factor], size: int, kind: FactorKind) -> int:
    factors.append(Factor(int(size), kind))
    return len(factors) - 1


def _dim(factors: list[Factor], major: int | None, minor: int) -> tuple[int, ...]:
    """A dim made of `major` then `minor`, without factors of size 1 (a conv's single group),
    but never of no factor at all."""
    kept = tuple(f for f in (major, minor) if f is not None and factors[f].size > 1)
    return kept or (minor,)


def _ragged_dot(eqn, in_shapes, out_shapes):
    """ragged_dot_general (`jax.lax.ragged_dot`, MoE experts over tokens sorted by expert): as a
    matmul, except that the ragged dim (the tokens) and the group dim (the experts) are cut by
    `group_sizes`, which hold counts for the whole array: both opaque. Where the ragged dim is
    contracted (the experts' weight gradient), the result gains the group dim, first."""
    rn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rn.dot_dimension_numbers
    lhs, rhs, sizes = in_shapes
    out = out_shapes[0]
    factors: list[Factor] = []
    ld: list[tuple] = [()] * len(lhs)
    rd: list[tuple] = [()] * len(rhs)
    group = _factor(factors, sizes[0] if sizes else 1, FactorKind.OPAQUE)
    for a, b in zip(lb, rb):
        ld[a] = rd[b] = (_factor(factors, lhs[a], FactorKind.PASS),)
    for a, b in zip(lc, rc):
        kind = FactorKind.OPAQUE if a in rn.lhs_ragged_dimensions else FactorKind.REDUCE
        ld[a] = rd[b] = (_factor(factors, lhs[a], kind),)
    for d in rn.rhs_group_dimensions:
        rd[d] = (group,)
    free_l = [d for d in range(len(lhs)) if not ld[d]]
    for d in free_l:
        kind = FactorKind.OPAQUE if d in rn.lhs_ragged_dimensions else FactorKind.PASS
        ld[d] = (_factor(factors, lhs[d], kind),)
    free_r = [d for d in range(len(rhs)) if not rd[d]]
    for d in free_r:
        rd[d] = (_factor(factors, rhs[d], FactorKind.PASS),)
    ragged_contracted = any(a in rn.lhs_ragged_dimensions for a in lc)
    od = (
        ([(group,)] if ragged_contracted else [])
        + [ld[a] for a in lb]
        + [ld[d] for d in free_l]
        + [rd[d] for d in free_r]
    )
    contracted = math.prod(lhs[a] for a in lc)
    return factors, [tuple(ld), tuple(rd), ((group,),) if sizes else ()], [tuple(od)], 2.0 * math.prod(out) * contracted


def _tile(eqn, in_shapes, out_shapes):
    """tile (`jnp.tile`, K/V heads repeated as whole blocks): a tiled dim of the result is (copy,
    the operand's dim), the operand's dim minor; an untiled dim passes through."""
    factors: list[Factor] = []
    op, res = [], []
    for n, reps in zip(in_shapes[0], eqn.params["reps"]):
        inner = _factor(factors, n, FactorKind.PASS)
        op.append((inner,))
        res.append(_dim(factors, _factor(factors, reps, FactorKind.PASS), inner) if reps > 1 else (inner,))
    return factors, [tuple(op)], [tuple(res)], 0.0


def _windowed(eqn, in_shapes, out_shapes):
    """reduce_window (pooling) and its gradients: a dim the window neither spans nor strides nor
    pads passes through; the others are opaque."""
    p = eqn.params
    window = p["window_dimensions"]
    strides = p.get("window_strides", (1,) * len(window))
    padding = p.get("padding", ((0, 0),) * len(window))
    factors: list[Factor] = []
    res = []
    for d, n in enumerate(out_shapes[0]):
        whole = window[d] == 1 and strides[d] == 1 and tuple(padding[d]) == (0, 0)
        res.append((_factor(factors, n, FactorKind.PASS if whole else FactorKind.OPAQUE),))
    ops = [
        tuple(
            res[d] if factors[res[d][0]].kind is FactorKind.PASS else (_factor(factors, n, FactorKind.OPAQUE),)
            for d, n in enumerate(s)
        )
        if len(s) == len(res)
        else _own(s, factors, FactorKind.OPAQUE)
        for s in in_shapes
    ]
    return factors, ops, [tuple(res) for _ in out_shapes], math.prod(out_shapes[0]) * math.prod(window)


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


def fresh(eqn, in_shapes, out_shapes):
    """iota, random bits from a key, ...: results are made here, their dims are free."""
    factors: list[Factor] = []
    return factors, [_own(s, factors) if s else () for s in in_shapes], [_own(s, factors) for s in out_shapes], 0.0


# Rules that read only an equation's shapes: its params only move data around.
PARAMS_FREE = (None, elementwise, same_where_unchanged, reshape, fresh)

RULES = {
    "broadcast_in_dim": _broadcast_in_dim,
    "transpose": _transpose,
    "reshape": reshape,
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
    "slice": same_where_unchanged,
    "pad": same_where_unchanged,
    "rev": same_where_unchanged,
    "dynamic_slice": same_where_unchanged,
    "dynamic_update_slice": same_where_unchanged,
    "conv_general_dilated": _conv,
    "ragged_dot_general": _ragged_dot,
    "tile": _tile,
    "reduce_window_sum": _windowed,
    "reduce_window_max": _windowed,
    "reduce_window_min": _windowed,
    "reduce_window": _windowed,
    "select_and_scatter_add": _windowed,
    "select_and_gather_add": _windowed,
    "split": _split,
    "top_k": _top_k,
    "stack": _stack,
    "unstack": _unstack,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
    "iota": fresh,
    "random_bits": fresh,
    "random_split": fresh,
    "random_seed": fresh,
    "rng_bit_generator": fresh,
}
