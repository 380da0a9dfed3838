"""Laps: a host's reports cover its whole segment back to back, each saying how long since the
previous one and when it ended, so the controller's goodput ledger partitions the host's wall time
without gaps (telemetry/goodput.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..protocol import Report

Reporter = Callable[[Report], None]


class Laps:
    def __init__(self, report: Reporter):
        self._report = report
        self._last = time.time()

    def split(self) -> tuple[float, float]:
        """(seconds since the previous lap, now): to derive figures from before reporting them."""
        now = time.time()
        return now - self._last, now

    def __call__(self, kind: type[Report], *, now: float | None = None, **fields) -> Report:
        now = time.time() if now is None else now
        report = kind(seconds=now - self._last, at=now, **fields)
        self._report(report)
        self._last = now
        return report


class Deferred:
    """Laps taken on another thread, replayed into the segment's laps in order once it is joined:
    each then says what it took in all (`took`), its lap what it took beyond the laps before it."""

    def __init__(self):
        self._start, self._laps = time.time(), []

    def __call__(self, kind: type[Report], **fields) -> None:
        self._laps.append((kind, fields, time.time() - self._start))

    def replay(self, lap: Laps) -> None:
        for kind, fields, took in self._laps:
            lap(kind, took=took, **fields)
