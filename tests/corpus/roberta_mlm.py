"""RoBERTa as Hugging Face's FlaxRobertaForMaskedLM writes it, trained as run_mlm_flax.py trains
it: an encoder-only masked LM. Word, position (offset by the padding index, as RoBERTa's are) and
token-type embeddings summed and layer-normed; separate query, key and value Dense layers with
biases; an additive attention mask from the padding mask; post-LN residual blocks with GELU; the
LM head a Dense, GELU and LayerNorm, then the decoder tied to the word embeddings through
`Embed.attend` plus its own bias; the loss over masked positions only (label weights), adamw with
weight decay masked off biases and layer norms. Vocab 50265 (not divisible by 8), as RoBERTa's is."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from tests.corpus import common

CFG = dict(vocab=50265, max_pos=514, hidden=768, heads=12, ff=3072, seq=512, batch=16, pad=1)
DENSE = dict(kernel_init=nn.initializers.normal(0.02), dtype=jnp.bfloat16)


class SelfAttention(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x, mask):
        h, d = self.c["heads"], self.c["hidden"]
        split = lambda y: y.reshape(y.shape[:2] + (h, d // h))  # noqa: E731
        q = split(nn.Dense(d, name="query", **DENSE)(x))
        k = split(nn.Dense(d, name="key", **DENSE)(x))
        v = split(nn.Dense(d, name="value", **DENSE)(x))
        bias = jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0), jnp.full(mask.shape, -1e10)).astype(x.dtype)
        weights = nn.dot_product_attention_weights(q, k, bias=bias[:, None, None, :], dtype=jnp.bfloat16)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return out.reshape(out.shape[:2] + (d,))


class Layer(nn.Module):
    c: dict

    @nn.compact
    def __call__(self, x, mask):
        d = self.c["hidden"]
        attn = SelfAttention(self.c, name="attention")(x, mask)
        attn = nn.Dense(d, name="attention_output", **DENSE)(attn)
        x = nn.LayerNorm(1e-5, name="attention_norm", dtype=jnp.bfloat16)(attn + x)
        y = nn.gelu(nn.Dense(self.c["ff"], name="intermediate", **DENSE)(x), approximate=False)
        y = nn.Dense(d, name="output", **DENSE)(y)
        return nn.LayerNorm(1e-5, name="output_norm", dtype=jnp.bfloat16)(y + x)


class RobertaForMaskedLM(nn.Module):
    c: dict
    layers: int

    @nn.compact
    def __call__(self, ids, mask):
        c = self.c
        init = nn.initializers.normal(0.02)
        words = nn.Embed(c["vocab"], c["hidden"], embedding_init=init, name="word_embeddings")
        # RoBERTa numbers positions from padding_idx + 1, skipping pads.
        positions = jnp.cumsum(mask, axis=1) * mask + c["pad"]
        x = words(ids)
        x = x + nn.Embed(c["max_pos"], c["hidden"], embedding_init=init, name="position_embeddings")(positions)
        x = x + nn.Embed(1, c["hidden"], embedding_init=init, name="token_type_embeddings")(jnp.zeros_like(ids))
        x = nn.LayerNorm(1e-5, name="embeddings_norm", dtype=jnp.bfloat16)(x)
        for i in range(self.layers):
            x = Layer(c, name=f"layer_{i}")(x, mask)
        y = nn.gelu(nn.Dense(c["hidden"], name="lm_head_dense", **DENSE)(x), approximate=False)
        y = nn.LayerNorm(1e-5, name="lm_head_norm", dtype=jnp.bfloat16)(y)
        logits = words.attend(y.astype(jnp.float32))
        return logits + self.param("lm_head_bias", nn.initializers.zeros, (c["vocab"],))


def _decay_mask(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keep = {p: not (p[-1].key in ("bias", "scale") or "norm" in str(p)) for p, _ in flat}
    return jax.tree_util.tree_unflatten(jax.tree.structure(params), [keep[p] for p, _ in flat])


def build(layers=2, c=CFG):
    model = RobertaForMaskedLM(c, layers)
    tx = optax.adamw(optax.linear_schedule(1e-4, 0.0, 10000), b1=0.9, b2=0.98, eps=1e-6, mask=_decay_mask)
    ids = jax.ShapeDtypeStruct((c["batch"], c["seq"]), jnp.int32)

    def make(key):
        params = model.init(key, jnp.zeros(ids.shape, ids.dtype), jnp.ones(ids.shape, ids.dtype))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["input_ids"], batch["attention_mask"])
            labels = batch["labels"]
            weights = (labels > 0).astype(jnp.float32)  # -100 / 0 where not masked, as run_mlm_flax
            onehot = jax.nn.one_hot(jnp.maximum(labels, 0), logits.shape[-1])
            loss = optax.softmax_cross_entropy(logits, onehot) * weights
            return loss.sum() / jnp.maximum(weights.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = jax.eval_shape(make, jax.random.key(0))
    return step, (state, {"input_ids": ids, "attention_mask": ids, "labels": ids})


def tensor_parallel(path, shape):
    """Megatron's BERT split: query, key, value and intermediate column-parallel, the attention
    output and output row-parallel; the vocabulary (50265) does not divide, so the tied table
    stays whole, as Megatron-LM would pad it first."""
    if path.endswith(("query/kernel", "key/kernel", "value/kernel", "intermediate/kernel")):
        return (None, "model")
    if path.endswith(("query/bias", "key/bias", "value/bias", "intermediate/bias")):
        return ("model",)
    if path.endswith(("attention_output/kernel", "output/kernel")) and "lm_head" not in path:
        return ("model", None)
    return None


EXPERTS = common.standard_experts(tensor_parallel)
