"""The fleet store: SQLite shared by several jobs on several clusters, written concurrently."""

import multiprocessing
import time

import pytest

from orchestrator.dashboard.store import FleetStore


def write_job(path, name, cluster, steps):
    store = FleetStore(path)
    run = store.start_run(name, cluster=cluster, steps=steps)
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
        store.add(run, events=events, steps=rows)
        store.update_run(run, state="running", steps_completed=i, mesh={"data": 4}, goodput_ratio=0.5)
    store.update_run(run, state="finished", goodput={"goodput_ratio": 0.5, "badput_seconds": {"startup": 1.0}})
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
    for j in jobs.values():
        assert j["state"] == "finished" and j["steps_completed"] == 100 and j["mesh"] == {"data": 4}
        assert j["goodput"]["badput_seconds"] == {"startup": 1.0}
        assert len(store.steps(j["run"])) == 200 and len(store.events(j["run"])) == 10


def _step(run_steps, i, at):
    return {"segment": 1, "host": 0, "step": i, "at": at, "loss": 1.0 / i, "seconds": 0.1, "tokens_per_second": 1.0,
            "mfu": 0.1, "metrics": {"grad_norm": 2.0 * i}}  # fmt: skip


def test_each_run_of_a_job_has_its_own_id_events_and_steps(tmp_path):
    from orchestrator.dashboard.server import job_detail

    store = FleetStore(str(tmp_path / "fleet.db"))
    first = store.start_run("a", cluster="c", steps=10)
    store.add(first, events=[{"kind": "host_lost", "step": 3, "at": 1.0, "seconds": 0.5, "hosts": [1]}],
              steps=[_step(first, i, float(i)) for i in range(1, 6)])  # fmt: skip
    store.update_run(first, state="failed", reason="2 hosts left")
    second = store.start_run("a", cluster="c", steps=10)
    store.add(second, steps=[_step(second, i, 100.0 + i) for i in range(1, 11)])
    assert second != first
    latest = store.jobs()
    assert [(j["name"], j["run"], j["runs"], j["state"]) for j in latest] == [("a", second, 2, "starting")]
    assert store.job("a")["reason"] == "" and store.job("a", first)["reason"] == "2 hosts left"
    assert [r["run"] for r in store.runs("a")] == [second, first]
    now, before = job_detail(store, "a"), job_detail(store, "a", run=first)
    assert now["run"] == second and [s["step"] for s in now["steps"]] == list(range(1, 11)) and now["events"] == []
    assert before["run"] == first and [s["step"] for s in before["steps"]] == list(range(1, 6))
    assert before["events"] == [{"kind": "host_lost", "step": 3, "at": 1.0, "seconds": 0.5, "detail": {"hosts": [1]}}]
    assert before["steps"][-1]["metrics"] == {"grad_norm": 10.0}
    assert job_detail(store, "a", run=second + 7) is None
    with pytest.raises(KeyError, match="unknown run columns \\['colour'\\]"):
        store.update_run(first, colour="red")
    assert store.job("missing") is None


