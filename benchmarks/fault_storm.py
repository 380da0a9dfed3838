"""The fault storm: the demo's GPT trained through at least 30 seeded random faults, checked
against a fault-free run of the same job.

    .venv/bin/python benchmarks/fault_storm.py --seed 0 --faults 30            # a report (JSON) at the end
    .venv/bin/python benchmarks/fault_storm.py --seed 0 --faults 30 --plan     # the faults only, no run

Faults (`plan_storm`, from the seed alone, so a failure replays with the same faults at the same
steps; when each lands within its step still depends on timing):
- in the controller's hands (`--chaos`, orchestrator/chaos/): one host killed; two at once (host 0
  among them half the time); a host killed while its group saves, starts (before joining
  jax.distributed), compiles or restores; a host added while a recovery's group starts; a host's
  process frozen with SIGSTOP (found by the poll timeout, not by Ray); and those the health loop
  finds while every host answers: a host three times slower (`slow-step`), a step that hangs
  (`hang`), a bit flipped in one copy of the state (`flip`), a host's rows of a batch corrupted
  (`flip-grad`: a loss spike, the step computed again);
- in the storm's: the checkpoint disk filled until a save fails, then freed (a tmpfs of its own
  mounted on the checkpoint directory; skipped, and said so, where this process may not mount);
  the controller killed (SIGKILL, as a Ray job's driver dies) and the job run again, once with
  the newest committed checkpoint corrupted in between.

The job runs as `remesh run` legs, one per controller lifetime, each on an embedded cluster of 4
emulated hosts x 2 fake CPU devices, all in one checkpoint directory and fleet store.

Invariants, checked from what the runs recorded (the fleet store's step rows of every host and
segment, recomputed steps included; its events; the checkpoint directory):
- every step's loss within 1e-4 (relative) of the fault-free run's, except the steps computed
  from a state the health loop then found corrupt and computed again (`superseded`: a segment's
  steps after the step it went back to);
- nothing committed lost: every restore is at or after the newest commit when it began, except
  where the storm corrupted that commit (then the one before, and the damaged one is set aside);
  the retained checkpoints at the end all verify (checksums and the state digest);
- every restore bitwise equal to what was saved: its state digest equals the one saved with the
  checkpoint or snapshot (a snapshot taken before its group's digest program was compiled carries
  none: counted apart, its pieces checked by crc32 alone);
- every fault fired and the job finished.
Reported: those, the recovery times (median, p95, worst), steps recomputed, and the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from recovery import p95  # benchmarks/, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS, MIN_HOSTS, EVERY = 4, 2, 10  # the demo's cluster, hosts.min and checkpoint.every
LEG_TIMEOUT_S = 900
TMPFS_BYTES = 256 << 20
CONTROLLER_KILLS = ("controller-kill", "corrupt+controller-kill")
# Each kind once first (in a seeded order), then drawn at random.
KINDS = (
    "lose",
    "lose-two",
    "lose-in-save",
    "lose-in-start",
    "lose-in-compile",
    "lose-in-restore",
    "add-in-recovery",
    "freeze",
    "disk-full",
    *CONTROLLER_KILLS,
)
# The health loop's faults: a slow host, a hang, a flipped copy, a corrupted batch (left out with
# `--crashes-only`, the storm as it was before the health loop).
HEALTH_KINDS = ("slow-step", "hang", "flip", "flip-grad")
SPIKE_FROM = 25  # a loss spike is judged past the loss's fast early fall (`control.health.SpikeConfig`)
RANDOM_KINDS = KINDS[:-2]  # controller kills cost a cold start each: once of each kind is enough


@dataclasses.dataclass
class Leg:
    """One controller lifetime: its `--chaos` faults, a disk fill, and how it ends."""

    chaos: list[str] = dataclasses.field(default_factory=list)
    disk_full_at: int | None = None  # fill the disk once this step is reported
    kill_at: int | None = None  # kill the controller once this step is reported (None: run to the end)
    corrupt: bool = False  # then corrupt the newest committed checkpoint
    faults: int = 0

    def spec(self) -> str:
        return ",".join(self.chaos)


def plan_storm(seed: int, faults: int, health: bool = True) -> tuple[list[Leg], int]:
    """The legs and the job's step count for `faults` faults drawn with `seed`. Hosts a fault
    kills come back (`add`) a few steps after it, so the next fault finds 4 hosts in the cluster
    (the group grows onto them at its next checkpoint)."""
    rng = random.Random(seed)
    kinds = list(KINDS) + (list(HEALTH_KINDS) if health else [])
    rng.shuffle(kinds)
    drawn = RANDOM_KINDS + (HEALTH_KINDS if health else ())
    kinds += [rng.choice(drawn) for _ in range(max(0, faults - len(kinds)))]
    legs, leg, step = [], Leg(), 12
    for kind in kinds:
        host, lost, injected, back = rng.randrange(3), 0, [], 3  # injected: the --chaos faults this kind is
        if kind == "lose":
            injected, lost = [f"lose@{step}:{host}"], 1
        elif kind == "lose-two":
            first = not any(":0+" in f for leg_ in (*legs, leg) for f in leg_.chaos)
            pair = (0, rng.randrange(1, 3)) if first or rng.random() < 0.5 else (1, 2)  # host 0 at least once
            injected, lost = [f"lose@{step}:{pair[0]}+{pair[1]}"], 2
        elif kind == "lose-in-save":
            step = -(-step // EVERY) * EVERY
            injected, lost = [f"lose-in-save@{step}:{host}"], 1
        elif kind.startswith("lose-in-"):  # a loss starts a recovery, and a host of its group hangs
            injected, lost = [f"lose@{step}", f"{kind}@{step}:{rng.randrange(2)}"], 2
        elif kind == "add-in-recovery":
            injected = [f"lose@{step}:{host}", f"add-in-recovery@{step}"]
        elif kind == "freeze":
            injected = [f"freeze@{step}:{host}"]
        elif kind == "slow-step":
            # Named over 4 to 6 steps of one group: from just past a boundary (where a host added
            # for the fault before grows the group), and its own host back only after it.
            step = -(-step // EVERY) * EVERY + 1
            injected, lost, back = [f"slow-step@{step}:{host}x3"], 1, EVERY - 1
        elif kind in ("hang", "flip"):  # the host is set aside; one comes back in its place
            injected, lost = [f"{kind}@{step}:{host}"], 1
        elif kind == "flip-grad":  # the step computed again, on the same hosts
            step = max(step, SPIKE_FROM)
            injected = [f"flip-grad@{step}:{host}"]
        elif kind == "disk-full":
            leg.disk_full_at = leg.disk_full_at or step
        leg.chaos += injected + [f"add@{step + back}"] * lost
        leg.faults += max(1, len(injected))  # a disk fill or a controller kill is the storm's own
        if kind in CONTROLLER_KILLS:
            # After a disk fill, not before the save it fails has been reported; and a commit to
            # corrupt has one before it to fall back to (the first two boundaries are past).
            step = max(step, (leg.disk_full_at or -99) + 3 * EVERY, 3 * EVERY)
            leg.kill_at, leg.corrupt = step, kind.startswith("corrupt")
            legs.append(leg)
            leg = Leg()  # a new controller starts a new embedded cluster of 4 hosts
            step += EVERY + 3  # past the newest commit the next leg resumes from
        # After a slow-step, no other fault until it is named and its replacement (added at the
        # boundary past it) is in the group: the group grows at that boundary or, where the host
        # is seen late, at the next one, which the next fault must come after.
        step += rng.randrange(6, 10) + (2 * EVERY if kind == "slow-step" else 0)
    legs.append(leg)
    return legs, step + 10


def run_storm(seed: int, faults: int, workdir: str | None = None, log=print, health: bool = True) -> dict:
    legs, steps = plan_storm(seed, faults, health)
    d = workdir or tempfile.mkdtemp(prefix="remesh-storm-")
    ckpt, store = os.path.join(d, "ckpt"), os.path.join(d, "fleet.db")
    os.makedirs(ckpt, exist_ok=True)
    job = _job(d, "storm", steps)
    log(f"storm seed {seed}: {sum(leg.faults for leg in legs)} faults over {steps} steps in {len(legs)} legs")
    for i, leg in enumerate(legs):
        log(f"  leg {i}: --chaos {leg.spec()}  disk full at {leg.disk_full_at}  controller killed at {leg.kill_at}")
    t0 = time.monotonic()
    reference = _reference(d, steps, log)
    disk = _Tmpfs(ckpt) if any(leg.disk_full_at for leg in legs) else None
    outputs, corrupted, killed_commits = [], [], []
    try:
        for i, leg in enumerate(legs):
            outputs.append(_run_leg(job, ckpt, store, leg, disk, log, os.path.join(d, f"leg-{i}.log")))
            if leg.kill_at is not None:
                killed_commits.append(_steps(ckpt)[-1] if _steps(ckpt) else 0)
                if leg.corrupt:
                    corrupted.append(_corrupt_newest(ckpt))
                    log(f"  corrupted the newest commit, step {corrupted[-1]}")
        report = check(store, ckpt, reference, outputs, legs, corrupted, killed_commits, steps)
    finally:
        if disk is not None:
            disk.close()
    report.update(
        seed=seed, storm_seconds=round(time.monotonic() - t0, 1), workdir=d, full_disk=bool(disk and disk.mounted)
    )
    return report


def _job(d: str, name: str, steps: int) -> str:
    with open(os.path.join(ROOT, "examples/gpt/job.toml")) as f:
        text = f.read().replace("steps = 120", f"steps = {steps}").replace('name = "gpt-demo"', f'name = "{name}"')
    path = os.path.join(d, f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def _reference(d: str, steps: int, log) -> dict[int, float]:
    """Losses of the same job without faults, on all 4 hosts: step -> loss."""
    ref = os.path.join(d, "reference")
    os.makedirs(ref, exist_ok=True)
    job = _job(ref, "storm-reference", steps)
    summary = os.path.join(ref, "summary.json")
    if os.path.exists(summary):  # a storm run again in the same directory: the same reference
        with open(summary) as f:
            losses = json.load(f)["losses"]
        if len(losses) == steps:
            return {i + 1: loss for i, loss in enumerate(losses)}
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", job, "--checkpoint-dir", os.path.join(ref, "ckpt")]
    cmd += ["--summary", summary, "--no-store"]
    t = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=LEG_TIMEOUT_S, env=_env())
    with open(summary) as f:
        losses = json.load(f)["losses"]
    log(f"  reference run: {steps} steps in {time.monotonic() - t:.0f} s")
    return {i + 1: loss for i, loss in enumerate(losses)}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


_PROGRESS = re.compile(r"^step\s+(\d+)/")
_SAVE_FAILED = re.compile(r"^warn  checkpoint step \d+ was not saved")


def _run_leg(job: str, ckpt: str, store: str, leg: Leg, disk, log, output: str) -> str:
    """Run one `remesh run` to its end, or kill it (SIGKILL) once `leg.kill_at` is reported;
    fill the disk on the way if asked. Returns its output, also written to `output`."""
    cmd = [sys.executable, "-m", "orchestrator.cli", "run", job, "--checkpoint-dir", ckpt, "--store", store]
    cmd += ["--chaos", leg.spec()] if leg.chaos else []
    sessions = ray_sessions()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    timer = threading.Timer(LEG_TIMEOUT_S, proc.kill)
    timer.start()
    lines, filled, freed, killed = [], False, False, False
    try:
        for line in proc.stdout:
            lines.append(line)
            step = _PROGRESS.match(line)
            reached = int(step[1]) if step else None
            if leg.disk_full_at and not (filled or freed) and reached is not None and reached >= leg.disk_full_at:
                filled = disk.fill()
                freed = not filled  # where no tmpfs could be mounted, once said is enough
                log(f"  disk full after step {reached}" if filled else "  disk full skipped: cannot mount a tmpfs here")
            if filled and _SAVE_FAILED.match(line):
                disk.free()
                log(f"  disk freed after: {line.strip()}")
                filled, freed = False, True
            if leg.kill_at is not None and not killed and reached is not None and reached >= leg.kill_at:
                time.sleep(random.Random(reached).uniform(0.0, 1.5))  # somewhere in a step or a save
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
                log(f"  controller killed after step {reached}")
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # the storm failed mid-leg: its run must not outlive it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kill_orphans(sessions)
        if filled:
            disk.free()
        with open(output, "w") as f:
            f.write("".join(lines))
    if killed:
        kill_orphans(sessions)  # a killed driver leaves its embedded cluster's daemons behind
    elif proc.returncode != 0:
        raise RuntimeError(f"remesh run exited with {proc.returncode}:\n{''.join(lines[-60:])}")
    return "".join(lines)


def ray_sessions() -> set[str]:
    root = os.path.join(tempfile.gettempdir(), "ray")
    return {n for n in os.listdir(root) if n.startswith("session_2")} if os.path.isdir(root) else set()


def kill_orphans(before: set[str]) -> None:
    for session in ray_sessions() - before:
        subprocess.run(["pkill", "-9", "-f", session], check=False)
    time.sleep(1.0)


class _Tmpfs:
    """The checkpoint directory on a tmpfs of its own, so the storm can fill it for real (ENOSPC)."""

    def __init__(self, path: str):
        self.path, self.filler = path, os.path.join(path, "filler")
        self.mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", path], capture_output=True
            ).returncode
            == 0
        )

    def fill(self) -> bool:
        if not self.mounted:
            return False
        # Unbuffered: a buffered file keeps the tail of a short write and raises ENOSPC again
        # when it is closed.
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while os.write(fd, b"\0" * (1 << 20)):  # until the disk refuses: every later write fails
                pass
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        return True

    def free(self) -> None:
        if os.path.exists(self.filler):
            os.remove(self.filler)

    def close(self) -> None:
        if not self.mounted:
            return
        self.free()
        keep = tempfile.mkdtemp(prefix="remesh-storm-ckpt-")
        try:  # keep what was committed: copy it off the tmpfs before it goes
            shutil.copytree(self.path, keep, dirs_exist_ok=True)
        finally:
            subprocess.run(["umount", self.path], check=False)
        shutil.copytree(keep, self.path, dirs_exist_ok=True)
        shutil.rmtree(keep, ignore_errors=True)


def _steps(ckpt: str) -> list[int]:
    from checkpoint import Store

    return Store(ckpt).steps()


def _corrupt_newest(ckpt: str) -> int:
    """Flip bytes in the middle of the newest commit's largest array file: its digest no longer
    matches (a bad disk block, a torn copy)."""
    steps = _steps(ckpt)
    if len(steps) < 2:  # the only commit: nothing could restore, and the job says so (not a storm fault)
        raise RuntimeError(f"the storm would corrupt the only commit ({steps}); its plan must kill later")
    step = steps[-1]
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(ckpt, str(step), "arrays")) for f in fs]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(64)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return step


def check(
    store: str, ckpt: str, reference: dict, outputs: list[str], legs: list[Leg], corrupted, killed_commits, steps
) -> dict:
    """The storm's invariants, from what the runs recorded."""
    from orchestrator.chaos import parse_chaos
    from orchestrator.dashboard.store import FleetStore

    db = FleetStore(store)
    runs = sorted(db.runs("storm"), key=lambda r: r["run"])
    rows = [dict(row, run=r["run"]) for r in runs for row in db.steps(r["run"])]
    events = [dict(e, run=r["run"]) for r in runs for e in db.events(r["run"])]
    final = runs[-1]
    db.close()
    dropped = superseded(rows, events)
    kept_rows = [r for r in rows if (r["run"], r["segment"], r["step"]) not in dropped]
    worst = max(abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]]) for r in kept_rows)
    restores = [e for e in events if e["kind"] == "restore"]
    bitwise = [e for e in restores if e["detail"].get("digest")]
    lost_commits = [
        e for e in restores if e["step"] < e["detail"].get("committed", 0) and e["detail"]["committed"] not in corrupted
    ]
    text = "".join(outputs)
    planned = [str(parse_chaos(f)[0]) for leg in legs for f in leg.chaos]  # (as the chaos lines spell them)
    # A fault planned twice (two hosts added at one step) must have fired twice.
    fired = [f for f in planned if text.count(f"chaos {f}:") >= planned.count(f)]
    recoveries = [float(x) for x in re.findall(r"recovered in ([\d.]+) s", text)]
    kept = _verify_retained(ckpt)
    return {
        "faults": sum(leg.faults for leg in legs),
        "chaos_faults_planned": len(planned),
        "chaos_faults_fired": len(fired),
        "not_fired": [f for f in planned if f not in fired],
        "disk_fills": text.count("was not saved"),
        "controller_kills": sum(1 for leg in legs if leg.kill_at is not None),
        "corrupted_commits": corrupted,
        "checkpoint_corrupt_events": sum(e["kind"] == "checkpoint_corrupt" for e in events),
        "finished": final["state"] == "finished" and final["steps_completed"] == steps,
        "steps": steps,
        "step_rows_checked": len(kept_rows),
        "step_rows_superseded": len(dropped),
        "corruptions_found": sum(e["kind"] == "corruption" for e in events),
        "stragglers_named": sum(e["kind"] == "straggler" for e in events),
        "hangs_found": sum(e["kind"] == "hang" for e in events),
        "steps_covered": len({r["step"] for r in rows}),
        "worst_relative_loss_difference": worst,
        "restores": len(restores),
        "restores_from_memory": sum(e["detail"].get("source") == "memory" for e in restores),
        "restores_digest_checked": len(bitwise),
        "restores_digest_equal": sum(e["detail"]["digest"] == e["detail"]["saved_digest"] for e in bitwise),
        "restores_from_disk_unchecked": sum(e["detail"].get("source") == "disk" and e not in bitwise for e in restores),
        "restores_before_newest_commit": [(e["step"], e["detail"]["committed"]) for e in lost_commits],
        "resumes_after_controller_kill": killed_commits,
        "retained_checkpoints_verified": kept,
        "recoveries": len(recoveries),
        "recovery_median_s": _round(statistics.median(recoveries)) if recoveries else None,
        "recovery_p95_s": _round(p95(recoveries)) if recoveries else None,
        "recovery_worst_s": _round(max(recoveries)) if recoveries else None,
        "recovery_seconds": recoveries,
        "recomputed_steps": [e["detail"].get("recomputed") for e in restores if "recomputed" in e["detail"]],
    }


