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
