"""A Llama decoder written as MaxText writes one (`MaxText/layers/attentions.py`, `linears.py`):
float32 master weights cast to bfloat16 for compute, projection kernels with several axes
(`[embed, heads, head_dim]` in, `[heads, head_dim, embed]` out, as `DenseGeneral` makes them)
applied with `jnp.einsum`, grouped-query attention with K/V heads repeated by `jnp.repeat`, RoPE
by halves (slices, rotation, concatenation), a causal mask from `jnp.tril`, RMSNorm, SwiGLU, and
layers as a Python loop; the optimizer is an optax chain of `clip_by_global_norm` and `adamw`
with a warmup-cosine schedule and weight decay masked off the norms. `remat=True` runs each layer
under `jax.checkpoint`."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, embed=1024, heads=16, kv_heads=4, head_dim=64, mlp=4096, seq=1024, batch=8)
SEVEN_B = dict(vocab=32000, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=11008, seq=2048, batch=32)
THIRTEEN_B = dict(vocab=32000, embed=5120, heads=40, kv_heads=8, head_dim=128, mlp=13824, seq=2048, batch=32)


def init_params(key, layers, c=CFG):
    e, h, k, d, f = c["embed"], c["heads"], c["kv_heads"], c["head_dim"], c["mlp"]
    keys = iter(jax.random.split(key, 8 * layers + 2))
    normal = lambda shape: jax.random.normal(next(keys), shape, jnp.float32) * 0.02
    layer = lambda: {
        "attention": {
            "query": {"kernel": normal((e, h, d))},
            "key": {"kernel": normal((e, k, d))},
            "value": {"kernel": normal((e, k, d))},
            "out": {"kernel": normal((h, d, e))},
        },
        "mlp": {
            "wi_0": {"kernel": normal((e, f))},
            "wi_1": {"kernel": normal((e, f))},
            "wo": {"kernel": normal((f, e))},
        },
        "pre_self_attention_norm": {"scale": jnp.ones((e,))},
        "post_self_attention_norm": {"scale": jnp.ones((e,))},
    }
    return {
        "token_embedder": {"embedding": normal((c["vocab"], e))},
        "decoder": {f"layers_{i}": layer() for i in range(layers)},
        "decoder_norm": {"scale": jnp.ones((e,))},
        "logits_dense": {"kernel": normal((e, c["vocab"]))},
    }


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale).astype(jnp.bfloat16)


def rope(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, :, None, None] * freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def attention(p, x, positions):
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    q = jnp.einsum("bse,ehd->bshd", x, w["query"]["kernel"])
    k = jnp.einsum("bse,ekd->bskd", x, w["key"]["kernel"])
    v = jnp.einsum("bse,ekd->bskd", x, w["value"]["kernel"])
    q, k = rope(q, positions), rope(k, positions)
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    scores = jnp.where(mask, scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(jnp.bfloat16)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return jnp.einsum("bshd,hde->bse", out, w["out"]["kernel"])


def mlp(p, x):
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    gate = jax.nn.silu(x @ w["wi_0"]["kernel"])
    return (gate * (x @ w["wi_1"]["kernel"])) @ w["wo"]["kernel"]


def decoder_layer(layer, x, positions):
    x = x + attention(layer["attention"], rms_norm(x, layer["pre_self_attention_norm"]["scale"]), positions)
    return x + mlp(layer["mlp"], rms_norm(x, layer["post_self_attention_norm"]["scale"]))


def forward(params, tokens, remat=False):
    x = params["token_embedder"]["embedding"].astype(jnp.bfloat16)[tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    run = jax.checkpoint(decoder_layer) if remat else decoder_layer  # MaxText's remat_policy="full"
    for name in sorted(params["decoder"], key=lambda n: int(n.split("_")[1])):
        x = run(params["decoder"][name], x, positions)
    x = rms_norm(x, params["decoder_norm"]["scale"])
    return (x @ params["logits_dense"]["kernel"].astype(jnp.bfloat16)).astype(jnp.float32)


def optimizer():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: "scale" not in str(path), params)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1, mask=decay_mask))


def build(layers=2, c=CFG, remat=False):
    tx = optimizer()

    def step(state, batch):
        def loss_fn(params):
            logits = forward(params, batch["inputs"], remat)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss}

    def init(key):
        params = init_params(key, layers, c)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    state = jax.eval_shape(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    """Megatron's split, by MaxText's logical axes: heads and mlp over model, embed replicated."""
    if path.endswith(("query/kernel", "key/kernel", "value/kernel")):
        return (None, "model", None)
    if path.endswith("out/kernel"):
        return ("model", None, None)
    if path.endswith(("wi_0/kernel", "wi_1/kernel")):
        return (None, "model")
    if path.endswith(("wo/kernel", "token_embedder/embedding")):  # MaxText: `vocab` on tensor
        return ("model", None)
    if path.endswith("logits_dense/kernel"):
        return (None, "model")
    return None


EXPERTS = common.standard_experts(tensor_parallel)
