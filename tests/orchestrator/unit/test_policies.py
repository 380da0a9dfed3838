import pytest

from orchestrator import Continue, Fail, Failure, FailurePolicy, Resize, Restart, ScalingPolicy
from orchestrator.chaos import ChaosInjector, ChaosSpecError, Fault, parse_chaos


def test_scaling_starts_on_what_is_there_up_to_max_and_grows():
    p = ScalingPolicy(min_hosts=2, max_hosts=4)
    assert p.initial(6) == Resize(4, "6 hosts available at start")
    assert isinstance(p.initial(1), Fail)
    assert p.on_progress(current=3, available=4).hosts == 4
    assert p.on_progress(current=4, available=5) == Continue()
    assert p.on_progress(current=3, available=3) == Continue()


def failure(**kw):
    base = dict(hosts_in_group=4, hosts_lost=1, processes_lost=0, hosts_alive=3, failures_in_a_row=0)
    return Failure(**{**base, **kw})


def test_failure_policy_decisions():
    p = FailurePolicy(min_hosts=2, max_hosts=4, max_failures=3)
    assert p.on_failure(failure()) == Resize(3, "1 host(s) lost")
    assert isinstance(p.on_failure(failure(hosts_lost=0, processes_lost=1, hosts_alive=4)), Restart)
    assert "needs at least 2" in p.on_failure(failure(hosts_alive=1)).reason
    assert "4 failures in a row" in p.on_failure(failure(failures_in_a_row=3)).reason


def test_chaos_parsing_and_firing():
    faults = parse_chaos("add@80, lose@40,lose-in-save@50:0,slow@5:1")
    assert faults == (Fault("slow", 5, (1,)), Fault("lose", 40), Fault("lose-in-save", 50, (0,)), Fault("add", 80))
    inj = ChaosInjector(faults)
    assert inj.slow_hosts() == {1: 5}
    assert inj.due(39) == []
    assert inj.due(45) == [Fault("lose", 40)]
    assert inj.due(45) == []  # fires once
    assert inj.hangs(45) == [Fault("lose-in-save", 50, (0,))]  # rides in every group until it fires
    assert inj.due(100) == [Fault("add", 80)]
    assert inj.slow_hosts() == {1: 5}  # a straggler stays one for every segment
    assert inj.hung("save", 50) == Fault("lose-in-save", 50, (0,)) and inj.hangs(100) == []
    for bad in ("lose", "lose@x", "explode@3", "add@3:1", "freeze@3:1+2", "lose@3:1+1", "add-in-recovery@3:0"):
        with pytest.raises(ChaosSpecError):
            parse_chaos(bad)


def test_storm_kinds_parse_and_fire_where_they_belong():
    faults = parse_chaos("lose@10:0+2,lose-in-restore@20:1,lose-in-start@20,freeze@30:1,add-in-recovery@5")
    assert faults[0] == Fault("add-in-recovery", 5) and faults[1] == Fault("lose", 10, (0, 2))
    assert str(faults[1]) == "lose@10:0+2" and faults[1].hosts_in(2) == [0, 1]  # beyond the group: its last
    inj = ChaosInjector(faults)
    assert inj.hangs(19) == []  # a phase fault rides in groups started once its step is done
    assert {f.phase for f in inj.hangs(20)} == {"restore", "start"}
    assert inj.recovery_adds(4) == [] and inj.recovery_adds(12) == [Fault("add-in-recovery", 5)]
    assert inj.due(30) == [Fault("lose", 10, (0, 2)), Fault("freeze", 30, (1,))]
    assert inj.hung("restore", None) == Fault("lose-in-restore", 20, (1,))
    assert inj.hangs(40) == [Fault("lose-in-start", 20)]


def test_a_loss_is_read_from_the_nodes_gone_and_the_slices_they_break():
    from orchestrator.control.losses import read_loss

    nodes = ["a", "b", "c", "d"]  # slices (a, b) and (c, d)
    # c's node is gone; d lives but leaves with its slice; process 0 died beside it (CPU aborts).
    loss = read_loss(nodes, [0, 2], alive=["a", "b"], live=["a", "b", "d"])
    assert (loss.hosts, loss.processes, loss.dead, loss.left, loss.processes_lost) == ([2], [0], 1, 1, 1)
    # No node gone: the processes that died are the loss, and the failure policy restarts them.
    loss = read_loss(nodes, [1], alive=nodes, live=nodes)
    assert (loss.hosts, loss.processes, loss.dead) == ([1], [], 0)
    assert FailurePolicy(2, 4).on_failure(loss.failure(4, 4, 0)) == Restart(4, "1 process(es) died on live hosts")


