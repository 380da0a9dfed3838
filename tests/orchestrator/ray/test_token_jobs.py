"""A job on token files through `remesh run` on a real embedded Ray cluster: stopped on 4 hosts,
resumed on 3, it goes on with the examples it would have seen on 4."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.jobs import gpt_job
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # two runs of a minute each


def remesh_run(folder, steps, hosts, tokens):
    job = folder / "job.toml"
    options = f'train_tokens = ["{tokens}"]'
    job.write_text(
        gpt_job(
            "tokens",
            steps,
            max_hosts=4,
            checkpoint_dir="ckpt",
            program="tests.programs.token_gpt:make",
            options=options,
        )
    )
    summary = folder / f"summary-{steps}.json"
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", str(job), "--hosts", str(hosts), "--summary", str(summary)]
    cmd += ["--no-store"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"remesh run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(summary.read_text())


def test_a_run_stopped_on_4_hosts_resumes_on_3_with_the_same_sample_order(tmp_path, devices8):
    from examples.gpt.model import write_tokens
    from orchestrator.worker import run_segment
    from tests.helpers.segments import collect, spec

    tokens = str(tmp_path / "train.bin")
    write_tokens(tokens, 40_000)
    first = remesh_run(tmp_path, 20, 4, tokens)
    assert [s["hosts"] for s in first["segments"]] == [4] and first["steps_completed"] == 20
    second = remesh_run(tmp_path, 30, 3, tokens)
    assert [(s["hosts"], s["devices"]) for s in second["segments"]] == [(3, 6)]
    assert [e["step"] for e in second["events"] if e["kind"] == "restore"] == [20]
    meta = json.loads((tmp_path / "ckpt" / "30" / "remesh.json").read_text())
    assert meta["meta"]["examples_seen"] == 30 * 24
    # The reference: one run of 30 steps on 8 devices in this process, from the same factory.
    reference = []
    job = spec(
        tmp_path / "reference", 8, 30, program_ref="tests.programs.token_gpt:make", options={"train_tokens": [tokens]}
    )
    run_segment(job, collect(reference))
    want = np.array([r["loss"] for r in reference if r["kind"] == "step"])
    np.testing.assert_allclose(first["losses"], want[:20], rtol=1e-4)
    np.testing.assert_allclose(second["losses"][20:], want[20:], rtol=1e-4)
