"""The controller as a state machine, one transition at a time, with the host group and cluster
injected (as Ray Train tests swap `worker_group_cls`): pure logic, no Ray, no devices."""

import itertools
import math

import pytest

from orchestrator import Phase, parse_job
from orchestrator.chaos import ChaosCallback, parse_chaos
from orchestrator.control.controller import ControllerConfig, JobController
from orchestrator.control.fleet_following import FleetFollowing
from orchestrator.control.planning import PlanCache
from orchestrator.hosts.group import HostsLostError, HostStatus, SegmentFailedError
from orchestrator.hosts.interface import Cluster, Placement
from orchestrator.hosts.slices import SlicedCluster, SliceLayout
from orchestrator.protocol import from_dict
from orchestrator.telemetry.console import ConsoleCallback
from orchestrator.telemetry.goodput import GoodputCallback
from orchestrator.telemetry.recorder import Recorder, RecorderCallback
from orchestrator.telemetry.summary import SummaryCallback
from partitioner import Cost, Plan


class World(Cluster):
    """Hosts that can die, and the checkpoint that survives them."""

    def __init__(self, hosts):
        self.alive = [f"node{i}" for i in range(hosts)]
        self.committed = 0
        self.groups = []
        self.broken = False
        self.survivors_report = False  # hosts still alive answer the poll that finds the loss
        self.stall = False  # groups end before training (a host that exits at once, say)
        self.ignore_stop = False  # groups that never act on a stop request (a hung host)
        self.eval_every = 0  # groups evaluate after every so many steps (0: never)
        self.input_seconds = 0.0  # of each step's 0.1 s, waited for its batch
        self.snapshot = None  # the next group restores this peer snapshot (a restore report's fields)
        self.down_with_loss = ()  # processes that die with any loss on their live nodes (CPU aborts)
        self.unseen = set()  # dead nodes the poll still finds answering (their death not yet seen)

    def alive_hosts(self):
        return list(self.alive)

    def host_env(self):
        return {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

    def kill_host(self, node):
        self.alive.remove(node)

    def add_host(self):
        self.alive.append(f"node{len(self.alive) + 10}")


def status(reports, done):
    """A host's answer to a poll, its reports typed as the real group types them."""
    return HostStatus(tuple(from_dict(r) for r in reports), done, None)


def fake_group_cls(world, every, now):
    def stepped(step):
        return {"kind": "step", "step": step, "loss": 1.0 / step, "seconds": 0.1, "at": now(),
                "tokens_per_second": 10.0, "mfu": 0.5, "input_seconds": world.input_seconds}  # fmt: skip

    def saved(step):
        return {"kind": "checkpoint", "step": step, "seconds": 0.01, "at": now()}

    class FakeGroup:
        def __init__(self, hosts, config, standby=None, placements=None, nodes=None):
            self.size = hosts
            self.node_ids = list(nodes)[:hosts] if nodes is not None else world.alive_hosts()[:hosts]
            self.places = [{"ip": "127.0.0.1", "port": 1, "pid": 0} for _ in range(hosts)]
            self.placements = placements
            self.stop = False
            self.step = None
            self.env = config.env_vars
            world.groups.append(self)

        def start(self, spec_for, snapshots=None, executables=None):
            self.specs = [spec_for(i, "127.0.0.1:1") for i in range(self.size)]
            self.step = world.committed
            self.pending = (
                [{"kind": "restore", "step": self.step, "source": "disk", "seconds": 0.01, "at": now()}]
                if self.step
                else []
            )
            if world.snapshot:  # a peer snapshot past the commit, with the step reports it kept
                self.step = world.snapshot["step"]
                self.pending = [{"kind": "restore", "seconds": 0.01, "at": now(), **world.snapshot}]
                world.snapshot = None
            self.stop_now = False

        def poll(self):
            if world.broken:
                raise SegmentFailedError("host 0 failed:\nZeroDivisionError: in the user's step")
            dead = [i for i, n in enumerate(self.node_ids) if n not in world.alive and n not in world.unseen]
            if dead:
                dead = sorted({*dead, *world.down_with_loss})
                survivors = []
                if world.survivors_report:  # they finished one more step before the loss was seen
                    self.step += 1
                    r = stepped(self.step)
                    survivors = [(i, status([r], False)) for i in range(self.size) if i not in dead]
                raise HostsLostError(dead, [self.node_ids[i] for i in dead], "ActorDiedError", survivors)
            pending, self.pending = self.pending, []
            if world.stall or self.step >= self.specs[0].steps:
                return [status(pending, True) for _ in range(self.size)]
            if self.stop_now and not world.ignore_stop:  # save the step reached, then end
                world.committed = self.step
                return [status([*pending, saved(self.step)], True) for _ in range(self.size)]
            self.step += 1
            reports = [*pending, stepped(self.step)]
            if world.eval_every and self.step % world.eval_every == 0:
                reports.append({"kind": "eval", "step": self.step, "loss": 2.0 / self.step, "seconds": 0.05,
                                "at": now(), "metrics": {"accuracy": 0.5}})  # fmt: skip
            done = False
            if self.step % every == 0:
                world.committed = self.step
                reports.append(saved(self.step))
                done = self.stop and not world.ignore_stop
            done = done or self.step >= self.specs[0].steps
            return [status(reports, done) for _ in range(self.size)]

        def compile_ahead(self, plan_json):
            self.ahead = [*getattr(self, "ahead", []), plan_json]

        def request_stop(self, now=False):
            self.stop = True
            self.stop_now = self.stop_now or now

        def shutdown(self):
            pass

    return FakeGroup


def fake_plan(devices):
    return Plan(
        mesh={"data": devices},
        in_specs=((), ()),
        out_specs=(),
        devices=devices,
        search_seconds=0.0,
        cost=Cost(0.0, 0.0, {}, 0),
    )


def make(world, chaos=(), steps=30, committed=lambda: 0, grace=20.0, recorder=None, lines=None, reserve_wait_s=30.0,
         cluster=None, max_hosts=4, host_check_s=0.0, standby=None, fleet=None, reverse=False):  # fmt: skip
    """A controller on `world` (seen through `cluster`, where given; following `fleet`'s grant,
    where given), and the run summary its callbacks keep; the terminal's lines go to `lines`."""
    lines = [] if lines is None else lines
    job = parse_job(
        {
            "name": "t",
            "program": "m:p",
            "steps": steps,
            "global_batch": 8,
            "hosts": {"min": 2, "max": max_hosts, "devices_per_host": 2},
            "checkpoint": {"dir": "/tmp/x", "every": 5},
        }
    )
    ticks = itertools.count()
    now = lambda: float(next(ticks))  # one clock for the controller and the hosts' stamps, 1 s a read
    goodput = GoodputCallback()
    summary = SummaryCallback(goodput)
    callbacks = [
        goodput,
        summary,
        RecorderCallback(recorder or Recorder(), goodput, summary),
        ConsoleCallback(lines.append),
    ]
    if chaos:
        callbacks.append(ChaosCallback(chaos, lines.append, hosts=world))
    callbacks = callbacks[::-1] if reverse else callbacks  # callbacks need no order among them
    c = JobController(
        job,
        cluster or world,
        plans=PlanCache(fake_plan, "f"),
        config=ControllerConfig(poll_interval_s=0, host_check_interval_s=host_check_s, stop_grace_s=grace),  # fmt: skip
        scaling=FleetFollowing(job.hosts.min, fleet, reserve_wait_s) if fleet is not None else None,
        callbacks=callbacks,
        group_cls=fake_group_cls(world, 5, now),
        clock=now,
        wall=now,
        sleep=lambda s: None,
        committed=committed,
        standby=standby,
    )
    return c, summary.summary


def run_until(c, pred, limit=500):
    for _ in range(limit):
        if pred():
            return
        c.step()
    raise AssertionError(f"condition not reached; phase {c.phase}")


def test_start_transitions_one_at_a_time():
    world = World(4)
    c, s = make(world)
    assert c.phase is Phase.PLANNING
    assert c.step() is Phase.STARTING
    assert s.events[-1]["kind"] == "replan" and s.events[-1]["devices"] == 8
    assert c.step() is Phase.RUNNING
    assert world.groups[0].env["XLA_FLAGS"].endswith("=2")  # the cluster says what a host process needs
    assert c.step() is Phase.RUNNING and s.losses == {1: 1.0}


def test_host_loss_replans_on_fewer_hosts_and_resumes_from_the_committed_step():
    world = World(4)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 12)
    world.kill_host("node3")
    assert c.step() is Phase.PLANNING
    assert [e["kind"] for e in s.events][-1] == "host_lost"
    assert c.step() is Phase.STARTING and s.events[-1]["devices"] == 6
    assert c.step() is Phase.RUNNING
    assert world.groups[-1].step == 10  # restored at the last committed checkpoint, not 12
    c.step()
    assert s.recovery_seconds and s.segments[-1].first_step == 11
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FINISHED and s.steps_completed == 30
    assert [seg.devices for seg in s.segments] == [8, 6]