def superseded(rows: list[dict], events: list[dict]) -> set[tuple]:
    """(run, segment, step) of the step rows a corruption event threw away: the rows of the segment
    it ended past the step it went back to (its copies' last agreement, or the step before a loss
    spike), computed again by the next segment."""
    out = set()
    for e in (e for e in events if e["kind"] == "corruption"):
        evidence = e["detail"]["evidence"]
        back_to = evidence["clean_step"] if "clean_step" in evidence else evidence["step"] - 1
        before = [r for r in rows if r["run"] == e["run"] and r["at"] <= e["at"]]
        if not before:
            continue
        segment = max(r["segment"] for r in before)
        out |= {(r["run"], r["segment"], r["step"]) for r in rows
                if r["run"] == e["run"] and r["segment"] == segment and r["step"] > back_to}  # fmt: skip
    return out


def _verify_retained(ckpt: str) -> dict:
    """Every checkpoint left: its checksums, and its state against the digest saved with it."""
    import jax

    from checkpoint import Store
    from examples.gpt.model import program
    from orchestrator.job.digest import compile_digest, digest

    abstract = jax.eval_shape(program.init, jax.random.key(0))
    fn = compile_digest(abstract)
    store, result = Store(ckpt), {}
    for step in store.steps():
        ok = store.verify(step).ok
        state = store.restore(step, target=abstract)
        result[step] = bool(ok and digest(fn, state) == store.metadata(step)["meta"]["digest"])
    return result


def _round(x: float) -> float:
    return round(x, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=30)
    parser.add_argument("--plan", action="store_true", help="print the faults and stop")
    parser.add_argument("--workdir", help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--crashes-only", action="store_true", help="leave out the health loop's faults")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    if args.plan:
        legs, steps = plan_storm(args.seed, args.faults, not args.crashes_only)
        print(json.dumps({"steps": steps, "legs": [dataclasses.asdict(leg) for leg in legs]}, indent=1))
        return 0
    report = run_storm(
        args.seed, args.faults, args.workdir, log=lambda s: print(s, flush=True), health=not args.crashes_only
    )
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
