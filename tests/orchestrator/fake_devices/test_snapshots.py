"""Peer snapshots without Ray: shares taken from sharded state, restored onto other shardings
through the checkpoint reader, checked by crc32; the keeper's bounded memory; and the worker's
snapshot-then-restore path on fake devices, held in this process."""

import dataclasses
import shutil

import numpy as np
import pytest

from checkpoint import CheckpointCorruptError, MemoryStep, restore_step, seal_snapshot, take_snapshot
from orchestrator.hosts.keepers import Keeper
from orchestrator.worker import run_segment


def sharded_state(devices, mesh_shape, specs):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices).reshape(mesh_shape), ("a", "b"))
    values = {
        "w": jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12) / 7,
        "h": (jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4) / 3).astype(jnp.bfloat16),
        "step": jnp.array(7, jnp.int32),
        "key": jax.random.key(3),
    }
    return {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec(*specs.get(k, ())))) for k, v in values.items()}


def target_like(state, devices, mesh_shape, specs):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices).reshape(mesh_shape), ("a", "b"))
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, PartitionSpec(*specs.get(k, ()))))
        for k, v in state.items()
    }


def held(state, log=None):
    """A snapshot of `state` taken as one process would, and the step reading it back."""
    index, arrays = take_snapshot(state)
    sealed = seal_snapshot(index, arrays)

    def fetch(keys):
        if log is not None:
            log.append(list(keys))
        return [arrays[n] for _, n in keys]

    return MemoryStep(12, {"data_position": 12}, {0: sealed}, fetch), arrays


def as_bits(x):
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).reshape(-1).view(np.uint8)


def test_a_snapshot_restores_bitwise_onto_other_shardings_with_one_fetch(devices8):
    state = sharded_state(devices8, (2, 4), {"w": ("a", "b"), "h": ("b", None)})
    calls = []
    step, arrays = held(state, calls)
    # Replicated leaves are taken once: w in 8 pieces, h in 4 (replicated over a), step and key in 1.
    assert len(arrays) == 8 + 4 + 1 + 1
    target = target_like(state, devices8, (4, 2), {"w": (None, "a"), "h": ("a", "b")})
    restored, stats = restore_step(step, target)
    for k in state:
        assert restored[k].sharding == target[k].sharding
        np.testing.assert_array_equal(as_bits(restored[k]), as_bits(state[k]))
    assert len(calls) == 1 and stats.bytes_needed > 0  # every piece in one batch


def test_a_piece_changed_after_it_was_taken_fails_its_crc(devices8):
    state = sharded_state(devices8, (2, 4), {"w": ("a", "b")})
    step, arrays = held(state)
    arrays[0].reshape(-1).view(np.uint8)[3] ^= 0x20
    with pytest.raises(CheckpointCorruptError, match="fails its crc32"):
        restore_step(step, target_like(state, devices8, (2, 4), {"w": ("a", "b")}))


def test_a_snapshot_missing_a_piece_is_incomplete_not_silently_zero(devices8):
    state = sharded_state(devices8, (2, 4), {"w": ("a", "b")})
    index, arrays = take_snapshot(state)
    sealed = seal_snapshot(index, arrays)
    sealed["pieces"] = sealed["pieces"][1:]
    step = MemoryStep(12, {}, {0: sealed}, lambda keys: [arrays[n + 1] for _, n in keys])
    with pytest.raises(CheckpointCorruptError, match="incomplete"):
        restore_step(step, target_like(state, devices8, (2, 4), {"w": ("a", "b")}))


@pytest.mark.unit
def test_the_snapshot_interval_keeps_the_copy_within_its_share_of_step_time():
    from orchestrator.worker.snapshots import SnapshotPace

    pace = SnapshotPace(0.05, peers=object())
    assert pace.interval == 1
    pace.took(copy_seconds=0.012, step_seconds=0.1)  # 12% of a step: every 3rd step is 4%
    assert pace.interval == 3
    pace.took(copy_seconds=0.001, step_seconds=0.1)  # by the medians of the last few
    assert pace.interval == 2
    pace.took(copy_seconds=0.001, step_seconds=0.1)
    assert pace.interval == 1
    assert SnapshotPace(0.0, peers=object()).interval == 0 and SnapshotPace(0.05, peers=None).interval == 0
    fixed = SnapshotPace(0.05, peers=object(), fixed=2)  # `checkpoint.snapshot_every`: whatever it costs
    fixed.took(copy_seconds=0.5, step_seconds=0.1)
    assert fixed.interval == 2


@pytest.mark.unit
def test_a_keeper_holds_the_newest_two_steps_of_the_newest_two_segments():
    keeper = Keeper()
    share = [np.ones(4, np.float32)]
    for segment, steps in ((0, range(1, 6)), (1, range(6, 9)), (2, range(9, 11))):
        for step in steps:
            for process in (0, 1):
                keeper.put((segment, step, process), {"processes": 2}, share)
    held_now = sorted((e["segment"], e["step"], e["process"]) for e in keeper.held())
    assert held_now == [(1, 7, 0), (1, 7, 1), (1, 8, 0), (1, 8, 1), (2, 9, 0), (2, 9, 1), (2, 10, 0), (2, 10, 1)]
    assert keeper.get((2, 10, 1), [0])[0].tolist() == [1.0] * 4
    with pytest.raises(LookupError):
        keeper.index((0, 5, 0))


