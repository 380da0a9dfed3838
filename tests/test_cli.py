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


@pytest.mark.parametrize("program, steps, chaos, message", [
    ("examples.gpt.model:progrm", "10", None, "has no attribute 'progrm'"),
    ("examples.gpt.model:program", '"10"', None, "key steps must be int, got str '10'"),
    ("examples.gpt.model:program", "10", "boom@3", "bad fault 'boom@3'"),
    ("examples.gpt.model:program", "10", "lose@3 --address 127.0.0.1:1", "needs the embedded cluster"),
])
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
