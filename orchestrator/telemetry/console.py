"""What a person running `remesh run` sees: remesh's own lines on the terminal, and everything else
this process and its children write (Ray's daemons, the error printer Ray runs in every driver,
which copies raylet log tails to the driver at each host loss and at shutdown) in a log file.

The split is made on file descriptors, not on Python's `sys.stdout`, because Ray's daemons inherit
the descriptors and write to them from C++; remesh keeps a duplicate of the terminal for itself.
"""

from __future__ import annotations

import os
import sys
import time


class Console:
    """Example:
    >>> with Console("runs/demo/logs/gpt-demo.ray.log") as console:
    ...     console.print("step 10 ...")   # to the terminal; Ray's output goes to the log
    """

    def __init__(self, log_path: str):
        self.log_path = os.path.abspath(log_path)
        self._saved: tuple[int, int] | None = None
        self._terminal = None

    def __enter__(self) -> Console:
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self._terminal = os.fdopen(os.dup(1), "w", buffering=1)
        with open(self.log_path, "a") as log:
            log.write(f"\n=== remesh run, {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
            log.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        return self

    def print(self, line: str) -> None:
        (self._terminal or sys.stdout).write(line + "\n")
        (self._terminal or sys.stdout).flush()

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._terminal.close()
        self._saved = self._terminal = None
