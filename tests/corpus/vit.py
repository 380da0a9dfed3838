"""A Vision Transformer written as `big_vision`/`vit_jax` write it in Flax Linen: patches by a
strided `nn.Conv` (a `conv_general_dilated`), flattened to tokens by reshape, a class token
concatenated in front, learned position embeddings, pre-LayerNorm blocks with
`nn.MultiHeadDotProductAttention` and a GELU `MlpBlock`, layers as a Python loop, the head on the
class token; optax sgd with momentum under `clip_by_global_norm`, a cosine schedule."""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from tests.corpus import common

CFG = dict(image=224, patch=16, width=768, heads=12, mlp=3072, classes=1000, batch=64)


class Block(nn.Module):
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm(name="LayerNorm_0")(x)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=jnp.bfloat16, name="MultiHeadDotProductAttention_0"
        )(y, y)
        y = nn.LayerNorm(name="LayerNorm_1")(x)
        y = nn.Dense(self.mlp, dtype=jnp.bfloat16, name="MlpBlock_Dense_0")(y)
        return x + nn.Dense(x.shape[-1], dtype=jnp.bfloat16, name="MlpBlock_Dense_1")(nn.gelu(y))


class ViT(nn.Module):
    layers: int
    c: dict

    @nn.compact
    def __call__(self, images):
        c = self.c
        x = nn.Conv(
            c["width"],
            (c["patch"], c["patch"]),
            strides=c["patch"],
            padding="VALID",
            dtype=jnp.bfloat16,
            name="embedding",
        )(images)
        n, h, w, d = x.shape
        x = x.reshape(n, h * w, d)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, d))
        x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)).astype(x.dtype), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w + 1, d)).astype(x.dtype)
        for i in range(self.layers):
            x = Block(c["heads"], c["mlp"], name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(c["classes"], name="head")(x[:, 0]).astype(jnp.float32)


def build(layers=2, c=CFG):
    model = ViT(layers, c)
    images = jax.ShapeDtypeStruct((c["batch"], c["image"], c["image"], 3), jnp.float32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(optax.cosine_decay_schedule(0.03, 10_000), momentum=0.9))

    def init(key):
        params = model.init(key, jnp.zeros(images.shape))["params"]
        return {"params": params, "opt_state": tx.init(params)}

    def step(state, batch):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch["image"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss}

    state = jax.eval_shape(init, jax.random.key(0))
    return step, (state, {"image": images, "label": jax.ShapeDtypeStruct((c["batch"],), jnp.int32)})


def tensor_parallel(path, shape):
    if any(path.endswith(f"{n}/kernel") for n in ("query", "key", "value")):
        return (None, "model", None)
    if any(path.endswith(f"{n}/bias") for n in ("query", "key", "value")):
        return ("model", None)
    if path.endswith("out/kernel"):
        return ("model", None, None)
    if path.endswith("MlpBlock_Dense_0/kernel"):
        return (None, "model")
    if path.endswith("MlpBlock_Dense_0/bias"):
        return ("model",)
    if path.endswith("MlpBlock_Dense_1/kernel"):
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
