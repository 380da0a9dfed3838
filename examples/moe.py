"""A mixture-of-experts decoder (GShard/Switch style) written as plain single-device JAX: attention,
then a top-1 routed expert MLP whose experts are stacked weights [experts, d, f], with a capacity
per group of tokens; AdamW train step. What the partitioner plans for expert parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from examples.gpt.model import GPTConfig, attention, layer_norm


def moe(d=2048, heads=16, experts=8, ff=8192, vocab=32000, layers=2, batch=8, seq=1024, capacity_factor=1.25):
    """(step, (state, batch)) with abstract arguments."""
    cfg = GPTConfig(vocab=vocab, seq_len=seq, d_model=d, n_heads=heads, n_layers=layers, d_ff=ff, dropout=0.0)
    capacity = int(capacity_factor * seq / experts)
    opt = optax.adamw(1e-4)
    z = jnp.zeros

    def init():
        layer = lambda: {
            "ln1": {"scale": z((d,)), "bias": z((d,))},
            "ln2": {"scale": z((d,)), "bias": z((d,))},
            "attn": {"wq": z((d, d)), "wk": z((d, d)), "wv": z((d, d)), "wo": z((d, d))},
            "router": z((d, experts)),
            "w_in": z((experts, d, ff)),
            "w_out": z((experts, ff, d)),
        }
        params = {
            "wte": z((vocab, d)),
            "layers": [layer() for _ in range(layers)],
            "ln_f": {"scale": z((d,)), "bias": z((d,))},
        }
        return {"params": params, "opt": opt.init(params)}

    def experts_mlp(x, p):
        """Each group (a sequence) sends each token to its top expert, at most `capacity` tokens
        per expert and group; the rest pass through on the residual."""
        probs = jax.nn.softmax(x @ p["router"], axis=-1)  # [g, s, e]
        choice = jax.nn.one_hot(jnp.argmax(probs, axis=-1), experts, dtype=x.dtype)
        position = jnp.cumsum(choice, axis=1) * choice - 1.0  # place in its expert's queue
        dispatch = (
            jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=x.dtype) * choice[..., None]
        )  # [g, s, e, c]
        combine = dispatch * jnp.max(probs, axis=-1)[..., None, None]
        xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", xe, p["w_in"]))
        ye = jnp.einsum("egcf,efd->egcd", h, p["w_out"])
        return jnp.einsum("gsec,egcd->gsd", combine, ye)

    def loss(params, tokens, targets):
        x = params["wte"][tokens]
        for p in params["layers"]:
            x = x + attention(layer_norm(x, p["ln1"]), p["attn"], cfg)
            x = x + experts_mlp(layer_norm(x, p["ln2"]), p)
        logits = layer_norm(x, params["ln_f"]) @ params["wte"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(state, batch):
        value, grads = jax.value_and_grad(loss)(state["params"], batch["inputs"], batch["targets"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, {"loss": value}

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return step, (jax.eval_shape(init), {"inputs": tokens, "targets": tokens})
