"""A Llama-style decoder train step for the partitioner's tests and benchmarks: RMSNorm, rotary
position embeddings, grouped-query attention (fewer key/value heads than query heads) and a SwiGLU
MLP, AdamW. Abstract arguments only: `llama(...)` returns `(step, (state, batch))`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def llama(d=4096, heads=32, kv_heads=8, ff=14336, vocab=32000, layers=2, batch=8, seq=1024):
    dh = d // heads
    opt = optax.adamw(1e-4)

    def init():
        z = jnp.zeros
        params = {
            "embed": z((vocab, d)),
            "norm": z((d,)),
            "lm_head": z((d, vocab)),
            "layers": [
                {
                    "attn_norm": z((d,)),
                    "wq": z((d, heads * dh)),
                    "wk": z((d, kv_heads * dh)),
                    "wv": z((d, kv_heads * dh)),
                    "wo": z((heads * dh, d)),
                    "mlp_norm": z((d,)),
                    "w_gate": z((d, ff)),
                    "w_up": z((d, ff)),
                    "w_down": z((ff, d)),
                }
                for _ in range(layers)
            ],
        }
        return {"params": params, "opt": opt.init(params)}

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1 + scale)

    def rope(x):
        pos = jnp.arange(x.shape[1])[:, None] / (10000 ** (jnp.arange(0, dh, 2) / dh))[None, :]
        cos, sin = jnp.cos(pos)[None, :, None, :], jnp.sin(pos)[None, :, None, :]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)

    def attention(x, p):
        b, s, _ = x.shape
        q = rope((x @ p["wq"]).reshape(b, s, heads, dh))
        k = rope((x @ p["wk"]).reshape(b, s, kv_heads, dh))
        v = (x @ p["wv"]).reshape(b, s, kv_heads, dh)
        k, v = jnp.repeat(k, heads // kv_heads, axis=2), jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(dh)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return out.reshape(b, s, heads * dh) @ p["wo"]

    def loss(params, tokens):
        x = params["embed"][tokens["inputs"]]
        for p in params["layers"]:
            x = x + attention(rms(x, p["attn_norm"]), p)
            h = rms(x, p["mlp_norm"])
            x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        logits = rms(x, params["norm"]) @ params["lm_head"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens["targets"][..., None], axis=-1))

    def step(state, tokens):
        value, grads = jax.value_and_grad(loss)(state["params"], tokens)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, {"loss": value}

    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return step, (jax.eval_shape(init), {"inputs": ids, "targets": ids})
