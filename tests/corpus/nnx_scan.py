"""A Llama in Flax NNX with its layers created by nnx.vmap under nnx.split_rngs and run by
nnx.scan (the Flax "scan over layers" guide), plain nnx.Linear projections reshaped into heads,
RoPE on interleaved pairs (Meta's reference layout, x.reshape(..., d/2, 2)), grouped-query
attention by grouping the queries against un-repeated K/V, a mask from iota comparisons, and an
nnx.Optimizer of adamw under clip_by_global_norm with a warmup-cosine schedule."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tests.corpus import common

CFG = dict(vocab=32000, embed=1024, heads=16, kv_heads=4, head_dim=64, mlp=2816, seq=1024, batch=8)
KW = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32)


def rope_interleaved(x, theta=10000.0):
    b, s, h, d = x.shape
    freqs = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    pairs = x.astype(jnp.float32).reshape(b, s, h, d // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(b, s, h, d).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, c, rngs):
        e, h, k, d = c["embed"], c["heads"], c["kv_heads"], c["head_dim"]
        self.c = c
        self.norm1 = nnx.RMSNorm(e, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.wq = nnx.Linear(e, h * d, rngs=rngs, **KW)
        self.wk = nnx.Linear(e, k * d, rngs=rngs, **KW)
        self.wv = nnx.Linear(e, k * d, rngs=rngs, **KW)
        self.wo = nnx.Linear(h * d, e, rngs=rngs, **KW)
        self.norm2 = nnx.RMSNorm(e, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.w1 = nnx.Linear(e, c["mlp"], rngs=rngs, **KW)
        self.w3 = nnx.Linear(e, c["mlp"], rngs=rngs, **KW)
        self.w2 = nnx.Linear(c["mlp"], e, rngs=rngs, **KW)

    def attention(self, x):
        b, s, _ = x.shape
        h, k, d = self.c["heads"], self.c["kv_heads"], self.c["head_dim"]
        q = rope_interleaved(self.wq(x).reshape(b, s, h, d))
        kk = rope_interleaved(self.wk(x).reshape(b, s, k, d))
        v = self.wv(x).reshape(b, s, k, d)
        q = q.reshape(b, s, k, h // k, d)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, kk).astype(jnp.float32) / jnp.sqrt(d)
        i = jax.lax.broadcasted_iota(jnp.int32, (s, s), 0)
        j = jax.lax.broadcasted_iota(jnp.int32, (s, s), 1)
        scores = jnp.where(i >= j, scores, -1e30)
        p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, h * d)
        return self.wo(out)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        y = self.norm2(x)
        return x + self.w2(jax.nn.silu(self.w1(y)) * self.w3(y))


class Llama(nnx.Module):
    def __init__(self, c, layers, rngs):
        self.embed = nnx.Embed(c["vocab"], c["embed"], param_dtype=jnp.float32, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(c, rngs)

        self.layers = create(rngs)
        self.norm = nnx.RMSNorm(c["embed"], dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.lm_head = nnx.Linear(c["embed"], c["vocab"], rngs=rngs, **KW)

    def __call__(self, tokens):
        x = self.embed(tokens).astype(jnp.bfloat16)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        x = forward(x, self.layers)
        return self.lm_head(self.norm(x)).astype(jnp.float32)


def build(layers=2, c=CFG):
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 200, 10000)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.95, weight_decay=0.1))

    def make(key):
        model = Llama(c, layers, nnx.Rngs(key))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(jax.random.key(0))))

    def step(state, batch):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits = m(batch["tokens"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), {"loss": loss}

    state = jax.eval_shape(lambda: nnx.state(make(jax.random.key(0))))
    return step, (state, {"tokens": jax.ShapeDtypeStruct((c["batch"], c["seq"] + 1), jnp.int32)})


def tensor_parallel(path, shape):
    path = path.removesuffix("/value")
    stacked = "layers/" in path
    lead = (None,) if stacked else ()
    if path.endswith(("wq/kernel", "wk/kernel", "wv/kernel", "w1/kernel", "w3/kernel", "lm_head/kernel")):
        return lead + (None, "model")
    if path.endswith(("wo/kernel", "w2/kernel")):
        return lead + ("model", None)
    if path.endswith("embed/embedding"):  # vocabulary-parallel
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
