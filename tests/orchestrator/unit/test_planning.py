"""The plan cache: a plan is made once per (program, device count), plans made ahead are taken
when a resize needs them, and what a group compiled ahead goes to the group that runs that plan."""

import threading

from orchestrator.control.planning import PlanCache
from orchestrator.protocol import CompileAhead, plan_key


class Planner:
    def __init__(self, fail_at=()):
        self.calls, self.fail_at = [], set(fail_at)
        self.threads = set()

    def __call__(self, devices):
        self.calls.append(devices)
        self.threads.add(threading.current_thread().name)
        if devices in self.fail_at:
            raise ValueError(f"no plan for {devices}")
        return f"plan-{devices}"


def test_a_second_request_for_the_same_mesh_is_a_cache_hit():
    planner = Planner()
    cache = PlanCache(planner, "fp")
    first, second = cache.plan(8), cache.plan(8)
    assert (first.plan, first.cached, first.ahead) == ("plan-8", False, False)
    assert (second.plan, second.cached, second.ahead) == ("plan-8", True, False)
    assert planner.calls == [8]


def test_plans_made_ahead_are_taken_without_planning_again():
    planner = Planner(fail_at={12})
    cache = PlanCache(planner, "fp")
    cache.plan(8)
    cache.plan_ahead(6)
    cache.plan_ahead(12)
    cache.plan_ahead(8)  # planned already: nothing to do
    made = {}
    while len(made) < 2:
        made.update(cache.made_ahead())
    assert made[6] == "plan-6" and isinstance(made[12], ValueError)
    taken = cache.plan(6)
    assert (taken.plan, taken.cached, taken.ahead) == ("plan-6", True, True)
    assert sorted(planner.calls) == [6, 8, 12] and any(t.startswith("remesh-plan") for t in planner.threads)
    cache.shutdown()


def test_executables_compiled_ahead_are_kept_for_their_plan_only():
    cache = PlanCache(Planner(), "fp")
    cache.compiled_ahead(CompileAhead(seconds=1.0, devices=4, executables={"plan": plan_key("A"), "step": ["x"]}))
    cache.compiled_ahead(CompileAhead(seconds=1.0, error="ValueError: failed"))
    assert cache.executables("A") == {"plan": plan_key("A"), "step": ["x"]} and cache.executables("B") is None


def test_a_mesh_is_ready_once_its_plan_is_made_and_its_programs_compiled_ahead():
    class Plan(str):
        def to_json(self):
            return str(self)

    cache = PlanCache(lambda devices: Plan(f"plan-{devices}"), "fp")
    assert not cache.ready(6)
    cache.plan(6)
    assert not cache.ready(6)  # planned, not compiled: a shrink to it would still compile
    cache.compiled_ahead(CompileAhead(seconds=1.0, devices=6, executables={"plan": plan_key("plan-6"), "step": ["x"]}))
    assert cache.ready(6) and not cache.ready(4)
