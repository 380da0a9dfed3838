"""A Llama written as hand-rolled JAX codebases write it (the shape of Levanter's and of the
Hugging Face Flax port): merged-head projection matrices (`x @ wq`, then a reshape to heads), one
`jax.checkpoint` per layer with a dots-saveable policy, RoPE by rotating interleaved pairs, a mask
from `iota` comparisons, bfloat16 throughout, and grouped-query attention in one of the four
forms users write:

    repeat     K/V heads repeated with `jnp.repeat` (each K/V head next to its query group)
    tile       K/V heads tiled with `jnp.tile` (query head h reads K/V head h % kv_heads)
    broadcast  K/V broadcast to [b, s, kv, group, d] then reshaped to [b, s, heads, d]
    grouped    queries reshaped to [b, s, kv, group, d] against un-repeated K/V (no copies)

The optimizer is `optax.adamw` under `optax.MultiSteps` (gradient accumulation)."""

import functools

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, d=1024, heads=16, kv_heads=4, head_dim=64, ff=2816, seq=1024, batch=8)


def init_params(key, layers, c=CFG):
    d, h, k, hd, f = c["d"], c["heads"], c["kv_heads"], c["head_dim"], c["ff"]
    keys = iter(jax.random.split(key, 8 * layers + 2))
    w = lambda *shape: (jax.random.normal(next(keys), shape) * 0.02).astype(jnp.bfloat16)
    block = lambda: {
        "wq": w(d, h * hd),
        "wk": w(d, k * hd),
        "wv": w(d, k * hd),
        "wo": w(h * hd, d),
        "w_gate": w(d, f),
        "w_up": w(d, f),
        "w_down": w(f, d),
        "attn_norm": jnp.ones((d,), jnp.bfloat16),
        "mlp_norm": jnp.ones((d,), jnp.bfloat16),
    }
    return {
        "embed": w(c["vocab"], d),
        "blocks": [block() for _ in range(layers)],
        "norm": jnp.ones((d,), jnp.bfloat16),
        "lm_head": w(d, c["vocab"]),
    }


def rms(x, g):
    return (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-5)).astype(
        x.dtype
    ) * g


def rotary(x):
    b, s, h, d = x.shape
    inv = 1.0 / (10000 ** (jnp.arange(0, d, 2) / d))
    ang = jnp.arange(s)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    pairs = x.reshape(b, s, h, d // 2, 2).astype(jnp.float32)
    even, odd = pairs[..., 0], pairs[..., 1]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape).astype(x.dtype)


def attend(q, k, v, form):
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    causal = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0) >= jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
    if form == "grouped":
        qg = q.reshape(b, s, kv, g, d)
        att = jnp.einsum("bqkgd,bskd->bkgqs", qg, k) / jnp.sqrt(d).astype(q.dtype)
        att = jax.nn.softmax(jnp.where(causal, att.astype(jnp.float32), -jnp.inf), -1).astype(q.dtype)
        return jnp.einsum("bkgqs,bskd->bqkgd", att, v).reshape(b, s, h, d)
    if form == "repeat":
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    elif form == "tile":
        k, v = jnp.tile(k, (1, 1, g, 1)), jnp.tile(v, (1, 1, g, 1))
    elif form == "broadcast":
        k = jnp.broadcast_to(k[:, :, :, None, :], (b, s, kv, g, d)).reshape(b, s, h, d)
        v = jnp.broadcast_to(v[:, :, :, None, :], (b, s, kv, g, d)).reshape(b, s, h, d)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d).astype(q.dtype)
    att = jax.nn.softmax(jnp.where(causal, att.astype(jnp.float32), -jnp.inf), -1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v)


def block(p, x, form, c=CFG):
    b, s, _ = x.shape
    y = rms(x, p["attn_norm"])
    q = rotary((y @ p["wq"]).reshape(b, s, c["heads"], c["head_dim"]))
    k = rotary((y @ p["wk"]).reshape(b, s, c["kv_heads"], c["head_dim"]))
    v = (y @ p["wv"]).reshape(b, s, c["kv_heads"], c["head_dim"])
    x = x + attend(q, k, v, form).reshape(b, s, -1) @ p["wo"]
    y = rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]


def loss(params, tokens, targets, form, c=CFG):
    x = params["embed"][tokens]
    layer = jax.checkpoint(
        functools.partial(block, form=form, c=c), policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    )
    for p in params["blocks"]:
        x = layer(p, x)
    logits = (rms(x, params["norm"]) @ params["lm_head"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def build(layers=2, form="repeat", c=CFG):
    tx = optax.MultiSteps(optax.adamw(3e-4, b2=0.95), every_k_schedule=4)

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch["tokens"], batch["targets"], form, c)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    def init(key):
        params = init_params(key, layers, c)
        return params, tx.init(params)

    state = jax.eval_shape(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"tokens": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    name = path.split("/")[-1]
    if name in ("wq", "wk", "wv", "w_gate", "w_up", "lm_head"):
        return (None, "model")
    if name in ("wo", "w_down", "embed"):  # the embedding vocabulary-parallel, as Megatron-LM
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
