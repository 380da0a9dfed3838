"""The pricing helper (partitioner/helper.py): candidates priced in a second process come back as
this process prices them, in the order asked, and a helper that stalls, dies or is busy with
another thread's plan leaves every plan as it was."""

import os
import signal
import threading

import pytest

from partitioner import helper as pricing
from partitioner.search import search
from tests.corpus import load


@pytest.fixture
def helper(monkeypatch):
    """A fresh helper, ready, with a count of the jobs sent to it; closed after the test."""
    if pricing._helper() is not None:
        pricing._HELPER[0].close()
    pricing.start_helper(always=True)
    h = pricing._helper()
    assert h is not None and h.wait_ready(30.0), "the helper did not start"
    sent = []
    send = pricing._Helper.send
    monkeypatch.setattr(pricing._Helper, "send", lambda self, job: sent.append(job) or send(self, job))
    h.sent = sent
    yield h
    h.close()


def _ranked(name, devices, helper=True, **options):
    module, kwargs = load(name)
    fn, args = module.build(**{**kwargs, **options})
    plan, ranked = search(fn, *args, devices=devices, hardware="h100", compile_check=False, pricing_helper=helper)
    return plan, [(c.tactic, dict(c.mesh), c.cost) for c in ranked]


def _specs(plan):
    return plan.to_dict()["in_specs"], plan.mesh


@pytest.mark.parametrize(
    ("name", "devices", "options"),
    [("llama-maxtext", 8, {}), ("moe-top2-shared", 8, {}), ("t5", 1024, {"layers": 12})],
)
def test_the_helper_prices_every_candidate_as_this_process_does(helper, monkeypatch, name, devices, options):
    on, ranked_on = _ranked(name, devices, **options)
    assert helper.sent, "the helper priced nothing: the test compares nothing"
    sent = len(helper.sent)
    off, ranked_off = _ranked(name, devices, helper=False, **options)
    assert len(helper.sent) == sent, "pricing_helper=False sent jobs to the helper"
    assert ranked_on == ranked_off
    assert _specs(on) == _specs(off)


def test_a_refinement_that_keeps_a_trial_drops_what_was_priced_past_it(helper, monkeypatch):
    # Grouped-query attention by `jnp.tile` breaks Megatron's alternation: the refinement keeps
    # trials, each time dropping the prices found ahead of it, and the next plan reads the helper's
    # answers in step (a stale answer would misprice it).
    on, ranked_on = _ranked("llama-gqa-tile", 8)
    assert on.tactic == "refined" and helper.sent
    again, ranked_again = _ranked("llama-gqa-tile", 8)
    off, ranked_off = _ranked("llama-gqa-tile", 8, helper=False)
    assert ranked_on == ranked_again == ranked_off
    assert _specs(on) == _specs(again) == _specs(off)


def test_a_helper_that_stalls_is_left_and_the_plan_is_the_same(helper, monkeypatch):
    monkeypatch.setattr(pricing, "HELPER_WAIT_S", 0.5)
    send = pricing._Helper.send

    def stalling(self, job):  # alive, holding the graph, never answering
        os.kill(self.proc.pid, signal.SIGSTOP)
        send(self, job)

    monkeypatch.setattr(pricing._Helper, "send", stalling)
    try:
        on, ranked_on = _ranked("llama-maxtext", 8)
    finally:
        if helper.proc.poll() is None:
            os.kill(helper.proc.pid, signal.SIGCONT)
    assert not helper.alive, "the stalled helper should have been given up"
    off, ranked_off = _ranked("llama-maxtext", 8, helper=False)
    assert ranked_on == ranked_off and _specs(on) == _specs(off)


def test_a_helper_that_stalls_before_taking_the_graph_is_left_too(helper, monkeypatch):
    monkeypatch.setattr(pricing, "HELPER_WAIT_S", 0.5)
    os.kill(helper.proc.pid, signal.SIGSTOP)  # the graph fills the pipe, and no more goes in
    try:
        on, ranked_on = _ranked("llama-maxtext", 8)
    finally:
        if helper.proc.poll() is None:
            os.kill(helper.proc.pid, signal.SIGCONT)
    assert not helper.alive
    off, ranked_off = _ranked("llama-maxtext", 8, helper=False)
    assert ranked_on == ranked_off and _specs(on) == _specs(off)


def test_a_dead_helper_is_left_and_a_search_starts_another(helper, monkeypatch):
    helper.proc.kill()
    helper.proc.wait()
    on, ranked_on = _ranked("llama-maxtext", 8)
    assert not helper.alive
    assert pricing._helper() is not None and pricing._helper() is not helper, "no new helper was started"
    off, ranked_off = _ranked("llama-maxtext", 8, helper=False)
    assert ranked_on == ranked_off and _specs(on) == _specs(off)


def test_two_threads_planning_at_once_share_the_helper_one_at_a_time(helper):
    alone, ranked_alone = _ranked("moe-top2-shared", 8)
    results, errors = {}, []

    def plan(k):
        try:
            results[k] = _ranked("moe-top2-shared", 8)
        except Exception as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=plan, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for p, ranked in results.values():
        assert ranked == ranked_alone and _specs(p) == _specs(alone)


def test_the_helper_prices_a_deep_step_without_importing_jax(helper):
    _ranked("t5", 1024, layers=96)
    assert helper.sent
    with open(f"/proc/{helper.proc.pid}/maps") as f:
        maps = f.read()
    assert "jaxlib" not in maps and "numpy" in maps
