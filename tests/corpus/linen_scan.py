"""A GPT written with Flax Linen as the Flax examples (`examples/lm1b`) and many Linen codebases
write it: `nn.Module`s with `nn.Dense`/`nn.DenseGeneral`, `nn.SelfAttention`-style projections
by `DenseGeneral` to `[heads, head_dim]`, learned positions, GELU MLP, layers stacked by
`nn.scan` over an `nn.remat`ed block (`variable_axes={"params": 0}`, `split_rngs`), and the
state as a `flax.training.train_state.TrainState` with optax adamw."""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

from tests.corpus import common

CFG = dict(vocab=32768, d=1024, heads=16, ff=4096, seq=1024, batch=8)


class Block(nn.Module):
    d: int
    heads: int
    ff: int

    @nn.compact
    def __call__(self, x, _):
        hd = self.d // self.heads
        y = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        q, k, v = (nn.DenseGeneral((self.heads, hd), dtype=jnp.bfloat16, name=n)(y) for n in ("query", "key", "value"))
        s = x.shape[1]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        logits = jnp.where(nn.make_causal_mask(jnp.ones(x.shape[:2]))[:, :1].astype(bool), logits, -1e10)
        out = jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(logits.astype(jnp.float32)).astype(jnp.bfloat16), v)
        del s
        x = x + nn.DenseGeneral(self.d, axis=(-2, -1), dtype=jnp.bfloat16, name="out")(out)
        y = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        y = nn.Dense(self.d, dtype=jnp.bfloat16, name="fc2")(
            nn.gelu(nn.Dense(self.ff, dtype=jnp.bfloat16, name="fc1")(y))
        )
        return x + y, None


class GPT(nn.Module):
    vocab: int
    d: int
    heads: int
    ff: int
    layers: int
    seq: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d, dtype=jnp.bfloat16, name="wte")(tokens)
        x = x + self.param("wpe", nn.initializers.normal(0.02), (self.seq, self.d)).astype(jnp.bfloat16)
        Stack = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        x, _ = Stack(self.d, self.heads, self.ff, name="blocks")(x, None)
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        return nn.Dense(self.vocab, use_bias=False, dtype=jnp.bfloat16, name="lm_head")(x).astype(jnp.float32)


def build(layers=2, c=CFG):
    model = GPT(c["vocab"], c["d"], c["heads"], c["ff"], layers, c["seq"])
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)

    def init(key):
        params = model.init(key, jnp.zeros(tokens.shape, jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-4))

    state = jax.eval_shape(init, jax.random.key(0))
    tx = optax.adamw(3e-4)

    def step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
        return new, {"loss": loss}

    return step, (state, {"inputs": tokens, "targets": tokens})


def tensor_parallel(path, shape):
    """Scanned kernels carry the layer first: [layers, embed, heads, head_dim], [layers, heads,
    head_dim, embed], [layers, d, ff]."""
    if path.endswith(("query/kernel", "key/kernel", "value/kernel")):
        return (None, None, "model", None)
    if path.endswith(("query/bias", "key/bias", "value/bias")):
        return (None, "model", None)
    if path.endswith("out/kernel"):
        return (None, "model", None, None)
    if path.endswith("fc1/kernel"):
        return (None, None, "model")
    if path.endswith("fc1/bias"):
        return (None, "model")
    if path.endswith("fc2/kernel"):
        return (None, "model", None)
    if path.endswith("lm_head/kernel"):
        return (None, "model")
    if path.endswith("wte/embedding"):  # vocabulary-parallel
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
