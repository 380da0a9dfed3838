"""End to end on a real embedded Ray cluster: 4 emulated hosts x 2 fake CPU devices, real
jax.distributed groups (Gloo), real checkpoints on TensorStore, faults injected by killing Ray nodes.

Each scenario is one `remesh run` subprocess (the CLI users run), shared by the tests that read it.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.jobs import gpt_job
from tests.helpers.paths import ROOT
from tests.helpers.recovery import assert_at_most_the_snapshot_interval_recomputed, kinds


def run_job(tmp_path_factory, name, steps, chaos=None, *, max_hosts=4, keep=3, resume_from=None):
    """`resume_from`: (a checkpoint directory, a step) whose commit the run starts from."""
    d = tmp_path_factory.mktemp(name)
    if resume_from is not None:
        ckpt, step = resume_from
        shutil.copytree(os.path.join(ckpt, str(step)), d / "ckpt" / str(step))
    job = d / "job.toml"
    job.write_text(gpt_job(name, steps, max_hosts=max_hosts, checkpoint_dir="ckpt", keep=keep))
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "run",
        str(job),
        "--summary",
        str(d / "summary.json"),
        "--store",
        str(d / "fleet.db"),
    ]
    if chaos:
        cmd += ["--chaos", chaos]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"remesh run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    summary = json.loads((d / "summary.json").read_text())
    summary["_ckpt"] = str(d / "ckpt")
    summary["_store"] = str(d / "fleet.db")
    summary["_stdout"] = proc.stdout
    return summary


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    # Every commit kept: a clean run that starts from one of them is a fault's reference.
    return run_job(tmp_path_factory, "static", 100, keep=10)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    return run_job(tmp_path_factory, "elastic", 100, "lose@40,add@60")


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    return run_job(tmp_path_factory, "straggler", 40, "slow-step@20:2x3")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    # Probes come 10, 30, 70 s after the exclusion; the steps after heal@60 outlast the second.
    return run_job(tmp_path_factory, "probed", 400, "slow-step@20:2x3,heal@60")


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    return run_job(tmp_path_factory, "hung", 40, "hang@30:1")


@pytest.fixture(scope="module", params=["flip@25:3", pytest.param("flip@25:3x0", marks=pytest.mark.slow)],
                ids=["bit30", "bit0"])  # fmt: skip
def flipped(tmp_path_factory, request):
    # A high exponent bit of a float32 (30, the default), and its lowest mantissa bit.
    return run_job(tmp_path_factory, "flipped", 40, request.param)


@pytest.fixture(scope="module")
def flipped_clean(tmp_path_factory, flipped, static):
    """The flipped run without the flip: the static run's state at the step the repair went back
    to, trained on from there on the 3 hosts the repair left."""
    back_to = kinds(flipped, "restore")[-1]["step"]
    return run_job(tmp_path_factory, "flipped-clean", 40, max_hosts=3, resume_from=(static["_ckpt"], back_to))


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    return run_job(tmp_path_factory, "spiked", 40, "flip-grad@25:3")


@pytest.fixture(scope="module")
def bad_host(tmp_path_factory):
    return run_job(tmp_path_factory, "bad-host", 40, "flip-grad@25:3x0")


@pytest.fixture(scope="module")
def coordinator_lost(tmp_path_factory):
    return run_job(tmp_path_factory, "coordinator", 60, "lose@30:0")


@pytest.fixture(scope="module")
def lost_in_save(tmp_path_factory):
    return run_job(tmp_path_factory, "in-save", 60, "lose-in-save@50")


def assert_same_losses(run, static):
    got, want = np.array(run["losses"], float), np.array(static["losses"][: len(run["losses"])], float)
    assert len(got) == run["steps"] and not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-4)


def assert_restores_are_bitwise(run):
    """Restores from disk match the digest saved with the step; restores from peer snapshots in
    host memory are checked piece by piece (crc32), and a failed check would have fallen back."""
    restores = kinds(run, "restore")
    assert restores, "no restore happened"
    for e in restores:
        if e["source"] == "disk":
            assert e["saved_digest"] and e["digest"] == e["saved_digest"], e
        else:
            assert e["source"] == "memory" and e["bytes_needed"] > 0, e


def assert_recovered_with_parts_recorded(run, losses):
    # How fast is measured by benchmarks/recovery.py (BENCHMARKS.md), not here: a loaded 2-core
    # machine can miss any wall-clock bound. Here: every loss was detected, recovered from, and
    # each part of the recovery recorded.
    assert len(run["recovery_seconds"]) == losses
    assert all(r > 0 for r in run["recovery_seconds"]), run["recovery_seconds"]
    lost = kinds(run, "host_lost")
    assert len(lost) == losses and all(e["seconds"] > 0 for e in lost), lost  # detection latency measured
    after = [e["kind"] for e in run["events"] if e["at"] >= lost[0]["at"]]
    for part in ("replan", "group_start", "restore", "compile"):
        assert part in after, f"recovery part {part} was not recorded: {after}"


def test_static_run_learns(static):
    assert static["state"] == "finished" and static["steps_completed"] == 100
    assert [s["devices"] for s in static["segments"]] == [8]
    losses = static["losses"]
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10]), "loss did not clearly fall"


def test_elastic_run_matches_static_run_at_every_step(elastic, static):
    assert elastic["state"] == "finished" and elastic["steps_completed"] == 100
    assert [s["devices"] for s in elastic["segments"]] == [8, 6, 8]
    assert_same_losses(elastic, static)
    assert_restores_are_bitwise(elastic)
    assert_at_most_the_snapshot_interval_recomputed(elastic)
    first, second = kinds(elastic, "restore")
    assert elastic["segments"][1]["first_step"] == first["step"] + 1
    assert second["step"] == elastic["segments"][2]["first_step"] - 1 == elastic["segments"][1]["last_step"]


def test_host_loss_recovers_with_parts_recorded(elastic):
    assert_recovered_with_parts_recorded(elastic, losses=1)
    assert len(kinds(elastic, "host_added")) == 1
    grown_from = elastic["segments"][2]["first_step"] - 1
    # add@60 fires once step 60 is reported; if the new host is seen before the step-60 checkpoint
    # consensus the job grows at that very boundary, otherwise at a later one.
    assert grown_from % 10 == 0 and 60 <= grown_from < 100


def test_a_slow_host_is_named_and_the_job_goes_on_without_it_with_the_static_losses(straggler, static):
    assert straggler["state"] == "finished" and straggler["steps_completed"] == 40
    named = kinds(straggler, "straggler")
    assert len(named) == 1, named  # (a probe 10 s after, if the run lasts that long, fails: no event)
    (slow,) = named
    assert slow["host"] == 2 and slow["action"] == "excluded" and slow["hosts"] == 3, slow
    evidence = slow["evidence"]
    assert 20 < evidence["steps"][0] and evidence["steps"][-1] <= 25, evidence  # named within 5 steps of 20
    assert evidence["own_wait_seconds"] < evidence["others_wait_seconds"]  # the straggler waits least
    assert slow["without_seconds"] < slow["staying_seconds"]
    assert [s["hosts"] for s in straggler["segments"]] == [4, 3]
    assert straggler["segments"][1]["first_step"] == straggler["segments"][0]["last_step"] + 1
    assert_same_losses(straggler, static)
    assert_restores_are_bitwise(straggler)
    (restore,) = kinds(straggler, "restore")[-1:]
    assert restore["recomputed"] == 0 and restore["step"] >= restore["committed"]  # nothing lost
    assert "slow  after step" in straggler["_stdout"] and "resizing to 3 hosts now" in straggler["_stdout"]


@pytest.mark.slow
def test_a_slow_host_set_aside_is_probed_until_it_heals_and_then_taken_back(probed, static):
    assert probed["state"] == "finished" and probed["steps_completed"] == 400
    excluded, back = kinds(probed, "straggler")
    assert excluded["host"] == 2 and excluded["action"] == "excluded", excluded
    assert back["action"] == "taken back" and back["node"] == excluded["node"], back
    ratios = back["evidence"]["probe_ratios"]
    # Probed 10 s after, then at doubling waits: 3x slow until heal@60 (here the first probe
    # comes before it; a machine far faster would heal first), so failing the rule (over 1.25x;
    # 2.2x to 3.4x measured: the peer probed is busy training), then twice in a row within 1.25x.
    assert ratios[0] > 1.25 and all(r <= 1.25 for r in ratios[-2:]), back["evidence"]
    assert [s["hosts"] for s in probed["segments"]] == [4, 3, 4]
    assert probed["segments"][2]["first_step"] == probed["segments"][1]["last_step"] + 1
    np.testing.assert_allclose(probed["losses"][:100], static["losses"], rtol=1e-4)
    assert_restores_are_bitwise(probed)


@pytest.mark.slow
def test_a_hung_step_is_found_its_stacks_written_and_the_job_goes_on_without_the_host(hung, static):
    assert hung["state"] == "finished" and hung["steps_completed"] == 40
    (hang,) = kinds(hung, "hang")
    assert hang["host"] == 1 and hang["action"] == "excluded" and hang["step"] == 29, hang
    evidence = hang["evidence"]
    # Found once nothing was reported for max(5 x the median step, 5 s), and not much later.
    assert evidence["threshold_seconds"] <= evidence["waited_seconds"] < evidence["threshold_seconds"] + 2
    assert [loop["where"] for loop in evidence["loops"]] == ["dispatched", "dispatching", "dispatched", "dispatched"]
    stacks = [os.path.join(evidence["stacks"], f"host{i}.txt") for i in range(4)]
    assert all(os.path.getsize(p) > 0 for p in stacks)
    with open(stacks[1]) as f:
        assert "in dispatching" in f.read()  # the hung host's stack says where it hangs
    (lost,) = kinds(hung, "host_lost")
    assert lost["hosts"] == [1] and lost["slice_left"] == 0
    assert [s["hosts"] for s in hung["segments"]] == [4, 3]
    (restore,) = kinds(hung, "restore")[-1:]
    assert restore["source"] == "memory" and restore["step"] >= restore["committed"]  # nothing committed lost
    assert_at_most_the_snapshot_interval_recomputed(hung)
    assert_same_losses(hung, static)
    assert_restores_are_bitwise(hung)
    assert_recovered_with_parts_recorded(hung, losses=1)


def test_a_flipped_bit_in_one_copy_is_found_named_and_trained_past_from_the_last_agreeing_step(flipped, static):
    assert flipped["state"] == "finished" and flipped["steps_completed"] == 40
    (sdc,) = kinds(flipped, "corruption")
    assert sdc["host"] == 3 and sdc["action"] == "repaired and excluded", sdc
    evidence = sdc["evidence"]
    found_at = evidence["found_after_step"]
    every = evidence["every"]
    # Compared every `every` steps and at each checkpoint boundary (10): found at the first after 25.
    assert 25 < found_at <= min(30, 25 + every if every else 30), (found_at, every)
    assert all(d["processes"] == [3] and d["majority"] for d in evidence["disagreements"])
    assert evidence["clean_step"] <= 25  # back to a step whose copies agreed, before the flip
    (restore,) = kinds(flipped, "restore")[-1:]
    assert restore["step"] == evidence["clean_step"] and restore["step"] >= restore["committed"]
    assert [s["hosts"] for s in flipped["segments"]] == [4, 3]
    assert_restores_are_bitwise(flipped)


def test_a_flipped_bits_run_has_bitwise_the_losses_of_the_same_run_without_the_flip(flipped, flipped_clean, static):
    # Every step after the repair's step is computed again without host 3; a clean run that leaves
    # host 3 at that step computes each of them to the same bits (CPU reductions are deterministic
    # for one mesh; a 4-host mesh reduces in another order, so the static run is the reference
    # only up to that step).
    back_to = kinds(flipped, "restore")[-1]["step"]
    assert flipped_clean["segments"][0]["first_step"] == back_to + 1 and flipped_clean["segments"][0]["hosts"] == 3
    clean = static["losses"][:back_to] + flipped_clean["losses"][back_to:]
    assert flipped["losses"] == clean, [s + 1 for s, (a, b) in enumerate(zip(flipped["losses"], clean)) if a != b]


@pytest.mark.slow
def test_a_corrupted_local_gradient_is_caught_at_its_step_and_the_step_computed_again(spiked, static):
    assert spiked["state"] == "finished" and spiked["steps_completed"] == 40
    (sdc,) = kinds(spiked, "corruption")
    assert sdc["action"] == "recomputed" and sdc["evidence"]["step"] == 25, sdc  # caught at that step
    assert sdc["evidence"]["loss"] > sdc["evidence"]["before"] * (1 + sdc["evidence"]["allowed_rise"])
    (restore,) = kinds(spiked, "restore")[-1:]
    assert restore["step"] <= 24 and restore["step"] >= restore["committed"]  # from the state before it
    assert [s["hosts"] for s in spiked["segments"]] == [4, 4]  # on the same hosts
    assert_same_losses(spiked, static)  # the spike computed again: every step's loss the clean run's
    assert_restores_are_bitwise(spiked)


@pytest.mark.slow
def test_a_spike_that_follows_a_host_names_it_and_the_job_goes_on_without_it(bad_host, static):
    assert bad_host["state"] == "finished" and bad_host["steps_completed"] == 40
    sdc = kinds(bad_host, "corruption")
    actions = [e["action"] for e in sdc]
    # Computed again on the same hosts, then without each host in turn until the spike is gone.
    assert actions == ["recomputed", *["recomputed without a host"] * (len(sdc) - 2), "excluded"], actions
    left_out = [e["node"] for e in sdc if e["action"] == "recomputed without a host"]
    assert sdc[-1]["node"] == left_out[-1] and len(set(left_out)) == len(left_out)
    assert bad_host["segments"][-1]["hosts"] == 3
    assert_same_losses(bad_host, static)


# The coordinator's loss and a loss in a save are runs of their own, and the fault storm has
# both among its faults: they run in the slow tier, beside it.
@pytest.mark.slow
def test_losing_the_coordinator_recovers_like_any_host(coordinator_lost, static):
    assert coordinator_lost["state"] == "finished"
    assert kinds(coordinator_lost, "host_lost")[0]["hosts"] == [0]
    assert_at_most_the_snapshot_interval_recomputed(coordinator_lost)
    assert [s["devices"] for s in coordinator_lost["segments"]] == [8, 6]
    assert_same_losses(coordinator_lost, static)
    assert_restores_are_bitwise(coordinator_lost)
    assert_recovered_with_parts_recorded(coordinator_lost, losses=1)


@pytest.mark.slow
def test_loss_during_a_save_resumes_from_the_previous_committed_step(lost_in_save, static):
    assert lost_in_save["state"] == "finished"
    lost = kinds(lost_in_save, "host_lost")
    assert len(lost) == 1 and lost[0]["step"] == 50
    # 50 never committed, and the frozen host never took 50's snapshot: the group resumes from
    # the newest snapshot every host sent (49 on the demo), not from the disk's 40.
    assert_at_most_the_snapshot_interval_recomputed(lost_in_save)
    assert kinds(lost_in_save, "restore")[0]["step"] > 40
    assert_same_losses(lost_in_save, static)
    assert_restores_are_bitwise(lost_in_save)


@pytest.mark.parametrize(
    "scenario",
    [
        "elastic",
        pytest.param("coordinator_lost", marks=pytest.mark.slow),
        pytest.param("lost_in_save", marks=pytest.mark.slow),
    ],
)
def test_every_committed_checkpoint_survives_and_verifies(request, scenario):
    import jax

    from checkpoint import Store
    from examples.gpt.model import program
    from orchestrator.job.digest import compile_digest, digest

    run = request.getfixturevalue(scenario)
    abstract = jax.eval_shape(program.init, jax.random.key(0))
    digest_fn = compile_digest(abstract)
    store = Store(run["_ckpt"])
    steps = store.steps()
    assert steps == [run["steps"] - 20, run["steps"] - 10, run["steps"]]  # keep = 3
    for step in steps:
        state = store.restore(step, target=abstract)
        assert digest(digest_fn, state) == store.metadata(step)["meta"]["digest"]


def test_goodput_with_a_host_loss_adds_up_to_the_wall_time_with_each_part_measured(elastic):
    g, b = elastic["goodput"], elastic["goodput"]["badput_seconds"]
    assert g["useful_seconds"] + sum(b.values()) == pytest.approx(g["wall_seconds"], abs=1e-3)
    assert g["wall_seconds"] == pytest.approx(elastic["wall_seconds"], abs=0.5)
    assert g["goodput_ratio"] == pytest.approx(g["useful_seconds"] / g["wall_seconds"], abs=1e-3)
    total = lambda kind: sum(e["seconds"] for e in kinds(elastic, kind))
    # Each part is what the hosts and the controller measured for it (the ledger only clips overlaps).
    assert b["planning"] == pytest.approx(total("replan"), abs=0.05)
    assert b["compile"] == pytest.approx(total("compile"), abs=0.05)
    assert b["restore"] == pytest.approx(total("restore"), abs=0.05)
    assert b["checkpoint"] >= total("checkpoint") - 0.05  # plus the final flushes
    # Steps after the restored checkpoint (if any) ran twice: the second run is lost, and so is the
    # time the failure took to detect and the broken group to tear down.
    lost_after = kinds(elastic, "host_lost")[0]["step"]
    restored = kinds(elastic, "restore")[0]["step"]
    assert lost_after >= restored and b["lost"] > 0  # detection and tear-down at least
    assert b["startup"] > 0 and g["useful_seconds"] > 0
    t = elastic["throughput"]
    assert t["steps_measured"] == 100 + lost_after - restored
    assert t["model_flops_per_step"] > 0 and 0 < t["mfu"] < 1 and t["tokens_per_second"] > 0


def test_the_fleet_store_holds_the_run_as_its_summary_says(elastic):
    from orchestrator.dashboard.store import FleetStore

    store = FleetStore(elastic["_store"])
    job = store.job("elastic")
    run = job["run"]
    assert job["state"] == "finished" and job["steps_completed"] == 100 and job["devices"] == 8
    assert job["goodput"] == elastic["goodput"] and job["throughput"] == elastic["throughput"]
    assert [e["kind"] for e in store.events(run)] == [e["kind"] for e in elastic["events"]]
    steps = store.steps(run)
    assert {r["step"] for r in steps} == set(range(1, 101))
    # The segment a loss ended is the one whose last step is the step the loss was seen after.
    # A process that went down with the lost host (on CPU they abort) loses its last reports too.
    lost = {(e["step"], h) for e in kinds(elastic, "host_lost") for h in e["hosts"] + e["processes"]}
    assert lost
    for seg, info in enumerate(elastic["segments"], start=1):
        ran = sorted({r["step"] for r in steps if r["segment"] == seg})  # any host may be the one lost
        ended = {h for s, h in lost if s == info["last_step"]}
        for host in range(info["hosts"]):
            got = sorted(r["step"] for r in steps if r["segment"] == seg and r["host"] == host)
            if host in ended:
                # A killed host's last reports die with it: what it did report is a prefix.
                assert got and got == ran[: len(got)], (seg, host)
                lost.discard((info["last_step"], host))
            elif ended:
                # A survivor reported every step up to the loss; one more, in flight as the group
                # was stopped, may have reached the store from some hosts and not from others.
                assert got == ran[: len(got)] and got[-1] >= info["last_step"], (seg, host, got[-3:], ran[-3:])
            else:
                assert got == ran, (seg, host)
    assert not lost, f"host losses matched to no segment: {lost}"


def test_the_terminal_shows_remesh_lines_and_one_line_per_fault_while_ray_writes_to_its_log(elastic):
    out = elastic["_stdout"]
    assert "state-dump" not in out and "(raylet)" not in out and "Raylet is terminated" not in out
    lost = [line for line in out.splitlines() if line.startswith("lost  ")]
    # Killed once step 40 is reported; the group may finish a step more before the loss is seen.
    found = re.match(r"lost  host\(s\) \[3\] after step (\d+) ", lost[0]) if len(lost) == 1 else None
    assert found and int(found[1]) >= 40, lost
    log = out.splitlines()[0].split("Ray's own output goes to ")[1]
    assert os.path.getsize(os.path.join(ROOT, log)) > 0
