"""`remesh run` over a job's lifetime, as a user drives it: a re-run of a finished job ends at once,
and SIGTERM or Ctrl-C sent to the run's process group (as `timeout`, a terminal or a shell does),
or a preemption notice file, commits the step reached, stops the hosts and the embedded cluster,
and writes the summary; a re-run resumes from that step."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from helpers.jobs import gpt_job

from checkpoint import Store

pytestmark = pytest.mark.ray


def _command(d, steps):
    job = d / "job.toml"
    job.write_text(gpt_job(d.name, steps, max_hosts=2, checkpoint_dir="ckpt"))
    return [sys.executable, "-m", "orchestrator.cli", "run", str(job), "--summary", str(d / "summary.json"),
            "--store", str(d / "fleet.db")]  # fmt: skip


def _env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def test_a_rerun_of_a_finished_job_reports_it_complete_and_starts_nothing(tmp_path):
    cmd = _command(tmp_path, 10)
    first = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["steps_completed"] == 10
    assert "already complete: step 10 of 10" in summary["reason"]
    assert summary["segments"] == [] and "start embedded Ray cluster" not in again.stdout


def _stop_mid_run(tmp_path, stop, extra=()):
    """Start a long run, wait for its step 10, `stop(proc)`, and wait for it to end."""
    out = open(tmp_path / "stdout.txt", "w")
    proc = subprocess.Popen([*_command(tmp_path, 10_000), *extra], cwd=ROOT, env=_env(), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a guard against a hang, not a measure of speed
        while "step     10/" not in (tmp_path / "stdout.txt").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stdout.txt").read_text()[-3000:]
            time.sleep(0.5)
        stop(proc)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out.close()
    text = (tmp_path / "stdout.txt").read_text()
    return json.loads((tmp_path / "summary.json").read_text()), text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_commits_the_step_reached_and_ends_the_run(tmp_path, sig):
    summary, text = _stop_mid_run(tmp_path, lambda proc: os.killpg(proc.pid, sig))
    assert summary["state"] == "stopped" and summary["reason"].startswith(f"stopped by signal {sig.name}"), text[-3000:]
    assert Store(tmp_path / "ckpt").steps()[-1] == summary["steps_completed"] >= 10
    assert "state-dump" not in text and "Ray's own output goes to" in text


def test_a_preemption_notice_file_stops_the_run_and_a_rerun_resumes_from_the_step_reached(tmp_path):
    notice = tmp_path / "preempted"
    summary, text = _stop_mid_run(tmp_path, lambda proc: notice.touch(), extra=["--stop-file", str(notice)])
    assert summary["state"] == "stopped" and summary["reason"] == f"preemption notice: {notice} appeared", text[-3000:]
    reached = summary["steps_completed"]
    assert Store(tmp_path / "ckpt").steps()[-1] == reached >= 10
    assert not notice.exists()  # consumed: the re-run trains on
    cmd = _command(tmp_path, reached + 3)  # the same job, to a nearer last step
    again = subprocess.run([*cmd, "--stop-file", str(notice)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = json.loads((tmp_path / "summary.json").read_text())
    restore = next(e for e in resumed["events"] if e["kind"] == "restore")
    assert restore["step"] == reached and restore["source"] == "disk"
    assert resumed["state"] == "finished" and resumed["segments"][0]["first_step"] == reached + 1
