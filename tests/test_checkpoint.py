import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from checkpoint import CheckpointNotFoundError, CheckpointTargetError, Store

pytestmark = pytest.mark.fake_devices


def make_state():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((24, 16)).astype(np.float32),
        "b": rng.standard_normal((16,)).astype(np.float32),
        "emb": rng.standard_normal((48, 12)).astype(np.float32).astype(jnp.bfloat16),
        "count": np.int32(7),
        "rng": np.array([1, 2], np.uint32),
    }


def spec_for(kind, x):
    if kind == "dp" or np.ndim(x) == 0 or x.shape[0] % 2:
        return P()
    return P("x") if kind == "fsdp" else P(None, "x") if np.ndim(x) > 1 and x.shape[1] % 2 == 0 else P()


def target(state, devices, kind):
    """Abstract leaves with a `kind` sharding over `devices` (replicated where it would not divide)."""
    mesh = Mesh(np.array(devices), ("x",))

    def sharding(x):
        spec = spec_for(kind, x)
        divides = all(d is None or np.shape(x)[i] % len(devices) == 0 for i, d in enumerate(spec))
        return NamedSharding(mesh, spec if divides else P())

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding(x)), state)


def place(state, devices, kind):
    return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state, target(state, devices, kind))


@pytest.mark.parametrize("save", [(8, "fsdp"), (4, "dp"), (2, "tp")])
@pytest.mark.parametrize("restore", [(6, "fsdp"), (3, "tp"), (1, "dp"), (8, "tp")])
def test_restore_onto_another_mesh_is_bitwise_exact(tmp_path, devices8, save, restore):
    state = make_state()
    store = Store(tmp_path)
    store.save(5, place(state, devices8[: save[0]], save[1]), meta={"data_position": 5})
    store.wait()
    restored = store.restore(target=target(state, devices8[: restore[0]], restore[1]))
    for key in state:
        got = restored[key]
        assert got.sharding.mesh.size == restore[0]
        np.testing.assert_array_equal(np.atleast_1d(np.asarray(got)).view(np.uint8), np.atleast_1d(np.asarray(state[key])).view(np.uint8))
    assert store.metadata()["meta"] == {"data_position": 5}


def test_target_mismatch_and_missing_steps_say_what_is_wrong(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "dp"))
    store.wait()
    bad = dict(target(state, devices8, "dp"))
    bad["w"] = jax.ShapeDtypeStruct((24, 17), np.float32)
    with pytest.raises(CheckpointTargetError, match=r"leaf \['w'\].*shape \[24, 16\].*\[24, 17\]"):
        store.restore(target=bad)
    extra = dict(target(state, devices8, "dp"), new=jax.ShapeDtypeStruct((2,), np.float32))
    with pytest.raises(CheckpointTargetError, match="does not"):
        store.restore(target=extra)
    with pytest.raises(CheckpointNotFoundError, match=r"committed steps: \[1\]"):
        store.restore(3, target=target(state, devices8, "dp"))


def test_a_save_killed_mid_write_leaves_the_committed_step_restorable(tmp_path):
    """A real process dies (os._exit) while its asynchronous write of step 2 is in flight."""
    script = textwrap.dedent(f"""
        import os, numpy as np
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax.numpy as jnp
        from checkpoint import Store
        store = Store({str(tmp_path)!r})
        big = {{"w": jnp.arange(4_000_000, dtype=jnp.float32)}}
        store.save(1, big); store.wait()
        store.save(2, {{"w": big["w"] + 1}})
        os._exit(0)  # the write of step 2 is still going on in the background
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=os.getcwd())
    store = Store(tmp_path)
    assert 1 in store.steps()
    for step in store.steps():
        value = store.restore(step, target={"w": jax.ShapeDtypeStruct((4_000_000,), np.float32)})["w"]
        np.testing.assert_array_equal(np.asarray(value), np.arange(4_000_000, dtype=np.float32) + (step - 1))


def test_a_target_without_shardings_restores_onto_one_local_device(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "fsdp"))
    store.wait()
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    restored = store.restore(target=plain)
    assert restored["w"].sharding.device_set == {jax.local_devices()[0]}
    np.testing.assert_array_equal(np.asarray(restored["w"]), state["w"])
