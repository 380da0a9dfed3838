"""The fleet page in headless Chromium over a store written directly: hosts per job over time on a
shared cluster (a job shrunk for another and grown back), the idle hosts, and the queued jobs with
why each waits."""

import json
import threading
import time
import urllib.request

import pytest

from orchestrator.dashboard.server import DashboardConfig, make_server
from orchestrator.dashboard.store import FleetStore, FleetStoreConfig
from tests.helpers import browser


@pytest.fixture
def fleet_page(tmp_path):
    path = str(tmp_path / "fleet.db")
    store = FleetStore(path)
    t0 = time.time() - 600
    low = store.start_run("low", cluster="shared", steps=150)
    segments = [{"mesh": {"data": 8}, "hosts": 4, "started_at": 5.0}, {"mesh": {"data": 4}, "hosts": 2, "started_at": 100.0},
                {"mesh": {"data": 8}, "hosts": 4, "started_at": 300.0}]  # fmt: skip
    store.update_run(low, state="running", segments=segments, cluster_hosts=5, started_at=t0)
    high = store.start_run("high", cluster="shared", steps=30)
    store.update_run(high, state="finished", segments=[{"mesh": {"data": 4}, "hosts": 2, "started_at": 10.0}],
                     cluster_hosts=5, started_at=t0 + 95)  # fmt: skip
    store.add(
        high,
        steps=[
            {
                "segment": 1,
                "host": 0,
                "step": 30,
                "at": t0 + 290,
                "loss": 1.0,
                "seconds": 0.1,
                "tokens_per_second": 100.0,
                "mfu": 0.1,
            }
        ],
    )  # its last step, before the low job grew back
    waiting = store.start_run("big", cluster="shared", steps=10)
    store.update_run(waiting, state="queued", cluster_hosts=5, started_at=t0 + 400,
                     reason="waiting for hosts: needs 4, 1 idle, 4 held by jobs of priority 0 or higher")  # fmt: skip
    store.close()
    server = make_server(DashboardConfig(port=0, store=FleetStoreConfig(path=path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", (low, high, waiting), t0
    server.shutdown()


def test_the_allocation_api_gives_each_runs_hosts_over_time(fleet_page):
    url, (low, high, waiting), t0 = fleet_page
    with urllib.request.urlopen(f"{url}/api/allocation", timeout=10) as r:
        a = json.load(r)
    spans = [(i["run"], i["hosts"], round(i["start"] - t0)) for i in a["intervals"]]
    assert spans == [(low, 4, 5), (low, 2, 100), (low, 4, 300), (high, 2, 105)]
    low_ends = [round(i["end"] - t0) for i in a["intervals"] if i["run"] == low][:2]
    assert low_ends == [100, 300]  # each segment holds its hosts until the next one starts
    assert [round(i["end"] - t0) for i in a["intervals"] if i["run"] == high] == [290]  # ended with its last step
    assert [i["holding"] for i in a["intervals"]] == [False, False, True, False]
    assert a["cluster_hosts"] == {"shared": 5}
    assert [(q["run"], q["reason"]) for q in a["queued"]] == [
        (waiting, "waiting for hosts: needs 4, 1 idle, 4 held by jobs of priority 0 or higher")
    ]


def test_the_fleet_page_charts_hosts_per_job_and_shows_idle_hosts_and_the_queue(fleet_page, tmp_path):
    url, _, _ = fleet_page
    page = browser.dom(url, str(tmp_path / "profile"))
    browser.screenshot(url, "dashboard-fleet.png", str(tmp_path / "profile"))
    chart = page.split('id="allocation"')[1].split("<h2")[0]
    assert chart.count('class="js-line"') >= 3, chart[:2000]  # low, high, and the cluster's hosts
    assert "idle hosts: 1 of 5" in page, page.split('id="idle"')[1][:200]  # the low job's 4 of the cluster's 5, now
    queued = page.split('id="queued"')[1].split("</table>")[0]
    assert 'data-job="big"' in queued and "waiting for hosts: needs 4, 1 idle" in queued
