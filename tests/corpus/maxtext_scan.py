"""A decoder written as MaxText writes its scanned layers (`scan_layers=True`, `decoders.py`):
float32 master weights stacked with the layer axis first (`[embed, layers, heads, head_dim]`
would be MaxText's `param_scan_axis=1`; here, as with `param_scan_axis=0`, `[layers, ...]`), the
body run by `jax.lax.scan` under `jax.checkpoint` with the `nothing_saveable` policy
(`remat_policy="full"`), weights cast to bfloat16 inside the body, `DenseGeneral`-shaped
kernels applied with `jnp.einsum`, full multi-head attention with a `tril` mask, and adamw with a
linear warmup."""

import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, embed=1024, heads=16, head_dim=64, mlp=4096, seq=1024, batch=8)


def init_params(key, layers, c=CFG):
    e, h, d, f = c["embed"], c["heads"], c["head_dim"], c["mlp"]
    k = iter(jax.random.split(key, 16))
    n = lambda *shape: jax.random.normal(next(k), shape, jnp.float32) * 0.02
    return {
        "token_embedder": {"embedding": n(c["vocab"], e)},
        "decoder": {
            "layers": {
                "self_attention": {
                    "query": {"kernel": n(layers, e, h, d)},
                    "key": {"kernel": n(layers, e, h, d)},
                    "value": {"kernel": n(layers, e, h, d)},
                    "out": {"kernel": n(layers, h, d, e)},
                },
                "mlp": {"wi": {"kernel": n(layers, e, f)}, "wo": {"kernel": n(layers, f, e)}},
                "pre_self_attention_layer_norm": {"scale": jnp.ones((layers, e))},
                "pre_mlp_layer_norm": {"scale": jnp.ones((layers, e))},
            },
            "decoder_norm": {"scale": jnp.ones((e,))},
        },
    }


def norm(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6) * scale).astype(jnp.bfloat16)


def layer(x, p):
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    a = p["self_attention"]
    y = norm(x, p["pre_self_attention_layer_norm"]["scale"])
    q = jnp.einsum("bse,ehd->bshd", y, a["query"]["kernel"])
    k = jnp.einsum("bse,ehd->bshd", y, a["key"]["kernel"])
    v = jnp.einsum("bse,ehd->bshd", y, a["value"]["kernel"])
    s = x.shape[1]
    w = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), w, -1e9), -1).astype(jnp.bfloat16)
    x = x + jnp.einsum("bshd,hde->bse", jnp.einsum("bhqk,bkhd->bqhd", w, v), a["out"]["kernel"])
    y = norm(x, p["pre_mlp_layer_norm"]["scale"])
    return x + jax.nn.gelu(y @ p["mlp"]["wi"]["kernel"]) @ p["mlp"]["wo"]["kernel"], None


def forward(params, tokens):
    x = params["token_embedder"]["embedding"][tokens].astype(jnp.bfloat16)
    body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, params["decoder"]["layers"])
    x = norm(x, params["decoder"]["decoder_norm"]["scale"])
    # Logits through the embedding, as MaxText's `logits_via_embedding`.
    return jnp.einsum("bse,ve->bsv", x, params["token_embedder"]["embedding"].astype(jnp.bfloat16)).astype(jnp.float32)


def build(layers=2, c=CFG):
    tx = optax.adamw(optax.linear_schedule(0.0, 3e-4, 1000), b1=0.9, b2=0.95, weight_decay=0.1)

    def step(state, batch):
        def loss_fn(params):
            return optax.softmax_cross_entropy_with_integer_labels(
                forward(params, batch["inputs"]), batch["targets"]
            ).mean()

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
    if path.endswith(("query/kernel", "key/kernel", "value/kernel")):
        return (None, None, "model", None)
    if path.endswith("out/kernel"):
        return (None, "model", None, None)
    if path.endswith("wi/kernel"):
        return (None, None, "model")
    if path.endswith("wo/kernel"):
        return (None, "model", None)
    if path.endswith("embedding"):
        return ("model", None)  # vocab-parallel, as MaxText's `vocab` logical axis on tensor
    return None


EXPERTS = common.standard_experts(tensor_parallel)