def test_what_the_next_group_needs_is_prepared_once_per_segment_not_every_step():
    class Counted(World):
        asked = 0

        def alive_hosts(self):
            self.asked += 1
            return super().alive_hosts()

    class Standby:
        refills = 0

        def refill(self, nodes, env):
            self.refills += 1

    world, standby = Counted(4), Standby()
    c, s = make(world, steps=40, host_check_s=1e9, standby=standby)  # no host checks while a group trains
    asked, planner = [], c.plans.planner
    c.plans.planner = lambda devices: asked.append(devices) or planner(devices)
    run_until(c, lambda: c.phase is Phase.RUNNING)
    before = world.asked
    run_until(c, lambda: s.steps_completed >= 20)
    # One look at the cluster, one refill and one round of plans ahead, whatever the steps.
    assert (world.asked - before, standby.refills) == (1, 1)
    assert sorted(asked) == [6, 8]  # the job's plan, then a host fewer (a host more is over hosts.max)


def test_added_host_grows_at_the_next_checkpoint_boundary():
    world = World(3)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 7)
    world.add_host()
    c.step()
    assert s.events[-1]["kind"] == "host_added"
    run_until(c, lambda: c.phase is Phase.PLANNING)
    assert s.steps_completed == 10  # stopped exactly at the checkpoint boundary
    run_until(c, lambda: c.phase.is_terminal)
    assert [seg.devices for seg in s.segments] == [6, 8]
    assert s.segments[1].first_step == 11


