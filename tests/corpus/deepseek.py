"""A DeepSeek-V2/V3-style decoder as its reference `model.py` and MaxText's `deepseek` write it:
multi-head latent attention (queries and keys/values through low-rank latents `wq_a`/`wkv_a`
with their own RMSNorms, a decoupled RoPE part of each head shared by the keys), and a MoE layer
of routed experts beside an always-on shared expert, top-k routing by softmax scores normalised
over the chosen. Dispatch in one of the two forms public code uses:

    sort     tokens sorted by expert (`argsort` of the flattened choices), each expert's first
             `capacity` taken into a [experts, capacity, d] buffer by gather, the experts' stacked
             weights applied by one batched matmul, the outputs gathered back and weighted
             (the permute-based dispatch of MaxText's dropping path)
    ragged   tokens sorted by expert, the experts applied by `jax.lax.ragged_dot` with each
             expert's token count as group sizes, unsorted by the inverse permutation
             (MaxText's `sparse_matmul` path on GPU, without its shard_map)

bfloat16 compute, float32 parameters, `optax.adamw` with global-norm clipping."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(
    vocab=32000,
    d=1024,
    heads=16,
    q_rank=384,
    kv_rank=256,
    nope=64,
    rope=32,
    v_dim=64,
    experts=8,
    top_k=2,
    expert_ff=1024,
    shared_ff=1024,
    seq=512,
    batch=16,
    capacity=1.25,
)


def init(key, layers, c=CFG):
    d, h, e = c["d"], c["heads"], c["experts"]
    keys = iter(jax.random.split(key, 16 * layers + 4))
    w = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32) * 0.02  # noqa: E731
    layer = lambda: {  # noqa: E731
        "attn": {
            "wq_a": w(d, c["q_rank"]),
            "q_norm": jnp.ones((c["q_rank"],)),
            "wq_b": w(c["q_rank"], h * (c["nope"] + c["rope"])),
            "wkv_a": w(d, c["kv_rank"] + c["rope"]),
            "kv_norm": jnp.ones((c["kv_rank"],)),
            "wkv_b": w(c["kv_rank"], h * (c["nope"] + c["v_dim"])),
            "wo": w(h * c["v_dim"], d),
        },
        "moe": {
            "gate": w(d, e),
            "w1": w(e, d, c["expert_ff"]),
            "w3": w(e, d, c["expert_ff"]),
            "w2": w(e, c["expert_ff"], d),
            "shared_w1": w(d, c["shared_ff"]),
            "shared_w3": w(d, c["shared_ff"]),
            "shared_w2": w(c["shared_ff"], d),
        },
        "attn_norm": jnp.ones((d,)),
        "ffn_norm": jnp.ones((d,)),
    }
    return {
        "embed": w(c["vocab"], d),
        "layers": [layer() for _ in range(layers)],
        "norm": jnp.ones((d,)),
        "head": w(d, c["vocab"]),
    }


def rms(x, g):
    y = x.astype(jnp.float32)
    return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(x.dtype) * g.astype(x.dtype)


def rope(x):
    """Rotary embedding of [b, s, h, r] by complex-pair rotation, as DeepSeek's `apply_rotary_emb`."""
    s, r = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, r, 2) / r))
    angles = jnp.arange(s)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (r // 2, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], -1)
    return out.reshape(x.shape).astype(x.dtype)


def latent_attention(p, x, c=CFG):
    b, s, _ = x.shape
    h, nope, r, v_dim = c["heads"], c["nope"], c["rope"], c["v_dim"]
    bf = lambda name: p[name].astype(jnp.bfloat16)  # noqa: E731
    q = (rms(x @ bf("wq_a"), p["q_norm"]) @ bf("wq_b")).reshape(b, s, h, nope + r)
    q_nope, q_pe = q[..., :nope], rope(q[..., nope:])
    kv = x @ bf("wkv_a")
    kv_latent, k_pe = kv[..., : c["kv_rank"]], rope(kv[..., None, c["kv_rank"] :])
    kv = (rms(kv_latent, p["kv_norm"]) @ bf("wkv_b")).reshape(b, s, h, nope + v_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (b, s, h, r))], -1)
    q = jnp.concatenate([q_nope, q_pe], -1)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) * (nope + r) ** -0.5
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores.astype(jnp.float32), -jnp.inf), -1).astype(jnp.bfloat16)
    out = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, h * v_dim)
    return out @ bf("wo")


