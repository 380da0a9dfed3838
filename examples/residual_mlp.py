"""A stack of residual MLP blocks (the MLP half of a transformer) with its AdamW train step, at
any size, as abstract arguments: what the partitioner's tests and benchmarks plan."""

import jax
import jax.numpy as jnp
import optax


def residual_mlp(d, f, layers, tokens):
    """A train step (AdamW) of a stack of residual MLP blocks, as the transformer's MLP half."""
    opt = optax.adamw(1e-3)

    def init():
        params = {f"layer{i}": {"w1": jnp.zeros((d, f)), "w2": jnp.zeros((f, d))} for i in range(layers)}
        return {"params": params, "opt": opt.init(params)}

    def loss(params, x):
        for i in range(layers):
            x = x + jax.nn.gelu(x @ params[f"layer{i}"]["w1"]) @ params[f"layer{i}"]["w2"]
        return jnp.mean(x**2)

    def step(state, x):
        value, grads = jax.value_and_grad(loss)(state["params"], x)
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, value

    return step, jax.eval_shape(init), jax.ShapeDtypeStruct((8, tokens // 8, d), jnp.float32)
