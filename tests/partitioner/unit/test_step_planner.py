"""One step planned for several device counts (`partitioner.StepPlanner`): read once, each plan
as `plan` makes it, from two threads at once as a controller and its planning thread ask."""

import threading

import pytest

from partitioner import PlanInputError, StepPlanner, depth, plan
from tests.corpus import load


def essentials(p):
    d = p.to_dict()
    return d["mesh"], d["in_specs"], d["out_specs"], p.cost.total_seconds, p.cost.peak_bytes_per_device


def test_a_step_read_once_plans_every_device_count_as_plan_does(monkeypatch):
    module, options = load("llama-maxtext")
    fn, args = module.build(layers=10, **options)
    fresh = {n: plan(fn, *args, devices=n, hardware="h100", compile_check=False) for n in (8, 4, 2)}
    made, trace = [], depth._trace
    monkeypatch.setattr(depth, "_trace", lambda *a: made.append(a[4]) or trace(*a))  # (fn, ..., layers, memo)
    steps = StepPlanner(fn, *args)
    got, start = {}, threading.Barrier(2)

    def planned(n):
        start.wait()
        got[n] = steps.plan(n, hardware="h100", compile_check=False)

    threads = [threading.Thread(target=planned, args=(n,)) for n in (8, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got[2] = steps.plan(2, hardware="h100", compile_check=False)
    assert made == [4, 3]  # the two shallow traces (the shared depth first), for all three plans
    for n, p in got.items():
        assert essentials(p) == essentials(fresh[n]), n
    reused = [n for n, p in got.items() if "capture and fold reused from an earlier plan" in p.notes[-1]]
    assert sorted(reused) in ([2, 4], [2, 8])  # all but the first one planned
    (first,) = set(got) - set(reused)
    read = steps._inputs.seconds  # the first plan's time includes reading the step
    assert got[first].search_seconds > sum(read) > 0 and got[first].notes[-1].startswith("time: capture ")
    with pytest.raises(PlanInputError, match="devices must be at least 1, got 0"):
        steps.plan(0)
    with pytest.raises(PlanInputError, match=r"\['batch_argnums'\] say how the step is read: give them to StepPlanner"):
        steps.plan(8, batch_argnums=(1,))
