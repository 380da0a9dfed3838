"""The per-host worker as a plain function, without Ray: one process, fake devices."""

import json
import os

import pytest

import partitioner
from checkpoint import CheckpointCorruptError, Store
from checkpoint.layout import manifest_checksum
from orchestrator.job.digest import KIND as DIGEST_KIND
from orchestrator.job.jobfile import CheckpointSpec
from orchestrator.worker import CheckpointSaveError, run_segment
from tests.helpers.segments import collect, spec


def test_resumes_on_another_mesh_at_the_saved_data_position(tmp_path, devices8):
    first, second = [], []
    run_segment(spec(tmp_path, 8, 10), collect(first))
    run_segment(spec(tmp_path, 4, 12), collect(second))
    steps = [r for r in first if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    restore = next(r for r in second if r["kind"] == "restore")
    assert restore["step"] == 10 and restore["digest"] == restore["saved_digest"]
    assert [r["step"] for r in second if r["kind"] == "step"] == [11, 12]


def test_a_tactics_plan_trains_and_resumes_on_another_plan(tmp_path, devices8):
    """The factor-graph search's plans through the worker: Megatron x DP on 8 devices, then data
    parallel on 6, resuming bitwise at the saved data position."""
    first, second = [], []
    tp = spec(tmp_path, 8, 10, planner="megatron")
    assert "model" in partitioner.Plan.from_json(tp.plan_json).mesh  # a tensor-parallel plan
    run_segment(tp, collect(first))
    dp = spec(tmp_path, 6, 12, planner="tactics")
    run_segment(dp, collect(second))
    restore = next(r for r in second if r["kind"] == "restore")
    assert restore["step"] == 10 and restore["digest"] == restore["saved_digest"]
    losses = [r["loss"] for r in first + second if r["kind"] == "step"]
    assert len(losses) == 12 and losses[-1] < losses[0]


def damage_a_chunk(step_dir):
    doc = json.load(open(os.path.join(step_dir, "remesh.json")))
    victim = os.path.join(step_dir, max((f for f in doc["files"] if "/c/" in f), key=lambda f: doc["files"][f]["size"]))
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 3] ^= 0x10
    open(victim, "wb").write(bytes(data))


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_that_verifies(tmp_path, devices8):
    run_segment(spec(tmp_path, 8, 10), lambda r: None)
    damage_a_chunk(tmp_path / "ckpt" / "10")
    reports = []
    run_segment(spec(tmp_path, 4, 12), collect(reports))
    corrupt = [r for r in reports if r["kind"] == "checkpoint_corrupt"]
    assert [r["step"] for r in corrupt] == [10] and "failed its checksum" in corrupt[0]["error"]
    restore = next(r for r in reports if r["kind"] == "restore")
    assert restore["step"] == 5 and restore["digest"] == restore["saved_digest"]
    assert [r["step"] for r in reports if r["kind"] == "step"] == list(range(6, 13))
    assert os.path.isdir(tmp_path / "ckpt" / "10.corrupt")  # moved aside, not deleted


def test_a_restore_that_does_not_match_its_digest_falls_back_and_none_intact_is_an_error(tmp_path, devices8):
    run_segment(spec(tmp_path, 8, 10), lambda r: None)
    path = tmp_path / "ckpt" / "10" / "remesh.json"
    doc = json.load(open(path))
    doc["meta"]["digest"] = DIGEST_KIND + "0" * 64
    doc["checksum"] = manifest_checksum(doc)  # a consistent manifest whose state digest is wrong
    json.dump(doc, open(path, "w"))
    reports = []
    run_segment(spec(tmp_path, 8, 10), collect(reports))
    corrupt = next(r for r in reports if r["kind"] == "checkpoint_corrupt")
    assert corrupt["step"] == 10 and "does not match the digest saved" in corrupt["error"]
    assert next(r for r in reports if r["kind"] == "restore")["step"] == 5
    for step in Store(tmp_path / "ckpt").steps():
        damage_a_chunk(tmp_path / "ckpt" / str(step))
    with pytest.raises(CheckpointCorruptError, match="no checkpoint in .* restores intact"):
        run_segment(spec(tmp_path, 8, 12), lambda r: None)


def nnx_spec(tmp_path, devices, steps):
    return spec(tmp_path, devices, steps, program_ref="tests.programs.nnx_mlp:program", global_batch=8)