def test_slow_step_takes_a_host_and_a_factor():
    faults = parse_chaos("slow-step@20:2x3,slow-step@5")
    assert faults == (Fault("slow-step", 5, (), 3.0), Fault("slow-step", 20, (2,), 3.0))
    assert str(faults[1]) == "slow-step@20:2x3" and parse_chaos("slow-step@7:1x1.5")[0].factor == 1.5
    assert ChaosInjector(faults).pending("slow-step") == list(faults) and ChaosInjector(faults).due(100) == []
    for bad in ("slow-step@20:2x1", "slow@20:2x3", "lose@3x2", "slow-step@20:1+2"):
        with pytest.raises(ChaosSpecError):
            parse_chaos(bad)


def test_hang_and_flip_parse():
    flip, low, hang = parse_chaos("hang@30:1,flip@25:3,flip@26:3x0")
    assert hang == Fault("hang", 30, (1,)) and ChaosInjector((hang,)).pending("hang") == [hang]
    assert flip == Fault("flip", 25, (3,), 30.0) and low.factor == 0.0 and str(low) == "flip@26:3x0"
    assert parse_chaos(str(low)) == (low,)
    assert ChaosInjector((flip, low)).pending("flip") == [flip, low] and ChaosInjector((flip,)).due(100) == []
    assert parse_chaos("flip-grad@25:3x0")[0].factor == 0 and parse_chaos("flip-grad@25:3")[0].factor == 1
    for bad in ("flip@25:3x32", "flip@25:3x1.5", "hang@30:1x2", "flip-grad@25:3x2"):
        with pytest.raises(ChaosSpecError):
            parse_chaos(bad)


def test_a_hang_is_found_at_the_step_it_hung_not_the_step_reached():
    # hang@18 hangs as step 18 is dispatched, before step 17 is read back: the group reached 16.
    # Counted as found only at the hung step's event, the fault hung the next group's host too.
    from orchestrator.chaos import ChaosCallback
    from orchestrator.protocol import Event, EventKind

    (hang,) = parse_chaos("hang@18:0")
    chaos = ChaosCallback((hang,), printer=lambda line: None)
    chaos.on_event(None, Event(EventKind.HANG, 16, 0.0, 0.0, {"action": "excluded", "evidence": {"step": 18}}))
    assert chaos.injector.pending("hang") == []


def test_a_slow_step_bound_to_its_node_is_not_overwritten_by_a_later_one_on_the_same_host():
    # slow-step@261 follows the node that was host 1 of the group at step 260; in the next group
    # that node is host 2, which slow-step@321 (not bound yet) also names. The node is slow from
    # 261, not from 321 (seen in a storm: the slow host was not slowed until step 321).
    import types

    from orchestrator.chaos import ChaosCallback

    early, late = parse_chaos("slow-step@261:1x3,slow-step@321:2x3")
    chaos = ChaosCallback((early, late), printer=lambda line: None)
    before = types.SimpleNamespace(group=types.SimpleNamespace(node_ids=("a", "b", "c"), size=3), step_reached=260)
    chaos._bind_nodes(before)
    after = types.SimpleNamespace(group=types.SimpleNamespace(node_ids=("a", "c", "b", "d"), size=4))
    assert chaos._on_nodes(after, "slow-step", lambda f: f.step) == {2: 261}


def test_jitter_and_stall_parse():
    stall, jitter = parse_chaos("jitter@10x0.2,stall@150:1x5")[::-1]
    assert jitter == Fault("jitter", 10, (), 0.2) and stall == Fault("stall", 150, (1,), 5.0)
    assert parse_chaos("jitter@10")[0].factor == 0.2 and parse_chaos("stall@3:2")[0].factor == 5.0
    with pytest.raises(ChaosSpecError):
        parse_chaos("jitter@10:1")  # every host jitters: no host to name
