"""The health loop's straggler watch and its policy, on the signal SPMD hosts report: every host's
step takes the group's time, and each waits on the devices and its peers for whatever of it is not
its own work (`Step.wait_seconds`), so the straggler waits least."""

import dataclasses
import random
import types

import pytest

from orchestrator.control import policies
from orchestrator.control.corruption import CorruptionWatch, LossWatch, Spike
from orchestrator.control.hangs import HangWatch, waited_on
from orchestrator.control.health import HealthyScaling
from orchestrator.control.quarantine import Quarantine
from orchestrator.control.state import Running, Segment
from orchestrator.control.stragglers import StragglerConfig, StragglerWatch
from orchestrator.protocol import EventKind, ReplicasDiffer, Step

NODES = ("n0", "n1", "n2", "n3")


def _view(size: int = 4, segment: int = 0):
    seg = Segment(segment, {"data": size}, size, size, "", 0.0, 0.0, first_step=1)
    group = types.SimpleNamespace(size=size, node_ids=NODES[:size])
    return types.SimpleNamespace(group=group, segment=seg, job=types.SimpleNamespace(hosts=types.SimpleNamespace(
        devices_per_host=2)))  # fmt: skip


def _feed(watch: StragglerWatch, view, step: int, work: dict[int, float]) -> None:
    """One step of SPMD hosts whose own work on it takes `work[h]` seconds: the step ends when the
    slowest is done, and each host waits the rest."""
    seconds = max(work.values()) + 0.01
    for host, w in work.items():
        report = Step(seconds=seconds, at=float(step), step=step, loss=1.0, wait_seconds=seconds - w)
        watch.on_report(view, host, report, host == 0)


def test_a_host_three_times_slower_is_named_within_five_steps():
    watch, view = StragglerWatch(), _view()
    for step in range(2, 20):
        _feed(watch, view, step, {h: 0.4 for h in range(4)})
    assert watch.named() is None
    for step in range(20, 25):
        _feed(watch, view, step, {0: 0.4, 1: 0.4, 2: 1.2, 3: 0.4})
        found = watch.named()
        if found:
            break
    assert found is not None and found.host == 2 and found.node == "n2", found
    assert found.steps[0] >= 20 and step - 20 < 5
    assert found.healthy_seconds == pytest.approx(0.41)  # the pace before host 2 was slow
    assert found.lead_share > 0.6


def test_jitter_and_one_long_stall_name_nobody():
    rng = random.Random(7)
    watch, view = StragglerWatch(), _view()
    for step in range(2, 302):
        work = {h: 0.4 * rng.uniform(0.8, 1.2) for h in range(4)}
        if step == 150:
            work[1] = 5.0  # one 5 s stall of one host
        _feed(watch, view, step, work)
        assert watch.named() is None, step


def test_slowness_that_follows_the_data_names_nobody():
    watch, view = StragglerWatch(), _view()
    for step in range(2, 40):
        heavy = step % 4  # the heavy shard lands on another host each step
        _feed(watch, view, step, {h: (1.2 if h == heavy else 0.4) for h in range(4)})
        assert watch.named() is None, step
    assert watch.imbalanced  # seen, and said to be the data's


def test_a_new_group_is_judged_afresh():
    watch, view = StragglerWatch(), _view()
    for step in range(2, 5):
        _feed(watch, view, step, {0: 0.4, 1: 0.4, 2: 1.2, 3: 0.4})
    later = _view(segment=1)
    for step in range(5, 7):
        _feed(watch, later, step, {0: 0.4, 1: 0.4, 2: 1.2, 3: 0.4})
    assert watch.named() is None  # three slow steps in one group and two in the next are not four


def test_off_reads_nothing():
    watch, view = StragglerWatch(StragglerConfig(mode="off")), _view()
    for step in range(2, 12):
        _feed(watch, view, step, {0: 0.4, 1: 0.4, 2: 1.2, 3: 0.4})
    assert watch.named() is None