def test_too_few_hosts_fails_with_a_reason():
    world = World(2)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 3)
    world.kill_host("node1")
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FAILED and "needs at least 2" in s.reason


def test_chaos_kills_the_named_host_once_its_step_is_reached():
    world = World(4)
    c, s = make(world, chaos=parse_chaos("lose@6:0"))
    run_until(c, lambda: s.steps_completed == 6)
    c.step()
    assert "node0" not in world.alive
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FINISHED
    lost = [e for e in s.events if e["kind"] == "host_lost"]
    assert len(lost) == 1 and lost[0]["hosts"] == [0]


def test_processes_that_go_down_with_a_lost_host_are_told_apart_and_come_back():
    world = World(4)
    world.down_with_loss = (2, 3)  # the coordinator's loss aborts them, their nodes live on
    c, s = make(world, chaos=parse_chaos("lose@6:0"))
    run_until(c, lambda: len(world.groups) == 2 and c.phase is Phase.RUNNING)
    lost = next(e for e in s.events if e["kind"] == "host_lost")
    assert (lost["hosts"], lost["processes"], lost["nodes_dead"]) == ([0], [2, 3], 1)
    assert world.groups[1].node_ids == ["node1", "node2", "node3"]


def test_a_dead_host_the_poll_has_not_seen_yet_counts_as_dead():
    world = World(4)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 5)
    world.kill_host("node2")
    world.kill_host("node3")
    world.unseen = {"node3"}  # still answers the poll that finds node2 dead
    run_until(c, lambda: len(world.groups) == 2 and c.phase is Phase.RUNNING)
    lost = next(e for e in s.events if e["kind"] == "host_lost")
    assert (lost["hosts"], lost["processes"], lost["nodes_dead"]) == ([2, 3], [], 2)
    assert world.groups[1].node_ids == ["node0", "node1"]


def test_an_error_in_the_program_fails_the_job_with_its_traceback():
    world = World(4)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 3)
    world.broken = True
    assert c.step() is Phase.FAILED
    assert "ZeroDivisionError" in s.reason


