"""A T5-style encoder-decoder written as T5X/flaxformer write it, in plain JAX: no biases,
RMS-style layer norm without centring, relative position buckets turned into a per-head bias by
a gather from a small table, `[embed, heads * kv]` projections with heads split by reshape, an
encoder with bidirectional self-attention, a decoder with causal self-attention and
cross-attention to the encoder, a shared input embedding and a separate untied output layer,
ReLU MLP; optax adafactor, as T5 trains."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32128, d=768, heads=12, kv=64, ff=3072, buckets=32, enc_seq=512, dec_seq=128, batch=16)


def _attn_params(n, c):
    hk = c["heads"] * c["kv"]
    return {"q": n(c["d"], hk), "k": n(c["d"], hk), "v": n(c["d"], hk), "o": n(hk, c["d"])}


def init_params(key, layers, c=CFG):
    k = iter(jax.random.split(key, 64 * layers))
    n = lambda *s: jax.random.normal(next(k), s) * 0.02
    mlp = lambda: {"wi": n(c["d"], c["ff"]), "wo": n(c["ff"], c["d"])}
    ln = lambda: jnp.ones((c["d"],))
    enc = [{"attn": _attn_params(n, c), "mlp": mlp(), "ln_attn": ln(), "ln_mlp": ln()} for _ in range(layers)]
    dec = [
        {
            "self": _attn_params(n, c),
            "cross": _attn_params(n, c),
            "mlp": mlp(),
            "ln_self": ln(),
            "ln_cross": ln(),
            "ln_mlp": ln(),
        }
        for _ in range(layers)
    ]
    return {
        "shared": n(c["vocab"], c["d"]),
        "encoder": {"layers": enc, "rel_bias": n(c["buckets"], c["heads"]), "ln": ln()},
        "decoder": {"layers": dec, "rel_bias": n(c["buckets"], c["heads"]), "ln": ln()},
        "lm_head": n(c["d"], c["vocab"]),
    }


def norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def buckets(q_len, k_len, n, bidirectional):
    rel = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
    half = n // 2 if bidirectional else n
    ret = (rel > 0).astype(jnp.int32) * half if bidirectional else 0
    rel = jnp.abs(rel) if bidirectional else -jnp.minimum(rel, 0)
    exact = half // 2
    large = exact + (jnp.log(jnp.maximum(rel, 1) / exact) / jnp.log(128 / exact) * (half - exact)).astype(jnp.int32)
    return ret + jnp.where(rel < exact, rel, jnp.minimum(large, half - 1))


def attention(p, x, kv, bias, c, mask=None):
    b, s, _ = x.shape
    split = lambda t: t.reshape(b, t.shape[1], c["heads"], c["kv"])
    q, k, v = split(x @ p["q"]), split(kv @ p["k"]), split(kv @ p["v"])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
    return out.reshape(b, s, -1) @ p["o"]


def position_bias(table, q_len, k_len, c, bidirectional):
    return jnp.transpose(table[buckets(q_len, k_len, c["buckets"], bidirectional)], (2, 0, 1))[None]


def forward(params, batch, c):
    enc, dec = params["encoder"], params["decoder"]
    x = params["shared"][batch["inputs"]]
    bias = position_bias(enc["rel_bias"], x.shape[1], x.shape[1], c, True)
    for p in enc["layers"]:
        y = norm(x, p["ln_attn"])
        x = x + attention(p["attn"], y, y, bias, c)
        x = x + jax.nn.relu(norm(x, p["ln_mlp"]) @ p["mlp"]["wi"]) @ p["mlp"]["wo"]
    memory = norm(x, enc["ln"])
    y = params["shared"][batch["decoder_inputs"]]
    s = y.shape[1]
    self_bias = position_bias(dec["rel_bias"], s, s, c, False)
    causal = jnp.tril(jnp.ones((s, s), bool))
    for p in dec["layers"]:
        h = norm(y, p["ln_self"])
        y = y + attention(p["self"], h, h, self_bias, c, causal)
        y = y + attention(p["cross"], norm(y, p["ln_cross"]), memory, None, c)
        y = y + jax.nn.relu(norm(y, p["ln_mlp"]) @ p["mlp"]["wi"]) @ p["mlp"]["wo"]
    return norm(y, dec["ln"]) @ params["lm_head"]


def build(layers=2, c=CFG):
    tx = optax.adafactor(1e-3)

    def step(state, batch):
        def loss_fn(params):
            logits = forward(params, batch, c)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

    def init(key):
        params = init_params(key, layers, c)
        return {"params": params, "opt_state": tx.init(params)}

    state = jax.eval_shape(init, jax.random.key(0))
    enc = jax.ShapeDtypeStruct((c["batch"], c["enc_seq"]), jnp.int32)
    dec = jax.ShapeDtypeStruct((c["batch"], c["dec_seq"]), jnp.int32)
    return step, (state, {"inputs": enc, "decoder_inputs": dec, "targets": dec})


def tensor_parallel(path, shape):
    name = path.split("/")[-1]
    if name in ("q", "k", "v", "wi", "lm_head"):
        return (None, "model")
    if name in ("o", "wo", "shared"):  # the shared embedding vocabulary-parallel (t5x: vocab on model)
        return ("model", None)
    if name == "rel_bias":
        return (None, "model")
    return None


EXPERTS = common.standard_experts(tensor_parallel)