class _Cluster:
    def alive_hosts(self):
        return list(NODES)

    def placement(self, hosts):
        return "any"

    def placement_on(self, nodes):
        return list(nodes)


def _named_watch(mode: str) -> StragglerWatch:
    watch, view = StragglerWatch(StragglerConfig(mode=mode)), _view()
    for step in range(2, 12):
        _feed(watch, view, step, {0: 0.4, 1: 0.4, 2: 1.2, 3: 0.4} if step > 5 else {h: 0.4 for h in range(4)})
    return watch


def _running(target: int = 4) -> Running:
    return Running(Segment(0, {}, target, target * 2, "", 0.0, 0.0), target, 0)


def test_act_excludes_the_host_where_the_hosts_left_are_predicted_faster():
    watch, quarantine = _named_watch("act"), Quarantine(_Cluster())
    scaling = HealthyScaling(policies.ScalingPolicy(2, 4), watch, quarantine, lambda d: 1.0 / d, 2)
    decision = scaling.while_running(_view(), _running(), lambda: quarantine.alive_hosts())
    assert isinstance(decision, policies.Resize) and decision.at_once
    assert decision.hosts == 3 and decision.event == EventKind.STRAGGLER
    assert decision.fields["host"] == 2 and decision.fields["action"] == "excluded"
    assert decision.fields["without_seconds"] < decision.fields["staying_seconds"]
    assert quarantine.alive_hosts() == ["n0", "n1", "n3"]
    assert quarantine.placement(3) == ["n0", "n1", "n3"]  # the next group is placed without it


def test_staying_is_kept_where_it_is_predicted_faster_and_warn_only_warns():
    for mode, predict in (("act", lambda d: 1.0 if d == 8 else 4.0), ("warn", lambda d: 1.0 / d)):
        watch, quarantine = _named_watch(mode), Quarantine(_Cluster())
        scaling = HealthyScaling(policies.ScalingPolicy(2, 4), watch, quarantine, predict, 2)
        decision = scaling.while_running(_view(), _running(), quarantine.alive_hosts)
        assert isinstance(decision, policies.Warn) and decision.event == EventKind.STRAGGLER, mode
        assert decision.fields["action"] == "warned" and quarantine.alive_hosts() == list(NODES)


def test_a_straggler_named_while_a_grow_waits_for_its_boundary_is_set_aside_at_once():
    # A group of 3 with a host added, to grow onto at the next checkpoint: the straggler named
    # before that boundary is not dropped (the watch judges afresh after naming).
    watch, view = StragglerWatch(), _view(3)
    for step in range(2, 12):
        _feed(watch, view, step, {0: 0.4, 1: 0.4, 2: 1.2} if step > 5 else {h: 0.4 for h in range(3)})
    quarantine = Quarantine(_Cluster())
    scaling = HealthyScaling(policies.ScalingPolicy(2, 4), watch, quarantine, lambda d: 1.0 / d, 2)
    grow = policies.Resize(4, "1 more host(s) available", EventKind.HOST_ADDED)
    running = dataclasses.replace(_running(3), target=4, resize=grow)
    decision = scaling.while_running(view, running, quarantine.alive_hosts)
    assert isinstance(decision, policies.Resize) and decision.at_once, decision
    assert decision.event == EventKind.STRAGGLER and decision.fields["node"] == "n2"
    assert decision.hosts == 3  # the grow still happens, without the straggler
    assert quarantine.placement(3) == ["n0", "n1", "n3"]
    for step in range(12, 20):  # named again before the group stops: excluded once
        _feed(watch, view, step, {0: 0.4, 1: 0.4, 2: 1.2})
    again = scaling.while_running(view, dataclasses.replace(running, target=3, resize=decision), quarantine.alive_hosts)
    assert not isinstance(again, policies.Resize), again