def test_goodput_parts_add_up_to_wall_time_and_recomputed_steps_are_lost():
    world = World(4)
    c, s = make(world, chaos=parse_chaos("lose@12"), steps=20)
    c.run()
    summary = s
    g = summary.goodput
    parts = g["useful_seconds"] + sum(g["badput_seconds"].values())
    assert parts == pytest.approx(g["wall_seconds"], abs=1e-6)
    # Every step counts as useful once (20 x 0.1 s); steps 11 and 12 ran twice (restored from
    # step 10), and their second run is lost, as is the time the failure took to detect.
    assert g["useful_seconds"] == pytest.approx(20 * 0.1)
    assert g["badput_seconds"]["lost"] >= 2 * 0.1
    assert g["badput_seconds"]["checkpoint"] == pytest.approx(4 * 0.01)  # steps 5, 10, then 15, 20
    assert g["badput_seconds"]["planning"] > 0 and g["badput_seconds"]["startup"] > 0
    assert summary.throughput["mfu"] == 0.5 and summary.throughput["steps_measured"] == 22
    assert [seg["median_step_seconds"] for seg in summary.to_dict()["segments"]] == [0.1, 0.1]
    # The loss's own badput: from the last report before it to the first step past step 12.
    (charged,) = summary.loss_badput
    assert charged["lost"] >= 2 * 0.1 and charged["restore"] == pytest.approx(0.01) and charged["planning"] > 0
    assert charged["total"] == pytest.approx(sum(v for k, v in charged.items() if k != "total"))
    assert summary.recomputed_steps == [2]  # restored step 10 after step 12 was reached


def test_the_callbacks_keep_the_same_record_in_any_order():
    class Statuses(Recorder):
        def __init__(self):
            self.seen = []

        def status(self, **fields):
            self.seen.append(fields)

    kept = []
    for reverse in (False, True):
        world, statuses = World(4), Statuses()
        c, s = make(world, chaos=parse_chaos("lose@12"), recorder=statuses, reverse=reverse)
        c.run()
        d = s.to_dict()
        segments = [{k: v for k, v in seg.items() if k in ("hosts", "first_step", "last_step", "median_step_seconds")}
                    for seg in d["segments"]]  # fmt: skip
        last = [
            {k: seg[k] for k in ("hosts", "first_step", "median_step_seconds")} for seg in statuses.seen[-1]["segments"]
        ]
        kept.append((d["losses"], segments, [e["kind"] for e in d["events"]], d["recomputed_steps"], last))
    assert kept[0] == kept[1] and len(kept[0][1]) == 2


def test_evaluations_are_reported_like_the_training_loss_and_input_waits_charged_as_input():
    world = World(4)
    world.eval_every, world.input_seconds = 4, 0.02
    c, s = make(world, chaos=parse_chaos("lose@12"), steps=20)
    c.run()
    summary = s
    d = summary.to_dict()
    evaluated = [s for s in range(1, 21) if s % 4 == 0]
    assert [i + 1 for i, x in enumerate(d["metrics"]["eval/loss"]) if x is not None] == evaluated
    assert all(d["metrics"]["eval/loss"][s - 1] == 2.0 / s for s in evaluated)
    assert {d["metrics"]["eval/accuracy"][s - 1] for s in evaluated} == {0.5}
    assert len(d["losses"]) == 20 and None not in d["losses"]  # training losses unaffected
    # Step 12 is evaluated twice (before the loss after it and after the restore from 10): both charged.
    assert [e["step"] for e in d["events"] if e["kind"] == "eval"] == [4, 8, 12, 12, 16, 20]
    g = summary.goodput
    assert g["badput_seconds"]["eval"] == pytest.approx(6 * 0.05)
    # Input waits are carved out of each step's time: 22 steps ran (11 and 12 twice).
    assert g["badput_seconds"]["input"] == pytest.approx(22 * 0.02)
    assert g["useful_seconds"] == pytest.approx(20 * 0.08)
    assert g["useful_seconds"] + sum(g["badput_seconds"].values()) == pytest.approx(g["wall_seconds"], abs=1e-6)


