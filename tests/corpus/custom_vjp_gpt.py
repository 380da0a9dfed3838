"""A GPT-2 written as nanoGPT-style JAX ports write it, with the pieces performance-minded users
add: a fused QKV projection cut by `jnp.split`, a layer norm with a hand-written backward pass
(`jax.custom_vjp`), attention inside a nested `jax.jit`, a tied embedding for the logits, each
layer under `jax.checkpoint` (no policy), and optax adamw with weight decay masked to matrices."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=50304, d=768, heads=12, seq=1024, batch=16)


@jax.custom_vjp
def layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    r = jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    return (x - mu) * r * g + b


def _ln_fwd(x, g, b):
    mu = x.mean(-1, keepdims=True)
    r = jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (x - mu) * r
    return xhat * g + b, (xhat, r, g)


def _ln_bwd(res, dy):
    xhat, r, g = res
    dxhat = dy * g
    dx = r * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    axes = tuple(range(dy.ndim - 1))
    return dx, (dy * xhat).sum(axes), dy.sum(axes)


layer_norm.defvjp(_ln_fwd, _ln_bwd)


@jax.jit
def causal_attention(q, k, v):
    t = q.shape[1]
    att = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1])
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(att, -1), v)


def init_params(key, layers, c=CFG):
    d = c["d"]
    k = iter(jax.random.split(key, 8 * layers + 2))
    n = lambda *s: jax.random.normal(next(k), s) * 0.02
    block = lambda: {
        "ln_1": {"g": jnp.ones(d), "b": jnp.zeros(d)},
        "c_attn": {"w": n(d, 3 * d), "b": jnp.zeros(3 * d)},
        "c_proj": {"w": n(d, d), "b": jnp.zeros(d)},
        "ln_2": {"g": jnp.ones(d), "b": jnp.zeros(d)},
        "c_fc": {"w": n(d, 4 * d), "b": jnp.zeros(4 * d)},
        "mlp_proj": {"w": n(4 * d, d), "b": jnp.zeros(d)},
    }
    return {
        "wte": n(c["vocab"], d),
        "wpe": n(c["seq"], d),
        "h": [block() for _ in range(layers)],
        "ln_f": {"g": jnp.ones(d), "b": jnp.zeros(d)},
    }


def block(p, x, heads):
    b, t, d = x.shape
    q, k, v = jnp.split(layer_norm(x, **p["ln_1"]) @ p["c_attn"]["w"] + p["c_attn"]["b"], 3, axis=2)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    x = x + causal_attention(q, k, v).reshape(b, t, d) @ p["c_proj"]["w"] + p["c_proj"]["b"]
    h = jax.nn.gelu(layer_norm(x, **p["ln_2"]) @ p["c_fc"]["w"] + p["c_fc"]["b"])
    return x + h @ p["mlp_proj"]["w"] + p["mlp_proj"]["b"]


def forward(params, tokens, c):
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
    run = jax.checkpoint(block, static_argnums=(2,))
    for p in params["h"]:
        x = run(p, x, c["heads"])
    return layer_norm(x, **params["ln_f"]) @ params["wte"].T


def build(layers=2, c=CFG):
    matrices = lambda params: jax.tree.map(lambda a: a.ndim >= 2, params)
    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1, mask=matrices)

    def step(state, batch):
        def loss_fn(params):
            logits = forward(params, batch["inputs"], c)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

    def init(key):
        params = init_params(key, layers, c)
        return {"params": params, "opt_state": tx.init(params)}

    state = jax.eval_shape(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    """nanoGPT's Megatron split: the fused c_attn and c_fc column-parallel, the projections row."""
    if path.endswith(("c_attn/w", "c_fc/w")):
        return (None, "model")
    if path.endswith(("c_attn/b", "c_fc/b")):
        return ("model",)
    if path.endswith(("c_proj/w", "mlp_proj/w")):
        return ("model", None)
    if path.endswith("wte"):
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
