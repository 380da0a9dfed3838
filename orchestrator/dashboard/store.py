"""The fleet store: every run of every job, its state, events and step metrics, in one SQLite file.

Several jobs on several clusters may write to one store at once (WAL mode, a busy timeout, one
short transaction per batch), and `remesh dashboard` reads it. Each attempt at a job (a `remesh run`
or `remesh submit`, including a re-run of the same job name) is a run with its own id. Three tables:
`runs` (one row per run: its job's name, latest state, mesh, throughput, goodput), `events` (host
losses, resizes, restores, checkpoints, compiles, plans) and `steps` (one row per kept step per
host: loss, every other scalar metric, step time, tokens/s, MFU), both keyed by run. A run keeps
rows for at most `FleetStoreConfig.step_rows` steps per host: past that its rows are thinned to
every other kept step (each segment's first kept), so a long job's rows stay bounded and evenly
spread, and `runs.step_stride` says which steps remain. Structured columns
that vary (mesh, plan notes, an event's details, the goodput breakdown, metrics) are JSON text.
A store written before runs existed is migrated when opened: each job becomes one run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    cluster TEXT NOT NULL,
    state TEXT NOT NULL,
    steps INTEGER NOT NULL,
    steps_completed INTEGER NOT NULL DEFAULT 0,
    mesh TEXT NOT NULL DEFAULT '{}',
    hosts INTEGER NOT NULL DEFAULT 0,
    devices INTEGER NOT NULL DEFAULT 0,
    tokens_per_second REAL,
    mfu REAL,
    goodput_ratio REAL,
    goodput TEXT NOT NULL DEFAULT '{}',
    throughput TEXT NOT NULL DEFAULT '{}',
    segments TEXT NOT NULL DEFAULT '[]',
    reason TEXT NOT NULL DEFAULT '',
    submission TEXT NOT NULL DEFAULT '',
    cluster_hosts INTEGER NOT NULL DEFAULT 0,
    step_stride INTEGER NOT NULL DEFAULT 1,
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_name ON runs (name, id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run INTEGER NOT NULL DEFAULT 0,
    job TEXT NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER,
    at REAL NOT NULL,
    seconds REAL NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS steps (
    run INTEGER NOT NULL DEFAULT 0,
    job TEXT NOT NULL,
    segment INTEGER NOT NULL,
    host INTEGER NOT NULL,
    step INTEGER NOT NULL,
    at REAL NOT NULL,
    loss REAL,
    seconds REAL NOT NULL,
    tokens_per_second REAL NOT NULL,
    mfu REAL NOT NULL,
    input_seconds REAL NOT NULL DEFAULT 0,
    wait_seconds REAL NOT NULL DEFAULT 0,
    metrics TEXT NOT NULL DEFAULT '{}'
);
"""
# Indexes on columns an older store gains by migration, made after it.
INDEXES = """
CREATE INDEX IF NOT EXISTS events_run ON events (run, at);
CREATE INDEX IF NOT EXISTS steps_run ON steps (run, segment, step);
"""

RUN_COLUMNS = (
    "name",
    "cluster",
    "state",
    "steps",
    "steps_completed",
    "mesh",
    "hosts",
    "devices",
    "tokens_per_second",
    "mfu",
    "goodput_ratio",
    "goodput",
    "throughput",
    "segments",
    "reason",
    "submission",
    "cluster_hosts",
    "started_at",
    "updated_at",
)
JSON_COLUMNS = {"mesh", "goodput", "throughput", "segments", "detail", "metrics"}


def default_path() -> str:
    """`REMESH_FLEET_DB`, else ~/.remesh/fleet.db."""
    return os.environ.get("REMESH_FLEET_DB") or os.path.join(os.path.expanduser("~"), ".remesh", "fleet.db")


@dataclasses.dataclass(frozen=True)
class FleetStoreConfig:
    path: str = ""  # empty: default_path()
    busy_timeout_s: float = 30.0
    step_rows: int = 4096  # steps per host a run keeps rows for; beyond, thinned evenly

    def open(self) -> FleetStore:
        return FleetStore(self.path or default_path(), self.busy_timeout_s)