def test_a_store_from_before_runs_is_migrated_one_run_per_job(tmp_path):
    import sqlite3

    path = str(tmp_path / "old.db")
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE jobs (name TEXT PRIMARY KEY, cluster TEXT NOT NULL, state TEXT NOT NULL, steps INTEGER NOT NULL,
            steps_completed INTEGER NOT NULL DEFAULT 0, reason TEXT NOT NULL DEFAULT '', started_at REAL NOT NULL,
            updated_at REAL NOT NULL);
        CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, kind TEXT NOT NULL, step INTEGER,
            at REAL NOT NULL, seconds REAL NOT NULL DEFAULT 0, detail TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE steps (job TEXT NOT NULL, segment INTEGER NOT NULL, host INTEGER NOT NULL, step INTEGER NOT NULL,
            at REAL NOT NULL, loss REAL, seconds REAL NOT NULL, tokens_per_second REAL NOT NULL, mfu REAL NOT NULL);
        INSERT INTO jobs VALUES ('old', 'c', 'finished', 2, 2, '', 1.0, 2.0);
        INSERT INTO events (job, kind, step, at) VALUES ('old', 'checkpoint', 2, 1.5);
        INSERT INTO steps VALUES ('old', 1, 0, 1, 1.1, 0.5, 0.1, 10.0, 0.2), ('old', 1, 0, 2, 1.2, 0.4, 0.1, 10.0, 0.2);
    """)  # fmt: skip
    db.close()
    store = FleetStore(path)
    (job,) = store.jobs()
    assert job["name"] == "old" and job["state"] == "finished" and job["runs"] == 1
    assert [s["loss"] for s in store.steps(job["run"])] == [0.5, 0.4] and len(store.events(job["run"])) == 1
    again = store.start_run("old", cluster="c", steps=2)
    assert store.job("old")["run"] == again and len(store.steps(again)) == 0


def test_a_long_jobs_steps_are_thinned_evenly_keeping_each_segments_ends(tmp_path):
    from orchestrator.dashboard.server import job_detail

    store = FleetStore(str(tmp_path / "fleet.db"))
    run = store.start_run("long", cluster="c", steps=1000)
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
    store.add(run, steps=rows)
    full = job_detail(store, "long", points=5000)
    assert full["steps_every"] == 1 and len(full["steps"]) == 2000
    thin = job_detail(store, "long", points=100)
    steps = sorted({s["step"] for s in thin["steps"]})
    assert thin["steps_every"] == 10
    assert steps == sorted(set(range(10, 1001, 10)) | {1, 333, 334})  # each segment's first and last kept
    assert all(len([s for s in thin["steps"] if s["step"] == k]) == 2 for k in steps)  # every host


def test_a_runs_step_rows_stay_bounded_and_evenly_spread_however_long_it_runs(tmp_path):
    """A recorder keeping rows for at most 64 steps per host, fed 5,000 steps of 3 hosts over two
    segments: the store never holds more than 64 steps (plus each segment's first) per host, what
    it holds is evenly spread over the whole run, and the job page still charts every host."""
    from types import SimpleNamespace

    from orchestrator.dashboard.server import job_detail
    from orchestrator.telemetry.recorder import FleetRecorder

    store = FleetStore(str(tmp_path / "fleet.db"))
    recorder = FleetRecorder(store, SimpleNamespace(name="long", steps=5000), cluster="c", step_rows=64)
    recorder.started()
    most = 0
    for step in range(1, 5001):
        for host in range(3):
            report = {
                "step": step,
                "at": float(step),
                "loss": 1.0,
                "seconds": 0.1,
                "tokens_per_second": 1.0,
                "mfu": 0.1,
            }
            recorder.step(host, 1 if step <= 2500 else 2, report, speaker=host == 0)
        if step % 250 == 0:
            recorder.flush(force=True)
            rows = store._db.execute("SELECT COUNT(*) FROM steps WHERE run = ?", (recorder.run,)).fetchone()[0]
            most = max(most, rows)
    recorder.flush(force=True)
    assert most <= 3 * (64 + 2)
    kept = sorted({s["step"] for s in store.steps(recorder.run)})
    stride = store.job("long")["step_stride"]
    assert stride == 128  # 5,000 steps in at most 64 kept: every 128th
    assert [k for k in kept if k % stride] == [1, 2501]  # each segment's first step
    assert kept[-1] == 4992 and len(kept) == 5000 // stride + 2
    page = job_detail(store, "long", points=20)
    assert page["steps_every"] % stride == 0
    charted = {(s["host"], s["step"]) for s in page["steps"]}
    assert {h for h, _ in charted} == {0, 1, 2} and len(charted) == 3 * len({k for _, k in charted})


def test_status_reads_a_jobs_state_through_a_dashboard_where_the_store_is_out_of_reach(tmp_path):
    """`remesh status --dashboard URL`: the latest run's row as the store holds it, as JSON from
    the dashboard's API; a job it does not know is empty, and a dashboard that does not answer
    says how to start one."""
    import threading

    from orchestrator.cli.submit import SubmitError, remesh_state
    from orchestrator.dashboard.server import DashboardConfig, make_server
    from orchestrator.dashboard.store import FleetStoreConfig

    path = str(tmp_path / "fleet.db")
    write_job(path, "seen", "c", 20)
    server = make_server(DashboardConfig(port=0, store=FleetStoreConfig(path=path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}"
    try:
        got = remesh_state("seen", dashboard=url)
        want = remesh_state("seen", store=path)
        assert got == want and got["state"] == "finished" and got["steps_completed"] == 20
        assert got["mesh"] == {"data": 4} and got["goodput"]["badput_seconds"] == {"startup": 1.0}
        assert remesh_state("unseen", dashboard=url) == {}
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(SubmitError, match="remesh dashboard --store"):
        remesh_state("seen", dashboard=url)


def test_a_resumed_run_stores_the_steps_a_killed_controller_had_not_flushed(tmp_path):
    """Run 1 stored steps 1 to 7 and was killed holding 8 to 10 (its checkpoint at 10 committed);
    run 2 resumes from step 10 with the reports that checkpoint kept (steps 6 to 10): run 1 gets
    rows for 8, 9 and 10 as host 0's, once, and nothing already stored is written again."""
    from types import SimpleNamespace

    from orchestrator.telemetry.recorder import FleetRecorder

    def report(step):
        return {"step": step, "at": float(step), "loss": 1.0 / step, "seconds": 0.1, "tokens_per_second": 1.0,
                "mfu": 0.1, "input_seconds": 0.0, "wait_seconds": 0.0, "metrics": {"accuracy": 0.5}}  # fmt: skip

    store = FleetStore(str(tmp_path / "fleet.db"))
    job = SimpleNamespace(name="resumed", steps=20)
    first = FleetRecorder(store, job, cluster="c")
    first.started()
    for step in range(1, 8):
        for host in range(2):
            first.step(host, 1, report(step), speaker=host == 0)
    first.flush(force=True)  # and then the controller is killed: 8 to 10 never reach the store
    second = FleetRecorder(store, job, cluster="c")
    second.started()
    reported = {"segment": 1, "steps": [report(s) for s in range(6, 11)]}
    second.resumed(10, reported)
    second.resumed(10, reported)  # a second resume finds them stored
    rows = store.steps(first.run)
    assert sorted((r["host"], r["step"]) for r in rows if r["step"] > 7) == [(0, 8), (0, 9), (0, 10)]
    assert len(rows) == 2 * 7 + 3 and store.steps(second.run) == []
    assert {r["step"]: r["loss"] for r in rows}[9] == 1.0 / 9 and rows[-1]["metrics"] == {"accuracy": 0.5}
    assert store.job("resumed", first.run)["steps_completed"] == 10
