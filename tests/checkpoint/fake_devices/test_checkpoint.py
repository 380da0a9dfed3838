"""The checkpoint store on 8 fake devices: exact resharding matrix, mapping rules, dtype policy,
plain Orbax layouts, retention and integrity. Crash and multi-process tiers are in
test_checkpoint_crash.py and test_checkpoint_multiprocess.py."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoint import (
    Cast,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointTargetError,
    Rename,
    Stack,
    Store,
    StoreConfig,
    Unstack,
)

COUNTS = (1, 2, 3, 4, 6, 8)
PLANS = [(n, kind) for n in COUNTS for kind in ("dp", "fsdp", "tp")] + [(4, "2d"), (6, "2d"), (8, "2d")]


def make_state():
    rng = np.random.default_rng(0)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)
    return {
        "params": {
            "w": normal(48, 72),
            "emb": normal(96, 24).astype(ml_dtypes.bfloat16),
            "b": normal(72),
            "odd": normal(5, 7),
        },
        "opt": {"count": np.int32(7), "mu": {"w": normal(48, 72)}},
        "rng": np.array([1, 2], np.uint32),
    }


def mesh_for(devices, kind):
    if kind == "2d":
        return Mesh(np.array(devices).reshape(len(devices) // 2, 2), ("data", "model"))
    return Mesh(np.array(devices), ("x",))


def spec_for(kind, shape, mesh):
    """DP replicates; FSDP shards the first dimension the mesh divides; TP the last; 2d both."""
    n = mesh.devices.size
    divisible = [i for i, d in enumerate(shape) if d % n == 0]
    if kind == "dp" or not divisible:
        if kind != "2d":
            return P()
    if kind == "fsdp":
        return P(*[("x" if i == divisible[0] else None) for i in range(len(shape))])
    if kind == "tp":
        return P(*[("x" if i == divisible[-1] else None) for i in range(len(shape))])
    a, b = mesh.shape["data"], mesh.shape["model"]
    if len(shape) == 2 and shape[0] % a == 0 and shape[1] % b == 0:
        return P("data", "model")
    return P()


def target(state, devices, kind):
    mesh = mesh_for(devices, kind)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            np.shape(x), x.dtype, sharding=NamedSharding(mesh, spec_for(kind, np.shape(x), mesh))
        ),
        state,
    )


def place(state, devices, kind):
    return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), state, target(state, devices, kind))


def assert_bitwise(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.atleast_1d(got).view(np.uint8), np.atleast_1d(want).view(np.uint8))


@pytest.mark.parametrize("save", PLANS, ids=lambda p: f"save{p[0]}{p[1]}")
def test_round_trip_matrix_is_bitwise_exact(tmp_path, devices8, save):
    """Every (save mesh, save specs) x (restore mesh, restore specs) over 1, 2, 3, 4, 6 and 8 devices."""
    state = make_state()
    store = Store(tmp_path)
    store.save(5, place(state, devices8[: save[0]], save[1]), meta={"data_position": 5})
    store.wait()
    for n, kind in PLANS:
        restored, stats = store.restore_with_stats(target=target(state, devices8[:n], kind))
        for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(state)):
            assert got.sharding.mesh.size == n, path
            assert_bitwise(got, want)
        assert stats.bytes_needed > 0
    assert store.metadata()["meta"] == {"data_position": 5}


def test_metadata_is_versioned_json_with_leaves_and_saved_sharding(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(3, place(state, devices8, "fsdp"), meta={"data_position": 3, "program_fingerprint": "abc"})
    store.wait()
    with open(tmp_path / "3" / "remesh.json") as f:
        doc = json.load(f)
    assert doc["format"] == "remesh.checkpoint/2" and doc["step"] == 3 and doc["meta"]["program_fingerprint"] == "abc"
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert leaves["params/w"]["shape"] == [48, 72] and leaves["params/w"]["dtype"] == "float32"
    assert leaves["params/w"]["sharding"] == {"mesh": {"x": 8}, "spec": ["x", None]}
    assert leaves["params/emb"]["dtype"] == "bfloat16"
    # A replicated leaf is written once; an 8-way sharded one as 8 files.
    files = [f for f in doc["files"] if not f.endswith("zarr.json")]
    per_array = lambda name: [f for f in files if f.startswith(f"arrays/{leaves[name]['array']}/")]
    assert len(per_array("params/odd")) == 1 and len(per_array("params/w")) == 8


def test_target_mismatch_and_missing_steps_say_what_is_wrong(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "dp"))
    store.wait()
    bad = target(state, devices8, "dp")
    bad["params"]["w"] = jax.ShapeDtypeStruct((48, 70), np.float32)
    with pytest.raises(
        CheckpointTargetError,
        match=r"leaf params/w: the target asks for shape \[48, 70\] but params/w was saved with shape \[48, 72\]",
    ):
        store.restore(target=bad)
    extra = dict(target(state, devices8, "dp"), new=jax.ShapeDtypeStruct((2,), np.float32))
    with pytest.raises(CheckpointTargetError, match=r"leaf new is not in the checkpoint.*include=.*rules="):
        store.restore(target=extra)
    with pytest.raises(CheckpointNotFoundError, match=r"committed steps: \[1\]"):
        store.restore(3, target=target(state, devices8, "dp"))


def test_partial_restore_by_path_pattern_leaves_the_rest_as_given(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "fsdp"))
    store.wait()
    fresh = jax.tree.map(jnp.zeros_like, place(state, devices8[:4], "tp"))
    restored, stats = store.restore_with_stats(target=fresh, include=["params/*"])
    assert_bitwise(restored["params"]["w"], state["params"]["w"])
    assert_bitwise(restored["params"]["emb"], state["params"]["emb"])
    assert restored["opt"]["mu"]["w"] is fresh["opt"]["mu"]["w"]  # untouched
    assert stats.leaves == 4


def test_dtype_policy_casts_only_when_asked_and_never_between_kinds(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "fsdp"))
    store.wait()
    sharding = NamedSharding(mesh_for(devices8[:2], "fsdp"), P("x"))
    to_bf16 = {"params": {"w": jax.ShapeDtypeStruct((48, 72), jnp.bfloat16, sharding=sharding)}}
    with pytest.raises(
        CheckpointTargetError, match=r"params/w: saved as float32, the target asks for bfloat16; pass cast=Cast.LOSSY"
    ):
        store.restore(target=to_bf16, include=["params/w"])
    got = store.restore(target=to_bf16, include=["params/w"], cast=Cast.LOSSY)["params"]["w"]
    assert_bitwise(got, state["params"]["w"].astype(ml_dtypes.bfloat16))
    to_f32 = {"params": {"emb": jax.ShapeDtypeStruct((96, 24), jnp.float32, sharding=sharding)}}
    with pytest.raises(CheckpointTargetError, match="cast=Cast.WIDEN"):
        store.restore(target=to_f32, include=["params/emb"])
    got = store.restore(target=to_f32, include=["params/emb"], cast=Cast.WIDEN)["params"]["emb"]
    assert_bitwise(got, state["params"]["emb"].astype(np.float32))
    to_int = {"params": {"b": jax.ShapeDtypeStruct((72,), jnp.int32)}}
    with pytest.raises(CheckpointTargetError, match="between float and int is never done"):
        store.restore(target=to_int, include=["params/b"], cast=Cast.LOSSY)


def layered(n_layers=4):
    rng = np.random.default_rng(1)
    return {
        f"layer_{i}": {
            "w": rng.standard_normal((24, 48)).astype(np.float32),
            "b": rng.standard_normal(48).astype(np.float32),
        }
        for i in range(n_layers)
    }


def test_renamed_and_restacked_leaves_map_at_load_time(tmp_path, devices8):
    per_layer = layered()
    mesh = mesh_for(devices8[:8], "fsdp")
    store = Store(tmp_path / "unrolled")
    store.save(1, {"params": jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("x"))), per_layer)})
    store.wait()
    # Unrolled -> scanned: one (layers, ...) leaf per parameter, sharded across layers x model on 6 devices.
    mesh6 = mesh_for(devices8[:6], "2d")
    stacked_target = {
        "model": {
            "layers": {
                "w": jax.ShapeDtypeStruct(
                    (4, 24, 48), np.float32, sharding=NamedSharding(mesh6, P(None, "data", "model"))
                ),
                "b": jax.ShapeDtypeStruct((4, 48), np.float32, sharding=NamedSharding(mesh6, P("model", "data"))),
            }
        }
    }
    rules = [Stack(r"model/layers/(?P<name>\w+)", "params/layer_{i}/{name}")]
    stacked = store.restore(target=stacked_target, rules=rules)
    assert_bitwise(stacked["model"]["layers"]["w"], np.stack([per_layer[f"layer_{i}"]["w"] for i in range(4)]))
    assert_bitwise(stacked["model"]["layers"]["b"], np.stack([per_layer[f"layer_{i}"]["b"] for i in range(4)]))
    # ... and back: scanned -> unrolled, renamed on the way.
    scanned = Store(tmp_path / "scanned")
    scanned.save(2, stacked)
    scanned.wait()
    target = {
        "net": {
            f"block{i}": {
                k: jax.ShapeDtypeStruct(
                    v.shape,
                    v.dtype,
                    sharding=NamedSharding(mesh_for(devices8[:3], "tp"), P(None, "x") if v.ndim == 2 else P("x")),
                )
                for k, v in per_layer["layer_0"].items()
            }
            for i in range(4)
        }
    }
    unrolled = scanned.restore(
        target=target, rules=[Unstack(r"net/block(?P<i>\d+)/(?P<name>\w+)", "model/layers/{name}")]
    )
    for i in range(4):
        assert_bitwise(unrolled["net"][f"block{i}"]["w"], per_layer[f"layer_{i}"]["w"])
        assert_bitwise(unrolled["net"][f"block{i}"]["b"], per_layer[f"layer_{i}"]["b"])
    renamed = store.restore(
        target={"p": {"l0": {"w": jax.ShapeDtypeStruct((24, 48), np.float32)}}},
        rules=[Rename(r"p/l(?P<i>\d)/(?P<k>\w+)", "params/layer_{i}/{k}")],
    )
    assert_bitwise(renamed["p"]["l0"]["w"], per_layer["layer_0"]["w"])


def test_prng_key_leaves_round_trip(tmp_path, devices8):
    key = jax.random.split(jax.random.key(3), 8)
    store = Store(tmp_path)
    store.save(1, {"keys": jax.device_put(key, NamedSharding(mesh_for(devices8, "fsdp"), P("x")))})
    store.wait()
    got = store.restore(
        target={
            "keys": jax.ShapeDtypeStruct(
                key.shape, key.dtype, sharding=NamedSharding(mesh_for(devices8[:4], "fsdp"), P("x"))
            )
        }
    )
    assert_bitwise(jax.random.key_data(got["keys"]), jax.random.key_data(key))


@pytest.mark.parametrize("layout", ["standard", "manager", "remesh-0.1"])
def test_plain_orbax_checkpoints_restore_onto_a_remesh_plan(tmp_path, devices8, layout):
    state = make_state()
    placed = place(state, devices8[:4], "fsdp")
    if layout == "standard":
        path = tmp_path / "ck"
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, placed)
        checkpointer.wait_until_finished()
        step = 0
    else:
        path, step = tmp_path, 12
        manager = ocp.CheckpointManager(path)
        if layout == "manager":
            manager.save(step, args=ocp.args.StandardSave(placed))
        else:  # what remesh 0.1 wrote: items `state` and `meta` of one CheckpointManager step
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(placed), meta=ocp.args.JsonSave({"meta": {"data_position": 12}})
                ),
            )
        manager.wait_until_finished()
        manager.close()
    store = Store(path)
    assert store.steps() == [step]
    restored = store.restore(target=target(state, devices8[:6], "tp"))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert_bitwise(got, want)
    assert store.metadata()["kind"] == "orbax"
    if layout == "remesh-0.1":
        assert store.metadata()["meta"] == {"data_position": 12}
    assert store.verify().ok
    # A job resumes from it and goes on in remesh's format in the same directory.
    if layout != "standard":
        store.save(13, restored)
        store.wait()
        assert store.steps() == [12, 13] and store.metadata(13)["kind"] == "remesh"


def test_retention_keeps_the_last_n_and_every_mth(tmp_path, devices8):
    store = Store(tmp_path, config=StoreConfig(keep_last=2, keep_every=4))
    for step in range(1, 11):
        store.save(step, {"x": jnp.full((8,), step, jnp.float32)})
    store.wait()
    assert store.steps() == [4, 8, 9, 10]
    assert sorted(os.listdir(tmp_path)) == ["10", "4", "8", "9"]  # no partial or deleting leftovers


def test_save_returns_after_the_host_copy_so_the_state_may_be_donated(tmp_path, devices8):
    x = jax.device_put(jnp.arange(4096, dtype=jnp.float32), NamedSharding(mesh_for(devices8, "fsdp"), P("x")))
    store = Store(tmp_path)
    store.save(1, {"x": x})
    x.delete()  # as a donated buffer would be, while the write may still be going on
    store.wait()
    assert_bitwise(
        store.restore(target={"x": jax.ShapeDtypeStruct((4096,), np.float32)})["x"], np.arange(4096, dtype=np.float32)
    )


def chunk_files(step_dir):
    doc = json.load(open(os.path.join(step_dir, "remesh.json")))
    return doc, [f for f in doc["files"] if not f.endswith("zarr.json")]


def test_corruption_names_the_leaf_and_chunk_and_verify_reports_it(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "fsdp"))
    store.wait()
    doc, files = chunk_files(tmp_path / "1")
    w = next(leaf for leaf in doc["leaves"] if leaf["path"] == "params/w")
    victim = tmp_path / "1" / next(f for f in files if f.startswith(f"arrays/{w['array']}/"))
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointCorruptError, match=r"leaf params/w, chunk \(0, 0\) in file arrays/\d+/c/0/0 failed its checksum"
    ):
        store.restore(target=target(state, devices8[:2], "tp"))
    report = store.verify(1)
    assert not report.ok and len(report.problems) == 1 and "params/w" in report.problems[0]
    victim.write_bytes(bytes(data[:-7]))  # truncated: caught by size before any read
    with pytest.raises(CheckpointCorruptError, match=r"leaf params/w: file .* holds \d+ bytes, \d+ were written"):
        store.restore(target=target(state, devices8[:2], "tp"))
    victim.unlink()  # missing: would otherwise read as zeros
    assert any("is missing" in p for p in store.verify(1).problems)


def test_a_restore_checks_only_the_files_it_reads(tmp_path, devices8):
    """A host stats and checks the chunks its own boxes overlap, not every file any host wrote: a
    missing chunk of a leaf it does not read is no error for it, and still one for a host that does."""
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "fsdp"))  # params/w: [48, 72] in 8 row chunks of 6
    store.wait()
    doc, files = chunk_files(tmp_path / "1")
    w = next(leaf for leaf in doc["leaves"] if leaf["path"] == "params/w")
    step = store.open_step(1)
    rows = step.files_read("params/w", [((6, 18), (0, 72))])
    base = f"arrays/{w['array']}"
    assert rows == {f"{base}/zarr.json", f"{base}/c/1/0", f"{base}/c/2/0"}
    assert len(step.files_read("params/w")) == 9  # every chunk, and the metadata
    (tmp_path / "1" / f"{base}/c/7/0").unlink()
    restored = store.restore(target=place(state, devices8, "dp"), include=["params/b", "opt/*"])
    assert_bitwise(restored["opt"]["mu"]["w"], state["opt"]["mu"]["w"])
    with pytest.raises(CheckpointCorruptError, match=r"leaf params/w: file arrays/\d+/c/7/0 is missing"):
        store.restore(target=place(state, devices8, "dp"), include=["params/w"])


def test_every_sampled_single_byte_corruption_of_a_data_chunk_is_detected(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path, config=StoreConfig(chunk_bytes=2048))
    store.save(1, place(state, devices8, "tp"))
    store.wait()
    assert store.verify(1).ok
    _, files = chunk_files(tmp_path / "1")
    rng = np.random.default_rng(0)
    trials = 0
    for _ in range(120):
        victim = tmp_path / "1" / files[rng.integers(len(files))]
        original = victim.read_bytes()
        offset = int(rng.integers(len(original)))
        damaged = bytearray(original)
        damaged[offset] ^= int(rng.integers(1, 256))
        victim.write_bytes(bytes(damaged))
        report = store.verify(1)
        victim.write_bytes(original)
        assert not report.ok, f"flipping byte {offset} of {victim.name} went unnoticed"
        trials += 1
    assert trials >= 100 and store.verify(1).ok


def test_a_damaged_manifest_is_refused(tmp_path, devices8):
    store = Store(tmp_path)
    store.save(1, {"x": jnp.ones(8)})
    store.wait()
    path = tmp_path / "1" / "remesh.json"
    path.write_text(path.read_text().replace('"step": 1', '"step": 2'))
    report = store.verify(1)
    assert not report.ok and "does not match its checksum" in report.problems[0]


def test_a_target_without_shardings_restores_onto_one_local_device(tmp_path, devices8):
    state = make_state()
    store = Store(tmp_path)
    store.save(1, place(state, devices8, "fsdp"))
    store.wait()
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    restored = store.restore(target=plain)
    assert restored["params"]["w"].sharding.device_set == {jax.local_devices()[0]}
    assert_bitwise(restored["params"]["w"], state["params"]["w"])


def test_a_resharded_restore_reads_each_needed_byte_once(tmp_path, devices8):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((768, 3072)).astype(np.float32)
    store = Store(tmp_path, config=StoreConfig(chunk_bytes=256 << 10))
    store.save(1, {"w": jax.device_put(w, NamedSharding(mesh_for(devices8, "fsdp"), P("x")))})
    store.wait()
    # Row-sharded 8 ways when saved; column halves, each replicated on 3 devices, when restored.
    mesh = mesh_for(devices8[:6], "2d")
    restored, stats = store.restore_with_stats(
        target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P(None, "model")))}
    )
    assert_bitwise(restored["w"], w)
    assert stats.bytes_needed == w.nbytes and 1.0 <= stats.read_amplification <= 1.02, stats
