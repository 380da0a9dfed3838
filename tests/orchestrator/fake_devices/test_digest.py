"""The state digest: equal on every mesh and spec, different when one word changes or moves, and
defined for typed PRNG keys (Flax NNX keeps them in the state); computed without a gather."""

import numpy as np


def _state():
    import jax
    import jax.numpy as jnp

    k = jax.random.key(3)
    return {
        "w": jax.random.normal(k, (16, 8), jnp.float32),
        "b": jnp.arange(8, dtype=jnp.bfloat16),
        "count": jnp.array(7, jnp.int32),
        "mask": jnp.arange(16) % 3 == 0,
        "rng": jax.random.split(jax.random.key(5), 8),  # typed keys, as nnx.Rngs holds them
    }


def _placed(state, mesh_shape, specs):
    import jax
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape), ("a", "b")[: len(mesh_shape)])
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)


def _digest(state):
    import jax

    from orchestrator.job.digest import compile_digest, digest

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return digest(compile_digest(abstract), state)


def test_the_digest_is_the_same_on_every_mesh_and_spec(devices8):
    from jax.sharding import PartitionSpec as P

    state = _state()
    layouts = [
        ((1,), {"w": P(), "b": P(), "count": P(), "mask": P(), "rng": P()}),
        ((8,), {"w": P("a"), "b": P("a"), "count": P(), "mask": P("a"), "rng": P("a")}),
        ((2, 4), {"w": P("b", "a"), "b": P("b"), "count": P(), "mask": P(("a", "b")), "rng": P("b")}),
        ((4, 2), {"w": P(None, ("a", "b")), "b": P(), "count": P(), "mask": P("a"), "rng": P(("b", "a"))}),
    ]
    digests = {_digest(_placed(state, shape, specs)) for shape, specs in layouts}
    assert len(digests) == 1


def test_one_changed_or_moved_word_changes_the_digest(devices8):
    import jax
    import jax.numpy as jnp

    state = _state()
    base = _digest(state)
    flipped = dict(state, w=state["w"].at[3, 5].set(jnp.nextafter(state["w"][3, 5], jnp.inf)))
    swapped = dict(state, w=state["w"].at[jnp.array([0, 1])].set(state["w"][jnp.array([1, 0])]))
    other_key = dict(state, rng=state["rng"].at[2].set(jax.random.key(99)))
    assert len({base, _digest(flipped), _digest(swapped), _digest(other_key)}) == 4


def test_the_pre_run_check_traces_the_digest_of_typed_keys():
    import jax

    from orchestrator.job.digest import check_digestible

    check_digestible(jax.eval_shape(_state))  # no TypeError: key data is read, not the key
