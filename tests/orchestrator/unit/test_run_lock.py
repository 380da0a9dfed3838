"""One run per checkpoint directory: a second run is refused with who holds it, and a killed
run leaves nothing stuck."""

import os
import signal
import subprocess
import sys

import pytest

from orchestrator.job.lock import CheckpointInUseError, RunLock

HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from orchestrator.job.lock import RunLock
with RunLock({directory!r}, job="gpt", run="gpt-20261126-1"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_run_is_refused_until_the_first_is_killed(tmp_path):
    directory = str(tmp_path / "ckpt")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(root=root, directory=directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointInUseError) as e:
            with RunLock(directory, job="gpt"):
                pass
        message = str(e.value)
        assert f"checkpoint directory {directory} is in use by another run of job 'gpt'" in message
        assert f"run gpt-20261126-1, pid {holder.pid} on" in message
        assert "give this run another checkpoint.dir" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(directory, job="gpt", run="again"):  # the kernel let go of the killed run's lock
        with pytest.raises(CheckpointInUseError, match="run again"):
            with RunLock(directory, job="gpt"):
                pass
    with RunLock(directory, job="gpt"):  # and of a run that ended
        pass
