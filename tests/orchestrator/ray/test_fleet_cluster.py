"""Fleet end to end on a real Ray cluster made with `ray start` (head + 3 worker nodes on
127.0.0.1, token authentication on): `remesh submit` a job, stop a worker node under it, watch
`remesh status` throughout, scrape Ray's Prometheus endpoints for remesh's metrics, and stop a
second job with `remesh stop`. The fleet store both jobs write is what the dashboard tests read."""

import json
import re
import subprocess
import sys
import time

import pytest

from tests.helpers.jobs import gpt_job
from tests.helpers.paths import ROOT
from tests.helpers.ray_start import RayStartCluster

KILL_AFTER_STEP = 25
STRAGGLER = 1  # this host's input is slow (chaos slow@1:1) for the whole of job A
DEADLINE_S = 420  # bounded: the whole scenario, not one poll


def cli(cluster, *args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=ROOT,
        env=env or cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status(cluster, sid, store):
    proc = cli(cluster, "status", sid, "--address", cluster.address, "--store", store, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)[0]


def submit(cluster, d, name, steps, *extra):
    (d / f"{name}.toml").write_text(gpt_job(name, steps, max_hosts=3, checkpoint_dir=f"ckpt-{name}"))
    proc = cli(
        cluster,
        "submit",
        str(d / f"{name}.toml"),
        "--address",
        cluster.address,
        "--store",
        str(d / "fleet.db"),
        "--summary",
        str(d / f"{name}.json"),
        *extra,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def host_labels(text, name, job="fleet-a"):
    """Hosts with a sample of metric `name` for `job` in a Prometheus exposition (Ray exports
    application metrics under its `ray_` namespace; deploy/prometheus.yml renames them back)."""
    samples = re.findall(rf"^ray_{name}{{([^}}]*)}} [\d.e+-]+$", text, re.M)
    return {m[1] for labels in samples if f'job="{job}"' in labels for m in [re.search(r'host="(\d+)"', labels)] if m}


def metrics_seen(text):
    return host_labels(text, "remesh_step_seconds") == {"0", "1", "2"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    cluster = RayStartCluster(str(d), workers=3, devices_per_host=2)
    store = str(d / "fleet.db")
    out = {"dir": d, "store": store, "address": cluster.address, "cluster": cluster, "observed": [], "metrics": ""}
    try:
        sid = submit(cluster, d, "fleet-a", 60, "--chaos", f"slow@1:{STRAGGLER}")
        out["a"] = sid
        deadline, killed = time.monotonic() + DEADLINE_S, False
        while time.monotonic() < deadline:
            s = status(cluster, sid, store)
            out["observed"].append((time.monotonic(), killed, s))
            step, hosts = s["remesh"].get("steps_completed", 0), s["remesh"].get("hosts")
            if not killed and step >= 5 and not metrics_seen(out["metrics"]):
                out["metrics"] = cluster.metrics()  # Ray's agents export every few seconds
            if not killed and step >= KILL_AFTER_STEP and hosts == 3 and (metrics_seen(out["metrics"]) or step >= 45):
                cluster.stop_worker(2)
                out["killed_after"] = step
                killed = True
            if s["ray_status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(1.0)
        out["logs_a"] = cli(cluster, "logs", sid, "--address", cluster.address).stdout
        out["no_token"] = cli(
            cluster,
            "status",
            sid,
            "--address",
            cluster.address,
            env={k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH")},
        )
        out["unknown"] = cli(cluster, "status", "no-such-job", "--address", cluster.address)

        sid_b = submit(cluster, d, "fleet-b", 2000)
        out["b"] = sid_b
        while time.monotonic() < deadline and status(cluster, sid_b, store)["remesh"].get("steps_completed", 0) < 3:
            time.sleep(1.0)
        out["stop"] = cli(cluster, "stop", sid_b, "--address", cluster.address)
        while time.monotonic() < deadline:
            out["b_status"] = status(cluster, sid_b, store)
            if (
                out["b_status"]["ray_status"] in ("STOPPED", "SUCCEEDED", "FAILED")
                and out["b_status"]["remesh"]["state"] == "stopped"
            ):
                break
            time.sleep(1.0)
        out["list"] = cli(cluster, "status", "--address", cluster.address, "--store", store).stdout
        yield out
    finally:
        cluster.shutdown()


def test_submitted_job_survives_a_worker_node_stopped_under_it(fleet):
    final = fleet["observed"][-1][2]
    assert final["ray_status"] == "SUCCEEDED", (final, fleet["logs_a"][-3000:])
    assert final["remesh"]["state"] == "finished" and final["remesh"]["steps_completed"] == 60
    summary = json.loads((fleet["dir"] / "fleet-a.json").read_text())
    assert [s["hosts"] for s in summary["segments"]] == [3, 2], summary["segments"]
    assert [e["kind"] for e in summary["events"]].count("host_lost") == 1
    assert "lost  host(s)" in fleet["logs_a"] and "fleet-a: finished after 60/60 steps" in fleet["logs_a"]


def test_status_reads_a_dashboard_where_the_store_is_out_of_reach(fleet, dashboard):
    cluster = fleet["cluster"]
    proc = cli(cluster, "status", fleet["a"], "--address", cluster.address, "--store", "/nonexistent/fleet.db")
    assert proc.returncode == 0 and "pass --store PATH" in proc.stdout, proc.stdout + proc.stderr
    proc = cli(cluster, "status", fleet["a"], "--address", cluster.address, "--dashboard", dashboard, "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)[0]["remesh"]
    assert r["steps_completed"] == 60 and r["steps"] == 60 and r["hosts"] == 2 and r["mesh"] == {"data": 4}
    assert r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1


def test_status_tells_the_truth_throughout(fleet):
    observed = [(killed, s) for _, killed, s in fleet["observed"]]
    steps = [s["remesh"].get("steps_completed", 0) for _, s in observed]
    assert steps == sorted(steps), "progress went backwards"
    for killed, s in observed:
        r = s["remesh"]
        if s["ray_status"] == "RUNNING" and r:
            # Ray's driver may outlive the controller by a moment: finished is still the truth then.
            assert r["state"] in ("starting", "planning", "running", "finished"), s
        if r.get("state") == "running" and r["steps_completed"]:
            assert r["devices"] == 2 * r["hosts"] and (killed or r["hosts"] == 3), s
    before = [s for killed, s in observed if not killed and s["remesh"].get("state") == "running"]
    after = [
        s
        for killed, s in observed
        if killed and s["remesh"].get("state") == "running" and s["remesh"]["steps_completed"] > fleet["killed_after"]
    ]
    assert before and all(s["remesh"]["hosts"] == 3 for s in before)
    assert (
        after
        and after[-1]["remesh"]["hosts"] == 2
        and after[-1]["remesh"]["mesh"] in ({"data": 4}, {"data": 2, "model": 2})
    )
    line = fleet["list"]
    assert re.search(r"fleet-a-\S+: SUCCEEDED\s+remesh finished\s+step 60/60", line), line
    assert re.search(r"fleet-b-\S+: STOPPED\s+remesh stopped", line), line


def test_stop_stops_a_running_job_and_the_store_says_so(fleet):
    assert fleet["stop"].returncode == 0 and "stop requested" in fleet["stop"].stdout
    b = fleet["b_status"]
    assert b["ray_status"] == "STOPPED" and b["remesh"]["state"] == "stopped", b
    assert 3 <= b["remesh"]["steps_completed"] < 2000


def test_a_client_without_the_token_or_with_an_unknown_id_gets_a_clear_error(fleet):
    proc = fleet["no_token"]
    assert proc.returncode == 2 and "token" in proc.stderr.lower(), proc.stderr
    proc = fleet["unknown"]
    assert proc.returncode == 2 and "no job 'no-such-job' on the cluster" in proc.stderr, proc.stderr


def test_metrics_reach_prometheus_through_ray_with_job_and_host_labels(fleet):
    from orchestrator.metrics import METRICS

    text = fleet["metrics"]
    for name in ("remesh_step_seconds", "remesh_tokens_per_second", "remesh_mfu", "remesh_step"):
        assert host_labels(text, name) == {"0", "1", "2"}, (
            name,
            [leaf for leaf in text.splitlines() if "remesh" in leaf][:20],
        )
    assert re.search(r'^ray_remesh_goodput_ratio{[^}]*job="fleet-a"[^}]*} ', text, re.M), "controller metrics missing"
    assert re.search(r'^ray_remesh_devices{[^}]*job="fleet-a"[^}]*} 6\.0$', text, re.M), "devices gauge missing"
    exported = set(re.findall(r"^ray_(remesh_\w+?)(?:_total)?{", text, re.M))
    assert exported and exported <= set(METRICS) | {n.removesuffix("_total") for n in METRICS}, exported


@pytest.fixture(scope="module")
def dashboard(fleet):
    import threading

    from orchestrator.dashboard.server import DashboardConfig, make_server
    from orchestrator.dashboard.store import FleetStoreConfig

    server = make_server(DashboardConfig(port=0, store=FleetStoreConfig(path=fleet["store"])))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    yield f"http://{host}:{port}"
    server.shutdown()


def get_json(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.mark.browser
def test_fleet_page_in_chromium_lists_both_jobs_with_their_figures(dashboard, fleet, tmp_path):
    from tests.helpers import browser

    page = browser.dom(dashboard + "/", str(tmp_path / "profile"))
    shot = browser.screenshot(dashboard + "/", "dashboard-fleet.png", str(tmp_path / "profile"))
    rows = dict(re.findall(r'<tr data-job="([^"]+)">(.*?)</tr>', page, re.S))
    assert set(rows) == {"fleet-a", "fleet-b"}, page[-3000:]
    assert 'class="state-finished">finished<' in rows["fleet-a"] and 'class="state-stopped">stopped<' in rows["fleet-b"]
    api = {j["name"]: j for j in get_json(dashboard + "/api/jobs")}
    mfu = re.search(r'class="num mfu">([\d.]+)%<', rows["fleet-a"])[1]
    assert float(mfu) == pytest.approx(100 * api["fleet-a"]["mfu"], abs=0.051)
    assert "2 jobs, 0 running" in page and shot


@pytest.mark.browser
def test_job_page_in_chromium_charts_throughput_loss_hosts_and_marks_events(dashboard, fleet, tmp_path):
    from tests.helpers import browser

    url = dashboard + "/jobs/fleet-a"
    page = browser.dom(url, str(tmp_path / "profile"))
    browser.screenshot(url, "dashboard-job.png", str(tmp_path / "profile"))
    assert 'data-loaded="true"' in page, page[-3000:]
    for chart in ("throughput", "loss", "hosts", "waits", "goodput"):
        div = page.split(f'id="{chart}"')[1][:200000]
        assert 'class="main-svg"' in div.split('class="chart"')[0], f"plotly drew no {chart} chart"
    throughput_svg = page.split('id="throughput"')[1].split('id="loss"')[0]
    assert "host lost" in throughput_svg and "restore" in throughput_svg  # events marked on the chart
    hosts_svg = page.split('id="hosts"')[1].split('id="waits"')[0]
    assert all(f"host {h}" in hosts_svg for h in (0, 1, 2))  # per-host step times, a legend entry each
    waits_svg = page.split('id="waits"')[1].split('id="goodput"')[0]
    assert all(f"host {h}" in waits_svg for h in (0, 1, 2))
    segments = re.findall(r"<tr><td>\d</td>.*?</tr>", page.split('id="segments"')[1].split('id="events"')[0], re.S)
    assert len(segments) == 2 and "mesh" in segments[0]
    kinds = re.findall(r'<tr data-kind="(\w+)">', page)
    assert {"host_lost", "restore", "replan", "compile", "checkpoint"} <= set(kinds)


def test_json_api_agrees_with_the_run_summary(dashboard, fleet):
    summary = json.loads((fleet["dir"] / "fleet-a.json").read_text())
    d = get_json(dashboard + "/api/jobs/fleet-a")
    assert d["job"]["throughput"]["tokens_per_second"] == summary["throughput"]["tokens_per_second"]
    assert d["job"]["throughput"]["mfu"] == summary["throughput"]["mfu"]
    assert d["job"]["goodput"] == summary["goodput"]
    assert d["job"]["steps_completed"] == summary["steps_completed"] == 60
    # SPMD: every host of a segment reports the same loss for a step; the latest segment's run of a
    # step is the one the summary keeps. Host 0 need not have every step: where its node is the one
    # stopped, the survivors' reports of the last steps before the loss speak for the group.
    by_run = {}
    for s in d["steps"]:
        by_run.setdefault((s["segment"], s["step"]), set()).add(s["loss"])
    assert all(len(losses) == 1 for losses in by_run.values()), "hosts of one segment disagree on a loss"
    latest = {step: losses.pop() for (_, step), losses in sorted(by_run.items())}
    assert [latest[i] for i in range(1, 61)] == pytest.approx(summary["losses"], rel=1e-6)
    assert [e["kind"] for e in d["events"]] == [e["kind"] for e in summary["events"]]
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as e:
        get_json(dashboard + "/api/jobs/no-such-job")
    assert e.value.code == 404 and "no job named 'no-such-job'" in e.value.read().decode()


def test_a_straggler_stands_out_in_the_per_host_figures(dashboard, fleet):
    import statistics

    steps = get_json(dashboard + "/api/jobs/fleet-a")["steps"]
    for segment in sorted({s["segment"] for s in steps}):
        rows = [
            s
            for s in steps
            if s["segment"] == segment and s["step"] > min(r["step"] for r in steps if r["segment"] == segment)
        ]
        wait = {
            h: statistics.median(s["wait_seconds"] for s in rows if s["host"] == h) for h in {s["host"] for s in rows}
        }
        slowest_input = max(wait, key=lambda h: statistics.median(s["input_seconds"] for s in rows if s["host"] == h))
        assert slowest_input == STRAGGLER and min(wait, key=wait.get) == STRAGGLER, (segment, wait)
        # The others wait for the straggler's extra input time (0.3 s a step), less what they overlap.
        assert all(wait[h] > wait[STRAGGLER] + 0.15 for h in wait if h != STRAGGLER), (segment, wait)
