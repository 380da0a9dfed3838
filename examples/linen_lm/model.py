"""A decoder language model written as a Flax Linen user writes one, trained on their own token files.

The recipe for Linen: the train state is a `flax.training.train_state.TrainState` (or any dict of
`params` and `opt_state`); its `apply_fn` and `tx` are static fields, so only arrays are
checkpointed and resharded. The job file names the factory,
`program = "examples.linen_lm.model:make_program"`, and `[options] train_tokens` the files.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

from orchestrator import JobSettings, Program, TokenFiles

VOCAB, SEQ, D, HEADS, LAYERS = 512, 64, 128, 4, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        x = x + nn.SelfAttention(HEADS, dtype=jnp.bfloat16)(nn.LayerNorm(dtype=jnp.bfloat16)(x), mask=mask)
        y = nn.Dense(4 * D, dtype=jnp.bfloat16)(nn.LayerNorm(dtype=jnp.bfloat16)(x))
        return x + nn.Dense(D, dtype=jnp.bfloat16)(nn.gelu(y))


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D, dtype=jnp.bfloat16)
        x, mask = embed(tokens), nn.make_causal_mask(tokens)
        for _ in range(LAYERS):
            x = Block()(x, mask)
        return embed.attend(nn.LayerNorm(dtype=jnp.bfloat16)(x)).astype(jnp.float32)


def make_program(settings: JobSettings) -> Program:
    paths = settings.options.get("train_tokens")
    if not paths:
        raise ValueError('the job file\'s [options] needs train_tokens = ["path/to/train.bin", ...]')
    model = LM()
    tx = optax.adamw(optax.cosine_decay_schedule(3e-3, settings.steps), weight_decay=0.1)

    def init(key):
        params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    data = TokenFiles(tuple([paths] if isinstance(paths, str) else paths), SEQ, seed=settings.seed).dataset()
    return Program(init=init, step=step, data=data, tokens_per_example=SEQ)
