"""The fleet store: every job's state, events and step metrics in one SQLite file.

Several jobs on several clusters may write to one store at once (WAL mode, a busy timeout, one
short transaction per batch), and `remesh dashboard` reads it. Three tables: `jobs` (one row per
job name, its latest state), `events` (host losses, resizes, restores, checkpoints, compiles,
plans), `steps` (one row per step per host: loss, step time, tokens/s, MFU). Structured columns
that vary (mesh, plan notes, an event's details, the goodput breakdown) are JSON text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
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
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER,
    at REAL NOT NULL,
    seconds REAL NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_job ON events (job, at);
CREATE TABLE IF NOT EXISTS steps (
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
    wait_seconds REAL NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS steps_job ON steps (job, segment, step);
"""

JOB_COLUMNS = (
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
    "started_at",
    "updated_at",
)
JSON_COLUMNS = {"mesh", "goodput", "throughput", "segments", "detail"}


def default_path() -> str:
    """`REMESH_FLEET_DB`, else ~/.remesh/fleet.db."""
    return os.environ.get("REMESH_FLEET_DB") or os.path.join(os.path.expanduser("~"), ".remesh", "fleet.db")


@dataclasses.dataclass(frozen=True)
class FleetStoreConfig:
    path: str = ""  # empty: default_path()
    busy_timeout_s: float = 30.0

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
        with self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            self._add_new_columns()

    def _add_new_columns(self) -> None:
        """A store made by an older remesh gains the columns added since (with their defaults)."""
        for table in ("jobs", "steps"):
            have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for line in SCHEMA.split(f"CREATE TABLE IF NOT EXISTS {table} (")[1].split(");")[0].strip().splitlines():
                column = line.strip().rstrip(",")
                if column.split()[0] not in have and "PRIMARY KEY" not in column and "NOT NULL DEFAULT" in column:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    def close(self) -> None:
        self._db.close()

    # -- writing -------------------------------------------------------------------------
    def start_job(self, name: str, *, cluster: str, steps: int) -> None:
        """A job (re)starts: its row is created or reset to running; its history stays."""
        now = time.time()
        with self._db:
            self._db.execute(
                "INSERT INTO jobs (name, cluster, state, steps, started_at, updated_at) VALUES (?, ?, 'starting', ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET cluster=excluded.cluster, state='starting', steps=excluded.steps, "
                "reason='', updated_at=excluded.updated_at",
                (name, cluster, steps, now, now),
            )

    def update_job(self, name: str, **fields) -> None:
        unknown = set(fields) - set(JOB_COLUMNS)
        if unknown:
            raise KeyError(f"unknown job columns {sorted(unknown)}; expected some of {JOB_COLUMNS}")
        fields["updated_at"] = time.time()
        values = [json.dumps(v) if k in JSON_COLUMNS else v for k, v in fields.items()]
        with self._db:
            self._db.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in fields)} WHERE name = ?", (*values, name))

    def add(self, name: str, *, events: list[dict] = (), steps: list[dict] = ()) -> None:
        """Events (summary events: kind, step, at, seconds, details) and step rows in one transaction."""
        with self._db:
            self._db.executemany(
                "INSERT INTO events (job, kind, step, at, seconds, detail) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        name,
                        e["kind"],
                        e.get("step"),
                        e["at"],
                        e.get("seconds", 0.0),
                        json.dumps({k: v for k, v in e.items() if k not in ("kind", "step", "at", "seconds")}),
                    )
                    for e in events
                ],
            )
            self._db.executemany(
                "INSERT INTO steps (job, segment, host, step, at, loss, seconds, tokens_per_second, mfu, input_seconds, "
                "wait_seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        name,
                        s["segment"],
                        s["host"],
                        s["step"],
                        s["at"],
                        s.get("loss"),
                        s["seconds"],
                        s["tokens_per_second"],
                        s["mfu"],
                        s.get("input_seconds") or 0.0,
                        s.get("wait_seconds") or 0.0,
                    )
                    for s in steps
                ],
            )

    # -- reading -------------------------------------------------------------------------
    def jobs(self) -> list[dict]:
        return [self._row(r) for r in self._db.execute("SELECT * FROM jobs ORDER BY started_at DESC")]

    def job(self, name: str) -> dict | None:
        r = self._db.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
        return self._row(r) if r else None

    def events(self, name: str) -> list[dict]:
        return [
            self._row(r)
            for r in self._db.execute(
                "SELECT kind, step, at, seconds, detail FROM events WHERE job = ? ORDER BY at, id", (name,)
            )
        ]

    def steps(self, name: str, every: int = 1) -> list[dict]:
        """Step rows of every host, time-ordered; `every` > 1 keeps steps divisible by it, and
        each segment's first and last (so a long job's charts stay light and no segment vanishes)."""
        return [
            dict(r)
            for r in self._db.execute(
                "SELECT segment, host, step, at, loss, seconds, tokens_per_second, mfu, input_seconds, wait_seconds FROM steps "
                "WHERE job = ? AND (step % ? = 0 OR step IN (SELECT MIN(step) FROM steps WHERE job = ? GROUP BY segment "
                "UNION SELECT MAX(step) FROM steps WHERE job = ? GROUP BY segment)) ORDER BY at, host",
                (name, max(1, every), name, name),
            )
        ]

    def last_step(self, name: str) -> int:
        return self._db.execute("SELECT COALESCE(MAX(step), 0) FROM steps WHERE job = ?", (name,)).fetchone()[0]

    @staticmethod
    def _row(r: sqlite3.Row) -> dict:
        return {k: json.loads(r[k]) if k in JSON_COLUMNS else r[k] for k in r.keys()}