def test_no_exclusion_below_the_jobs_minimum():
    watch, quarantine = _named_watch("act"), Quarantine(_Cluster())
    scaling = HealthyScaling(policies.ScalingPolicy(4, 4), watch, quarantine, lambda d: 1.0 / d, 4)
    decision = scaling.while_running(_view(), _running(), lambda: quarantine.alive_hosts())
    assert isinstance(decision, policies.Warn)


def test_the_host_a_hung_step_waits_on_is_the_one_behind():
    def loops(*marks):
        return [{"step": s, "where": w, "at": 0.0} for s, w in marks]

    assert waited_on(loops((31, "dispatched"), (31, "dispatching"), (31, "dispatched"))) == 1
    assert waited_on(loops((31, "dispatched"), (30, "dispatched"), (31, "dispatched"))) == 1  # never reached it
    assert waited_on(loops((31, "dispatched"), (31, "dispatched"), (31, "dispatched"))) is None  # the devices hang
    assert waited_on(loops((31, "dispatching"), (31, "dispatching"), (31, "dispatched"))) is None  # not one host
    assert waited_on([None, *loops((31, "dispatched"))]) is None  # a host that never marked: nothing to go by


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _hang_view(clock, seconds, progress):
    seg = Segment(0, {}, 3, 6, "", 0.0, 0.0, first_step=1)
    group = types.SimpleNamespace(size=3, node_ids=NODES[:3], progress=progress)
    return types.SimpleNamespace(segment=seg, group=group, recent_step_seconds=seconds, step_reached=30, clock=clock,
                                 host_stacks=lambda: ["stack 0", "stack 1", ""])  # fmt: skip


def _found_after_30_seconds(watch, view, clock):
    """A restarted group's step, judged by the group before's 2 s median: 3 x 5 x 2 s."""
    clock.t += 29.9
    watch.on_poll(view)
    assert watch.hung() is None
    clock.t += 0.2
    watch.on_poll(view)  # seen: the stacks written, then looked at again
    watch.on_poll(view)
    found = watch.hung()
    assert found is not None and found.host == 1 and found.threshold == 30.0


def test_a_hang_is_found_after_five_median_steps_or_five_seconds_with_every_hosts_stacks(tmp_path):
    clock = _Clock()
    marks = [{"step": 31, "where": w, "at": 0.0} for w in ("dispatched", "dispatching", "dispatched")]
    watch = HangWatch(str(tmp_path))
    view = _hang_view(clock, (0.4, 0.4), marks)
    watch.on_poll(view)
    clock.t = 60.0
    watch.on_poll(view)
    assert watch.hung() is None  # two steps timed: too few to say what a step takes
    view = _hang_view(clock, (2.0,) * 5, marks)
    watch.on_report(view, 0, None, True)
    clock.t += 9.9
    watch.on_poll(view)
    assert watch.hung() is None  # under 5 x 2 s
    clock.t += 0.2
    watch.on_poll(view)
    assert watch.hung() is None  # seen: every host's stacks written, then looked at again
    watch.on_poll(view)
    found = watch.hung()
    assert found is not None and found.host == 1 and found.node == "n1" and found.step == 31
    assert found.threshold == 10.0 and found.waited == pytest.approx(10.1)
    files = sorted(p.name for p in (tmp_path / found.stacks.rsplit("/", 1)[1]).iterdir())
    assert files == ["host0.txt", "host1.txt", "host2.txt"]
    assert (tmp_path / found.stacks.rsplit("/", 1)[1] / "host2.txt").read_text() == "(did not answer)\n"
    clock.t += 100
    watch.on_poll(view)
    assert watch.hung() is None  # once a group
    # A group that hangs in its first steps, after a restart: judged by the steps before it, 3x.
    view = _hang_view(clock, (2.0,), marks)
    view.segment = dataclasses.replace(view.segment, index=view.segment.index + 1)
    watch.on_poll(view)
    _found_after_30_seconds(watch, view, clock)
    # Hung in its very first step: judged once every host's loop began (restored and compiled).
    restoring = [{"step": 0, "where": "", "at": 0.0}, marks[1], None]
    view = _hang_view(clock, (), restoring)
    view.segment = dataclasses.replace(view.segment, index=view.segment.index + 2, first_step=None)
    watch.on_poll(view)
    clock.t += 100
    watch.on_poll(view)
    assert watch.hung() is None  # hosts 0 and 2 still restore or compile: no step yet
    view.group.progress = marks
    watch.on_report(view, 0, None, True)
    _found_after_30_seconds(watch, view, clock)


