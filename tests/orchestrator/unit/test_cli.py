import pytest

from orchestrator.cli.main import main

JOB = """
name = "x"
program = "{program}"
steps = {steps}
global_batch = 24
[hosts]
min = 1
max = 2
devices_per_host = 2
[checkpoint]
dir = "ck"
every = 5
"""


@pytest.mark.parametrize(
    "program, steps, chaos, message",
    [
        ("examples.gpt.model:progrm", "10", None, "has no attribute 'progrm'"),
        ("examples.gpt.model:program", '"10"', None, "key steps must be int, got str '10'"),
        ("examples.gpt.model:program", "10", "boom@3", "bad fault 'boom@3'"),
        ("examples.gpt.model:program", "10", "lose@3 --address 127.0.0.1:1", "needs the embedded cluster"),
    ],
)
def test_bad_input_fails_before_any_cluster_starts_with_a_clear_error(tmp_path, capsys, program, steps, chaos, message):
    job = tmp_path / "job.toml"
    job.write_text(JOB.format(program=program, steps=steps))
    argv = ["run", str(job)] + (["--chaos", *chaos.split()] if chaos else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("remesh run: error: ") and message in err


def test_plan_command_explains_its_choice(capsys):
    assert main(["plan", "examples.gpt.model:plan_target", "--devices", "7", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "mesh data=6 (6 of 7 devices)" in out and "all-reduce" in out
    assert (
        "note: using 6 of 7 devices: on all 7, data can be at most 1 (the batch is 24) and no weight or sequence "
        "splits the remaining 7 evenly" in out
    )


def test_plan_command_on_slices_says_what_crosses_the_slow_link(capsys):
    argv = ["plan", "examples.gpt.model:plan_target", "--devices", "8", "--slices", "2", "--hardware", "tpu-v5p"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "in 2 slices)" in out and "note: across slices (6.25 GB/s per device, 14x slower than within one)" in out
    assert "over host links:" in out


def test_plan_command_pipelines_a_scanned_step_when_asked(capsys):
    argv = ["plan", "tests.corpus.llama_scan:small", "--devices", "8", "--slices", "4", "--hardware", "tpu-v5e"]
    assert main([*argv, "--pipeline", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh stage=4 x " in out and "pipeline 4 stages" in out and "without a pipeline:" in out
    assert main([*argv, "--pipeline", "off"]) == 0
    assert "stage" not in capsys.readouterr().out.split("\n")[0]
    with pytest.raises(SystemExit):
        main([*argv, "--pipeline", "1"])


def test_plan_notes_say_in_one_line_why_devices_go_unused_however_many_there_are(capsys):
    assert main(["plan", "examples.gpt.model:plan_target", "--devices", "1024", "--hardware", "h100"]) == 0
    (reason,) = [line for line in capsys.readouterr().out.splitlines() if "note: using" in line]
    # The batch of 24 fills 24; meshes on all 1,024 put the rest over seq and model, and lose.
    assert reason.strip().startswith("note: using 24 of 1024 devices: the best plan on all 1024 (")
    assert "is predicted slower" in reason


def test_plan_from_a_job_file_prices_with_the_jobs_hardware_and_names_leaves_as_checkpoints_do(capsys):
    import json

    import partitioner
    from checkpoint import leaf_path
    from examples.gpt.model import plan_target

    assert main(["plan", "examples/gpt/job.toml", "--devices", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fn, args = plan_target()
    want = partitioner.plan(fn, *args, devices=8, hardware="cpu")  # the job says hardware = "cpu"
    assert doc["cost"] == want.to_dict()["cost"] and doc["mesh"] == want.to_dict()["mesh"]
    import jax

    paths = {leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]}
    assert set(doc["in_specs"][0]) == paths and "opt/0/mu/wte" in paths


def test_the_thorough_level_prints_no_solver_banner(capfd):
    assert main(["plan", "examples.gpt.model:plan_target", "--devices", "8", "--level", "thorough", "--json"]) == 0
    out = capfd.readouterr().out
    json_start = out.index("{")
    assert out[:json_start].strip() == "" and "HiGHS" not in out


def test_plan_with_tactics_recovers_megatron_and_verifies_it(capsys, devices8):
    assert main(["plan", "examples.gpt.model:plan_target_large", "--devices", "8", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "note: chosen: megatron" in out and "note: runner-up: " in out
    assert "compiled by XLA:" in out and "all-reduce bytes" in out


def test_ckpt_ls_inspect_verify(tmp_path, capsys, devices8):
    import json

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from checkpoint import Store

    mesh = Mesh(np.array(devices8), ("data",))
    state = {
        "w": jax.device_put(np.arange(96 * 24, dtype=np.float32).reshape(96, 24), NamedSharding(mesh, P("data"))),
        "b": np.zeros(5, np.float32),
    }
    store = Store(tmp_path)
    for step in (10, 20):
        store.save(step, state, meta={"data_position": step})
    store.wait()
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["10", "remesh"] and "data=8" in lines[2]
    assert main(["ckpt", "inspect", str(tmp_path), "--devices", "6", "--devices-per-host", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 20 and doc["restore"]["hosts"] == 3
    w = next(leaf for leaf in doc["restore"]["leaves"] if leaf["path"] == "w")
    assert w["spec"] == ["x", None] and w["bytes_needed"] == 96 * 24 * 4 // 3  # rows of 2 of 6 devices
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    victim = next(p for p in (tmp_path / "20").rglob("*") if p.is_file() and "/c/" in str(p))
    victim.write_bytes(
        b"\0" + victim.read_bytes()[1:] if victim.read_bytes()[:1] != b"\0" else b"\1" + victim.read_bytes()[1:]
    )
    assert main(["ckpt", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step       10  ok" in out and "step       20  DAMAGED" in out and "leaf w" in out
    assert main(["ckpt", "ls", str(tmp_path / "nothing")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    assert main(["ckpt", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["format"], r["saved_under"], r["data_position"]) for r in rows] == [
        (10, "remesh", "data=8", 10),
        (20, "remesh", "data=8", 20),
    ]
    assert main(["ckpt", "verify", str(tmp_path), "--json"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["ok"]) for r in reports] == [(10, True), (20, False)]
    assert any("leaf w" in p for p in reports[1]["problems"])


def test_a_submitted_run_gets_the_grace_a_stop_promises_before_ray_kills_it():
    # Ray's job stop sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by default):
    # a loaded cluster's run was killed before it committed the step reached.
    from orchestrator.cli.submit import submission_env
    from orchestrator.control.controller import ControllerConfig

    env = submission_env("job-1")
    assert env["REMESH_RUN_ID"] == "job-1"
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) > ControllerConfig().stop_grace_s
