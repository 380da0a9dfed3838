"""Gemma as google-deepmind/gemma's Flax Linen modules write it: an `Einsum` module whose kernels
are heads-first (q_einsum (N, D, H) read by "BTD,NDH->BTNH", attn_vec_einsum (N, H, D)), K and V
stacked in one kv_einsum kernel (2, K, D, H) and split by indexing, the MLP's gate and up stacked
in one gating_einsum kernel (2, F, D), GeGLU, RMSNorm with a (1 + scale), the embedding tied to
the logits and scaled by sqrt(D), logits soft-capped by tanh, a sliding-window causal mask from
iota comparisons on alternate layers, grouped-query attention by grouping the queries, layers in
a Python list; an optax chain written out by hand (clip, scale_by_adam, masked decoupled weight
decay, a warmup-cosine schedule, scale by -1)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from tests.corpus import common

CFG = dict(vocab=32768, embed=1024, heads=8, kv_heads=2, head_dim=128, ff=4096, seq=1024, batch=8, window=256)


class Einsum(nn.Module):
    shape: tuple

    @nn.compact
    def __call__(self, eqn, x):
        w = self.param("w", nn.initializers.normal(0.02), self.shape)
        return jnp.einsum(eqn, x, w.astype(jnp.bfloat16))


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6)
        return (normed * (1 + scale)).astype(x.dtype)


def apply_rope(x, positions, base=10000):
    h = x.shape[-1]
    frac = 2 * jnp.arange(h // 2) / h
    t = positions[..., None] / base**frac
    t = t[..., None, :]
    sin, cos = jnp.sin(t), jnp.cos(t)
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    c: dict
    local: bool

    @nn.compact
    def __call__(self, x, positions):
        c = self.c
        n, k, d, h = c["heads"], c["kv_heads"], c["embed"], c["head_dim"]
        q = Einsum((n, d, h), name="q_einsum")("BTD,NDH->BTNH", x)
        kv = Einsum((2, k, d, h), name="kv_einsum")("BSD,CKDH->CBSKH", x)
        key, value = kv[0], kv[1]
        q, key = apply_rope(q, positions), apply_rope(key, positions)
        q = q * h**-0.5
        b, t = q.shape[:2]
        qg = q.reshape(b, t, k, n // k, h)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", qg, key).astype(jnp.float32)
        logits = jnp.tanh(logits / 50.0) * 50.0
        i = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
        j = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
        mask = i >= j
        if self.local:
            mask = mask & (i - j < c["window"])
        logits = jnp.where(mask[None, :, None, None, :], logits, -2.3819763e38)
        probs = jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)
        enc = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value).reshape(b, t, n, h)
        return Einsum((n, h, d), name="attn_vec_einsum")("BTNH,NHD->BTD", enc)


class FeedForward(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x):
        gate = Einsum((2, self.c["ff"], self.c["embed"]), name="gating_einsum")("...D,CFD->C...F", x)
        hidden = jax.nn.gelu(gate[0]) * gate[1]
        return Einsum((self.c["ff"], self.c["embed"]), name="linear")("...F,FD->...D", hidden)


class Block(nn.Module):
    c: dict
    local: bool

    @nn.compact
    def __call__(self, x, positions):
        x = x + Attention(self.c, self.local, name="attn")(RMSNorm(name="pre_attention_norm")(x), positions)
        return x + FeedForward(self.c, name="mlp")(RMSNorm(name="pre_ffw_norm")(x))


class Gemma(nn.Module):
    c: dict
    layers: int

    @nn.compact
    def __call__(self, tokens):
        c = self.c
        table = self.param("input_embedding", nn.initializers.normal(1.0), (c["vocab"], c["embed"]))
        x = (table[tokens] * jnp.sqrt(c["embed"]).astype(table.dtype)).astype(jnp.bfloat16)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        for i in range(self.layers):
            x = Block(c, local=i % 2 == 0, name=f"layer_{i}")(x, positions)
        x = RMSNorm(name="final_norm")(x)
        logits = jnp.einsum("BTD,VD->BTV", x, table.astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.tanh(logits / 30.0) * 30.0


def build(layers=2, c=CFG):
    model = Gemma(c, layers)
    sched = optax.warmup_cosine_decay_schedule(0.0, 1.0, 100, 10000)
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b2=0.95),
        optax.add_decayed_weights(0.1, mask=decay),
        optax.scale_by_schedule(sched),
        optax.scale(-3e-4),
    )
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)

    def make(key):
        params = model.init(key, jnp.zeros(tokens.shape, tokens.dtype))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn({"params": p}, batch["tokens"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return (losses * batch["mask"]).sum() / batch["mask"].sum()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = jax.eval_shape(make, jax.random.key(0))
    batch = {"tokens": tokens, "targets": tokens, "mask": jax.ShapeDtypeStruct(tokens.shape, jnp.float32)}
    return step, (state, batch)


def tensor_parallel(path, shape):
    if path.endswith("q_einsum/w") or path.endswith("attn_vec_einsum/w"):
        return ("model", None, None)  # heads
    if path.endswith("kv_einsum/w"):
        return (None, "model", None, None)  # kv heads
    if path.endswith("gating_einsum/w"):
        return (None, "model", None)
    if path.endswith("mlp/linear/w"):
        return ("model", None)
    if path.endswith("input_embedding"):
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
