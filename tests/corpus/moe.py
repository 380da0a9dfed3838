"""A mixture-of-experts decoder written as Mixtral/DeepSeek-style JAX ports write it (the dense
"dropping" formulation of MaxText's `moe.py` and of flaxformer): a router, top-2 gating by
`jax.lax.top_k` with renormalised weights, tokens dispatched and combined by one-hot einsums with
a capacity factor, stacked expert weights `[experts, embed, mlp]` applied by einsum, an
always-on shared expert beside them, and a load-balancing auxiliary loss; attention with
`[embed, heads * head_dim]` projections; adamw."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, d=1024, heads=16, experts=8, ff=2048, shared_ff=2048, seq=512, batch=16, capacity=1.25)


def init_params(key, layers, c=CFG):
    d, e, f = c["d"], c["experts"], c["ff"]
    k = iter(jax.random.split(key, 12 * layers + 2))
    n = lambda *s: (jax.random.normal(next(k), s) * 0.02).astype(jnp.bfloat16)
    layer = lambda: {
        "attn": {"wqkv": n(d, 3 * d), "wo": n(d, d)},
        "router": n(d, e),
        "experts": {"w_in": n(e, d, f), "w_gate": n(e, d, f), "w_out": n(e, f, d)},
        "shared": {"w_in": n(d, c["shared_ff"]), "w_out": n(c["shared_ff"], d)},
        "ln1": jnp.ones((d,), jnp.bfloat16),
        "ln2": jnp.ones((d,), jnp.bfloat16),
    }
    return {"embed": n(c["vocab"], d), "layers": [layer() for _ in range(layers)], "head": n(d, c["vocab"])}


def rms(x, g):
    return (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)).astype(
        x.dtype
    ) * g


def attention(p, x, heads):
    b, s, d = x.shape
    q, k, v = jnp.split(x @ p["wqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads) for t in (q, k, v))
    w = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(d // heads)
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, -1e9), -1).astype(x.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, d) @ p["wo"]


def moe(p, x, c):
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    n, e = tokens.shape[0], c["experts"]
    probs = jax.nn.softmax((tokens @ p["router"]).astype(jnp.float32), -1)
    gates, index = jax.lax.top_k(probs, 2)
    gates = gates / gates.sum(-1, keepdims=True)
    capacity = int(c["capacity"] * 2 * n / e)
    onehot = jax.nn.one_hot(index, e, dtype=jnp.int32)  # [tokens, 2, experts]
    position = (jnp.cumsum(onehot.reshape(-1, e), axis=0).reshape(n, 2, e) - 1) * onehot
    keep = (position < capacity) * onehot
    slot = jax.nn.one_hot(position.sum(-1), capacity, dtype=x.dtype)  # [tokens, 2, capacity]
    dispatch = jnp.einsum("tke,tkc->tec", keep.astype(x.dtype), slot)
    combine = jnp.einsum("tke,tkc,tk->tec", keep.astype(x.dtype), slot, gates.astype(x.dtype))
    routed = jnp.einsum("tec,td->ecd", dispatch, tokens)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", routed, p["experts"]["w_gate"]))
    h = h * jnp.einsum("ecd,edf->ecf", routed, p["experts"]["w_in"])
    out = jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", h, p["experts"]["w_out"]))
    shared = jax.nn.silu(tokens @ p["shared"]["w_in"]) @ p["shared"]["w_out"]
    balance = e * jnp.sum(jnp.mean(onehot[:, 0], 0) * jnp.mean(probs, 0))
    return (out + shared).reshape(b, s, d), balance


def loss_fn(params, batch, c):
    x = params["embed"][batch["inputs"]]
    aux = 0.0
    for p in params["layers"]:
        x = x + attention(p["attn"], rms(x, p["ln1"]), c["heads"])
        y, balance = moe(p, rms(x, p["ln2"]), c)
        x, aux = x + y, aux + balance
    logits = (x @ params["head"]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return ce + 0.01 * aux, ce


def build(layers=2, c=CFG):
    tx = optax.adamw(3e-4)

    def step(state, batch):
        (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, c)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": ce}

    def init(key):
        params = init_params(key, layers, c)
        return {"params": params, "opt": tx.init(params)}

    state = jax.eval_shape(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    name = path.split("/")[-1]
    if name in ("wqkv", "head") or path.endswith("shared/w_in"):
        return (None, "model")
    if name in ("wo", "embed") or path.endswith("shared/w_out"):  # the embedding vocabulary-parallel
        return ("model", None)
    if path.endswith(("experts/w_in", "experts/w_gate")):
        return (None, None, "model")
    if path.endswith("experts/w_out"):
        return (None, "model", None)
    return None


def expert_parallel(path, shape):
    return ("model", None, None) if "experts/" in path else None


EXPERTS = common.standard_experts(tensor_parallel, expert_parallel)
