"""A TPU job on a shared `ray start` cluster whose hosts say their slices (127.0.0.1, token
authentication on; 2 slices of 2 hosts by the node label `remesh.io/slice`, as the KubeRay
manifests set it): `remesh run --address` takes the cluster's slices (the job file leaves their
size to the cluster), the fleet scheduler grants whole slices, and a host lost takes its slice:
the job goes on on the other one, gives the broken slice's survivor back, and finishes with at
most one step computed again."""

import json
import re
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.ray_start import RayStartCluster
from tests.helpers.recovery import assert_at_most_the_snapshot_interval_recomputed

pytestmark = pytest.mark.slow  # a 4-host cluster and a job on it: minutes on this machine's cores
DEADLINE_S = 600

JOB = """
name = "sliced"
program = "examples.gpt.model:program"
steps = 40
global_batch = 24
hardware = "tpu-v5p"
planner = "shapes"
[hosts]
min = 2
max = 4
devices_per_host = 2
[checkpoint]
dir = "ckpt"
every = 10
keep = 3
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sliced")
    cluster = RayStartCluster(str(d), workers=4, devices_per_host=2, slices=["a", "a", "b", "b"])
    try:
        (d / "job.toml").write_text(JOB)
        cmd = [sys.executable, "-m", "orchestrator.cli", "run", str(d / "job.toml"), "--address", f"127.0.0.1:{cluster.gcs_port}",
               "--summary", str(d / "summary.json"), "--no-store"]  # fmt: skip
        out = open(d / "out.log", "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + DEADLINE_S
        while not re.search(r"step\s+10/", (d / "out.log").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, (d / "out.log").read_text()[-4000:]
            time.sleep(0.2)
        cluster.stop_worker(3)  # a host of slice b
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        log = (d / "out.log").read_text()
        assert proc.returncode == 0, log[-4000:]
        yield json.loads((d / "summary.json").read_text()), log
    finally:
        cluster.shutdown()


def test_the_job_takes_the_cluster_slices_and_a_host_lost_takes_its_slice(run):
    summary, log = run
    assert "slices the cluster's hosts say: 2 of 2 hosts (a host lost takes its slice)" in log
    assert summary["state"] == "finished" and len(summary["losses"]) == 40
    assert [s["devices"] for s in summary["segments"]] == [8, 4], summary["segments"]
    lost = next(e for e in summary["events"] if e["kind"] == "host_lost")
    assert (lost["nodes_dead"], lost["slice_left"]) == (1, 1)  # its slice-mate left the group with it
    assert_at_most_the_snapshot_interval_recomputed(summary)
