"""A Llama in Equinox as its users write one: eqx.nn.Linear (weights (out, in), applied to one
vector and vmapped over batch and sequence), layers built by eqx.filter_vmap and run by lax.scan
over the partitioned arrays (eqx.partition / eqx.combine) under jax.checkpoint, attention by
jax.nn.dot_product_attention (grouped-query: K/V with fewer heads, is_causal), RoPE by halves,
and optax adamw with clip_by_global_norm; the state is (eqx.filter(model, eqx.is_array), opt)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from tests.corpus import common

CFG = dict(vocab=32000, embed=1024, heads=16, kv_heads=4, head_dim=64, mlp=2816, seq=1024, batch=8)


def rope(x, theta=10000.0):  # x: (s, h, d)
    s, _, d = x.shape
    half = d // 2
    ang = jnp.arange(s)[:, None] * theta ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


def seqwise(lin: eqx.nn.Linear, x):
    """A linear layer's weight, cast to bfloat16, applied to each row of `x` (its bias unused)."""
    return jax.vmap(lambda r: lin.weight.astype(jnp.bfloat16) @ r)(x)


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * self.weight).astype(x.dtype)


class Block(eqx.Module):
    n1: RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    n2: RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, c, key):
        e, h, kv, d, f = c["embed"], c["heads"], c["kv_heads"], c["head_dim"], c["mlp"]
        ks = jax.random.split(key, 7)
        lin = lambda i, o, kk: eqx.nn.Linear(i, o, use_bias=False, key=kk)
        self.n1, self.n2 = RMSNorm(jnp.ones(e)), RMSNorm(jnp.ones(e))
        self.q, self.k, self.v, self.o = (
            lin(e, h * d, ks[0]),
            lin(e, kv * d, ks[1]),
            lin(e, kv * d, ks[2]),
            lin(h * d, e, ks[3]),
        )
        self.gate, self.up, self.down = lin(e, f, ks[4]), lin(e, f, ks[5]), lin(f, e, ks[6])
        self.heads, self.kv_heads = h, kv

    def attend(self, x):  # x: (s, e) in bfloat16
        s = x.shape[0]
        q = seqwise(self.q, x).reshape(s, self.heads, -1)
        k = seqwise(self.k, x).reshape(s, self.kv_heads, -1)
        v = seqwise(self.v, x).reshape(s, self.kv_heads, -1)
        out = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return seqwise(self.o, out.reshape(s, -1))

    def __call__(self, x):
        x = x + self.attend(jax.vmap(self.n1)(x))
        y = jax.vmap(self.n2)(x)
        return x + seqwise(self.down, jax.nn.silu(seqwise(self.gate, y)) * seqwise(self.up, y))


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: Block
    norm: RMSNorm
    head: eqx.nn.Linear

    def __init__(self, c, layers, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(c["vocab"], c["embed"], key=k1)
        self.blocks = eqx.filter_vmap(lambda k: Block(c, k))(jax.random.split(k2, layers))
        self.norm = RMSNorm(jnp.ones(c["embed"]))
        self.head = eqx.nn.Linear(c["embed"], c["vocab"], use_bias=False, key=k3)

    def __call__(self, tokens):  # one sequence
        x = jax.vmap(self.embed)(tokens).astype(jnp.bfloat16)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        @jax.checkpoint
        def layer(x, d):
            return eqx.combine(d, static)(x), None

        x, _ = jax.lax.scan(layer, x, dynamic)
        x = jax.vmap(self.norm)(x)
        return seqwise(self.head, x).astype(jnp.float32)


def build(layers=2, c=CFG):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
    static = eqx.filter(eqx.filter_eval_shape(Llama, c, layers, jax.random.key(0)), eqx.is_array, inverse=True)

    def make(key):
        params = eqx.filter(Llama(c, layers, key), eqx.is_array)
        return params, tx.init(params)

    def step(state, batch):
        params, opt = state

        @eqx.filter_value_and_grad
        def loss_fn(p):
            model = eqx.combine(p, static)
            logits = jax.vmap(model)(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = loss_fn(params)
        updates, opt = tx.update(grads, opt, params)
        return (eqx.apply_updates(params, updates), opt), {"loss": loss}

    state = jax.eval_shape(make, jax.random.key(0))
    tok = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)
    return step, (state, {"x": tok, "y": tok})


def tensor_parallel(path, shape):
    lead = (None,) if "blocks" in path else ()
    if path.endswith(("q/weight", "k/weight", "v/weight", "gate/weight", "up/weight", "head/weight")):
        return lead + ("model", None)
    if path.endswith(("o/weight", "down/weight")):
        return lead + (None, "model")
    if path.endswith("embed/weight"):  # vocabulary-parallel
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