def test_a_step_that_finishes_while_the_stacks_are_written_was_slow_not_hung(tmp_path):
    clock, said = _Clock(), []
    marks = [{"step": 31, "where": w, "at": 0.0} for w in ("dispatched", "dispatching", "dispatched")]
    watch = HangWatch(str(tmp_path), printer=said.append)
    view = _hang_view(clock, (0.4,) * 5, marks)
    watch.on_poll(view)
    clock.t = 5.5
    watch.on_poll(view)  # seen: the stacks written
    watch.on_report(view, 0, None, True)  # meanwhile the step finished (a save beside hosts starting)
    watch.on_poll(view)
    assert watch.hung() is None and "slow, not hung" in said[0], said
    clock.t = 11.0
    watch.on_poll(view)
    watch.on_poll(view)
    assert watch.hung() is not None  # judged again: this time nothing came


def test_copies_that_differ_send_the_job_back_to_their_last_agreement_without_the_named_host():
    watch, quarantine, corruption = StragglerWatch(), Quarantine(_Cluster()), CorruptionWatch()
    scaling = HealthyScaling(policies.ScalingPolicy(2, 4), watch, quarantine, lambda d: 1.0 / d, 2,
                             corruption=corruption)  # fmt: skip
    differ = {"leaf": "params/w", "block": [[0, 8]], "copies": 4, "devices": [7], "processes": [3], "majority": True}
    corruption.on_report(_view(), 1, ReplicasDiffer(step=30, clean_step=25, every=5, disagreements=[differ]), False)
    assert corruption.found() is None  # the host that speaks for the group says it, once
    corruption.on_report(_view(), 0, ReplicasDiffer(step=30, clean_step=25, every=5, disagreements=[differ]), True)
    decision = scaling.while_running(_view(), _running(), quarantine.alive_hosts)
    assert isinstance(decision, policies.Evict) and decision.hosts == (3,) and decision.restore_at_most == 25
    assert decision.event == EventKind.CORRUPTION and decision.fields["action"] == "repaired and excluded"
    assert quarantine.alive_hosts() == ["n0", "n1", "n2"]
    two = dict(differ, copies=2, devices=[1, 5], processes=[0, 2], majority=False)
    corruption.on_report(_view(), 0, ReplicasDiffer(step=40, clean_step=35, every=5, disagreements=[two]), True)
    decision = scaling.while_running(_view(), _running(), quarantine.alive_hosts)
    assert decision.hosts == () and decision.restore_at_most == 35  # no majority: back, on the same hosts


def _loss(watch: LossWatch, step: int, loss: float, speaker: bool = True) -> None:
    watch.on_report(None, 0, Step(seconds=0.3, at=float(step), step=step, loss=loss), speaker)


def test_a_loss_spike_is_found_each_time_and_computed_again_from_the_step_before():
    rng = random.Random(3)
    watch = LossWatch()
    for step in range(1, 25):  # falling fast at first (no spike before the warm-up ends), then slowly
        _loss(watch, step, 5.5 * 0.93**step * rng.uniform(0.98, 1.02) if step < 15 else 2.6 - 0.01 * step)
        assert watch.found() is None, step
    _loss(watch, 25, 2.35, speaker=False)
    assert watch.found() is None  # the host that speaks for the group says it
    _loss(watch, 25, 3.3)
    spike = watch.found()
    assert spike is not None and spike.step == 25 and spike.before == pytest.approx(2.36)
    _loss(watch, 25, 3.3)
    assert watch.found().step == 25  # computed again and high again: found again (the policy decides)
    _loss(watch, 25, 2.35)
    _loss(watch, 26, float("nan"))
    assert watch.found().step == 26  # not finite: a spike whatever the trend


