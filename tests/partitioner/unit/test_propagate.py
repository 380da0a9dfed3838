"""Sharding propagation over the factor graph: a few annotations shard everything else."""

import jax
import jax.numpy as jnp
import pytest

from partitioner.capture import capture
from partitioner.propagate import _fresh, _static, first_stages, propagate

f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
MESH = {"data": 2, "model": 4}


def mlp(x, w1, w2):
    return jax.nn.relu(x @ w1) @ w2


def producer_of(g, primitive, n=0):
    return [op for op in g.ops if op.primitive == primitive][n]


def test_megatron_annotations_propagate_column_then_row_parallel():
    g = capture(mlp, f32(16, 64), f32(64, 256), f32(256, 64))
    x, w1, w2 = g.inputs
    p = propagate(g, {x: (("data",), ()), w1: ((), ("model",)), w2: (("model",), ())}, MESH)
    first, second = producer_of(g, "dot_general", 0), producer_of(g, "dot_general", 1)
    hidden = first.results[0]
    assert p.shardings[hidden] == (("data",), ("model",))  # column-parallel: hidden units split
    assert p.shardings[g.outputs[0]] == (("data",), ())  # row-parallel: whole columns again ...
    reduce = [c for c in p.communication if c.kind == "all-reduce"]
    assert [(c.op, c.axes) for c in reduce] == [(second.id, ("model",))]  # ... after one all-reduce
    assert reduce[0].bytes == 16 * 64 * 4 // 2  # the (batch/2, 64) partial sums per device
    assert not [c for c in p.communication if c.kind == "reshard"]


def test_data_parallel_batch_annotation_reaches_the_loss_and_gradients_need_a_reduction():
    loss = lambda w, x: jnp.mean((x @ w) ** 2)
    g = capture(jax.grad(loss), f32(64, 64), f32(32, 64))
    w, x = g.inputs
    p = propagate(g, {w: ((), ()), x: (("data",), ())}, MESH)
    grad_matmul = [op for op in g.ops if op.primitive == "dot_general" and g.values[op.results[0]].shape == (64, 64)]
    assert grad_matmul and any(
        c.kind == "all-reduce" and c.op == grad_matmul[0].id and c.axes == ("data",) for c in p.communication
    )
    assert p.shardings.get(g.outputs[0], ((), ())) == ((), ())  # the gradient is whole (summed)


def test_a_dimension_that_does_not_divide_stays_replicated():
    g = capture(lambda x, w: x @ w, f32(6, 64), f32(64, 30))
    x, w = g.inputs
    p = propagate(g, {x: ((), ()), w: ((), ("model",))}, MESH)  # 30 does not divide by 4
    assert p.of(g.outputs[0], 2) == ((), ())


def test_backward_propagation_from_an_output_annotation():
    g = capture(lambda x, w: jnp.tanh(x @ w), f32(16, 64), f32(64, 128))
    out = g.outputs[0]
    p = propagate(g, {out: (("data",), ("model",))}, MESH)
    x, w = g.inputs
    assert p.shardings[x][0] == ("data",) and p.shardings[w][1] == ("model",)


