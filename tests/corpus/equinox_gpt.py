"""A GPT written with Equinox as its examples and most Equinox users write it: `eqx.Module`
dataclasses holding `eqx.nn.Linear`/`eqx.nn.Embedding`/`eqx.nn.LayerNorm`, each applied per token
under `jax.vmap` (Equinox layers take unbatched inputs), `eqx.nn.MultiheadAttention` with a
causal mask, blocks kept in a Python list, `eqx.filter_value_and_grad` over the model and
`eqx.partition`/`eqx.combine` around the step; optax adamw."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, d=1024, heads=16, ff=4096, seq=512, batch=16)


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, c, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(c["d"]), eqx.nn.LayerNorm(c["d"])
        self.attn = eqx.nn.MultiheadAttention(c["heads"], c["d"], key=k1)
        self.fc = eqx.nn.Linear(c["d"], c["ff"], key=k2)
        self.proj = eqx.nn.Linear(c["ff"], c["d"], key=k3)

    def __call__(self, x):  # x: [seq, d], one sequence
        y = jax.vmap(self.ln1)(x)
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(y, y, y, mask=mask)
        y = jax.vmap(self.ln2)(x)
        return x + jax.vmap(self.proj)(jax.nn.gelu(jax.vmap(self.fc)(y)))


class GPT(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: list
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, c, layers, key):
        keys = jax.random.split(key, layers + 3)
        self.embed = eqx.nn.Embedding(c["vocab"], c["d"], key=keys[0])
        self.pos = jax.random.normal(keys[1], (c["seq"], c["d"])) * 0.02
        self.blocks = [Block(c, k) for k in keys[3:]]
        self.ln = eqx.nn.LayerNorm(c["d"])
        self.head = eqx.nn.Linear(c["d"], c["vocab"], use_bias=False, key=keys[2])

    def __call__(self, tokens):  # [seq]
        x = jax.vmap(self.embed)(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.ln)(x))


def build(layers=2, c=CFG):
    tx = optax.adamw(3e-4)
    model = eqx.filter_eval_shape(GPT, c, layers, jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))  # (abstract arrays)

    def step(state, batch):
        params, opt_state = state

        @eqx.filter_value_and_grad
        def loss_fn(params):
            logits = jax.vmap(eqx.combine(params, static))(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = loss_fn(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (eqx.apply_updates(params, updates), opt_state), {"loss": loss}

    state = (params, jax.eval_shape(tx.init, params))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    """Equinox keeps a Linear's weight [out, in]: column-parallel splits dim 0, row dim 1."""
    if any(f"attn/{n}_proj/weight" in path for n in ("query", "key", "value")) or path.endswith("fc/weight"):
        return ("model", None)
    if path.endswith("fc/bias"):
        return ("model",)
    if path.endswith("embed/weight"):  # vocabulary-parallel
        return ("model", None)
    if path.endswith(("attn/output_proj/weight", "proj/weight")) or path.endswith("head/weight"):
        return ("model", None) if path.endswith("head/weight") else (None, "model")
    return None


EXPERTS = common.standard_experts(tensor_parallel)
