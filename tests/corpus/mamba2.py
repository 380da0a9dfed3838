"""A Mamba-2 language model as `mamba_ssm`'s Mamba2 block and its `ssd_minimal.py` write it, in
JAX: one fused `in_proj` to (z, xBC, dt); a causal depthwise conv over xBC (one width-4 filter
per channel, `feature_group_count` = channels); x, B and C cut from it; dt through softplus with
a bias; A = -exp(A_log); the SSD scan in chunks (`segsum` by a masked cumsum, the intra-chunk
output by one einsum, chunk states, the inter-chunk recurrence, the state-to-output term); a
skip D; a gated RMSNorm (y * silu(z)); `out_proj`. Pre-norm residual blocks, the LM head tied
to the embedding (MambaLMHeadModel's default), float32 parameters with bfloat16 compute, adamw."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, d=1024, expand=2, headdim=64, state=128, conv=4, chunk=128, seq=1024, batch=8)


def dims(c=CFG):
    inner = c["expand"] * c["d"]
    heads = inner // c["headdim"]
    return inner, heads, inner + 2 * c["state"]  # (d_inner, nheads, conv channels)


def init(key, layers, c=CFG):
    d = c["d"]
    inner, heads, conv_dim = dims(c)
    keys = iter(jax.random.split(key, 4 * layers + 2))
    w = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32) * 0.02  # noqa: E731
    layer = lambda: {  # noqa: E731
        "norm": jnp.ones((d,)),
        "in_proj": w(d, 2 * inner + 2 * c["state"] + heads),
        "conv_w": w(c["conv"], 1, conv_dim),
        "conv_b": jnp.zeros((conv_dim,)),
        "dt_bias": jnp.zeros((heads,)),
        "A_log": jnp.log(jnp.arange(1, heads + 1, dtype=jnp.float32)),
        "D": jnp.ones((heads,)),
        "gate_norm": jnp.ones((inner,)),
        "out_proj": w(inner, d),
    }
    return {"embedding": w(c["vocab"], d), "layers": [layer() for _ in range(layers)], "norm_f": jnp.ones((d,))}


def rms(x, g, eps=1e-5):
    y = x.astype(jnp.float32)
    return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + eps)).astype(x.dtype) * g.astype(x.dtype)


def segsum(x):
    """[..., T] -> [..., T, T]: sums of x over (j, i] below the diagonal, -inf above (ssd_minimal)."""
    t = x.shape[-1]
    x = jnp.broadcast_to(x[..., None], x.shape + (t,))
    x = jnp.where(jnp.tril(jnp.ones((t, t), bool), -1), x, 0)
    x = jnp.cumsum(x, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((t, t), bool), 0), x, -jnp.inf)


def ssd(x, a, b, c, chunk):
    """ssd_minimal_discrete: x [b, l, h, p], a [b, l, h], b and c [b, l, n] (one group)."""
    bsz, length, h, p = x.shape
    chunks = length // chunk
    x = x.reshape(bsz, chunks, chunk, h, p)
    b = b.reshape(bsz, chunks, chunk, -1)
    c = c.reshape(bsz, chunks, chunk, -1)
    a = a.reshape(bsz, chunks, chunk, h).transpose(0, 3, 1, 2)  # b h c l
    a_cumsum = jnp.cumsum(a, axis=-1)
    decay = jnp.exp(segsum(a))
    y_diag = jnp.einsum("bcln,bcsn,bhcls,bcshp->bclhp", c, b, decay, x)
    decay_states = jnp.exp(a_cumsum[..., -1:] - a_cumsum)
    states = jnp.einsum("bcln,bhcl,bclhp->bchpn", b, decay_states, x)
    states = jnp.concatenate([jnp.zeros_like(states[:, :1]), states], axis=1)
    decay_chunk = jnp.exp(segsum(jnp.pad(a_cumsum[..., -1], ((0, 0), (0, 0), (1, 0)))))
    states = jnp.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = jnp.einsum("bcln,bchpn,bhcl->bclhp", c, states, jnp.exp(a_cumsum))
    return (y_diag + y_off).reshape(bsz, length, h, p)


def mixer(p, u, c=CFG):
    bsz, length, _ = u.shape
    inner, heads, conv_dim = dims(c)
    bf = lambda name: p[name].astype(jnp.bfloat16)  # noqa: E731
    zxbcdt = u @ bf("in_proj")
    z, xbc, dt = jnp.split(zxbcdt, [inner, inner + conv_dim], axis=-1)
    xbc = jax.lax.conv_general_dilated(
        xbc,
        bf("conv_w"),
        window_strides=(1,),
        padding=[(c["conv"] - 1, 0)],
        feature_group_count=conv_dim,
        dimension_numbers=("NWC", "WIO", "NWC"),
    )
    xbc = jax.nn.silu(xbc + bf("conv_b"))
    x, b, cc = jnp.split(xbc, [inner, inner + c["state"]], axis=-1)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p["dt_bias"])
    a = -jnp.exp(p["A_log"])
    x = x.reshape(bsz, length, heads, c["headdim"])
    y = ssd((x * dt[..., None]).astype(jnp.bfloat16), (a * dt).astype(jnp.float32), b, cc, c["chunk"])
    y = y.astype(jnp.bfloat16) + x * bf("D")[:, None]
    y = y.reshape(bsz, length, inner)
    y = rms(y * jax.nn.silu(z), p["gate_norm"])
    return y @ bf("out_proj")


def loss(params, tokens, c=CFG):
    x = params["embedding"].astype(jnp.bfloat16)[tokens[:, :-1]]
    for p in params["layers"]:
        x = x + mixer(p, rms(x, p["norm"]), c)
    logits = (rms(x, params["norm_f"]) @ params["embedding"].astype(jnp.bfloat16).T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def build(layers=2, c=CFG):
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 8e-4, 100, 10000), b2=0.95, weight_decay=0.1)

    def step(state, batch):
        params, opt = state
        value, grads = jax.value_and_grad(loss)(params, batch["tokens"], c)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), {"loss": value}

    def make(key):
        params = init(key, layers, c)
        return params, tx.init(params)

    state = jax.eval_shape(make, jax.random.key(0))
    return step, (state, {"tokens": jax.ShapeDtypeStruct((c["batch"], c["seq"] + 1), jnp.int32)})


def tensor_parallel(path, shape):
    """mamba_ssm's tensor parallelism as Mamba-2's paper describes it: `in_proj` column-parallel
    (each rank its heads' z, x and dt), the conv and per-head parameters split alike, `out_proj`
    row-parallel; the embedding vocabulary-parallel. The fused `in_proj` of the single-device
    program holds z, xBC and dt one after another, so a contiguous split of its columns is the
    closest a plan of the program as written comes to the per-rank layout."""
    name = path.split("/")[-1]
    if name == "in_proj":
        return (None, "model")
    if name in ("conv_w",):
        return (None, None, "model")
    if name in ("conv_b", "dt_bias", "A_log", "D", "gate_norm"):
        return ("model",)
    if name in ("out_proj", "embedding"):
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