@pytest.mark.parametrize("lost_host", [0, 3])
def test_steps_reported_in_the_poll_that_finds_a_loss_are_kept_even_without_process_0(lost_host):
    world = World(4)
    world.survivors_report = True
    c, s = make(world, chaos=parse_chaos(f"lose@12:{lost_host}"), steps=20)
    seen = []
    while not c.phase.is_terminal:
        c.step()
        if s.events and s.events[-1]["kind"] == "host_lost" and not seen:
            seen = sorted(s.losses)
    # Step 13 came only from the survivors' answers to the poll that found the loss.
    assert seen[-1] == 13 and s.losses[13] == pytest.approx(1 / 13)


def test_steps_whose_reports_went_with_a_lost_group_come_back_with_the_snapshot_restored():
    """The group ran steps 13 and 14 and snapshotted 14, then lost a host before the controller
    polled those steps: the restore brings their reports (kept with the snapshot), and the run's
    losses and step rows have them, as the segment that ran them, once."""

    class Rows(Recorder):
        def __init__(self):
            self.rows = []

        def step(self, host, segment, report, speaker):
            self.rows.append((segment, host, report["step"]))

    world, rows = World(4), Rows()
    c, s = make(world, steps=20, recorder=rows)
    run_until(c, lambda: s.steps_completed == 12)
    kept = [{"step": s, "loss": 1.0 / s, "at": 0.0, "seconds": 0.1, "metrics": {}} for s in (11, 12, 13, 14)]
    world.snapshot = {"step": 14, "source": "memory", "reported": {"segment": 0, "steps": kept}}
    world.kill_host("node3")
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FINISHED and sorted(s.losses) == list(range(1, 21))
    assert s.losses[13] == 1.0 / 13 and s.segments[1].first_step == 15
    assert [r for r in rows.rows if r[2] in (13, 14)] == [(1, 0, 13), (1, 0, 14)]
    assert [e["recomputed"] for e in s.events if e["kind"] == "restore"] == [0]


def test_a_rerun_of_a_finished_job_ends_at_once_without_starting_hosts():
    world = World(4)
    c, s = make(world, committed=lambda: 30)
    c.run()
    summary = s
    assert summary.state == "finished" and summary.steps_completed == 30
    assert "already complete" in summary.reason and not world.groups


def test_a_segment_restored_at_the_last_step_finishes_the_job():
    # The job's final step is committed but the controller was not told (a checkpoint written
    # while it planned, say): the group restores step 30, has nothing left and ends.
    world = World(4)
    world.committed = 30
    c, s = make(world)
    run_until(c, lambda: c.phase.is_terminal, limit=20)
    assert c.phase is Phase.FINISHED and s.steps_completed == 30 and len(world.groups) == 1


def test_segments_that_end_without_a_new_step_fail_after_a_bounded_number():
    world = World(4)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 7)
    world.stall = True
    run_until(c, lambda: c.phase.is_terminal, limit=50)
    assert c.phase is Phase.FAILED and "3 segments in a row ended without completing a step" in s.reason
    assert len(world.groups) == 4  # the one that trained, then three that did not


def test_a_stop_saves_the_step_reached_and_stops_the_hosts():
    world = World(4)
    c, s = make(world)
    run_until(c, lambda: s.steps_completed == 7)
    c.request_stop("stopped by signal SIGTERM")
    assert c.step() is Phase.STOPPING
    run_until(c, lambda: c.phase.is_terminal, limit=10)
    assert c.phase is Phase.STOPPED and world.committed == s.steps_completed >= 7
    assert s.reason.startswith("stopped by signal SIGTERM")


def test_a_stop_is_bounded_by_its_grace_and_a_second_request_is_immediate():
    from orchestrator.control.controller import JobStopped

    world = World(4)
    world.ignore_stop = True
    c, s = make(world, grace=3.0)  # the fake clock advances 1 s a read: over before step 10 is saved
    run_until(c, lambda: s.steps_completed == 7)
    c.request_stop("stopped by signal SIGTERM")
    run_until(c, lambda: c.phase.is_terminal, limit=30)
    assert c.phase is Phase.STOPPED and "did not finish within 3 s" in s.reason
    assert world.committed == 5  # the newest commit stands

    c, s = make(World(4))
    c.step()
    with pytest.raises(JobStopped):  # nothing trains yet: stop at once
        c.request_stop("stopped by signal SIGINT")