def _spike(step=25):
    return Spike(step, 3.3, 2.36, 0.1)


def test_a_spike_that_comes_back_is_traced_to_the_host_it_follows():
    quarantine = Quarantine(_Cluster())
    scaling = HealthyScaling(policies.ScalingPolicy(2, 4), StragglerWatch(), quarantine, lambda d: 1.0 / d, 2)
    segments = [Segment(0, {}, 4, 8, "", 0.0, 0.0, first_step=1, last_step=26)]
    view = types.SimpleNamespace(**vars(_view()), segments=segments)
    first = scaling._recompute(view, _spike())
    assert isinstance(first, policies.Evict) and first.hosts == () and first.restore_at_most == 24
    assert first.fields["action"] == "recomputed" and quarantine.alive_hosts() == list(NODES)
    again = scaling._recompute(view, _spike())  # back on the same hosts: left out in turn
    assert again.fields["action"] == "recomputed without a host" and again.fields["node"] == "n0"
    assert quarantine.alive_hosts() == ["n1", "n2", "n3"] and again.restore_at_most == 24
    segments.append(Segment(1, {}, 3, 6, "", 0.0, 0.0, first_step=25, last_step=25))
    third = scaling._recompute(view, _spike())  # back without n0: not n0
    assert third.fields["node"] == "n1" and quarantine.alive_hosts() == ["n0", "n2", "n3"]
    segments.append(Segment(2, {}, 3, 6, "", 0.0, 0.0, first_step=25, last_step=25))
    view.segment = segments[-1]
    assert scaling._settled(view) is None  # step 25 not yet past
    segments[-1].last_step = 27
    named = scaling._settled(view)
    assert isinstance(named, policies.Warn) and named.fields == {
        "host": None, "node": "n1", "action": "excluded", "evidence": {"step": 25, "spikes": 3}}  # fmt: skip
    assert quarantine.alive_hosts() == ["n0", "n2", "n3"]  # n1 stays out


def test_a_spike_that_comes_back_without_every_host_is_the_datas():
    quarantine = Quarantine(_Cluster())
    scaling = HealthyScaling(policies.ScalingPolicy(2, 4), StragglerWatch(), quarantine, lambda d: 1.0 / d, 2)
    view = types.SimpleNamespace(**vars(_view()), segments=[])
    decisions = [scaling._recompute(view, _spike()) for _ in range(6)]
    assert [d.fields.get("node") for d in decisions[1:5]] == ["n0", "n1", "n2", "n3"]
    assert isinstance(decisions[5], policies.Warn) and decisions[5].fields["action"] == "accepted"
    assert quarantine.alive_hosts() == list(NODES)
    assert isinstance(scaling._recompute(view, _spike()), policies.Continue)  # accepted: not traced again


class _Probe:
    """A probe whose answers the test gives: False (running), a ratio, or None (failed)."""

    def __init__(self, answers):
        self.answers, self.started = list(answers), []

    def start(self, node, reference):
        self.started.append((node, reference))
        return node

    def spec(self, node):
        return {"env": {"XLA_FLAGS": "--x"}, "hook": None}

    def result(self, probing):
        return self.answers.pop(0)


def _view_at(clock):
    return types.SimpleNamespace(**vars(_view()), clock=clock)


