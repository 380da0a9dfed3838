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

from checkpoint import Store
from orchestrator.dashboard.store import FleetStore
from tests.helpers.jobs import gpt_job
from tests.helpers.paths import ROOT


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


def test_a_run_killed_before_it_stored_its_last_steps_gets_them_back_from_its_checkpoint(tmp_path):
    """SIGKILL to the whole run once step 20 is committed, and the killed run's rows past step 14
    taken out of the store, as a controller killed between two flushes of it leaves them: the
    re-run resumes from the newest commit and stores host 0's rows up to it from the reports that
    checkpoint kept, with the losses the killed run had."""
    ckpt = tmp_path / "ckpt"

    def kill_once_committed(proc):
        deadline = time.monotonic() + 300  # a guard against a hang, not a measure of speed
        while not (ckpt.exists() and any(s >= 20 for s in Store(ckpt).steps())):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from fault_storm import kill_orphans, ray_sessions

    sessions = ray_sessions()
    with pytest.raises(FileNotFoundError):  # no summary: the run was killed
        _stop_mid_run(tmp_path, kill_once_committed)
    kill_orphans(sessions)  # a killed driver leaves its embedded cluster's daemons behind
    committed = Store(ckpt).steps()[-1]
    db = FleetStore(str(tmp_path / "fleet.db"))
    killed = db.job(tmp_path.name)["run"]
    lost = {r["step"]: r["loss"] for r in db.steps(killed) if r["step"] > 14 and r["host"] == 0}
    with db._db:
        db._db.execute("DELETE FROM steps WHERE run = ? AND step > 14", (killed,))
    db.close()
    again = subprocess.run(_command(tmp_path, committed + 2), cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    db = FleetStore(str(tmp_path / "fleet.db"))
    back = {r["step"]: r["loss"] for r in db.steps(killed) if r["step"] > 14}
    resumed = db.job(tmp_path.name)["run"]
    assert sorted(back) == list(range(15, committed + 1))
    assert all(back[s] == loss for s, loss in lost.items() if s <= committed)
    assert min(r["step"] for r in db.steps(resumed)) == committed + 1
