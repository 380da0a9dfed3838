"""The per-host worker as a plain function, without Ray: one process, fake devices."""
import json

import pytest

import partitioner
from orchestrator import check_program
from orchestrator.jobfile import CheckpointSpec
from orchestrator.worker import RestoredStateMismatchError, SegmentSpec, run_segment

pytestmark = pytest.mark.fake_devices


def spec(tmp_path, devices, steps):
    from examples.gpt.model import program

    state, batch = check_program(program, 24)
    plan = partitioner.plan(program.step, state, batch, devices=devices, hardware="cpu")
    return SegmentSpec(program="examples.gpt.model:program", steps=steps, global_batch=24, seed=0,
                       checkpoint=CheckpointSpec(str(tmp_path / "ckpt"), every=5, keep=2), plan_json=plan.to_json(),
                       coordinator="", num_processes=1, process_id=0)


def test_resumes_on_another_mesh_at_the_saved_data_position(tmp_path, devices8):
    first, second = [], []
    run_segment(spec(tmp_path, 8, 10), first.append)
    run_segment(spec(tmp_path, 4, 12), second.append)
    steps = [r for r in first if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    restore = next(r for r in second if r["kind"] == "restore")
    assert restore["step"] == 10 and restore["digest"] == restore["saved_digest"]
    assert [r["step"] for r in second if r["kind"] == "step"] == [11, 12]


def test_a_restore_that_does_not_match_what_was_saved_is_refused(tmp_path, devices8):
    run_segment(spec(tmp_path, 8, 5), lambda r: None)
    meta_file = str(tmp_path / "ckpt" / "5" / "meta" / "metadata")
    doc = json.load(open(meta_file))
    doc["meta"]["digest"] = "0" * 64
    json.dump(doc, open(meta_file, "w"))
    with pytest.raises(RestoredStateMismatchError, match="from step 5 .* does not match the digest saved"):
        run_segment(spec(tmp_path, 8, 10), lambda r: None)
