"""The fleet store: SQLite shared by several jobs on several clusters, written concurrently."""

import multiprocessing
import time

import pytest

from orchestrator.fleet import FleetStore

pytestmark = pytest.mark.unit


def write_job(path, name, cluster, steps):
    store = FleetStore(path)
    store.start_job(name, cluster=cluster, steps=steps)
    for i in range(1, steps + 1):
        rows = [
            {
                "segment": 1,
                "host": h,
                "step": i,
                "at": time.time(),
                "loss": 1.0 / i,
                "seconds": 0.1,
                "tokens_per_second": 100.0 + h,
                "mfu": 0.4,
            }
            for h in range(2)
        ]
        events = [{"kind": "checkpoint", "step": i, "at": time.time(), "seconds": 0.01}] if i % 10 == 0 else []
        store.add(name, events=events, steps=rows)
        store.update_job(name, state="running", steps_completed=i, mesh={"data": 4}, goodput_ratio=0.5)
    store.update_job(name, state="finished", goodput={"goodput_ratio": 0.5, "badput_seconds": {"startup": 1.0}})
    store.close()


def test_several_jobs_from_several_clusters_write_one_store_at_once(tmp_path):
    path = str(tmp_path / "fleet.db")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=write_job, args=(path, f"job{i}", f"cluster{i % 2}", 100)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = FleetStore(path)
    jobs = {j["name"]: j for j in store.jobs()}
    assert set(jobs) == {"job0", "job1", "job2"}
    assert {j["cluster"] for j in jobs.values()} == {"cluster0", "cluster1"}
    for name, j in jobs.items():
        assert j["state"] == "finished" and j["steps_completed"] == 100 and j["mesh"] == {"data": 4}
        assert j["goodput"]["badput_seconds"] == {"startup": 1.0}
        assert len(store.steps(name)) == 200 and len(store.events(name)) == 10


def test_a_restarted_job_keeps_its_history_and_unknown_columns_are_refused(tmp_path):
    store = FleetStore(str(tmp_path / "fleet.db"))
    store.start_job("a", cluster="c", steps=10)
    store.add("a", events=[{"kind": "host_lost", "step": 3, "at": 1.0, "seconds": 0.5, "hosts": [1]}])
    store.update_job("a", state="failed", reason="2 hosts left")
    store.start_job("a", cluster="c", steps=10)
    assert store.job("a")["state"] == "starting" and store.job("a")["reason"] == ""
    assert store.events("a") == [{"kind": "host_lost", "step": 3, "at": 1.0, "seconds": 0.5, "detail": {"hosts": [1]}}]
    with pytest.raises(KeyError, match="unknown job columns \\['colour'\\]"):
        store.update_job("a", colour="red")
    assert store.job("missing") is None


def test_a_long_jobs_steps_are_thinned_evenly_keeping_each_segments_ends(tmp_path):
    from orchestrator.dashboard import job_detail

    store = FleetStore(str(tmp_path / "fleet.db"))
    store.start_job("long", cluster="c", steps=1000)
    rows = [
        {
            "segment": 1 if i <= 333 else 2,
            "host": h,
            "step": i,
            "at": float(i),
            "loss": 1.0,
            "seconds": 0.1,
            "tokens_per_second": 1.0,
            "mfu": 0.1,
        }
        for i in range(1, 1001)
        for h in range(2)
    ]
    store.add("long", steps=rows)
    full = job_detail(store, "long", points=5000)
    assert full["steps_every"] == 1 and len(full["steps"]) == 2000
    thin = job_detail(store, "long", points=100)
    steps = sorted({s["step"] for s in thin["steps"]})
    assert thin["steps_every"] == 10
    assert steps == sorted(set(range(10, 1001, 10)) | {1, 333, 334})  # each segment's first and last kept
    assert all(len([s for s in thin["steps"] if s["step"] == k]) == 2 for k in steps)  # every host
