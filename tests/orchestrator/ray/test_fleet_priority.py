"""Two teams' jobs on one `ray start` cluster of 4 hosts (127.0.0.1, token authentication on): a
low-priority job (min 1, max 4) trains on all 4 hosts; a high-priority one (min 2, max 2) is
submitted. The low one shrinks to 2 at its next step boundary and goes on, the high one starts on
the 2 hosts given back; when it finishes, the low one grows back to 4 (and is stopped ten steps
later, with `remesh stop`). Both train the losses of a static run of the same job, each shrink
computes at most one step again, and no host ever runs two jobs' host actors at once (Ray's
actor table, watched throughout)."""

import json
import subprocess
import sys
import time

import pytest

from tests.helpers.jobs import gpt_job
from tests.helpers.paths import ROOT
from tests.helpers.ray_start import RayStartCluster

pytestmark = pytest.mark.slow  # two jobs on a shared cluster, then each again alone: minutes
DEADLINE_S = 900  # the whole scenario, bounded


def cli(cluster, *args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=cluster.env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def status(cluster, sid, store):
    return json.loads(cli(cluster, "status", sid, "--address", cluster.address, "--store", store, "--json"))[0]


# name -> steps, priority, min hosts, max hosts. The low job is long enough that growing back
# pays for the resize when the high one ends (a running job grows only where the steps left save
# more than a group's start costs: `JobController._grows`).
JOBS = {"low": (400, 0, 1, 4), "high": (30, 5, 2, 2)}


def job_file(path, name, steps=None):
    """`name`'s job file at `path`, to `steps` (default: the job's)."""
    total, priority, min_hosts, max_hosts = JOBS[name]
    path.write_text(gpt_job(name, steps or total, max_hosts=max_hosts, min_hosts=min_hosts, priority=priority,
                            checkpoint_dir=f"ckpt-{name}"))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp("priority")
    cluster = RayStartCluster(str(d), workers=4, devices_per_host=2)
    store, out = str(d / "fleet.db"), {"dir": d, "observed": []}
    watch = cluster.watch_host_actors(str(d / "actors.jsonl"))
    try:
        low, high = job_file(d / "low.toml", "low"), job_file(d / "high.toml", "high")
        submit = lambda path: cli(cluster, "submit", str(path), "--address", cluster.address, "--store", store,  # noqa: E731
                                  "--summary", str(d / f"{path.stem}.json")).strip().splitlines()[-1]  # fmt: skip
        out["low"] = submit(low)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            s = status(cluster, out["low"], store)["remesh"]
            if s.get("hosts") == 4 and s.get("steps_completed", 0) >= 15:
                break
            time.sleep(1.0)
        out["high"] = submit(high)
        while time.monotonic() < deadline:
            both = {k: status(cluster, out[k], store) for k in ("low", "high")}
            seen = {k: (v["ray_status"], v["remesh"].get("hosts"), v["remesh"].get("reason")) for k, v in both.items()}
            out["observed"].append(seen)
            if "queue" not in out and seen["low"][1] == 2 and seen["high"][1] == 2:
                out["queue"] = json.loads(cli(cluster, "queue", "--address", cluster.address, "--json"))
            if all(v["ray_status"] in ("SUCCEEDED", "FAILED", "STOPPED") for v in both.values()):
                break
            if both["high"]["ray_status"] in ("SUCCEEDED", "FAILED") and seen["low"][1] == 4 and "stop" not in out:
                # Grown back: ten steps on 4 hosts, then the rest is not this test's (a stop keeps
                # the step reached, and the static run below goes as far).
                done = both["low"]["remesh"].get("steps_completed", 0)
                regrown = out.setdefault("regrown", done)
                if done >= regrown + 10:
                    out["stop"] = cli(cluster, "stop", out["low"], "--address", cluster.address)
            time.sleep(1.0)
        out["logs"] = {k: cli(cluster, "logs", out[k], "--address", cluster.address) for k in ("low", "high")}
    finally:
        watch.kill()
        cluster.shutdown()
    for name in ("low", "high"):
        out[name + "_summary"] = json.loads((d / f"{name}.json").read_text())
        # The same job alone and static: an embedded cluster of its fewest hosts (the losses do not
        # depend on the mesh, to float rounding; one process steps fastest on this machine's
        # cores), a fresh checkpoint directory.
        ref, fewest = d / f"{name}-static.json", str(JOBS[name][2])
        reached = out[name + "_summary"]["steps_completed"]
        static = job_file(d / f"{name}-static.toml", name, reached)  # as far as the run went
        subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", str(static), "--checkpoint-dir",
                        str(d / f"ckpt-{name}-static"), "--summary", str(ref), "--no-store", "--hosts", fewest],
                       cwd=ROOT, check=True, capture_output=True, timeout=DEADLINE_S)  # fmt: skip
        out[name + "_static"] = json.loads(ref.read_text())
    out["actors"] = [json.loads(line) for line in (d / "actors.jsonl").read_text().splitlines() if line.strip()]
    return out


def test_the_low_job_shrinks_for_the_high_one_and_grows_back(shared):
    low, high = shared["low_summary"], shared["high_summary"]
    assert low["state"] == "stopped" and high["state"] == "finished", shared["logs"]
    hosts = [seg["hosts"] for seg in low["segments"]]
    assert hosts[0] == 4 and 2 in hosts and hosts[-1] == 4, hosts
    assert low["segments"][-1]["last_step"] >= low["segments"][-1]["first_step"] + 9  # stepped on 4 again
    kinds = [e["kind"] for e in low["events"]]
    assert "shrink" in kinds and "grow" in kinds
    shrink = next(e for e in low["events"] if e["kind"] == "shrink")
    assert shrink["reason"] == "shrunk to 2 of 4 hosts for a job of higher priority"
    assert [seg["hosts"] for seg in high["segments"]] == [2]
    # The high job trained while the low one ran on the other two hosts.
    seen = [o for o in shared["observed"] if o["high"][1] == 2 and o["low"][1] == 2]
    assert seen, shared["observed"]
    said = {o["low"][2] for o in seen}  # what `remesh status` said of the low job meanwhile
    assert "2 of at most 4 hosts: the other 2 are held or kept for waiting jobs" in said, said
    assert len(low["recomputed_steps"]) >= 1  # the shrink's restore is counted
    queue = {r["job"]: (r["state"], r["hosts"], r["priority"]) for r in shared["queue"]}  # `remesh queue` meanwhile
    assert queue == {"high": ("running", 2, 5), "low": ("running", 2, 0)}


def test_each_shrink_computes_at_most_one_step_again_and_losses_equal_a_static_run(shared):
    for name in ("low", "high"):
        run, static = shared[name + "_summary"], shared[name + "_static"]
        assert all(n <= 1 for n in run["recomputed_steps"]), run["recomputed_steps"]
        assert len(run["losses"]) == len(static["losses"]) == run["steps_completed"]
        worst = max(abs(a - b) for a, b in zip(run["losses"], static["losses"]))
        assert worst <= 1e-4, (name, worst)


def test_no_host_ever_runs_two_jobs_host_actors_at_once(shared):
    assert len(shared["actors"]) > 20  # watched throughout
    for sample in shared["actors"]:
        jobs_on = {}
        for node, job in sample:
            jobs_on.setdefault(node, set()).add(job)
        assert all(len(jobs) == 1 for jobs in jobs_on.values()), sample
    both = [s for s in shared["actors"] if len({job for _, job in s}) == 2]
    assert both  # the two jobs did run side by side