class HeldHere:
    """The worker's side of peer snapshots (snapshots.PeerSnapshots) held in this process: what a
    host's keepers would hold, without Ray."""

    def __init__(self):
        self.shares = {}  # step -> (sealed index, arrays)
        self.restore = None  # the step to restore, as the controller would choose it
        self.damaged = False  # a bit of the first piece flips on its way back

    def offer(self, step, index, arrays, meta, digest=None):
        meta = {**meta, "digest": digest()} if digest else meta  # as PeerSnapshots' send thread does
        self.shares[step] = (index, arrays, meta)  # sealed when read: a keeper seals off the loop too

    def restore_step(self):
        if self.restore is None:
            return None
        index, arrays, meta = self.shares[self.restore]
        sealed = {**seal_snapshot(index, arrays), "meta": meta}

        def fetch(keys):
            out = [arrays[n].copy() for _, n in keys]
            if self.damaged and keys[0][1] == 0:
                out[0].reshape(-1).view(np.uint8)[0] ^= 1
            return out

        return MemoryStep(self.restore, meta, {0: sealed}, fetch)

    def close(self):
        pass


def trained_then_lost(path, memory):
    """13 steps on 8 devices with snapshots held in `memory`, as if a host were lost right after
    step 12: its commit of the last step never happened, so the newest commit is step 10. Returns
    the newest snapshot, as the controller would choose it. Which steps are snapshot follows the
    measured budget (here a copy may take up to 90% of a step)."""
    from tests.helpers.segments import spec

    first = spec(path, 8, 13)
    first = dataclasses.replace(first, checkpoint=dataclasses.replace(first.checkpoint, snapshot_time_share=0.9))
    run_segment(first, lambda r: None, peers=memory)
    shutil.rmtree(path / "ckpt" / "13")
    assert memory.shares and max(memory.shares) <= 12 and 1 in memory.shares  # the first step always
    return max(memory.shares)


def test_the_worker_resumes_from_a_snapshot_on_another_mesh_between_checkpoints(tmp_path, devices8):
    from tests.helpers.segments import collect, spec

    memory = HeldHere()
    memory.restore = newest = trained_then_lost(tmp_path / "a", memory)
    second, whole = [], []
    run_segment(spec(tmp_path / "a", 4, 16), collect(second), peers=memory)
    restore = next(r for r in second if r["kind"] == "restore")
    assert restore["source"] == "memory" and restore["step"] == newest
    assert restore["digest"] == restore["saved_digest"]  # the resharded state is bitwise the one taken
    got = {r["step"]: r["loss"] for r in second if r["kind"] == "step"}
    assert sorted(got) == list(range(newest + 1, 17))
    run_segment(spec(tmp_path / "b", 8, 16), collect(whole))
    want = {r["step"]: r["loss"] for r in whole if r["kind"] == "step"}
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
    # The snapshot kept the reports of the steps since a commit (the one at 10, or, while its save
    # was in flight, the one before), for a controller that never polled them; segment 0 ran them.
    kept = restore["reported"]
    steps = [r["step"] for r in kept["steps"]]
    assert kept["segment"] == 0 and steps == list(range(steps[0], newest + 1)) and steps[0] <= 11
    np.testing.assert_allclose([r["loss"] for r in kept["steps"]], [want[r["step"]] for r in kept["steps"]], rtol=1e-5)


def test_a_damaged_snapshot_falls_back_to_the_newest_commit(tmp_path, devices8):
    from tests.helpers.segments import collect, spec

    memory = HeldHere()
    memory.restore = trained_then_lost(tmp_path, memory)
    memory.damaged = True
    reports = []
    run_segment(spec(tmp_path, 4, 14), collect(reports), peers=memory)
    unusable = next(r for r in reports if r["kind"] == "snapshot_unusable")
    assert "crc32" in unusable["error"]
    restore = next(r for r in reports if r["kind"] == "restore")
    assert restore["source"] == "disk" and restore["step"] == 10
    assert [r["step"] for r in reports if r["kind"] == "step"] == [11, 12, 13, 14]
    assert [r["step"] for r in restore["reported"]["steps"]] == list(range(6, 11))  # since the commit at 5


def test_a_snapshot_whose_state_does_not_match_its_digest_falls_back_to_the_newest_commit(tmp_path, devices8):
    from orchestrator.job.digest import KIND
    from tests.helpers.segments import collect, spec

    memory = HeldHere()
    memory.restore = newest = trained_then_lost(tmp_path, memory)
    _, arrays, meta = memory.shares[newest]
    assert meta["digest"].startswith(KIND)  # taken after the step-5 save compiled the digest program
    arrays[0].reshape(-1).view(np.uint8)[0] ^= 1  # changed before its crc32s are made: only the digest tells
    reports = []
    run_segment(spec(tmp_path, 4, 14), collect(reports), peers=memory)
    assert "does not match the digest" in next(r for r in reports if r["kind"] == "snapshot_unusable")["error"]
    restore = next(r for r in reports if r["kind"] == "restore")
    assert restore["source"] == "disk" and restore["step"] == 10 and restore["digest"] == restore["saved_digest"]
