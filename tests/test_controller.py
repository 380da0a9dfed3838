"""The controller as a state machine, one transition at a time, with the host group and cluster
injected (as Ray Train tests swap `worker_group_cls`): pure logic, no Ray, no devices."""
import pytest

from orchestrator import Phase, parse_job
from orchestrator.controller import ControllerConfig, JobController
from orchestrator.hosts import HostsLostError, HostStatus, SegmentFailedError
from partitioner import Cost, Plan

pytestmark = pytest.mark.unit


class World:
    """Hosts that can die, and the checkpoint that survives them."""

    def __init__(self, hosts):
        self.alive = [f"node{i}" for i in range(hosts)]
        self.committed = 0
        self.groups = []
        self.broken = False

    def alive_hosts(self):
        return list(self.alive)

    def host_env(self):
        return {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

    def kill_host(self, node):
        self.alive.remove(node)

    def add_host(self):
        self.alive.append(f"node{len(self.alive) + 10}")


def fake_group_cls(world, every):
    class FakeGroup:
        def __init__(self, hosts, config):
            self.size = hosts
            self.node_ids = world.alive[:hosts]
            self.stop = False
            self.step = None
            self.env = config.env_vars
            world.groups.append(self)

        def start(self, spec_for):
            self.specs = [spec_for(i, "127.0.0.1:1") for i in range(self.size)]
            self.step = world.committed

        def poll(self):
            if world.broken:
                raise SegmentFailedError("host 0 failed:\nZeroDivisionError: in the user's step")
            dead = [i for i, n in enumerate(self.node_ids) if n not in world.alive]
            if dead:
                raise HostsLostError(dead, [self.node_ids[i] for i in dead], "ActorDiedError")
            if self.step >= self.specs[0].steps:
                return [HostStatus([], True, None)] * self.size
            self.step += 1
            reports = [{"kind": "step", "step": self.step, "loss": 1.0 / self.step, "seconds": 0.1, "tokens_per_second": 10.0}]
            done = False
            if self.step % every == 0:
                world.committed = self.step
                reports.append({"kind": "checkpoint", "step": self.step, "seconds": 0.01})
                done = self.stop
            done = done or self.step >= self.specs[0].steps
            return [HostStatus(list(reports), done, None) for _ in range(self.size)]

        def request_stop(self):
            self.stop = True

        def shutdown(self):
            pass

    return FakeGroup


def fake_plan(devices):
    return Plan(mesh={"data": devices}, in_specs=((), ()), out_specs=(), devices=devices, search_seconds=0.0,
                cost=Cost(0.0, 0.0, {}, 0))


def make(world, chaos=(), steps=30):
    job = parse_job({"name": "t", "program": "m:p", "steps": steps, "global_batch": 8,
                     "hosts": {"min": 2, "max": 4, "devices_per_host": 2},
                     "checkpoint": {"dir": "/tmp/x", "every": 5}})
    clock = iter(range(10**6))
    return JobController(job, world, planner=fake_plan, fingerprint="f", chaos=chaos,
                         config=ControllerConfig(poll_interval_s=0, host_check_interval_s=0),
                         group_cls=fake_group_cls(world, 5), clock=lambda: float(next(clock)),
                         sleep=lambda s: None, printer=lambda s: None)


def run_until(c, pred, limit=500):
    for _ in range(limit):
        if pred():
            return
        c.step()
    raise AssertionError(f"condition not reached; phase {c.phase}")


def test_start_transitions_one_at_a_time():
    world = World(4)
    c = make(world)
    assert c.phase is Phase.PLANNING
    assert c.step() is Phase.STARTING
    assert c.summary.events[-1]["kind"] == "replan" and c.summary.events[-1]["devices"] == 8
    assert c.step() is Phase.RUNNING
    assert world.groups[0].env["XLA_FLAGS"].endswith("=2")  # the cluster says what a host process needs
    assert c.step() is Phase.RUNNING and c.summary.losses == {1: 1.0}


def test_host_loss_replans_on_fewer_hosts_and_resumes_from_the_committed_step():
    world = World(4)
    c = make(world)
    run_until(c, lambda: c.summary.steps_completed == 12)
    world.kill_host("node3")
    assert c.step() is Phase.PLANNING
    assert [e["kind"] for e in c.summary.events][-1] == "host_lost"
    assert c.step() is Phase.STARTING and c.summary.events[-1]["devices"] == 6
    assert c.step() is Phase.RUNNING
    assert world.groups[-1].step == 10  # restored at the last committed checkpoint, not 12
    c.step()
    assert c.summary.recovery_seconds and c.summary.segments[-1]["first_step"] == 11
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FINISHED and c.summary.steps_completed == 30
    assert [s["devices"] for s in c.summary.segments] == [8, 6]


def test_added_host_grows_at_the_next_checkpoint_boundary():
    world = World(3)
    c = make(world)
    run_until(c, lambda: c.summary.steps_completed == 7)
    world.add_host()
    c.step()
    assert c.summary.events[-1]["kind"] == "host_added"
    run_until(c, lambda: c.phase is Phase.PLANNING)
    assert c.summary.steps_completed == 10  # stopped exactly at the checkpoint boundary
    run_until(c, lambda: c.phase.is_terminal)
    assert [s["devices"] for s in c.summary.segments] == [6, 8]
    assert c.summary.segments[1]["first_step"] == 11


def test_too_few_hosts_fails_with_a_reason():
    world = World(2)
    c = make(world)
    run_until(c, lambda: c.summary.steps_completed == 3)
    world.kill_host("node1")
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FAILED and "needs at least 2" in c.summary.reason


def test_chaos_kills_the_named_host_once_its_step_is_reached():
    from orchestrator import parse_chaos

    world = World(4)
    c = make(world, chaos=parse_chaos("lose@6:0"))
    run_until(c, lambda: c.summary.steps_completed == 6)
    c.step()
    assert "node0" not in world.alive
    run_until(c, lambda: c.phase.is_terminal)
    assert c.phase is Phase.FINISHED
    lost = [e for e in c.summary.events if e["kind"] == "host_lost"]
    assert len(lost) == 1 and lost[0]["hosts"] == [0]


def test_an_error_in_the_program_fails_the_job_with_its_traceback():
    world = World(4)
    c = make(world)
    run_until(c, lambda: c.summary.steps_completed == 3)
    world.broken = True
    assert c.step() is Phase.FAILED
    assert "ZeroDivisionError" in c.summary.reason