def test_a_straggler_set_aside_is_probed_with_backoff_and_taken_back_once_healthy():
    clock = _Clock()
    probe = _Probe([False, 3.1, 1.05, 1.4, 1.1, 1.02])
    watch, quarantine = _named_watch("act"), Quarantine(_Cluster())
    scaling = HealthyScaling(policies.ScalingPolicy(2, 4), watch, quarantine, lambda d: 1.0 / d, 2, probe=probe)
    view = types.SimpleNamespace(**vars(_view()), clock=clock)
    decision = scaling.while_running(view, _running(), quarantine.alive_hosts)
    assert isinstance(decision, policies.Resize) and quarantine.alive_hosts() == ["n0", "n1", "n3"]
    later = _view(3)
    later.group.node_ids = ("n0", "n1", "n3")
    view = types.SimpleNamespace(**vars(later), clock=clock)
    running = _running(3)
    for t in (5.0, 10.0, 10.5, 11.0):  # due at 10 s; running; 3.1x a peer: still slow, next in 20 s
        clock.t = t
        assert isinstance(scaling.while_running(view, running, quarantine.alive_hosts), policies.Continue)
    assert probe.started == [("n2", "n0")] and "n2" not in quarantine.alive_hosts()
    clock.t = 30.0
    scaling.while_running(view, running, quarantine.alive_hosts)
    assert len(probe.started) == 1  # (backed off: 20 s after the failed probe)
    clock.t = 31.5
    scaling.while_running(view, running, quarantine.alive_hosts)  # started
    # Passed once, probed again at once; 1.4x: the streak broken, backed off 40 s.
    for _ in range(3):
        assert isinstance(scaling.while_running(view, running, quarantine.alive_hosts), policies.Continue)
    assert len(probe.started) == 3 and "n2" not in quarantine.alive_hosts()
    clock.t = 31.5 + 39.0
    scaling.while_running(view, running, quarantine.alive_hosts)
    assert len(probe.started) == 3
    clock.t = 31.5 + 40.5
    scaling.while_running(view, running, quarantine.alive_hosts)  # started: 1.1x, and again at once: 1.02x
    assert isinstance(scaling.while_running(view, running, quarantine.alive_hosts), policies.Continue)
    scaling.while_running(view, running, quarantine.alive_hosts)
    taken = scaling.while_running(view, running, quarantine.alive_hosts)
    assert isinstance(taken, policies.Warn) and taken.fields["action"] == "taken back", taken
    assert taken.fields["evidence"] == {"probe_ratios": [3.1, 1.05, 1.4, 1.1, 1.02], "tries": 5}
    assert "n2" in quarantine.alive_hosts()
    grow = scaling.while_running(view, running, quarantine.alive_hosts)
    assert isinstance(grow, policies.Resize) and grow.hosts == 4 and grow.event == EventKind.HOST_ADDED
    # Slow again once back (its probe passed beside a busy peer): set aside, and probed after 20 s.
    scaling.watch, probe.answers = _named_watch("act"), [False]
    assert isinstance(scaling.while_running(_view_at(clock), _running(), quarantine.alive_hosts), policies.Resize)
    back = clock.t
    clock.t = back + 19.0
    scaling.while_running(view, running, quarantine.alive_hosts)
    assert len(probe.started) == 5
    clock.t = back + 20.5
    scaling.while_running(view, running, quarantine.alive_hosts)
    assert len(probe.started) == 6 and probe.started[-1] == ("n2", "n0")


class _Fleet:
    """The fleet scheduler as one job's `FleetFollowing` sees it: 4 hosts granted until given back."""

    def __init__(self):
        self.held, self.suspect = list(NODES), {}

    def report(self):
        from orchestrator.protocol.fleet import Grant

        return Grant("t-1", "running", 4, tuple((n, f"pg-{n}") for n in self.held), "")

    def release(self, nodes, suspect=None):
        self.held = [n for n in self.held if n not in nodes]
        self.suspect.update(suspect or {})
        return self.report()


