"""Where a host's loop is, for telling which host a hung step waits on, and every thread's stack,
for saying where each host was when it hung.

The loop marks each step as it enters the dispatch of the compiled step and as the dispatch
returns; a host answers its polls from another thread, with the latest mark. When a step does not
finish, the hosts that returned from its dispatch wait on the devices and their peers; a host that
never returned (or never reached the step) is the one they wait on.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback


class Progress:
    """The loop's latest mark: (step, where, when); read from another thread."""

    def __init__(self):
        self._mark: tuple[int, str, float] = (0, "", time.time())

    def mark(self, step: int, where: str) -> None:
        self._mark = (step, where, time.time())  # (one assignment: a reader sees a whole mark)

    def read(self) -> dict:
        step, where, at = self._mark
        return {"step": step, "where": where, "at": at}


def stacks() -> str:
    """Every thread's Python stack in this process, as `py-spy dump` would list them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {ident} ({names.get(ident, '?')}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)