class FleetStore:
    def __init__(self, path: str, busy_timeout_s: float = 30.0):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # One connection per store object, used from one thread at a time (the controller's, or
        # the dashboard's lock); other processes have their own.
        self._db = sqlite3.connect(path, timeout=busy_timeout_s, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._names: dict[int, str] = {}  # run id -> job name, for the rows that carry both
        with self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            self._add_new_columns()
            self._runs_from_jobs()
            self._db.executescript(INDEXES)

    def _add_new_columns(self) -> None:
        """A store made by an older remesh gains the columns added since (with their defaults)."""
        for table in ("runs", "events", "steps"):
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for line in SCHEMA.split(f"CREATE TABLE IF NOT EXISTS {table} (")[1].split(");")[0].strip().splitlines():
                column = line.strip().rstrip(",")
                if column.split()[0] not in have and "PRIMARY KEY" not in column and "NOT NULL DEFAULT" in column:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    def _runs_from_jobs(self) -> None:
        """A store from before runs: each row of its `jobs` table becomes a run, and that job's
        events and steps are given the run's id."""
        if not self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='jobs'").fetchone():
            return
        have = [r["name"] for r in self._db.execute("PRAGMA table_info(jobs)") if r["name"] in RUN_COLUMNS]
        for job in self._db.execute(f"SELECT {', '.join(have)} FROM jobs ORDER BY started_at").fetchall():
            run = self._db.execute(
                f"INSERT INTO runs ({', '.join(have)}) VALUES ({', '.join('?' * len(have))})", tuple(job)
            ).lastrowid
            for table in ("events", "steps"):
                self._db.execute(f"UPDATE {table} SET run = ? WHERE job = ? AND run = 0", (run, job["name"]))
        self._db.execute("DROP TABLE jobs")

    def close(self) -> None:
        self._db.close()

    # -- writing -------------------------------------------------------------------------
    def start_run(self, name: str, *, cluster: str, steps: int, submission: str = "") -> int:
        """A new run of job `name` (a first run, a re-run or a resume): returns its id.
        `submission`: the id it was submitted under (`remesh submit`), by which status finds it."""
        now = time.time()
        with self._db:
            run = self._db.execute(
                "INSERT INTO runs (name, cluster, state, steps, submission, started_at, updated_at) "
                "VALUES (?, ?, 'starting', ?, ?, ?, ?)",
                (name, cluster, steps, submission, now, now),
            ).lastrowid
        self._names[run] = name
        return run

    def thin_steps(self, run: int, stride: int) -> int:
        """Keep run `run`'s step rows only at steps divisible by `stride`, and each segment's first;
        returns how many distinct steps remain."""
        with self._db:
            self._db.execute(
                "DELETE FROM steps WHERE run = ? AND step % ? != 0 AND (segment, step) NOT IN "
                "(SELECT segment, MIN(step) FROM steps WHERE run = ? GROUP BY segment)",
                (run, stride, run),
            )
            self._db.execute("UPDATE runs SET step_stride = ? WHERE id = ?", (stride, run))
        return self._db.execute("SELECT COUNT(DISTINCT step) FROM steps WHERE run = ?", (run,)).fetchone()[0]

    def update_run(self, run: int, **fields) -> None:
        unknown = set(fields) - set(RUN_COLUMNS)
        if unknown:
            raise KeyError(f"unknown run columns {sorted(unknown)}; expected some of {RUN_COLUMNS}")
        fields["updated_at"] = time.time()
        values = [json.dumps(v) if k in JSON_COLUMNS else v for k, v in fields.items()]
        with self._db:
            self._db.execute(f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?", (*values, run))

    def add(self, run: int, *, events: list[dict] = (), steps: list[dict] = ()) -> None:
        """Events (summary events: kind, step, at, seconds, details) and step rows in one transaction."""
        if run not in self._names:
            self._names[run] = self._db.execute("SELECT name FROM runs WHERE id = ?", (run,)).fetchone()[0]
        name = self._names[run]
        with self._db:
            self._db.executemany(
                "INSERT INTO events (run, job, kind, step, at, seconds, detail) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (run, name, e["kind"], e.get("step"), e["at"], e.get("seconds", 0.0),
                     json.dumps({k: v for k, v in e.items() if k not in ("kind", "step", "at", "seconds")}))
                    for e in events
                ],
            )  # fmt: skip
            self._db.executemany(
                "INSERT INTO steps (run, job, segment, host, step, at, loss, seconds, tokens_per_second, mfu, "
                "input_seconds, wait_seconds, metrics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (run, name, s["segment"], s["host"], s["step"], s["at"], s.get("loss"), s["seconds"],
                     s["tokens_per_second"], s["mfu"], s.get("input_seconds") or 0.0, s.get("wait_seconds") or 0.0,
                     json.dumps(s.get("metrics") or {}))
                    for s in steps
                ],
            )  # fmt: skip

    # -- reading -------------------------------------------------------------------------
    def jobs(self) -> list[dict]:
        """The latest run of every job, newest first; `run` is its id, `runs` how many there were."""
        return [self._row(r) for r in self._db.execute(
            "SELECT runs.*, runs.id AS run, counts.n AS runs FROM runs JOIN "
            "(SELECT name, MAX(id) AS latest, COUNT(*) AS n FROM runs GROUP BY name) AS counts ON runs.id = counts.latest "
            "ORDER BY runs.started_at DESC"
        )]  # fmt: skip

    def allocation(self, since: float = 0.0) -> dict:
        """Hosts per run over time, from each run's segments (a segment holds its hosts from its
        start to the next one's, or to the run's last update), for runs updated since `since`;
        and per cluster the most hosts a run saw it offer (`cluster_hosts`), for the idle ones."""
        runs = [self._row(r) for r in self._db.execute(
            "SELECT id AS run, name, cluster, state, reason, segments, cluster_hosts, started_at, updated_at "
            "FROM runs WHERE updated_at >= ? ORDER BY started_at", (since,)
        )]  # fmt: skip
        out, clusters, now = [], {}, time.time()
        for r in runs:
            clusters[r["cluster"]] = max(clusters.get(r["cluster"], 0), r["cluster_hosts"])
            segments = r["segments"]
            holding = r["state"] in ("planning", "starting", "running", "stopping")  # its last segment goes on
            ended = now if holding else self.last_step_at(r["run"]) or r["updated_at"]
            for i, seg in enumerate(segments):
                last = i + 1 == len(segments)
                end = ended if last else r["started_at"] + segments[i + 1]["started_at"]
                out.append({"run": r["run"], "name": r["name"], "cluster": r["cluster"], "hosts": seg["hosts"],
                            "start": r["started_at"] + seg["started_at"], "end": end,
                            "holding": last and holding})  # fmt: skip
        queued = [
            {k: r[k] for k in ("run", "name", "cluster", "reason", "started_at", "updated_at")}
            for r in runs
            if r["state"] == "queued"
        ]
        return {"intervals": out, "cluster_hosts": clusters, "queued": queued}

    def last_step_at(self, run: int) -> float | None:
        """When run `run`'s last stored step ended (None: no step stored)."""
        return self._db.execute("SELECT MAX(at) FROM steps WHERE run = ?", (run,)).fetchone()[0]

    def runs(self, name: str) -> list[dict]:
        """Every run of job `name`, newest first (id, state, steps, started and updated)."""
        return [dict(r) for r in self._db.execute(
            "SELECT id AS run, state, steps_completed, steps, started_at, updated_at FROM runs WHERE name = ? "
            "ORDER BY id DESC", (name,)
        )]  # fmt: skip

    def job(self, name: str, run: int | None = None) -> dict | None:
        """Run `run` of job `name` (default: its latest), or None."""
        r = self._db.execute(
            "SELECT *, id AS run FROM runs WHERE name = ? AND (? IS NULL OR id = ?) ORDER BY id DESC LIMIT 1",
            (name, run, run),
        ).fetchone()
        return self._row(r) if r else None

    def submitted(self, submission: str) -> dict | None:
        """The run submitted as `submission`, or None."""
        r = self._db.execute(
            "SELECT *, id AS run FROM runs WHERE submission = ? ORDER BY id DESC LIMIT 1", (submission,)
        ).fetchone()
        return self._row(r) if r else None

    def events(self, run: int) -> list[dict]:
        return [self._row(r) for r in self._db.execute(
            "SELECT kind, step, at, seconds, detail FROM events WHERE run = ? ORDER BY at, id", (run,)
        )]  # fmt: skip

    def steps(self, run: int, every: int = 1) -> list[dict]:
        """Step rows of every host, time-ordered; `every` > 1 keeps steps divisible by it, and
        each segment's first and last (so a long job's charts stay light and no segment vanishes)."""
        return [self._row(r) for r in self._db.execute(
            "SELECT segment, host, step, at, loss, seconds, tokens_per_second, mfu, input_seconds, wait_seconds, metrics "
            "FROM steps WHERE run = ? AND (step % ? = 0 OR step IN (SELECT MIN(step) FROM steps WHERE run = ? "
            "GROUP BY segment UNION SELECT MAX(step) FROM steps WHERE run = ? GROUP BY segment)) ORDER BY at, host",
            (run, max(1, every), run, run),
        )]  # fmt: skip

    def last_step(self, run: int) -> int:
        return self._db.execute("SELECT COALESCE(MAX(step), 0) FROM steps WHERE run = ?", (run,)).fetchone()[0]

    @staticmethod
    def _row(r: sqlite3.Row) -> dict:
        return {k: json.loads(r[k]) if k in JSON_COLUMNS else r[k] for k in r.keys()}
