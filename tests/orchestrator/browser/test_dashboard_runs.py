"""The job page in headless Chromium over a store written directly: each run of a job on its own
(no line across the gap between runs), earlier runs picked by id, and every metric the step
returns charted beside the loss."""

import re
import threading

import pytest

from orchestrator.dashboard.server import DashboardConfig, make_server
from orchestrator.dashboard.store import FleetStore, FleetStoreConfig
from tests.helpers import browser


def _steps(first, last, t0):
    return [{"segment": 1, "host": 0, "step": i, "at": t0 + i, "loss": 3.0 / i, "seconds": 0.1,
             "tokens_per_second": 100.0, "mfu": 0.1, "metrics": {"grad_norm": 1.0 + i}}
            for i in range(first, last + 1)]  # fmt: skip


@pytest.fixture
def dashboard(tmp_path):
    path = str(tmp_path / "fleet.db")
    store = FleetStore(path)
    runs = []
    for t0, (first, last), state in ((1.7e9, (1, 30), "stopped"), (1.7e9 + 3600, (31, 50), "finished")):
        run = store.start_run("twice", cluster="c", steps=50)
        store.add(run, steps=_steps(first, last, t0))
        store.update_run(run, state=state, steps_completed=last, segments=[{"mesh": {"data": 4}, "hosts": 2}])
        runs.append(run)
    store.close()
    server = make_server(DashboardConfig(port=0, store=FleetStoreConfig(path=path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", runs
    server.shutdown()


def _plotted(page, chart):
    """(lines drawn, markers drawn) in a chart, read from plotly's SVG."""
    div = page.split(f'id="{chart}"')[1].split("<h2")[0]
    return len(re.findall(r'class="js-line"', div)), len(re.findall(r'class="point"', div))


def test_the_job_page_shows_the_latest_run_lets_the_user_pick_earlier_ones_and_charts_every_metric(dashboard, tmp_path):
    url, (first, second) = dashboard
    page = browser.dom(f"{url}/jobs/twice", str(tmp_path / "profile"))
    browser.screenshot(f"{url}/jobs/twice", "dashboard-runs.png", str(tmp_path / "profile"))
    assert 'data-loaded="true"' in page, page[-3000:]
    options = re.findall(r'<option value="(\d+)"( selected="")?[^>]*>([^<]*)</option>', page)
    assert [int(v) for v, _, _ in options] == [second, first]
    assert "2 runs of this job; the latest is shown" in page
    assert 'data-metric="grad_norm"' in page and 'class="main-svg"' in page.split('data-metric="grad_norm"')[1][:5000]
    assert _plotted(page, "throughput") == (1, 20)  # the latest run's steps 31-50, one line

    earlier = browser.dom(f"{url}/jobs/twice?run={first}", str(tmp_path / "profile"))
    assert "an earlier one is shown" in earlier and _plotted(earlier, "throughput") == (1, 30)


def test_the_json_api_refuses_a_run_or_points_that_is_not_a_number_and_names_it(dashboard):
    import json
    import urllib.error
    import urllib.request

    url, (first, _) = dashboard
    for query, message in (("run=x", "run must be an integer, got 'x'"), ("points=ten", "points must be an integer")):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}/api/jobs/twice?{query}", timeout=30)
        assert e.value.code == 400 and message in json.loads(e.value.read())["error"]
    missing = f"{url}/api/jobs/twice?run={first + 99}"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(missing, timeout=30)
    assert e.value.code == 404 and f"no run {first + 99} of job 'twice'" in json.loads(e.value.read())["error"]
    assert json.loads(urllib.request.urlopen(f"{url}/api/jobs/twice?run={first}", timeout=30).read())["run"] == first


def test_the_job_page_shows_each_hosts_health(tmp_path):
    path = str(tmp_path / "fleet.db")
    store = FleetStore(path)
    run = store.start_run("slow", cluster="c", steps=40)
    steps = []
    for i in range(1, 41):
        segment, hosts = (1, 4) if i <= 26 else (2, 3)
        for h in range(hosts):
            wait = 0.05 if (segment == 1 and h == 2 and i > 8) else (0.9 if segment == 1 and i > 8 else 0.3)
            steps.append({"segment": segment, "host": h, "step": i, "at": 1.7e9 + i, "loss": 3.0 / i, "seconds": 1.0,
                          "tokens_per_second": 100.0, "mfu": 0.1, "wait_seconds": wait})  # fmt: skip
    event = {"kind": "straggler", "step": 24, "at": 1.7e9 + 24, "host": 2, "action": "excluded", "hosts": 3,
             "reason": "host 2 is slow: the others waited 85% of each step for it"}  # fmt: skip
    store.add(run, events=[event], steps=steps)
    store.update_run(run, state="finished", steps_completed=40, segments=[{"hosts": 4}, {"hosts": 3}])
    store.close()
    server = make_server(DashboardConfig(port=0, store=FleetStoreConfig(path=path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.dom(f"http://127.0.0.1:{server.server_address[1]}/jobs/slow", str(tmp_path / "profile"))
    finally:
        server.shutdown()
    assert 'data-loaded="true"' in page, page[-3000:]
    table = page.split('id="health"')[1].split("</table>")[0]
    rows = re.findall(r'<tr data-health="(\w+)"><td>(\d+)</td><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td>', table)
    assert [(r[1], r[2], r[0]) for r in rows] == [
        ("1", "0", "ok"), ("1", "1", "ok"), ("1", "2", "straggler"), ("1", "3", "ok"),
        ("2", "0", "ok"), ("2", "1", "ok"), ("2", "2", "ok"),
    ]  # fmt: skip
    assert rows[2][3] == "straggler: excluded" and "host 2 is slow" in table
    assert float(rows[2][4]) < float(rows[0][4])  # the straggler waits least
