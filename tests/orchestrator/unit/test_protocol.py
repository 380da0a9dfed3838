"""The typed protocol: every report round-trips through the dict it is on the wire, and what
remesh keeps beside a state reads back with its defaults, including what older remesh wrote."""

import dataclasses

import pytest

from orchestrator.protocol import (
    EVENT_KINDS,
    REPORTS,
    CheckpointMeta,
    CompileAhead,
    Report,
    ReportError,
    ReportKind,
    Restore,
    Step,
    from_dict,
)

# One report of each kind, with the fields it carries on the wire today.
WIRE = [
    {"kind": "group_start", "seconds": 1.5, "at": 10.0, "devices": 8},
    {"kind": "load", "seconds": 0.2, "at": 10.2},
    {
        "kind": "compile",
        "seconds": 3.0,
        "at": 13.2,
        "loaded": ["step"],
        "load_failed": [],
        "model_flops": 1e9,
        "device_flops": None,
    },  # fmt: skip
    {
        "kind": "restore",
        "seconds": 0.1,
        "at": 13.3,
        "took": 2.0,
        "step": 10,
        "source": "disk",
        "bytes_read": 100,
        "bytes_needed": 90,
        "reported": {"segment": 0, "steps": []},
        "digest": "d1",
        "saved_digest": "d1",
    },  # fmt: skip
    {"kind": "init", "seconds": 0.1, "at": 13.3, "took": 0.5},
    {"kind": "checkpoint_corrupt", "seconds": 0.1, "at": 13.3, "took": 0.4, "step": 10, "error": "bad crc"},
    {"kind": "snapshot_unusable", "seconds": 0.1, "at": 13.3, "took": 0.2, "error": "lost"},
    {
        "kind": "step",
        "seconds": 0.1,
        "at": 13.4,
        "step": 11,
        "loss": 2.5,
        "metrics": {"acc": 0.5},
        "tokens_per_second": 100.0,
        "mfu": 0.4,
        "input_seconds": 0.01,
        "snapshot_seconds": 0.0,
        "wait_seconds": 0.02,
        "snapshot_every": 2,
    },  # fmt: skip
    {"kind": "eval", "seconds": 0.3, "at": 13.7, "step": 11, "loss": 2.6, "metrics": {}},
    {"kind": "checkpoint", "seconds": 0.05, "at": 13.75, "step": 15},
    {"kind": "checkpoint_failed", "step": 15, "error": "OSError: disk full", "newest": None},
    {"kind": "checkpoint_flush", "seconds": 0.5, "at": 14.3, "step": 20},
    {"kind": "compile_ahead", "seconds": 4.0, "devices": 4, "executables": {"plan": "k", "step": ["b", "t"]}},
    {"kind": "compile_ahead", "seconds": 0.1, "error": "ValueError: no"},
    {"kind": "chaos_frozen", "phase": "save", "step": 15},
    {
        "kind": "replicas_differ",
        "step": 30,
        "clean_step": 20,
        "every": 5,
        "disagreements": [
            {
                "leaf": "params/w",
                "block": [[0, 8], [2, 4]],
                "copies": 4,
                "devices": [7],
                "processes": [3],
                "majority": True,
            }
        ],
    },
]


@pytest.mark.parametrize("wire", WIRE, ids=lambda w: w["kind"])
def test_each_report_is_the_same_dict_on_the_wire_after_a_round_trip(wire):
    report = from_dict(wire)
    assert isinstance(report, Report) and report.KIND == wire["kind"]
    assert report.to_dict() == wire


def test_every_kind_has_a_report_and_the_summary_lists_the_same_events_as_before():
    assert {k for k in ReportKind} == set(REPORTS) == {w["kind"] for w in WIRE}
    assert set(EVENT_KINDS) == {
        "host_lost", "host_added", "replan", "restore", "checkpoint", "compile", "group_start",
        "checkpoint_corrupt", "checkpoint_failed", "eval", "compile_ahead",
        # and, since the fleet scheduler (issue 28), its decisions on a shared cluster:
        "queued", "shrink", "grow", "suspend", "admitted",
        # and, since the health loop (issue 43), what it decides of a slow, hung or corrupt host:
        "straggler", "hang", "corruption",
    }  # fmt: skip


def test_a_report_that_does_not_fit_the_protocol_says_what_was_expected():
    with pytest.raises(ReportError, match="kind 'stepped'.*expected one of"):
        from_dict({"kind": "stepped", "step": 1})
    with pytest.raises(ReportError, match="a restore report.*source"):
        from_dict({"kind": "restore", "step": 1, "seconds": 0.1, "at": 1.0})


def test_events_carry_what_the_summary_recorded_before():
    restore = from_dict(WIRE[3])
    assert "reported" not in restore.event_fields() and restore.event_fields()["source"] == "disk"
    ahead = from_dict(WIRE[12])
    assert ahead.event_fields() == {"devices": 4, "executables": ["step"]}  # names, not the bytes
    assert CompileAhead(seconds=0.1, error="x").event_fields() == {"error": "x"}
    corrupt = from_dict(WIRE[5])
    assert corrupt.event_fields() == {"error": "bad crc"} and corrupt.event_seconds() == 0.0


CHECKPOINT_META_TODAY = {  # what remesh wrote with a checkpoint before CheckpointMeta
    "data_position": 20, "examples_seen": 480, "segment": 1, "program": "examples.gpt.model:program", "seed": 0,
    "program_fingerprint": "abc", "global_batch": 24, "steps": 100, "options": {}, "reports": [{"step": 19}],
    "digest": "sum32:1",
}  # fmt: skip
SNAPSHOT_META_TODAY = {"data_position": 13, "examples_seen": 312, "segment": 2, "step": 13, "reports": []}


@pytest.mark.parametrize("saved", [CHECKPOINT_META_TODAY, SNAPSHOT_META_TODAY], ids=["checkpoint", "snapshot"])
def test_metadata_written_before_the_dataclass_reads_back_and_writes_the_same_dict(saved):
    meta = CheckpointMeta.from_dict(saved, step=saved["data_position"], global_batch=24)
    assert meta.to_dict() == saved
    assert meta.reported() == {"segment": saved["segment"], "steps": saved["reports"]}


def test_metadata_that_remesh_did_not_write_resumes_the_data_at_the_step():
    meta = CheckpointMeta.from_dict({}, step=12, global_batch=24)  # a plain Orbax checkpoint
    assert (meta.data_position, meta.examples_seen, meta.step_records, meta.digest) == (12, 12 * 24, (), None)
    meta = CheckpointMeta.from_dict({"data_position": 12}, step=12, global_batch=8)
    assert meta.examples_seen == 96


def test_a_step_is_frozen_and_typed():
    step = from_dict(WIRE[7])
    assert isinstance(step, Step) and step.metrics == {"acc": 0.5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.loss = 0.0
    assert isinstance(from_dict(WIRE[3]), Restore)


def test_a_restore_hands_back_only_the_steps_the_controller_has_not_seen():
    kept = [{"step": s, "loss": 1.0 / s} for s in (11, 12, 13, 14)]
    restore = Restore(step=13, source="memory", reported={"segment": 0, "steps": kept})
    assert [r["step"] for r in restore.unreported(11)] == [12, 13]  # 14 is past the restored step
    assert Restore(step=5, source="disk").unreported(0) == []  # a checkpoint with no records