def test_megatron_mlp_is_priced_with_one_intra_host_all_reduce():
    from partitioner.cost import estimate
    from partitioner.hardware import profile

    h100 = profile("h100")
    g = capture(mlp, f32(16, 64), f32(64, 256), f32(256, 64))
    x, w1, w2 = g.inputs
    p = propagate(g, {x: (("data",), ()), w1: ((), ("model",)), w2: (("model",), ())}, MESH)
    cost = estimate(p, h100)
    partial = 16 * 64 * 4 // 2
    assert cost.collective_bytes == {"all-reduce": 2 * 3 * partial // 4, "all-gather": 0}
    # Latency: a tree's 2*log2(4) = 4 steps, fewer than a ring's 2*(4-1) = 6.
    assert cost.communication_seconds == pytest.approx(
        2 * 3 / 4 * partial / h100.intra.bandwidth + 4 * h100.intra.latency
    )
    # Per device: x/2, w1/4 and w2/4 throughout (the caller's); the peak is while relu's output
    # and the hidden activation it reads, each (16, 256) split 8 ways, are both live.
    x_b, w_b, h_b = 16 * 64 * 4 // 2, 64 * 256 * 4 // 4, 16 * 256 * 4 // 8
    assert cost.peak_bytes_per_device == x_b + 2 * w_b + 2 * h_b


def test_spreading_one_annotation_at_a_time_reads_where_the_earlier_ones_sent_an_axis():
    """`Spreading` (Megatron's decisions, one weight at a time): after the first weight's split,
    the hidden activation the second weight multiplies arrives split over model; after both,
    every value is sharded as one propagation of both annotations shards it."""
    from partitioner.propagate import Spreading

    g = capture(mlp, f32(16, 64), f32(64, 256), f32(256, 64))
    x, w1, w2 = g.inputs
    hidden = producer_of(g, "dot_general", 0).results[0]
    s = Spreading(g, MESH)
    s.add({x: (("data",), ())})
    assert s.of(hidden, 2) == (("data",), ())
    s.add({w1: ((), ("model",))})
    assert s.of(hidden, 2) == (("data",), ("model",))
    s.add({w2: (("model",), ())})
    whole = propagate(g, {x: (("data",), ()), w1: ((), ("model",)), w2: (("model",), ())}, MESH)
    assert {v: s.of(v, len(g.values[v].shape)) for v in whole.shardings} == whole.shardings


def test_a_price_beyond_the_bound_skips_the_peak_and_says_so():
    """`estimate(..., beyond=)`: None where compute and communication alone reach the bound (a
    refinement trial that cannot be accepted), the same cost as without it otherwise."""
    from partitioner.cost import estimate
    from partitioner.hardware import profile

    h100 = profile("h100")
    g = capture(mlp, f32(16, 64), f32(64, 256), f32(256, 64))
    x, w1, w2 = g.inputs
    annotations = {x: (("data",), ()), w1: ((), ("model",)), w2: (("model",), ())}
    p = propagate(g, annotations, MESH)
    cost = estimate(p, h100)
    assert estimate(p, h100, beyond=cost.total_seconds) is None
    assert estimate(p, h100, beyond=cost.total_seconds * 1.001) == cost
    # Fresh, a trial reaches the bound partway through its collectives: it stops reading them
    # (`Propagation.exchanged`) and keeps none, and the whole price is the same afterwards.
    fresh = propagate(g, annotations, MESH)
    assert cost.communication_seconds > 0
    assert estimate(fresh, h100, beyond=cost.compute_seconds + cost.communication_seconds / 2) is None
    assert "communication" not in fresh.__dict__
    assert estimate(fresh, h100) == cost and fresh.communication == p.communication


def test_a_heads_split_wider_than_the_kv_groups_lands_on_the_query_groups():
    """Eight query heads read as two K/V groups of four (grouped-query attention against
    un-repeated K/V), split four ways: 2 x 2 blocks, which XLA computes without moving anything.
    The groups' factor stands for the split, so attention is priced split four ways, and the
    heads merged back are split as they came, with nothing resharded."""

    def attention(q, k):
        b, s = q.shape[:2]
        grouped = q.reshape(b, s, 2, 4, 64)
        probs = jax.nn.softmax(jnp.einsum("bskgd,btkd->bkgst", grouped, k), axis=-1)
        return jnp.einsum("bkgst,btkd->bskgd", probs, k).reshape(b, s, 8, 64)

    g = capture(attention, f32(2, 16, 8, 64), f32(2, 16, 2, 64))
    q, k = g.inputs
    p = propagate(g, {q: ((), (), ("model",), ())}, MESH)
    grouped = producer_of(g, "reshape", 0).results[0]
    assert p.shardings[grouped] == ((), (), (), ("model",), ())
    logits = producer_of(g, "dot_general", 0).results[0]
    assert ("model",) in p.shardings[logits]
    assert p.shardings[g.outputs[0]] == ((), (), ("model",), ())
    assert not [c for c in p.communication if c.kind == "reshard"], p.communication


def test_a_table_split_by_vocabulary_is_priced_as_a_lookup_and_a_sum():
    # Megatron's VocabParallelEmbedding: each device looks up the rows it holds, an all-reduce
    # over the vocabulary's axis sums the parts; the gradient needs no sum over it.
    ids = jax.ShapeDtypeStruct((16, 32), jnp.int32)
    loss = lambda table, ids: jnp.sum(jnp.tanh(table[ids]))
    g = capture(lambda table, ids: table - jax.grad(loss)(table, ids), f32(1000, 64), ids)
    table, tokens = g.inputs
    p = propagate(g, {tokens: (("data",), ()), table: (("model",), ())}, MESH)
    gather = producer_of(g, "gather")
    sums = [c for c in p.communication if c.op == gather.id]
    assert [(c.kind, c.axes) for c in sums] == [("all-reduce", ("model",))]
    assert sums[0].bytes == 16 // 2 * 32 * 64 * 4  # the activations on one device
    assert p.shardings[g.outputs[0]] == (("model",), ())  # the update keeps the table's split
    assert not [c for c in p.communication if "model" in c.axes and c.op != gather.id]


def test_a_chain_of_elementwise_ops_of_one_array_is_sharded_as_its_operand_and_not_stepped():
    def step(x, w):
        h = x @ w
        return jnp.sqrt(jnp.exp(-h) * 2.0) @ w.T

    g = capture(step, f32(16, 64), f32(64, 128))
    x, w = g.inputs
    hidden = producer_of(g, "dot_general", 0).results[0]
    chain = [op for op in g.ops if op.primitive in ("neg", "exp", "mul", "sqrt")]
    assert len(chain) == 4
    p = propagate(g, {x: (("data",), ()), w: ((), ("model",))}, MESH)
    for op in chain:  # each relabels the hidden activations: same split, its factors carry it
        assert p.shardings[op.results[0]] == p.shardings[hidden] == (("data",), ("model",))
        assert sorted(p.factor_axes[op.id].values()) == [("data",), ("model",)]
    assert not [c for c in p.communication if c.kind == "reshard"]
    assert all(_static(g).ops[op.id] is None for op in chain)  # propagated as one value, not stepped
    # An annotation on the last of them reaches back through the chain as one on the first would.
    sqrt = chain[-1].results[0]
    q = propagate(g, {sqrt: (("data",), ("model",))}, MESH)
    assert q.shardings[hidden] == (("data",), ("model",)) and q.shardings[w][1] == ("model",)


def test_a_rerun_after_a_takeover_starts_from_its_kept_first_stage_and_ends_as_a_fresh_one(monkeypatch):
    # FSDP-split weights far larger than the batch's activations take the data axis over at their
    # matmuls: propagation runs again with those matmuls' results seeded. A second candidate with
    # the same takeovers (a refinement's next trial) starts both runs from kept first stages.
    from partitioner import propagate as module

    shapes = (f32(8, 64), f32(64, 2048), f32(2048, 64))
    g = capture(mlp, *shapes)
    x, w1, w2 = g.inputs
    batch = {x: (("data",), ())}
    annotations = {**batch, w1: ((), ("data",)), w2: (("data",), ())}  # w1 split by its columns
    first = propagate(g, annotations, MESH, first=batch)
    assert any(key[2] for key in first_stages(g)), "no takeover: the test needs a rerun with seeds"
    fresh = []
    monkeypatch.setattr(module, "_fresh", lambda *a: fresh.append(a) or _fresh(*a))
    again = propagate(g, annotations, MESH, first=batch)
    assert fresh == []  # both runs began from a kept stage
    other = capture(mlp, *shapes)  # nothing kept on it
    reference = propagate(other, dict(zip(other.inputs, annotations.values())), MESH, first=[other.inputs[0]])
    for p in (first, again):
        assert p.shardings == reference.shardings and p.factor_axes == reference.factor_axes
        assert p.communication == reference.communication


def test_first_stages_kept_on_a_graph_stand_threads_keeping_and_evicting_at_once():
    # A job's controller and its planning thread plan one step at once (`StepPlanner`), so two
    # propagations keep, reuse and evict first stages on the same graph together. Thread switches
    # made as frequent as Python allows, so that the keeping and the evicting interleave.
    import sys
    import threading

    from partitioner.propagate import SEEDED_KEPT, _keep, _kept

    cache, errors = {}, []
    unseeded = [((("data", t),), (), (), 8) for t in range(4)]  # (mesh, first stage, seeds, sweeps)

    def plan(t):
        try:
            for i in range(2_000):
                key = unseeded[t] if i % 5 == 0 else (unseeded[t][0], (), ((t, i % (SEEDED_KEPT + 5)),), 8)
                if _kept(cache, key) is None:
                    _keep(cache, key, ("state", key))
        except Exception as e:  # what a planning thread would have died of
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=plan, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert all(cache[k] == ("state", k) for k in cache)
    assert all(k in cache for k in unseeded)  # one per mesh, never evicted
    assert len([k for k in cache if k[2]]) == SEEDED_KEPT
