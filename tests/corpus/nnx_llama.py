"""A Llama written with Flax NNX as the Flax "Gemma/Llama in NNX" examples write it: `nnx.Module`s
with `nnx.LinearGeneral` projections (kernels `[embed, heads, head_dim]` in and
`[heads, head_dim, embed]` out, contracting two axes), `nnx.Embed`, `nnx.RMSNorm`, float32 params
computed in bfloat16 (`param_dtype`/`dtype`), grouped-query attention by `jnp.repeat`, RoPE by
halves, layers in an `nnx.List` run by a Python loop, and the train state as
`nnx.state((model, optimizer))` split and merged around the step; optax adamw under
clip_by_global_norm."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tests.corpus import common

CFG = dict(vocab=32000, embed=1024, heads=16, kv_heads=4, head_dim=64, mlp=4096, seq=1024, batch=8)
BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)


def rope(x, theta=10000.0):
    s, half = x.shape[1], x.shape[-1] // 2
    angle = jnp.arange(s)[:, None] * theta ** (-jnp.arange(half) / half)
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c, rngs):
        e, h, k, d = c["embed"], c["heads"], c["kv_heads"], c["head_dim"]
        self.q = nnx.LinearGeneral(e, (h, d), use_bias=False, rngs=rngs, **BF16)
        self.k = nnx.LinearGeneral(e, (k, d), use_bias=False, rngs=rngs, **BF16)
        self.v = nnx.LinearGeneral(e, (k, d), use_bias=False, rngs=rngs, **BF16)
        self.o = nnx.LinearGeneral((h, d), e, axis=(-2, -1), use_bias=False, rngs=rngs, **BF16)

    def __call__(self, x):
        q, k, v = rope(self.q(x)), rope(self.k(x)), self.v(x)
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        s = x.shape[1]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(jnp.bfloat16)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", probs, v))


class MLP(nnx.Module):
    def __init__(self, c, rngs):
        self.gate = nnx.Linear(c["embed"], c["mlp"], use_bias=False, rngs=rngs, **BF16)
        self.up = nnx.Linear(c["embed"], c["mlp"], use_bias=False, rngs=rngs, **BF16)
        self.down = nnx.Linear(c["mlp"], c["embed"], use_bias=False, rngs=rngs, **BF16)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, c, rngs):
        self.attn_norm = nnx.RMSNorm(c["embed"], rngs=rngs, **BF16)
        self.attn = Attention(c, rngs)
        self.mlp_norm = nnx.RMSNorm(c["embed"], rngs=rngs, **BF16)
        self.mlp = MLP(c, rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    def __init__(self, c, layers, rngs):
        self.embed = nnx.Embed(c["vocab"], c["embed"], rngs=rngs, **BF16)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(c["embed"], rngs=rngs, **BF16)
        self.head = nnx.Linear(c["embed"], c["vocab"], use_bias=False, rngs=rngs, **BF16)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def build(layers=2, c=CFG):
    def make(key):
        model = Llama(c, layers, nnx.Rngs(key))
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(jax.random.key(0))))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(m):
            logits = m(batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    state = jax.eval_shape(lambda: nnx.state(make(jax.random.key(0))))
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    path = path.removesuffix("/value")  # (an nnx.Variable's leaf)
    if any(path.endswith(f"attn/{n}/kernel") for n in "qkv"):
        return (None, "model", None)
    if path.endswith("attn/o/kernel"):
        return ("model", None, None)
    if path.endswith(("gate/kernel", "up/kernel", "head/kernel")):
        return (None, "model")
    if path.endswith(("down/kernel", "embed/embedding")):  # the embedding vocabulary-parallel
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
