"""The partitioning IR captured from jaxprs: factor rules, inlined calls, loop bodies, repeated
layers, and FLOPs checked against XLA's own cost analysis."""

import jax
import jax.numpy as jnp
import pytest

from partitioner.capture import capture
from partitioner.ir import FactorKind
from partitioner.repeats import find_repeats

f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)


def only(graph, primitive):
    ops = [op for op in graph.ops if op.primitive == primitive]
    assert len(ops) == 1, [op.primitive for op in graph.ops]
    return ops[0]


def test_matmul_factors_say_which_dimension_is_contracted():
    g = capture(lambda x, w: x @ w, f32(8, 16), f32(16, 32))
    op = only(g, "dot_general")
    (xb, xk), (wk, wn) = op.operand_dims
    assert xk == wk and op.factors[xk[0]].kind is FactorKind.REDUCE and op.factors[xk[0]].size == 16
    assert op.result_dims[0] == (xb, wn) and op.factors[wn[0]].kind is FactorKind.PASS
    assert op.flops == 2 * 8 * 16 * 32


def test_reshape_splitting_heads_keeps_the_head_factor_major():
    g = capture(lambda x: x.reshape(2, 64, 4, 32), f32(2, 64, 128))
    op = only(g, "reshape")
    ((b, s, hd),) = op.operand_dims
    rb, rs, rh, rd = op.result_dims[0]
    assert (b, s) == (rb, rs) and hd == rh + rd and [op.factors[f].size for f in hd] == [4, 32]


def test_embedding_lookup_is_a_gather_over_the_vocabulary():
    g = capture(lambda table, ids: table[ids], f32(1000, 64), jax.ShapeDtypeStruct((4, 16), jnp.int32))
    op = only(g, "gather")
    (vocab, width), idx = op.operand_dims[0], op.operand_dims[1]
    assert op.factors[vocab[0]].kind is FactorKind.GATHER and op.factors[vocab[0]].size == 1000
    assert op.result_dims[0][-1] == width and op.factors[width[0]].kind is FactorKind.PASS
    assert op.result_dims[0][:2] == idx[:2]


def test_calls_are_inlined_custom_vjp_jit_and_remat():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))

    @jax.jit
    def inner(x, w):
        return jax.checkpoint(lambda y: jnp.tanh(y @ w))(x)

    loss = lambda x, w: jnp.sum(f(inner(x, w)))
    g = capture(jax.grad(loss, argnums=1), f32(8, 16), f32(16, 16))
    assert g.unknown == {}
    prims = {op.primitive for op in g.ops}
    # sin is dead under grad (pruned, as XLA would); the custom rule's cos and the tanh backward remain.
    assert (
        {"dot_general", "tanh", "cos"} <= prims
        and "sin" not in prims
        and not prims & {"jit", "pjit", "custom_vjp_call", "checkpoint"}
    )


def mlp_stack(n_layers, scan):
    def layer(x, w):
        return jax.nn.relu(x @ w), None

    def loss(ws, x):
        if scan:
            x, _ = jax.lax.scan(layer, x, ws)
        else:
            for i in range(n_layers):
                x, _ = layer(x, ws[i])
        return jnp.sum(x**2)

    return jax.grad(loss), (f32(n_layers, 64, 64), f32(32, 64))


def test_a_scanned_stack_is_captured_once_and_counts_every_iteration():
    scanned = capture(*mlp_stack(6, scan=True)[:1], *mlp_stack(6, scan=True)[1])
    unrolled = capture(*mlp_stack(6, scan=False)[:1], *mlp_stack(6, scan=False)[1])
    # Inlined once: the body's ops run 6 times; stacked weights are read a layer at a time.
    assert not [op for op in scanned.ops if op.primitive == "scan"]
    assert {op.trips for op in scanned.ops if op.primitive == "dot_general"} == {6}
    assert any(op.primitive == "scan_slice" for op in scanned.ops) and any(op.primitive == "tie" for op in scanned.ops)
    assert len(scanned.ops) < len(unrolled.ops) / 2
    matmul = 2 * 32 * 64 * 64
    # Unrolled, autodiff skips the input gradient of the first layer; a scanned backward cannot.
    assert unrolled.flops("dot_general") == (6 + 6 + 5) * matmul
    assert scanned.flops("dot_general") == (6 + 6 + 6) * matmul


def test_unrolled_layers_are_found_as_repeats_forward_and_backward():
    fn, args = mlp_stack(8, scan=False)
    g = capture(fn, *args)
    big = [
        r
        for r in find_repeats(g)
        if any(g.ops[i].primitive == "dot_general" for i in range(r.start, r.start + r.period))
    ]
    forward, backward = big
    assert forward.count == 8, big
    # The backward of the last layer starts from the loss and the first layer's skips its input
    # gradient: 6 identical blocks in between.
    assert backward.count == 6 and backward.start >= forward.stop, big
    assert sum(r.period * r.count for r in big) > 0.75 * len(g.ops)


def test_the_example_gpt_step_is_captured_whole_and_its_flops_match_xla():
    from examples.gpt.model import program
    from orchestrator import check_program

    state, batch = check_program(program, 24)
    g = capture(program.step, state, batch)
    assert g.unknown == {}
    assert len(g.inputs) == len(jax.tree.leaves((state, batch)))
    xla = jax.jit(program.step).lower(state, batch).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    # XLA counts every op of the compiled program (its fusions included); ours come from the jaxpr.
    assert g.flops() == pytest.approx(xla["flops"], rel=0.05), (g.flops(), xla["flops"])
    assert g.flops("dot_general") > 0.9 * g.flops()
    repeats = [r for r in find_repeats(g) if r.period > 50]
    assert [r.count for r in repeats] == [2, 2]  # two layers, forward and backward


