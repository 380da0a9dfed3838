"""Recovery by the unit that fails, end to end on the embedded cluster: 3 slices x 2 hosts x 2
fake CPU devices, global batch 24. With the tpu-v5p profile one host lost drops its slice (12 ->
8 devices) and the slice is added back when its host returns (8 -> 12), training the losses of a
static run of the same job; a whole slice lost at once (`lose-slice`) recovers from the peer
snapshots its hosts kept in other slices. (With a GPU profile the same loss removes one host only: the
controller's test, `test_a_lost_host_takes_its_slice_...`, and BENCHMARKS.md for a run of it.)

The job plans by shapes (data parallel over every device the batch divides): the searched plan
prices this toy model's gradients over the tpu-v5p data-center network dearer than the compute
that a third slice saves, and runs on two slices of three; which slices a group runs on is what
is tested here."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.paths import ROOT
from tests.helpers.recovery import assert_at_most_the_snapshot_interval_recomputed

pytestmark = pytest.mark.slow  # a 6-host cluster and a 2-host one on this machine's cores: minutes

JOB = """
name = "{name}"
program = "examples.gpt.model:program"
steps = 40
global_batch = 24
hardware = "{hardware}"
planner = "shapes"
[hosts]
min = 2
max = {hosts}
devices_per_host = 2
hosts_per_slice = {per}
[checkpoint]
dir = "ckpt"
every = 10
keep = 3
snapshot_every = {snapshot_every}
"""


def run(tmp_path_factory, name, hardware, chaos=None, hosts=6, per=2, snapshot_every=0):
    d = tmp_path_factory.mktemp(name)
    job = JOB.format(name=name, hardware=hardware, hosts=hosts, per=per, snapshot_every=snapshot_every)
    (d / "job.toml").write_text(job)
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", str(d / "job.toml"), "--summary", str(d / "summary.json"),
           "--no-store"] + (["--chaos", chaos] if chaos else [])  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"remesh run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = json.loads((d / "summary.json").read_text())
    out["_stdout"] = proc.stdout
    return out


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    # The same job alone and static, on one slice of 2 hosts: data parallel computes the same
    # losses on any number of devices (to float rounding), at a third of the cost of 6 hosts.
    return run(tmp_path_factory, "static", "tpu-v5p", hosts=2, per=2)


@pytest.fixture(scope="module")
def tpu(tmp_path_factory):
    return run(tmp_path_factory, "tpu", "tpu-v5p", "lose@15:2,add@25")


@pytest.fixture(scope="module")
def slice_lost(tmp_path_factory):
    # A snapshot every step, whatever the copies cost: a loaded machine would otherwise stretch the
    # interval past the 5 steps between the commit at 10 and the loss at 15, and restore the commit.
    return run(tmp_path_factory, "slice", "tpu-v5p", "lose-slice@15:1", snapshot_every=1)


def same_losses(run, static):
    got, want = np.array(run["losses"], float), np.array(static["losses"], float)
    assert len(got) == len(want) == run["steps"] and not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_on_tpu_a_lost_host_drops_its_slice_and_the_slice_comes_back_whole(tpu, static):
    assert tpu["state"] == "finished", tpu["_stdout"][-3000:]
    assert [s["devices"] for s in tpu["segments"]] == [12, 8, 12], tpu["segments"]
    assert [e["devices"] for e in tpu["events"] if e["kind"] == "replan"] == [12, 8, 12]
    lost = next(e for e in tpu["events"] if e["kind"] == "host_lost")
    assert lost["nodes_dead"] == 1 and lost["slice_left"] == 1  # its slice's other host left with it
    assert_at_most_the_snapshot_interval_recomputed(tpu)
    same_losses(tpu, static)


def test_a_slice_lost_whole_recovers_from_snapshots_kept_in_the_other_slices(slice_lost, static):
    assert slice_lost["state"] == "finished", slice_lost["_stdout"][-3000:]
    assert [s["devices"] for s in slice_lost["segments"]] == [12, 8], slice_lost["segments"]
    kills = [line for line in slice_lost["_stdout"].splitlines() if "chaos lose-slice@15:1: killing host" in line]
    assert len(kills) == 2, kills  # both hosts of slice 1, at once
    lost = next(e for e in slice_lost["events"] if e["kind"] == "host_lost")
    # Both leave the group at the loss: dead, or (the second's death not yet seen when the first's
    # is) as the survivor of a broken slice.
    assert lost["nodes_dead"] + lost["slice_left"] == 2, lost
    restore = next(e for e in slice_lost["events"] if e["kind"] == "restore")
    assert restore["source"] == "memory", restore  # every share was also kept outside the lost slice
    assert_at_most_the_snapshot_interval_recomputed(slice_lost)
    (parts,) = slice_lost["loss_badput"]  # the recovery's time by part, as for a host loss
    assert parts["total"] > 0 and {"compile", "restore", "lost", "startup", "planning"} <= set(parts)
    same_losses(slice_lost, static)
