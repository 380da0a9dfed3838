"""`plan.program(step)` pipelined against the plain step, for one scanned corpus model at a small
size: `python -m tests.helpers.pipeline_numerics MODEL STAGES:MICROBATCHES[:REPEATS][r][f][g] ...` (`r`: each
stage rematerialised; `f`: FSDP inside each stage, its weights gathered once per step, or with
`g` per microbatch) prints a JSON
line per pipeline with the largest relative differences of the losses and the updated state over
3 steps.

It runs in its own process because it computes in float32 (`jnp.bfloat16` is float32 here,
before the models are imported): the comparison then sees the pipeline's arithmetic, not
bfloat16's rounding of each microbatch's weight gradient, which the plain step rounds once.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jnp.bfloat16 = jnp.float32  # see the module docstring

import partitioner  # noqa: E402

SMALL = {
    "maxtext_scan": dict(vocab=256, embed=64, heads=4, head_dim=16, mlp=128, seq=16, batch=8),
    "nnx_scan": dict(vocab=256, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=128, seq=16, batch=8),
    "linen_scan": dict(vocab=256, d=64, heads=4, ff=128, seq=16, batch=8),
    "equinox_scan": dict(vocab=256, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=128, seq=16, batch=8),
}
LAYERS = 8


def concrete(args, seed: int = 0):
    """Small random weights, zero optimizer state, tokens below the vocabulary."""
    state, batch = args

    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        if "opt" in name or not jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.zeros(a.shape, a.dtype)
        return (
            jax.random.normal(jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) % 9973), a.shape)
            * 0.05
        ).astype(a.dtype)

    tokens = lambda i, a: jax.random.randint(jax.random.key(seed + i + 1), a.shape, 0, 256).astype(a.dtype)  # noqa: E731
    flat, tree = jax.tree.flatten(batch)
    return jax.jit(lambda: jax.tree_util.tree_map_with_path(leaf, state))(), jax.tree.unflatten(
        tree, [tokens(i, a) for i, a in enumerate(flat)]
    )


def relative(a, b, floor: float = 1e-30) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / max(float(jnp.max(jnp.abs(a))), floor))


def state_relative(a, b) -> float:
    """The largest relative difference of a part of the state: its leaves under the same first
    three keys (the parameters, each optimizer moment), the largest difference against the
    largest magnitude. Per part, not per leaf: a gradient that is zero in exact arithmetic (a key
    bias's, under a softmax) is float32 noise in both runs, as large as the round-off of its part."""
    worst: dict[str, list[float]] = {}
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
        diff, size = worst.setdefault(jax.tree_util.keystr(path[:3]), [0.0, 0.0])
        worst[jax.tree_util.keystr(path[:3])] = [
            max(diff, float(jnp.max(jnp.abs(x - y)))),
            max(size, float(jnp.max(jnp.abs(x)))),
        ]
    return max(diff / max(size, 1e-30) for diff, size in worst.values())


def main(name: str, shapes: list[tuple[int, ...]]):
    module = importlib.import_module(f"tests.corpus.{name}")
    step, args = module.build(layers=LAYERS, c=SMALL[name])
    state, batch = concrete(args)
    plain = jax.jit(step)
    reference, a = [], state
    for _ in range(3):
        a, metrics = plain(a, batch)
        reference.append((a, metrics["loss"]))
    plans = {}
    for stages, microbatches, *repeats, remat, fsdp, per_microbatch in shapes:
        if (stages, fsdp) not in plans:
            plans[stages, fsdp] = partitioner.plan(
                step, *args, devices=8, hardware="cpu", pipeline=stages, compile_check=False,
                tactics=("fsdp",) if fsdp else None,
            )  # fmt: skip
        plan = plans[stages, fsdp]
        pipe = dataclasses.replace(
            plan.pipeline,
            microbatches=microbatches,
            repeats=repeats[0] if repeats else 1,
            remat=remat,
            gather_once=not per_microbatch,
        )
        plan = dataclasses.replace(plan, pipeline=pipe)
        piped = plan.jit(plan.program(step), (state, batch), jax.devices(), carry={0: 0})
        b, losses, states = state, [], []
        for a, loss in reference:
            b, metrics = piped(b, batch)
            losses.append(relative(loss, metrics["loss"]))
            states.append(state_relative(a, b))
        yield {
            "model": name,
            "mesh": dict(plan.mesh),
            "tactic": plan.tactic,
            "pipeline": pipe.to_dict(),
            "loss": max(losses),
            "state": max(states),
        }


if __name__ == "__main__":
    shapes = [(*map(int, s.rstrip("rfg").split(":")), "r" in s, "f" in s, "g" in s) for s in sys.argv[2:]]
    for row in main(sys.argv[1], shapes):
        print(json.dumps(row), flush=True)
