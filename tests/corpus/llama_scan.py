"""A Llama decoder written the MaxText way with its layers scanned (`scan_layers=True`): the
layers' weights stacked `[layers, ...]` and stored in bfloat16, applied by `jax.lax.scan` under
`jax.checkpoint` (MaxText's `remat_policy="full"`), grouped-query attention (K/V heads shared by
groups of query heads), RoPE, RMSNorm, SwiGLU, a head of its own, and adamw. `SEVEN_B` is
Llama-2-7B's shape with Llama-3's grouped-query attention (d=4096, 32 layers, 32 heads, 8 K/V
heads, d_ff 11008)."""

import jax
import jax.numpy as jnp
import optax

CFG = dict(vocab=32000, embed=1024, heads=16, kv_heads=4, head_dim=64, mlp=2816, seq=1024, batch=8)
SEVEN_B = dict(vocab=32000, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=11008, seq=2048, batch=32)
THIRTEEN_B = dict(vocab=32000, embed=5120, heads=40, kv_heads=8, head_dim=128, mlp=13824, seq=2048, batch=32)
BF16 = jnp.bfloat16


def param_shapes(layers, c=CFG):
    e, h, k, d, f = c["embed"], c["heads"], c["kv_heads"], c["head_dim"], c["mlp"]
    w = lambda *shape: jax.ShapeDtypeStruct(shape, BF16)  # noqa: E731
    return {
        "embed": w(c["vocab"], e),
        "layers": {
            "attention_norm": w(layers, e),
            "query": w(layers, e, h, d),
            "key": w(layers, e, k, d),
            "value": w(layers, e, k, d),
            "out": w(layers, h, d, e),
            "mlp_norm": w(layers, e),
            "gate": w(layers, e, f),
            "up": w(layers, e, f),
            "down": w(layers, f, e),
        },
        "norm": w(e),
        "head": w(e, c["vocab"]),
    }


def rms(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6)).astype(BF16) * scale


def rope(x):
    s, d = x.shape[1], x.shape[-1]
    freqs = 10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None]
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(BF16)


def layer(x, p):
    b, s, _ = x.shape
    kv, groups = p["key"].shape[1], p["query"].shape[1] // p["key"].shape[1]
    y = rms(x, p["attention_norm"])
    q = rope(jnp.einsum("bse,ehd->bshd", y, p["query"])).reshape(b, s, kv, groups, -1)
    k = rope(jnp.einsum("bse,ehd->bshd", y, p["key"]))
    v = jnp.einsum("bse,ehd->bshd", y, p["value"])
    w = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, -1e9), -1).astype(BF16)
    a = jnp.einsum("bkgst,btkd->bskgd", w, v).reshape(b, s, -1, q.shape[-1])
    x = x + jnp.einsum("bshd,hde->bse", a, p["out"])
    y = rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(y @ p["gate"]) * (y @ p["up"])) @ p["down"], None


def forward(params, tokens):
    x = params["embed"][tokens]
    body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, params["layers"])
    return (rms(x, params["norm"]) @ params["head"]).astype(jnp.float32)


def build(layers=2, c=CFG):
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)

    def step(state, batch):
        def loss_fn(params):
            logits = forward(params, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

    params = param_shapes(layers, c)
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    if path.endswith(("query", "key", "value")):
        return (None, None, "model", None)
    if path.endswith("out"):
        return (None, "model", None, None)
    if path.endswith(("gate", "up")):
        return (None, None, "model")
    if path.endswith("down"):
        return (None, "model", None)
    return None


def small():
    """For `remesh plan tests.corpus.llama_scan:small --devices 8`: 8 layers at a small size."""
    return build(layers=8, c=dict(CFG, embed=256, heads=4, kv_heads=2, head_dim=64, mlp=512, seq=256))