def test_a_flax_nnx_state_with_typed_keys_saves_and_resumes_on_another_mesh(tmp_path, devices8):
    first, second = [], []
    run_segment(nnx_spec(tmp_path, 8, 10), collect(first))
    run_segment(nnx_spec(tmp_path, 4, 12), collect(second))
    restore = next(r for r in second if r["kind"] == "restore")
    assert restore["step"] == 10 and restore["digest"] == restore["saved_digest"]
    steps = [r for r in first + second if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(set(r["metrics"]) == {"grad_norm"} and r["metrics"]["grad_norm"] > 0 for r in steps)


def test_a_failed_save_is_reported_training_goes_on_and_three_in_a_row_end_the_segment(tmp_path, devices8):
    import dataclasses

    s = spec(tmp_path, 8, 12)  # saves at 5, 10 and 12
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the checkpoint directory goes: every write under it fails")
    reports = []

    def report(r):
        r = r.to_dict()
        reports.append(r)
        if r["kind"] == "checkpoint_failed":
            blocker.unlink()  # the space is freed

    run_segment(s, report)
    failed = [r for r in reports if r["kind"] == "checkpoint_failed"]
    assert (
        [r["step"] for r in failed] == [5] and failed[0]["newest"] is None and "FileExistsError" in failed[0]["error"]
    )
    assert [r["step"] for r in reports if r["kind"] == "step"] == list(range(1, 13))
    assert Store(s.checkpoint.dir).steps() == [10, 12]

    (tmp_path / "full").write_text("")
    s = dataclasses.replace(s, checkpoint=CheckpointSpec(str(tmp_path / "full"), every=2, keep=2), steps=8)
    with pytest.raises(CheckpointSaveError, match=r"3 checkpoint saves in a row failed .*step 6.*Free space"):
        run_segment(s, [].append)


def test_a_plan_compiled_ahead_is_loaded_by_the_segment_that_runs_it(tmp_path, devices8):
    """A segment on 8 devices compiles the 4-device plan beside training; a segment on that plan
    loads the step, evaluation and digest it handed over instead of compiling them, and trains
    as one that compiled them itself; executables for another plan are not used."""
    import threading

    import jax

    # Only programs compiled afresh are handed over (not ones JAX's in-memory cache holds from the
    # tests before this one in the process).
    jax.clear_caches()
    small = spec(tmp_path / "a", 4, 12)
    reports, handed = [], threading.Event()
    asked = iter([small.plan_json])

    def report(r):
        r = r.to_dict()
        reports.append(r)
        if r["kind"] == "compile_ahead":
            handed.set()

    run_segment(spec(tmp_path / "a", 8, 10), report, ahead=lambda: next(asked, None))
    assert handed.wait(timeout=600), "compile-ahead never reported"  # a guard against a hang
    ahead = next(r for r in reports if r["kind"] == "compile_ahead")
    assert "error" not in ahead, ahead["error"]
    executables = ahead["executables"]
    assert {"step", "digest"} <= set(executables)

    loaded, compiled = [], []
    run_segment(small, collect(loaded), executables=executables)
    run_segment(spec(tmp_path / "b", 8, 10), lambda r: None)
    run_segment(spec(tmp_path / "b", 4, 12), collect(compiled))
    compile = next(r for r in loaded if r["kind"] == "compile")
    assert "step" in compile["loaded"] and not compile["load_failed"]
    restore = next(r for r in loaded if r["kind"] == "restore")
    assert restore["digest"] == restore["saved_digest"]  # the digest program handed over reads alike
    steps = lambda rs: {r["step"]: r["loss"] for r in rs if r["kind"] == "step"}  # noqa: E731
    assert steps(loaded) == steps(compiled) and sorted(steps(loaded)) == [11, 12]

    other = []
    run_segment(spec(tmp_path / "c", 4, 2, planner="tactics"), collect(other), executables=executables)
    assert next(r for r in other if r["kind"] == "compile")["loaded"] == []


def test_a_program_the_persistent_cache_held_is_not_handed_over(tmp_path):
    """Two processes, one cache: the first compiles the 4-device programs afresh and hands them
    over; the second finds them in the cache, and an executable loaded from it and serialised
    again fails on XLA:CPU when run, so it hands none over (its group loads them from the cache)."""
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def handed(work):
        cmd = [sys.executable, "-m", "tests.helpers.ahead_process", str(tmp_path / "cache"), str(tmp_path / work)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    assert {"step", "digest"} <= set(handed("a"))
    assert handed("b") == []
