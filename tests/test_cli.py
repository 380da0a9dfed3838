import pytest

from orchestrator.cli import main

pytestmark = pytest.mark.unit

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
    assert "mesh data=6 (6 of 7 devices)" in out and "does not divide by 7" in out and "all-reduce" in out


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
