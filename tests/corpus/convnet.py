"""A small ResNet written as the Flax ImageNet example (`examples/imagenet/models.py`) writes
one: `nn.Conv` + `nn.BatchNorm` + relu residual blocks with strided downsampling and a projection
shortcut, global average pooling, a dense head, batch statistics kept in `batch_stats` and
updated by `mutable=["batch_stats"]`; optax sgd with nesterov momentum and weight decay."""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from tests.corpus import common

CFG = dict(image=64, widths=(64, 128, 256, 512), classes=1000, batch=128)


class ResidualBlock(nn.Module):
    filters: int
    strides: int

    @nn.compact
    def __call__(self, x, train):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False, name="proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    widths: tuple
    classes: int

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)))
        for i, w in enumerate(self.widths):
            x = ResidualBlock(w, 1 if i == 0 else 2)(x, train)
            x = ResidualBlock(w, 1)(x, train)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def build(layers=2, c=CFG):
    del layers  # (a fixed depth: two blocks per stage)
    model = ResNet(c["widths"], c["classes"])
    images = jax.ShapeDtypeStruct((c["batch"], c["image"], c["image"], 3), jnp.float32)
    tx = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9, nesterov=True))

    def init(key):
        variables = model.init(key, jnp.zeros(images.shape), train=False)
        return {
            "params": variables["params"],
            "batch_stats": variables["batch_stats"],
            "opt_state": tx.init(variables["params"]),
        }

    def step(state, batch):
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state["batch_stats"]}, batch["image"], mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), updates

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "batch_stats": new["batch_stats"], "opt_state": opt_state}, {"loss": loss}

    state = jax.eval_shape(init, jax.random.key(0))
    return step, (state, {"image": images, "label": jax.ShapeDtypeStruct((c["batch"],), jnp.int32)})


def tensor_parallel(path, shape):
    return None  # a conv net this size is trained data parallel: no engineer splits its kernels


EXPERTS = common.standard_experts(tensor_parallel)[:2]
