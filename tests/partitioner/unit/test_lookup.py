"""Tables read by lookup are weights like any other: an embedding read by `table[ids]`,
`jnp.take`, a one-hot matmul, or tied to the output projection, is split by vocabulary over the
model axis (Megatron-LM's VocabParallelEmbedding) where that is cheaper, and priced as XLA
partitions it: a masked local lookup and an all-reduce of the activations."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from partitioner import profile
from partitioner.analysis import read_inputs
from partitioner.candidates import Tactic, priced
from partitioner.search import search
from partitioner.tactics import batch_shardings

VOCAB, D, BATCH, SEQ = 32000, 512, 8, 256


def lm(form):
    def embed(table, ids):
        if form == "take":
            return jnp.take(table, ids, axis=0)
        if form == "one_hot":
            return jax.nn.one_hot(ids, VOCAB, dtype=table.dtype) @ table
        return table[ids]

    def loss(p, ids):
        x = embed(p["embed"], ids)
        x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
        head = p["embed"].T if form == "tied" else p["head"]
        logits = x @ head
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1).mean()

    def step(p, batch):
        value, grads = jax.value_and_grad(loss)(p, batch["ids"])
        return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads), {"loss": value}

    params = {
        "embed": jax.ShapeDtypeStruct((VOCAB, D), jnp.float32),
        "w1": jax.ShapeDtypeStruct((D, 4 * D), jnp.float32),
        "w2": jax.ShapeDtypeStruct((4 * D, D), jnp.float32),
    }
    if form != "tied":
        params["head"] = jax.ShapeDtypeStruct((D, VOCAB), jnp.float32)
    return step, (params, {"ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)})


@pytest.mark.parametrize("form", ["index", "take", "one_hot", "tied"])
def test_an_embedding_table_is_split_by_vocabulary_and_that_is_priced_cheaper(form):
    step, args = lm(form)
    plan, ranked = search(step, *args, devices=8, hardware="h100", compile_check=False, tactics={"megatron"})
    best = ranked[0]
    assert plan.in_specs[0]["embed"] == P("model"), plan.notes
    # The same plan with the table whole costs more: its gradient is reduced whole over data.
    inputs = read_inputs(step, args, None)
    table = inputs.ids[inputs.keys.index(("embed",))]
    whole = {v: s for v, s in best.annotations.items() if v != table}
    if form == "tied":  # (the tied table's vocabulary split is the logits': split its columns instead)
        whole[table] = ((), ("model",))
    batch = batch_shardings(inputs, best.mesh)
    kept = priced(inputs, Tactic("megatron"), best.mesh, whole, profile("h100"), batch)
    assert kept.cost.total_seconds > best.cost.total_seconds


def test_a_small_position_table_stays_whole():
    # A learned position table read once per position is smaller than the activations a
    # vocabulary split would all-reduce: Megatron-LM keeps it whole, and so does the tactic.
    def step(p, batch):
        def loss(p):
            x = p["embed"][batch["ids"]] + p["pos"][jnp.arange(SEQ)][None]
            return jnp.mean((x @ p["head"]) ** 2)

        return jax.tree.map(lambda w, g: w - g, p, jax.grad(loss)(p)), {}

    params = {
        "embed": jax.ShapeDtypeStruct((VOCAB, D), jnp.float32),
        "pos": jax.ShapeDtypeStruct((SEQ, D), jnp.float32),
        "head": jax.ShapeDtypeStruct((D, VOCAB), jnp.float32),
    }
    args = (params, {"ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)})
    plan, _ = search(step, *args, devices=8, hardware="h100", compile_check=False, tactics={"megatron"})
    assert plan.in_specs[0]["embed"] == P("model") and plan.in_specs[0]["pos"] == P()
