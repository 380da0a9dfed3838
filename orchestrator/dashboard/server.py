"""`remesh dashboard`: the fleet store as web pages and a JSON API, on 127.0.0.1 by default.

    /                   every job: state, mesh, step, tokens/s, MFU, goodput
    /jobs/<name>        one run of a job (the latest, or ?run=ID; earlier runs are listed to pick):
                        throughput, loss and every other metric over time with resize, failure and
                        restore events marked, goodput breakdown, the plan of each segment, per-host
                        step times
    /api/jobs           the fleet as JSON: each job's latest run (`run` is its id, `runs` the count)
    /api/allocation     hosts per run over the last day, each cluster's hosts, and the queued runs
    /api/jobs/<name>    one run as JSON: its row, every run of the job, segments, events and step
                        metrics (?run=ID: that run, default the latest; ?submission=ID: the run
                        submitted so; ?points=N: at most about N steps per host, evenly thinned;
                        default 2000)

Charts are drawn in the browser by plotly.js, served from the `plotly` Python package, so the
page needs nothing from the internet. The store is read on every request: the pages refresh.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import re
import threading
import time
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..telemetry.goodput import BADPUT, BADPUT_MEANING
from .store import FleetStore, FleetStoreConfig

PAGES = importlib.resources.files(__package__) / "pages"


@dataclasses.dataclass(frozen=True)
class DashboardConfig:
    host: str = "127.0.0.1"  # only this machine, unless told otherwise
    port: int = 8266
    store: FleetStoreConfig = FleetStoreConfig()


STEP_POINTS = 2000  # steps per host sent to a job page; longer jobs are thinned evenly
ALLOCATION_WINDOW_S = 24 * 3600  # the fleet page's allocation chart: runs updated in the last day


def job_detail(store: FleetStore, name: str, points: int = STEP_POINTS, run: int | None = None) -> dict | None:
    """One run of a job (default: its latest): its row, events and step rows, and every run of the
    job to pick from; with more than `points` steps, every k-th step only (`steps_every` says k)."""
    job = store.job(name, run)
    if job is None:
        return None
    run = job["run"]
    every = max(1, -(-store.last_step(run) // max(1, points)))
    stride = job.get("step_stride") or 1  # a long run keeps rows only at multiples of it
    every = -(-every // stride) * stride
    return {
        "job": job,
        "run": run,
        "runs": store.runs(name),
        "events": store.events(run),
        "steps": store.steps(run, every),
        "steps_every": every,
        "badput_meaning": {k: BADPUT_MEANING[k] for k in BADPUT},
    }


class _Handler(BaseHTTPRequestHandler):
    store: FleetStore
    lock: threading.Lock

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = urllib.parse.urlparse(self.path).path
        if path in ("/", "/index.html"):
            return self._file("fleet.html", "text/html; charset=utf-8")
        if re.fullmatch(r"/jobs/[^/]+", path):
            return self._file("job.html", "text/html; charset=utf-8")
        if path == "/static/plotly.min.js":
            return self._plotly()
        if path == "/api/jobs":
            with self.lock:
                return self._json(self.store.jobs())
        if path == "/api/allocation":
            with self.lock:
                return self._json(self.store.allocation(time.time() - ALLOCATION_WINDOW_S))
        m = re.fullmatch(r"/api/jobs/([^/]+)", path)
        if m:
            name = urllib.parse.unquote(m[1])
            query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
            try:
                points = _int_param(query, "points", STEP_POINTS)
                run = _int_param(query, "run", None)
            except ValueError as e:
                return self._json({"error": str(e)}, HTTPStatus.BAD_REQUEST)
            with self.lock:
                if "submission" in query:  # one submission's run (`remesh status ID --dashboard`)
                    found = self.store.submitted(query["submission"][0])
                    if found is None:
                        return self._json(
                            {"error": f"no run submitted as {query['submission'][0]!r}"}, HTTPStatus.NOT_FOUND
                        )
                    run = found["run"]
                detail = job_detail(self.store, name, points, run)
            if detail is None:
                what = f"no run {run} of job {name!r}" if run is not None else f"no job named {name!r}"
                return self._json({"error": f"{what} in {self.store.path}"}, HTTPStatus.NOT_FOUND)
            return self._json(detail)
        self._json({"error": f"no such page {path!r}; try / or /api/jobs"}, HTTPStatus.NOT_FOUND)

    def _file(self, name: str, content_type: str) -> None:
        self._send((PAGES / name).read_bytes(), content_type)

    def _plotly(self) -> None:
        data = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
        self._send(data, "application/javascript", cache=True)

    def _json(self, value, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(json.dumps(value).encode(), "application/json", status=status)

    def _send(self, body: bytes, content_type: str, *, status: HTTPStatus = HTTPStatus.OK, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=86400" if cache else "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's signature)
        pass  # quiet: the dashboard polls


def _int_param(query: dict, name: str, default):
    if name not in query:
        return default
    try:
        return int(query[name][0])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {query[name][0]!r}") from None


def make_server(config: DashboardConfig = DashboardConfig()) -> ThreadingHTTPServer:
    """A server bound to `config.host:port` (port 0: any free one; see `server_address`)."""
    handler = type("Handler", (_Handler,), {"store": config.store.open(), "lock": threading.Lock()})
    return ThreadingHTTPServer((config.host, config.port), handler)
