"""A latent-diffusion UNet as diffusers' FlaxUNet2DConditionModel writes it, trained as its
`train_text_to_image_flax.py` trains it: sinusoidal timestep embedding through two Dense layers;
down blocks of ResNet blocks (GroupNorm(32), SiLU, 3x3 convs, the time embedding added per
channel, a 1x1 shortcut where channels change) each followed by a spatial transformer
(GroupNorm, linear projection in, self-attention, cross-attention to the text encoder's
hidden states, a GEGLU feed-forward, projection out, residual), downsampling by a stride-2 conv;
a middle block; up blocks that concatenate the skip connections and upsample by nearest-
neighbour `jax.image.resize` and a conv. The noisy latents come from the DDPM schedule's
cumulative alphas gathered by timestep; the loss is the MSE to the noise; adamw."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from tests.corpus import common

CFG = dict(channels=(128, 256), heads=8, latent=32, latent_channels=4, text=77, text_dim=768, batch=8, steps=1000)
F32 = dict(dtype=jnp.float32)


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = jnp.exp(-np.log(10000.0) * jnp.arange(half) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


class ResnetBlock(nn.Module):
    out: int

    @nn.compact
    def __call__(self, x, temb):
        h = nn.silu(nn.GroupNorm(32, epsilon=1e-5, name="norm1")(x))
        h = nn.Conv(self.out, (3, 3), padding=((1, 1), (1, 1)), name="conv1", **F32)(h)
        h = h + nn.Dense(self.out, name="time_emb_proj", **F32)(nn.silu(temb))[:, None, None, :]
        h = nn.silu(nn.GroupNorm(32, epsilon=1e-5, name="norm2")(h))
        h = nn.Conv(self.out, (3, 3), padding=((1, 1), (1, 1)), name="conv2", **F32)(h)
        if x.shape[-1] != self.out:
            x = nn.Conv(self.out, (1, 1), name="conv_shortcut", **F32)(x)
        return x + h


class Attention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, context=None):
        d = x.shape[-1]
        kv = x if context is None else context
        split = lambda y: y.reshape(y.shape[:2] + (self.heads, d // self.heads))  # noqa: E731
        q = split(nn.Dense(d, use_bias=False, name="to_q", **F32)(x))
        k = split(nn.Dense(d, use_bias=False, name="to_k", **F32)(kv))
        v = split(nn.Dense(d, use_bias=False, name="to_v", **F32)(kv))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // self.heads) ** -0.5
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(x.shape)
        return nn.Dense(d, name="to_out", **F32)(out)


class TransformerBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, context):
        d = x.shape[-1]
        x = x + Attention(self.heads, name="attn1")(nn.LayerNorm(name="norm1")(x))
        x = x + Attention(self.heads, name="attn2")(nn.LayerNorm(name="norm2")(x), context)
        hidden, gate = jnp.split(nn.Dense(8 * d, name="ff_proj", **F32)(nn.LayerNorm(name="norm3")(x)), 2, axis=-1)
        return x + nn.Dense(d, name="ff_out", **F32)(hidden * nn.gelu(gate, approximate=False))


class SpatialTransformer(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x, context):
        b, h, w, c = x.shape
        y = nn.GroupNorm(32, epsilon=1e-6, name="norm")(x).reshape(b, h * w, c)
        y = nn.Dense(c, name="proj_in", **F32)(y)
        y = TransformerBlock(self.heads, name="transformer_block")(y, context)
        y = nn.Dense(c, name="proj_out", **F32)(y).reshape(b, h, w, c)
        return x + y


class UNet(nn.Module):
    c: dict
    layers: int  # ResNet blocks per down block (one more per up block, as diffusers)

    @nn.compact
    def __call__(self, latents, timesteps, context):
        chans, heads = self.c["channels"], self.c["heads"]
        temb = timestep_embedding(timesteps, chans[0])
        temb = nn.Dense(4 * chans[0], name="time_linear_1", **F32)(temb)
        temb = nn.Dense(4 * chans[0], name="time_linear_2", **F32)(nn.silu(temb))
        x = nn.Conv(chans[0], (3, 3), padding=((1, 1), (1, 1)), name="conv_in", **F32)(latents)
        skips = [x]
        for level, ch in enumerate(chans):
            for i in range(self.layers):
                x = ResnetBlock(ch, name=f"down_{level}_resnet_{i}")(x, temb)
                x = SpatialTransformer(heads, name=f"down_{level}_attn_{i}")(x, context)
                skips.append(x)
            if level < len(chans) - 1:
                x = nn.Conv(ch, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), name=f"down_{level}_sample", **F32)(x)
                skips.append(x)
        x = ResnetBlock(chans[-1], name="mid_resnet_0")(x, temb)
        x = SpatialTransformer(heads, name="mid_attn")(x, context)
        x = ResnetBlock(chans[-1], name="mid_resnet_1")(x, temb)
        for level, ch in reversed(list(enumerate(chans))):
            for i in range(self.layers + 1):
                x = jnp.concatenate([x, skips.pop()], axis=-1)
                x = ResnetBlock(ch, name=f"up_{level}_resnet_{i}")(x, temb)
                x = SpatialTransformer(heads, name=f"up_{level}_attn_{i}")(x, context)
            if level > 0:
                b, h, w, c = x.shape
                x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method="nearest")
                x = nn.Conv(c, (3, 3), padding=((1, 1), (1, 1)), name=f"up_{level}_sample", **F32)(x)
        x = nn.silu(nn.GroupNorm(32, epsilon=1e-5, name="conv_norm_out")(x))
        return nn.Conv(self.c["latent_channels"], (3, 3), padding=((1, 1), (1, 1)), name="conv_out", **F32)(x)


def build(layers=2, c=CFG):
    model = UNet(c, layers)
    tx = optax.adamw(1e-4, b1=0.9, b2=0.999, weight_decay=1e-2)
    latents = jax.ShapeDtypeStruct((c["batch"], c["latent"], c["latent"], c["latent_channels"]), jnp.float32)
    timesteps = jax.ShapeDtypeStruct((c["batch"],), jnp.int32)
    context = jax.ShapeDtypeStruct((c["batch"], c["text"], c["text_dim"]), jnp.float32)
    alphas = jnp.cumprod(1.0 - jnp.linspace(0.00085**0.5, 0.012**0.5, c["steps"]) ** 2)  # scaled_linear

    def make(key):
        zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
        params = model.init(key, zeros(latents), zeros(timesteps), zeros(context))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        t, noise = batch["timesteps"], batch["noise"]
        a = alphas[t][:, None, None, None]
        noisy = jnp.sqrt(a) * batch["latents"] + jnp.sqrt(1.0 - a) * noise

        def loss_fn(params):
            predicted = state.apply_fn({"params": params}, noisy, t, batch["encoder_hidden_states"])
            return jnp.mean((predicted - noise) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = jax.eval_shape(make, jax.random.key(0))
    batch = {"latents": latents, "noise": latents, "timesteps": timesteps, "encoder_hidden_states": context}
    return step, (state, batch)


def tensor_parallel(path, shape):
    return None  # a UNet this size is trained data parallel (diffusers' scripts, ZeRO): nothing split


EXPERTS = common.standard_experts(tensor_parallel)[:2]
