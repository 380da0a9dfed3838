"""The replicas' comparison on 8 fake devices: copies of each block of each leaf summed on their
own devices, a flipped bit in one copy found and named by the majority."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from orchestrator.job.replicas import compile_replica_sums, disagreements


def _state(mesh):
    w = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4), NamedSharding(mesh, P(None, "model")))
    b = jax.device_put(jnp.ones(4, jnp.bfloat16), NamedSharding(mesh, P()))
    step = jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))
    return {"w": w, "b": b, "step": step}


def _flipped(x, device, bit: int):
    """`x` with one bit of element 0 of `device`'s copy flipped (that copy alone)."""
    shards = []
    for s in x.addressable_shards:
        data = np.array(s.data)
        if s.device == device:
            words = data.view(np.uint32 if data.dtype.itemsize == 4 else np.uint16).reshape(-1)
            words[0] ^= type(words[0])(1 << bit)
        shards.append(jax.device_put(data, s.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def _table(fn, state):
    return np.asarray(fn(*jax.tree.leaves(state)).addressable_data(0))


def test_equal_copies_agree_and_a_flipped_bit_names_its_device():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    state = _state(mesh)
    fn = compile_replica_sums(state)
    assert _table(fn, state).shape == (8, 3, 2) and disagreements(_table(fn, state), state) == []
    victim = mesh.devices[3, 1]  # data replica 3's copy of the second column block
    for bit in (30, 0):  # a high exponent bit, and the lowest
        bad = dict(state, w=_flipped(state["w"], victim, bit))
        (found,) = disagreements(_table(fn, bad), bad)
        assert found.leaf == "w" and found.devices == (victim.id,) and found.majority
        assert found.copies == 4 and found.block == ((0, 8), (2, 4))
    bad = dict(state, b=_flipped(state["b"], mesh.devices[0, 0], 0))
    (found,) = disagreements(_table(fn, bad), bad)
    assert found.leaf == "b" and found.copies == 8 and found.devices == (mesh.devices[0, 0].id,)


def test_two_copies_that_differ_name_both():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    w = jax.device_put(jnp.zeros((4, 8), jnp.float32), NamedSharding(mesh, P(None, "model")))
    state = {"w": w}
    fn = compile_replica_sums(state)
    bad = {"w": _flipped(w, mesh.devices[1, 0], 5)}
    (found,) = disagreements(_table(fn, bad), bad)
    assert not found.majority and set(found.devices) == {mesh.devices[0, 0].id, mesh.devices[1, 0].id}