def test_running_medians_match_statistics_in_memory_bounded_by_the_spread():
    """The controller's medians over every step cost the same at any length of run."""
    import random
    import statistics

    from orchestrator.protocol import Step
    from orchestrator.telemetry.goodput import RunningMedian, Throughput

    rng = random.Random(3)
    for n in (1, 2, 3, 10, 1001):
        xs = [rng.uniform(0.05, 0.2) for _ in range(n)]
        assert RunningMedian(xs).median() == pytest.approx(statistics.median(xs), rel=1e-3)
        repeated = [0.1] * n + [0.25] * (n // 2)
        assert RunningMedian(repeated).median() == statistics.median(repeated)  # exact where values repeat
    m = RunningMedian()
    for _ in range(100_000):
        m.add(rng.uniform(0.05, 0.2))
    assert len(m) == 100_000 and len(m._bins) <= 1 + int(math.log(4) / RunningMedian.RESOLUTION) + 1
    t = Throughput()
    for step in range(1, 200):
        t.add(Step(step=step, loss=0.0, seconds=0.1, tokens_per_second=float(step), mfu=0.5))
    assert t.summary()["tokens_per_second"] == 100.0 and t.recent(20)["tokens_per_second"] == 189.5


class FleetWorld(World):
    """A shared cluster as one job sees it through the fleet scheduler: `target` hosts granted,
    `held` the ones placed for it (given back only when it releases them)."""

    def __init__(self, hosts, target=0, reason="waiting for hosts: needs 2, 0 idle"):
        super().__init__(hosts)
        from orchestrator.protocol.fleet import FleetProgress, Registration

        self.target, self.reason, self.held, self.released, self.suspect = 0, reason, [], [], {}
        self.registration = Registration("t-1", "t", 0, "default", 2, 4, "/tmp/x")
        self.progress, self.reported = FleetProgress, []
        self.set_target(target, reason)

    def set_target(self, n, reason=""):
        self.target, self.reason = n, reason
        free = [h for h in self.alive if h not in self.held]
        self.held += free[: max(0, n - len(self.held))]

    @property
    def grant(self):
        from orchestrator.protocol.fleet import Grant

        hosts = tuple((n, f"pg-{n}") for n in self.held)
        return Grant("t-1", "running" if self.target else "queued", self.target, hosts, self.reason)

    def attach(self, progress):
        self.progress = progress

    def report(self):
        self.reported.append(self.progress())
        return self.grant

    def alive_hosts(self):
        return [n for n in self.held if n in self.alive]

    def placement(self, hosts):
        return self.placement_on(self.alive_hosts()[:hosts])

    def placement_on(self, nodes):
        return Placement(reservations=[f"pg-{n}" for n in nodes])

    def release(self, nodes, suspect=None):
        self.released.append(list(nodes))
        self.suspect.update(suspect or {})
        self.held = [n for n in self.held if n not in nodes]
        return self.grant


def test_on_a_shared_cluster_the_job_waits_shrinks_suspends_and_resumes_as_granted():
    world = FleetWorld(4)
    c, s = make(world, fleet=world)
    assert c.step() is Phase.QUEUED and s.events[-1]["kind"] == "queued"
    assert s.events[-1]["reason"] == "waiting for hosts: needs 2, 0 idle"
    assert c.step() is Phase.QUEUED and len(s.events) == 1  # still waiting, said once
    world.set_target(4)
    assert c.step() is Phase.PLANNING and s.events[-1]["kind"] == "admitted"
    run_until(c, lambda: c.phase is Phase.RUNNING)
    assert world.groups[0].placements == ["pg-node0", "pg-node1", "pg-node2", "pg-node3"]
    run_until(c, lambda: s.steps_completed == 12)
    world.set_target(2, "shrunk to 2 of 4 hosts for a job of higher priority")
    c.step()
    assert s.events[-1]["kind"] == "shrink" and s.events[-1]["reason"].startswith("shrunk to 2 of 4")
    run_until(c, lambda: c.phase is Phase.STARTING)
    assert world.released == [["node2", "node3"]]  # given back before the smaller group starts
    run_until(c, lambda: c.phase is Phase.RUNNING)
    reached = s.segments[0].last_step
    c.step()
    assert world.groups[-1].placements == ["pg-node0", "pg-node1"]
    assert s.segments[1].first_step == reached + 1  # the step reached was committed: nothing again
    assert s.recomputed_steps == [0]
    run_until(c, lambda: s.steps_completed == 20)
    world.set_target(0, "waiting for hosts: needs 1, 0 idle, 4 held by jobs of priority 0 or higher")
    run_until(c, lambda: c.phase is Phase.QUEUED)
    assert [e["kind"] for e in s.events if e["kind"] in ("suspend", "queued")][-2:] == ["suspend", "queued"]
    assert world.released[-1] == ["node0", "node1"] and world.held == []
    world.set_target(3)
    c.run()
    assert c.phase is Phase.FINISHED and s.steps_completed == 30
    assert [seg.devices for seg in s.segments] == [8, 4, 6]
    assert s.goodput["badput_seconds"]["queued"] > 0


def test_a_job_says_it_would_grow_only_while_the_steps_left_pay_for_a_resize():
    # Each fake step takes 0.1 s and a group 1 s per clock read to start: on 2 of at most 4
    # hosts, growing saves 0.05 s a step left.
    for steps, at, grows in ((100_000, 3, True), (30, 25, False)):
        world = FleetWorld(4, target=2)
        c, s = make(world, steps=steps, fleet=world)
        run_until(c, lambda s=s, at=at: s.steps_completed >= at)
        c.step()
        assert world.reported[-1].grows is grows, (steps, world.reported[-1])


def test_granted_hosts_another_job_still_holds_are_waited_for_then_fewer_are_used():
    world = FleetWorld(4, target=3)
    world.held = ["node0", "node1"]  # the third granted host is still another job's
    c, s = make(world, reserve_wait_s=3.0, fleet=world)
    assert c.step() is Phase.QUEUED
    assert s.events[-1]["reason"] == (
        "waiting for hosts: 2 of the 3 granted are free, the rest still held by jobs that are giving them back"
    )
    run_until(c, lambda: c.phase is Phase.RUNNING)  # after reserve_wait_s, on the two it has (hosts.min)
    assert s.segments[0].devices == 4 and world.groups[0].placements == ["pg-node0", "pg-node1"]
    lonely = FleetWorld(4, target=2)
    lonely.held = ["node0"]  # one of two: below hosts.min, so it waits however long
    c, s = make(lonely, reserve_wait_s=3.0, fleet=lonely)
    for _ in range(20):
        assert c.step() is Phase.QUEUED
    lonely.held.append("node1")  # given back at last
    run_until(c, lambda: c.phase is Phase.RUNNING)
    assert s.segments[0].devices == 4


def test_a_shrink_while_a_grow_waits_for_its_checkpoint_stops_the_group_at_once():
    world = FleetWorld(4, target=2)
    c, s = make(world, fleet=world)
    run_until(c, lambda: s.steps_completed == 11)
    world.set_target(4)
    c.step()
    assert s.events[-1]["kind"] == "grow"  # waits for step 20, its next checkpoint
    world.set_target(2, "shrunk to 2 of 4 hosts for a job of higher priority")
    c.step()
    assert s.events[-1]["kind"] == "shrink"
    run_until(c, lambda: c.phase is Phase.PLANNING)
    assert s.segments[0].last_step < 20 and world.groups[0].stop_now  # not held to the boundary


class SlicedWorld(World):
    """Hosts in slices of 2 (nodes 0-1, 2-3, ...), as the embedded cluster lays them out: a host
    added joins the slice a lost one left short."""

    def __init__(self, hosts):
        super().__init__(hosts)
        self.slices = {n: str(i // 2) for i, n in enumerate(self.alive)}

    def slice_of(self):
        return {n: self.slices[n] for n in self.alive}

    def add_host(self):
        live = [self.slices[n] for n in self.alive]
        short = min(sorted(set(self.slices.values())), key=live.count)
        super().add_host()
        self.slices[self.alive[-1]] = short


@pytest.mark.parametrize("fails_by, after_loss", [("slice", ["node0", "node1"]), ("host", ["node0", "node1", "node3"])])
def test_a_lost_host_takes_its_slice_where_slices_fail_whole_and_only_itself_elsewhere(fails_by, after_loss):
    world = SlicedWorld(4)
    c, s = make(world, steps=40, cluster=SlicedCluster(world, SliceLayout(2, fails_by)))
    asked, planner = [], c.plans.planner
    c.plans.planner = lambda devices: asked.append(devices) or planner(devices)
    run_until(c, lambda: s.steps_completed >= 6)
    # Planned ahead for the mesh a loss would leave: a slice fewer where slices fail whole (2 hosts
    # x 2 devices), else a host fewer (3 x 2).
    assert asked[0] == 8 and set(asked[1:]) == ({4} if fails_by == "slice" else {6}), asked
    world.kill_host("node2")
    run_until(c, lambda: len(world.groups) == 2 and c.phase is Phase.RUNNING)
    assert world.groups[1].node_ids == after_loss  # slice-major; a TPU slice's survivor left with it
    ids = [(spec.slices, spec.slice_id) for spec in world.groups[1].specs]
    assert ids == ([(1, 0)] * 2 if fails_by == "slice" else [(2, 0), (2, 0), (2, 1)])  # what libtpu joins by
    lost = next(e for e in s.events if e["kind"] == "host_lost")
    assert (lost["nodes_dead"], lost["slice_left"]) == (1, 1 if fails_by == "slice" else 0)
    world.add_host()  # into slice 1: whole again
    run_until(c, lambda: len(world.groups) == 3 and c.phase is Phase.RUNNING)
    assert world.groups[2].node_ids == ["node0", "node1", "node13", "node3"]  # slice 1 whole again, in node order
    c.run()
    assert c.phase is Phase.FINISHED and [seg.hosts for seg in s.segments] == [4, len(after_loss), 4]


def test_a_slice_lost_whole_leaves_the_others_to_go_on():
    from orchestrator.chaos import parse_chaos
    from orchestrator.hosts.slices import SlicedCluster, SliceLayout

    world = SlicedWorld(6)
    sliced = SlicedCluster(world, SliceLayout(2, "slice"))
    c, s = make(world, steps=20, cluster=sliced, chaos=parse_chaos("lose-slice@6:1"), max_hosts=6)
    c.run()
    assert c.phase is Phase.FINISHED
    assert [g.node_ids for g in world.groups[1:2]] == [["node0", "node1", "node4", "node5"]]
    lost = next(e for e in s.events if e["kind"] == "host_lost")
    assert lost["nodes_dead"] == 2 and lost["slice_left"] == 0


class SlicedFleetWorld(FleetWorld):
    """A shared cluster whose hosts say their slices (two hosts each)."""

    slices = {f"node{i}": str(i // 2) for i in range(4)}

    def slice_of(self):
        return {n: self.slices[n] for n in self.alive_hosts()}


def test_a_shared_cluster_seen_through_its_slices_hears_the_jobs_progress():
    world = SlicedFleetWorld(4, target=4)
    c, s = make(world, steps=30, cluster=SlicedCluster(world, SliceLayout(2, "slice")), fleet=world)
    run_until(c, lambda: s.steps_completed >= 7)
    world.report()  # a heartbeat, as the fleet link's thread sends it
    # Checkpoints every 5 steps: 2 steps since the last, on 4 of at most 4 hosts (no growth to want).
    assert (c.step_reached, world.reported[-1].since_snapshot) == (7, 2)


def test_on_a_shared_cluster_a_slice_that_lost_a_host_is_given_back_whole():
    world = SlicedFleetWorld(4, target=4)
    c, s = make(world, steps=30, cluster=SlicedCluster(world, SliceLayout(2, "slice")), fleet=world)
    run_until(c, lambda: s.steps_completed >= 6)
    world.kill_host("node2")
    world.set_target(2, "2 of at most 4 hosts: the other 2 are held or kept for waiting jobs")
    run_until(c, lambda: len(world.groups) == 2 and c.phase is Phase.RUNNING)
    assert world.released == [["node3"]]  # the survivor of the broken slice: no group can run on it
    assert world.groups[1].node_ids == ["node0", "node1"]
    c.run()
    assert c.phase is Phase.FINISHED and [seg.hosts for seg in s.segments] == [4, 2]