def route(p, tokens, c=CFG):
    scores = jax.nn.softmax((tokens @ p["gate"].astype(jnp.bfloat16)).astype(jnp.float32), -1)
    weights, chosen = jax.lax.top_k(scores, c["top_k"])
    weights = weights / weights.sum(-1, keepdims=True)
    return weights, chosen


def experts_sorted(p, tokens, weights, chosen, c=CFG):
    """Permute by expert, fill [experts, capacity, d] by gather, one batched matmul, gather back."""
    n, k, e = tokens.shape[0], c["top_k"], c["experts"]
    capacity = int(c["capacity"] * n * k / e)
    flat = chosen.reshape(-1)  # [n * k]
    order = jnp.argsort(flat)
    counts = jnp.bincount(flat, length=e)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(capacity)[None, :]
    index = jnp.minimum(starts[:, None] + slot, n * k - 1)  # [e, capacity] into the sorted list
    valid = slot < counts[:, None]
    picked = order[index]  # which (token, choice) fills each slot
    x = jnp.where(valid[..., None], tokens[picked // k], 0)
    w = lambda name: p[name].astype(jnp.bfloat16)  # noqa: E731
    hidden = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x, w("w1"))) * jnp.einsum("ecd,edf->ecf", x, w("w3"))
    out = jnp.einsum("ecf,efd->ecd", hidden, w("w2"))
    out = out * jnp.where(valid, weights.reshape(-1)[picked], 0).astype(out.dtype)[..., None]
    combined = jnp.zeros((n * k, tokens.shape[1]), out.dtype).at[picked.reshape(-1)].add(out.reshape(-1, out.shape[-1]))
    return combined.reshape(n, k, -1).sum(1)


def experts_ragged(p, tokens, weights, chosen, c=CFG):
    """Sort the (token, choice) pairs by expert and apply each expert to its run of them."""
    n, k, e = tokens.shape[0], c["top_k"], c["experts"]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat)
    x = tokens[order // k]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    w = lambda name: p[name].astype(jnp.bfloat16)  # noqa: E731
    hidden = jax.nn.silu(jax.lax.ragged_dot(x, w("w1"), sizes)) * jax.lax.ragged_dot(x, w("w3"), sizes)
    out = jax.lax.ragged_dot(hidden, w("w2"), sizes)
    out = out[jnp.argsort(order)].reshape(n, k, -1)
    return (out * weights[..., None].astype(out.dtype)).sum(1)


def moe(p, x, form, c=CFG):
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    weights, chosen = route(p, tokens, c)
    routed = (experts_sorted if form == "sort" else experts_ragged)(p, tokens, weights, chosen, c)
    w = lambda name: p[name].astype(jnp.bfloat16)  # noqa: E731
    shared = (jax.nn.silu(tokens @ w("shared_w1")) * (tokens @ w("shared_w3"))) @ w("shared_w2")
    return (routed + shared).reshape(b, s, d)


def loss(params, batch, form, c=CFG):
    x = params["embed"].astype(jnp.bfloat16)[batch["tokens"]]
    for p in params["layers"]:
        x = x + latent_attention(p["attn"], rms(x, p["attn_norm"]), c)
        x = x + moe(p["moe"], rms(x, p["ffn_norm"]), form, c)
    logits = (rms(x, params["norm"]) @ params["head"].astype(jnp.bfloat16)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def build(layers=2, form="sort", c=CFG):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(2.2e-4, b1=0.9, b2=0.95, weight_decay=0.1))

    def step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch, form, c)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    def make(key):
        params = init(key, layers, c)
        return params, tx.init(params)

    state = jax.eval_shape(make, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"tokens": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    """MaxText's split of latent attention: the up-projections from the latents (`wq_b`,
    `wkv_b`) column-parallel by heads and `wo` row-parallel; the down-projections to the latents
    and their norms whole; the shared expert Megatron-split; the routed experts' hidden units
    split (MaxText's `mlp` axis on experts); the vocabulary split, embedding and head."""
    name = path.split("/")[-1]
    if name in ("wq_b", "wkv_b", "shared_w1", "shared_w3", "head"):
        return (None, "model")
    if name in ("wo", "shared_w2", "embed"):
        return ("model", None)
    if name in ("w1", "w3"):
        return (None, None, "model")
    if name == "w2":
        return (None, "model", None)
    return None


def expert_parallel(path, shape):
    """DeepSeek's expert parallelism: the routed experts spread over the axis."""
    return ("model", None, None) if path.split("/")[-1] in ("w1", "w2", "w3") else None


EXPERTS = common.standard_experts(tensor_parallel, expert_parallel)
