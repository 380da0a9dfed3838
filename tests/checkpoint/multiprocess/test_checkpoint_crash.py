"""Crash safety: a process saving checkpoints back to back is killed with SIGKILL at random
moments (in the host copy, the background write, the commit, or retention), 50 times; every time,
the newest committed step restores bitwise and verifies, and no committed step newer than the
one before the kill is lost."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from checkpoint import Store
from tests.helpers.ckpt_process import expected_state
from tests.helpers.paths import ROOT

TRIALS = 50


def start_saver(path, step: int) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.ckpt_process", "loop", "0", "1", "0", str(path), "fsdp", str(step)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_at_random_points_never_loses_the_latest_committed_step(tmp_path):
    rng = np.random.default_rng(1234)
    latest_before, kills_with_saves_in_flight, seen = -1, 0, set()
    for trial in range(TRIALS):
        proc = start_saver(tmp_path, latest_before + 1)
        first = proc.stdout.readline()  # the first save has begun
        assert first, f"trial {trial}: the saver died before saving:\n{proc.stderr.read()[-2000:]}"
        time.sleep(float(rng.uniform(0.0, 0.25)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        store = Store(tmp_path)
        steps = store.steps()
        if steps:
            latest = steps[-1]
            assert latest >= latest_before, (
                f"trial {trial}: step {latest_before} was committed, now the newest is {latest}"
            )
            partials = {n for n in os.listdir(tmp_path) if ".partial" in n}
            kills_with_saves_in_flight += bool(partials - seen)
            seen |= partials
            want = expected_state(latest)
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), want)
            got = store.restore(latest, target=target)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), (
                    f"trial {trial}: step {latest} restored wrong bytes"
                )
            report = store.verify(latest)
            assert report.ok, f"trial {trial}: {report.problems}"
            latest_before = latest
    print(f"{TRIALS} kills, {kills_with_saves_in_flight} during a save's write, newest step {latest_before}")
    assert latest_before > 0, "no save ever committed: the kills came too early to test anything"
    assert kills_with_saves_in_flight >= TRIALS // 5, f"only {kills_with_saves_in_flight} kills hit a save in flight"
