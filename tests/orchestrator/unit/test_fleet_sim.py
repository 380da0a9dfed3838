"""The fleet simulator: a trace replayed under each policy, costs applied as measured."""

import pytest

from orchestrator.fleet.simulate import Costs, TraceJob, simulate, synthetic_trace

COSTS = Costs(start=10.0, resize=4.0, efficiency=1.0, checkpoint_every=10)


def test_a_job_alone_takes_its_start_and_its_steps_on_its_maximum():
    job = TraceJob("a", 0.0, 0, 1, 4, steps=100, host_step_seconds=2.0)
    for policy in ("remesh", "no-preempt", "fcfs-gang"):
        r = simulate([job], 4, policy, COSTS)
        assert r.completion["a"] == pytest.approx(10.0 + 100 * 2.0 / 4)
        assert r.resizes == r.suspensions == 0


def test_an_urgent_job_shrinks_the_running_one_instead_of_waiting_for_it():
    low = TraceJob("low", 0.0, 0, 1, 4, steps=1000, host_step_seconds=4.0)
    high = TraceJob("high", 100.0, 5, 2, 2, steps=50, host_step_seconds=4.0)
    remesh = simulate([low, high], 4, "remesh", COSTS)
    fcfs = simulate([low, high], 4, "fcfs-gang", COSTS)
    assert remesh.completion["high"] == pytest.approx(10.0 + 50 * 4.0 / 2)  # started at once on the freed hosts
    assert fcfs.completion["high"] > 900  # waited for the whole of the low job
    assert remesh.resizes == 2 and remesh.suspensions == 0  # shrunk to 2, grown back to 4
    # The low job: 90 steps on 4 hosts by t=100, shrunk (the step in flight again: 89) and on 2
    # hosts from 104; grown at its checkpoint boundary after the urgent job ends at 210 (step 150
    # at 226), on 4 hosts from 230 to its last step at 1080.
    assert remesh.completion["low"] == pytest.approx(230 + 850 * 1.0)


@pytest.mark.parametrize("hosts", [4, 64])
def test_every_job_of_a_trace_finishes_under_every_policy(hosts):
    trace = synthetic_trace(40, hosts, seed=3)
    for policy in ("remesh", "no-preempt", "fcfs-gang"):
        r = simulate(trace, hosts, policy, COSTS)
        assert set(r.completion) == {j.id for j in trace}
        assert all(r.completion[j.id] >= COSTS.start for j in trace)
        assert 0 < r.utilisation <= 1
