"""A pipelined job resized end to end: the scanned demo GPT with `pipeline = 4` on 4 emulated
hosts x 2 fake CPU devices loses a host and gets it back. Each segment re-plans its stage count
(4 stages on 8 devices, 2 on 6: 4 does not divide 6) and restores the logical checkpoint onto it;
the losses are the static run's."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.jobs import gpt_job
from tests.helpers.paths import ROOT
from tests.helpers.recovery import kinds

pytestmark = pytest.mark.slow


def run_job(tmp_path_factory, name: str, chaos: str | None = None) -> dict:
    d = tmp_path_factory.mktemp(name)
    job = d / "job.toml"
    job.write_text(gpt_job(name, 60, max_hosts=4, checkpoint_dir="ckpt", program="examples.gpt.model:scanned_program",
                           pipeline=4, options="layers = 4"))  # fmt: skip
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", str(job), "--summary", str(d / "summary.json"),
           "--store", str(d / "fleet.db")] + (["--chaos", chaos] if chaos else [])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"remesh run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads((d / "summary.json").read_text())
    summary["_stdout"] = proc.stdout
    return summary


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    return run_job(tmp_path_factory, "static")


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    return run_job(tmp_path_factory, "elastic", "lose@20,add@40")


def test_every_segment_is_pipelined_on_the_hosts_it_has(elastic):
    segments = elastic["segments"]
    assert [s["hosts"] for s in segments] == [4, 3, 4]
    assert all("stage" in s["mesh"] for s in segments), segments
    assert [s["mesh"]["stage"] for s in segments] == [4, 2, 4]
    assert "pipeline=4 does not fit 4 layers on 6 devices: 2 stages, the nearest that does" in elastic["_stdout"]
    assert "pipeline 4 stages" in elastic["_stdout"] and "mesh stage=4" in elastic["_stdout"]


def test_losses_are_the_static_runs(elastic, static):
    assert all("stage" in s["mesh"] for s in static["segments"])
    got, want = np.array(elastic["losses"], float), np.array(static["losses"], float)
    assert len(got) == len(want) == 60 and not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_each_stage_count_restores_the_stacks_bitwise(elastic):
    # 4 stages onto 2 (a host lost), 2 onto 4 (a host back): each restore is of the logical
    # [layers, ...] arrays, checked against the digest saved with the step, or piece by piece
    # (crc32) from a peer snapshot.
    restores = kinds(elastic, "restore")
    assert len(restores) == 2, restores
    for e in restores:
        if e["source"] == "disk":
            assert e["saved_digest"] and e["digest"] == e["saved_digest"], e
        else:
            assert e["source"] == "memory" and e["bytes_needed"] > 0, e
