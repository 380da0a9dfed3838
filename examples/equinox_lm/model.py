"""A decoder language model written as an Equinox user writes one, trained on their own token files.

The recipe for Equinox: the train state is the array half of `eqx.partition(model, eqx.is_array)`
and the optax state; the static half is closed over and `eqx.combine`d inside the step. The job
file names the factory, `program = "examples.equinox_lm.model:make_program"`, and
`[options] train_tokens` the files.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from orchestrator import JobSettings, Program, TokenFiles

VOCAB, SEQ, D, HEADS, LAYERS = 512, 64, 128, 4, 2


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
        self.up, self.down = eqx.nn.Linear(D, 4 * D, key=k2), eqx.nn.Linear(4 * D, D, key=k3)

    def __call__(self, x):  # [seq, d]: Equinox layers take one example
        y = jax.vmap(self.ln1)(x)
        x = x + self.attn(y, y, y, mask=jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool)))
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    ln: eqx.nn.LayerNorm

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 1)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
        self.blocks = [Block(k) for k in keys[1:]]
        self.ln = eqx.nn.LayerNorm(D)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.ln)(x) @ self.embed.weight.T  # tied embeddings


def make_program(settings: JobSettings) -> Program:
    paths = settings.options.get("train_tokens")
    if not paths:
        raise ValueError('the job file\'s [options] needs train_tokens = ["path/to/train.bin", ...]')
    tx = optax.adamw(optax.cosine_decay_schedule(3e-3, settings.steps), weight_decay=0.1)
    _, static = eqx.partition(eqx.filter_eval_shape(LM, jax.random.key(0)), eqx.is_array)

    def init(key):
        params, _ = eqx.partition(LM(key), eqx.is_array)
        return {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        @eqx.filter_value_and_grad
        def loss_fn(params):
            logits = jax.vmap(eqx.combine(params, static))(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = loss_fn(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = eqx.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    data = TokenFiles(tuple([paths] if isinstance(paths, str) else paths), SEQ, seed=settings.seed).dataset()
    return Program(init=init, step=step, data=data, tokens_per_example=SEQ)