def test_on_a_shared_cluster_a_straggler_goes_back_to_the_fleet_marked_suspect_and_the_job_probes_nothing():
    from orchestrator.control.fleet_following import FleetFollowing

    clock, probe, fleet = _Clock(), _Probe([]), _Fleet()
    held = lambda: list(fleet.held)  # noqa: E731
    quarantine = Quarantine(types.SimpleNamespace(alive_hosts=held, live_hosts=held))
    scaling = HealthyScaling(FleetFollowing(2, fleet), _named_watch("act"), quarantine, lambda d: 1.0 / d, 2,
                             probe=probe)  # fmt: skip
    view = types.SimpleNamespace(**vars(_view()), clock=clock, cluster=quarantine)
    decision = scaling.while_running(view, _running(), quarantine.alive_hosts)
    assert isinstance(decision, policies.Resize) and decision.hosts == 3
    assert scaling.admit(view, 3, 0.0) == policies.Resize(3, "granted")  # the group after: n2 given back
    assert fleet.held == ["n0", "n1", "n3"]
    assert fleet.suspect == {"n2": {"why": "straggler at step 8", "env": {"XLA_FLAGS": "--x"}, "hook": None}}
    clock.t = 60.0
    scaling.while_running(view, _running(3), quarantine.alive_hosts)
    assert probe.started == []  # the fleet probes it, not the job that no longer holds it


def test_a_hang_that_names_nobody_waits_three_times_as_long(tmp_path):
    clock = _Clock()
    marks = [{"step": 31, "where": "dispatched", "at": 0.0}] * 3  # every host waits: the devices, or a slow step
    watch = HangWatch(str(tmp_path))
    view = _hang_view(clock, (0.4,) * 5, marks)
    watch.on_poll(view)
    watch.on_report(view, 0, None, True)
    clock.t = 14.0
    watch.on_poll(view)
    assert watch.hung() is None  # past 5 s, not yet 15 s
    clock.t = 15.5
    watch.on_poll(view)
    watch.on_poll(view)
    found = watch.hung()
    assert found is not None and found.host is None and found.threshold == 5.0


def test_a_straggler_the_others_wait_for_every_other_step_is_named_within_six_steps():
    """Where the stop agreement is not every step, the others run a step ahead of the slow host
    and wait for it two steps' worth at once, every other step (seen in the fault storm)."""
    watch, view = StragglerWatch(), _view()
    for step in range(2, 20):
        _feed(watch, view, step, {h: 0.4 for h in range(4)})
    for step in range(20, 27):
        for host in range(4):
            wait = (0.3 if host == 2 else 2.0) if step % 2 else 0.35
            watch.on_report(view, host, Step(seconds=2.0 if step % 2 else 0.4, at=float(step), step=step, loss=1.0,
                                             wait_seconds=wait), host == 0)  # fmt: skip
        found = watch.named()
        if found:
            break
    assert found is not None and found.host == 2 and step - 20 < 6, (step, found)


def test_the_loss_history_stays_a_few_windows_long():
    watch = LossWatch()
    for step in range(1, 2001):
        _loss(watch, step, 2.0)
    assert len(watch._losses) <= 4 * watch.config.window + 1  # (no memory per step on a long job)


def test_a_group_the_health_loop_stops_on_live_hosts_is_said_as_such_not_as_a_loss():
    from orchestrator.protocol import Event
    from orchestrator.telemetry.console import ConsoleCallback

    lines = []
    console = ConsoleCallback(lines.append)
    detail = "the loss at step 25 is 9.1, up from 2.3: computed again from the state before it"
    console.on_event(None, Event(EventKind.HOST_LOST, 26, 1.0, fields={"hosts": [], "processes": [], "detail": detail}))
    console.on_event(None, Event(EventKind.HOST_LOST, 30, 2.0, fields={"hosts": [3], "processes": [], "detail": "x"}))
    assert lines == [
        f"stop  the group after step 26, every host live ({detail})",
        "lost  host(s) [3] after step 30 (x)",
    ]
