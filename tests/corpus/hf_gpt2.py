"""GPT-2 as Hugging Face's FlaxGPT2LMHeadModel writes it, trained as run_clm_flax.py trains it.
Conv1D kernels stored (out, in) and contracted on their second axis by lax.dot_general; a fused
c_attn cut by jnp.split; heads split by reshape; flax's make_causal_mask and lax.select bias;
learned positions; tied lm head through wte.attend; gelu(approximate); Linen TrainState with
adamw whose weight decay is masked off biases and layer norms, warmup then linear decay joined
by optax.join_schedules. Vocab 50257 (not divisible by 8), as GPT-2's is."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax import lax

from tests.corpus import common

CFG = dict(vocab=50257, n_pos=1024, embed=1024, heads=16, seq=1024, batch=8)


class Conv1D(nn.Module):
    features: int
    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(0.02), (self.features, x.shape[-1]))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        x = x.astype(self.dtype)
        y = lax.dot_general(x, kernel.astype(self.dtype), (((x.ndim - 1,), (1,)), ((), ())))
        return y + bias.astype(self.dtype)


class Attention(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x):
        e, h = self.c["embed"], self.c["heads"]
        qkv = Conv1D(3 * e, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=2)
        split = lambda t: t.reshape(t.shape[:2] + (h, e // h))
        q, k, v = split(q), split(k), split(v)
        mask = nn.make_causal_mask(jnp.ones((x.shape[0], x.shape[1]), dtype="bool"), dtype="bool")
        bias = lax.select(mask > 0, jnp.full(mask.shape, 0.0, jnp.bfloat16), jnp.full(mask.shape, -1e4, jnp.bfloat16))
        w = nn.dot_product_attention_weights(q, k, bias=bias, dtype=jnp.bfloat16)
        out = jnp.einsum("...hqk,...khd->...qhd", w, v)
        out = out.reshape(out.shape[:2] + (e,))
        return Conv1D(e, name="c_proj")(out)


class MLP(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x):
        x = Conv1D(4 * self.c["embed"], name="c_fc")(x)
        return Conv1D(self.c["embed"], name="c_proj")(nn.gelu(x, approximate=True))


class Block(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.c, name="attn")(nn.LayerNorm(1e-5, dtype=jnp.bfloat16, name="ln_1")(x))
        return x + MLP(self.c, name="mlp")(nn.LayerNorm(1e-5, dtype=jnp.bfloat16, name="ln_2")(x))


class GPT2(nn.Module):
    c: dict
    layers: int

    def setup(self):
        c = self.c
        self.wte = nn.Embed(c["vocab"], c["embed"], embedding_init=nn.initializers.normal(0.02))
        self.wpe = nn.Embed(c["n_pos"], c["embed"], embedding_init=nn.initializers.normal(0.01))
        self.h = [Block(c, name=str(i)) for i in range(self.layers)]
        self.ln_f = nn.LayerNorm(1e-5, dtype=jnp.bfloat16)

    def __call__(self, ids):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[-1])[None], ids.shape)
        x = (self.wte(ids) + self.wpe(pos)).astype(jnp.bfloat16)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.wte.attend(x.astype(jnp.float32))


def _decay_mask(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keep = {p: not (p[-1].key == "bias" or "ln" in str(p)) for p, _ in flat}
    return jax.tree_util.tree_unflatten(jax.tree.structure(params), [keep[p] for p, _ in flat])


def build(layers=2, c=CFG):
    model = GPT2(c, layers)
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, 3e-4, 500), optax.linear_schedule(3e-4, 0.0, 10000)], [500]
    )
    tx = optax.adamw(sched, b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.01, mask=_decay_mask)
    ids = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)

    def make(key):
        params = model.init(key, jnp.zeros(ids.shape, ids.dtype))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["input_ids"])
            shift = logits[:, :-1]
            labels = batch["input_ids"][:, 1:]
            return optax.softmax_cross_entropy(shift, jax.nn.one_hot(labels, shift.shape[-1])).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = jax.eval_shape(make, jax.random.key(0))
    return step, (state, {"input_ids": ids})


def tensor_parallel(path, shape):
    if path.endswith("c_attn/kernel") or path.endswith("c_fc/kernel"):
        return ("model", None)
    if path.endswith("c_attn/bias") or path.endswith("c_fc/bias"):
        return ("model",)
    if path.endswith("c_proj/kernel"):
        return (None, "model")
    if path.endswith("wte/embedding"):
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
