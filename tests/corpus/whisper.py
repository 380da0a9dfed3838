"""Whisper as Hugging Face's FlaxWhisperForConditionalGeneration writes it, trained as its
speech-recognition fine-tuning script trains it: a convolutional front end over log-mel frames
(two 1-D convolutions of width 3, the second of stride 2, each with GELU) and fixed sinusoidal
positions; pre-LN encoder layers; a decoder with learned positions, causal self-attention and
cross-attention to the encoder (keys and values from the encoder output, the key projection
without bias), and its output tied to the token embedding; adamw on a linear schedule. Vocab
51865, as Whisper's (odd: no axis divides it)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from tests.corpus import common

CFG = dict(vocab=51865, mels=80, frames=3000, d=1024, heads=16, ff=4096, target=448, batch=8)
BF16 = dict(dtype=jnp.bfloat16, kernel_init=nn.initializers.normal(0.02))


def sinusoids(length, channels):
    """Whisper's fixed encoder positions."""
    increment = np.log(10000) / (channels // 2 - 1)
    inv = np.exp(-increment * np.arange(channels // 2))
    scaled = np.arange(length)[:, None] * inv[None, :]
    return jnp.asarray(np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1), jnp.bfloat16)


class Attention(nn.Module):
    c: dict
    causal: bool = False

    @nn.compact
    def __call__(self, x, context=None):
        d, h = self.c["d"], self.c["heads"]
        kv = x if context is None else context
        heads = lambda y: y.reshape(y.shape[:2] + (h, d // h))  # noqa: E731
        q = heads(nn.Dense(d, name="q_proj", **BF16)(x)) * (d // h) ** -0.5
        k = heads(nn.Dense(d, use_bias=False, name="k_proj", **BF16)(kv))
        v = heads(nn.Dense(d, name="v_proj", **BF16)(kv))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if self.causal:
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]), dtype=bool)
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(jnp.bfloat16)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(x.shape[:2] + (d,))
        return nn.Dense(d, name="out_proj", **BF16)(out)


class MLP(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x):
        y = nn.gelu(nn.Dense(self.c["ff"], name="fc1", **BF16)(x), approximate=False)
        return nn.Dense(self.c["d"], name="fc2", **BF16)(y)


class EncoderLayer(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.c, name="self_attn")(nn.LayerNorm(name="self_attn_layer_norm", dtype=jnp.bfloat16)(x))
        return x + MLP(self.c, name="mlp")(nn.LayerNorm(name="final_layer_norm", dtype=jnp.bfloat16)(x))


class DecoderLayer(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x, encoded):
        norm = lambda name: nn.LayerNorm(name=name, dtype=jnp.bfloat16)  # noqa: E731
        x = x + Attention(self.c, causal=True, name="self_attn")(norm("self_attn_layer_norm")(x))
        x = x + Attention(self.c, name="encoder_attn")(norm("encoder_attn_layer_norm")(x), encoded)
        return x + MLP(self.c, name="mlp")(norm("final_layer_norm")(x))


class Whisper(nn.Module):
    c: dict
    layers: int

    @nn.compact
    def __call__(self, features, tokens):
        c = self.c
        conv = dict(dtype=jnp.bfloat16, kernel_init=nn.initializers.normal(0.02))
        x = nn.gelu(nn.Conv(c["d"], (3,), padding=((1, 1),), name="conv1", **conv)(features), approximate=False)
        x = nn.gelu(nn.Conv(c["d"], (3,), strides=(2,), padding=((1, 1),), name="conv2", **conv)(x), approximate=False)
        x = x + sinusoids(x.shape[1], c["d"])
        for i in range(self.layers):
            x = EncoderLayer(c, name=f"encoder_layer_{i}")(x)
        encoded = nn.LayerNorm(name="encoder_layer_norm", dtype=jnp.bfloat16)(x)
        embed = nn.Embed(c["vocab"], c["d"], embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
        positions = self.param("embed_positions", nn.initializers.normal(0.02), (c["target"], c["d"]))
        y = embed(tokens).astype(jnp.bfloat16) + positions[: tokens.shape[1]].astype(jnp.bfloat16)
        for i in range(self.layers):
            y = DecoderLayer(c, name=f"decoder_layer_{i}")(y, encoded)
        y = nn.LayerNorm(name="decoder_layer_norm", dtype=jnp.bfloat16)(y)
        return embed.attend(y.astype(jnp.float32))


def build(layers=2, c=CFG):
    model = Whisper(c, layers)
    tx = optax.adamw(optax.linear_schedule(1e-5, 0.0, 5000), weight_decay=0.0)
    features = jax.ShapeDtypeStruct((c["batch"], c["frames"], c["mels"]), jnp.bfloat16)
    tokens = jax.ShapeDtypeStruct((c["batch"], c["target"]), jnp.int32)

    def make(key):
        params = model.init(key, jnp.zeros(features.shape, features.dtype), jnp.zeros(tokens.shape, tokens.dtype))
        return train_state.TrainState.create(apply_fn=model.apply, params=params["params"], tx=tx)

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["input_features"], batch["decoder_input_ids"])
            labels = batch["labels"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = jax.eval_shape(make, jax.random.key(0))
    return step, (state, {"input_features": features, "decoder_input_ids": tokens, "labels": tokens})


def tensor_parallel(path, shape):
    """Megatron's split of every attention and MLP: q, k, v and fc1 column-parallel, out_proj and
    fc2 row-parallel; the convolutions' output channels column-parallel would cut the residual
    stream, so they stay whole, as does the odd vocabulary."""
    if path.endswith(("q_proj/kernel", "k_proj/kernel", "v_proj/kernel", "fc1/kernel")):
        return (None, "model")
    if path.endswith(("q_proj/bias", "v_proj/bias", "fc1/bias")):
        return ("model",)
    if path.endswith(("out_proj/kernel", "fc2/kernel")):
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
