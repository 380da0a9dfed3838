"""A training program as a Flax NNX user writes it (the Flax NNX "MNIST tutorial" shape): an
`nnx.Module` with dropout, an `nnx.Optimizer`, the train state as `nnx.state((model, optimizer))`,
and `nnx.merge` inside the step. `nnx.Rngs` streams keep typed PRNG keys and counts in the state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from orchestrator import Program


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def build(key):
    model = MLP(nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1)))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


GRAPHDEF = nnx.graphdef(build(jax.random.key(0)))


def init(key):
    return nnx.state(build(key))


def step(state, batch):
    model, optimizer = nnx.merge(GRAPHDEF, state)

    def loss_fn(m):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def batch(step, size):
    rng = np.random.default_rng([7, step])
    x = rng.normal(size=(size, 16)).astype(np.float32)
    return {"x": x, "y": x[:, :4] * 2.0}


program = Program(init=init, step=step, batch=batch, tokens_per_example=1)