def test_a_llama_style_step_is_captured_whole():
    from examples.llama import llama

    fn, args = llama(d=256, heads=8, kv_heads=2, ff=512, vocab=512, layers=2, batch=2, seq=16)
    g = capture(fn, *args)
    assert g.unknown == {}  # RMSNorm, rotary embeddings (stack/unstack), grouped-query repeat, SwiGLU
    assert len([op for op in g.ops if op.primitive == "dot_general"]) >= 2 * 9 * 3 // 2


def test_a_convolution_passes_the_batch_and_contracts_input_features():
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    g = capture(conv, f32(8, 32, 32, 3), f32(3, 3, 3, 16))
    op = only(g, "conv_general_dilated")
    (xn, xh, xw, xc), (kh, kw, ki, ko) = op.operand_dims
    (yn, yh, yw, yc) = op.result_dims[0]
    assert xn == yn and op.factors[xn[0]].kind is FactorKind.PASS and op.factors[xn[0]].size == 8
    assert xc == ki and op.factors[xc[0]].kind is FactorKind.REDUCE
    assert ko == yc and op.factors[ko[0]].kind is FactorKind.PASS
    assert all(op.factors[d[0]].kind is FactorKind.OPAQUE for d in (xh, xw, kh, kw, yh, yw))
    assert op.flops == 2 * 8 * 16 * 16 * 16 * 3 * 3 * 3
    assert not g.unknown


def test_a_fused_projection_cut_by_split_and_top_k_have_rules():
    def f(x, w):
        q, k, v = jnp.split(x @ w, 3, axis=-1)
        return jax.lax.top_k(q + k + v, 2)

    g = capture(f, f32(8, 16), f32(16, 96))
    op = only(g, "split")
    (rows, cut) = op.operand_dims[0]
    assert op.factors[cut[0]].kind is FactorKind.OPAQUE and op.factors[rows[0]].kind is FactorKind.PASS
    assert all(res[0] == rows and res[1] != cut for res in op.result_dims)
    top = only(g, "top_k")
    assert top.operand_dims[0][0] == top.result_dims[0][0] == top.result_dims[1][0]
    assert not g.unknown


def test_a_depthwise_conv_passes_its_channels_through():
    # Mamba-2's causal conv: one filter per channel (feature_group_count == channels).
    conv = lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1,), [(3, 0)], feature_group_count=64, dimension_numbers=("NWC", "WIO", "NWC")
    )
    g = capture(conv, f32(4, 32, 64), f32(4, 1, 64))
    op = only(g, "conv_general_dilated")
    (xb, _, xc), (_, _, wo) = op.operand_dims
    rb, _, rc = op.result_dims[0]
    assert xc == wo == rc and op.factors[xc[0]].kind is FactorKind.PASS and op.factors[xc[0]].size == 64
    assert xb == rb and g.unknown == {}
    assert op.flops == 2 * 4 * 32 * 64 * 4
    # Its kernel's gradient groups the batch instead: the channels still pass through.
    grads = capture(jax.grad(lambda x, w: conv(x, w).sum(), argnums=(0, 1)), f32(4, 32, 64), f32(4, 1, 64))
    assert grads.unknown == {}
    for op in (op for op in grads.ops if op.primitive == "conv_general_dilated"):
        kinds = {op.factors[f].kind for dims in op.result_dims for d in dims for f in d}
        assert FactorKind.PASS in kinds


def test_ragged_dot_contracts_features_and_keeps_tokens_and_experts_whole():
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    g = capture(jax.lax.ragged_dot, f32(64, 16), f32(8, 16, 32), sizes)
    op = only(g, "ragged_dot_general")
    (tokens, k), (experts, k2, n), _ = op.operand_dims
    assert k == k2 and op.factors[k[0]].kind is FactorKind.REDUCE
    assert op.factors[tokens[0]].kind is FactorKind.OPAQUE and op.factors[experts[0]].kind is FactorKind.OPAQUE
    assert op.result_dims[0] == (tokens, n) and op.flops == 2 * 64 * 16 * 32
    # The weight's gradient contracts the tokens within each expert: the result leads with experts.
    loss = lambda x, w, s: jax.lax.ragged_dot(x, w, s).sum()
    grads = capture(jax.grad(loss, argnums=(0, 1)), f32(64, 16), f32(8, 16, 32), sizes)
    assert grads.unknown == {}
    dw = [
        op
        for op in grads.ops
        if op.primitive == "ragged_dot_general" and op.results and len(grads.values[op.results[0]].shape) == 3
    ]
    assert dw and [grads.values[v].shape for v in dw[0].results] == [(8, 16, 32)]


def test_pooling_passes_the_dims_its_window_does_not_span():
    pool = lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    g = capture(jax.grad(lambda x: pool(x).sum()), f32(4, 8, 8, 16))
    assert g.unknown == {}
    op = only(capture(pool, f32(4, 8, 8, 16)), "reduce_window_sum")
    b, h, w, c = op.result_dims[0]
    assert [op.factors[f[0]].kind for f in (b, h, w, c)] == [
        FactorKind.PASS,
        FactorKind.OPAQUE,
        FactorKind.OPAQUE,
        FactorKind.PASS,
    ]


def test_tiled_heads_keep_the_operands_heads_minor():
    g = capture(lambda k: jnp.tile(k, (1, 1, 4, 1)), f32(2, 8, 2, 16))
    op = only(g, "tile")
    ((b, s, heads, d),) = op.operand_dims
    rb, rs, rheads, rd = op.result_dims[0]
    assert (b, s, d) == (rb, rs, rd) and g.unknown == {}
    assert rheads[1:] == heads and [op.factors[f].size for f in rheads] == [4, 2]
