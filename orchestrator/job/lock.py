"""One run of a job per checkpoint directory at a time.

Two runs writing one checkpoint directory would each take the other's partial saves for their
own. A run holds an exclusive `flock` on `<checkpoint dir>/.remesh-run.lock` for as long as it
lives; the kernel lets go of it when the process ends, however it ends (a killed run leaves no
stale lock), and the file's text says who holds it, for the error a second run gets. (On a
filesystem shared between machines the lock holds where its flock is honoured: local disks and
NFSv4.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

LOCK_NAME = ".remesh-run.lock"


class CheckpointInUseError(ValueError):
    """Another live run holds the checkpoint directory (a ValueError: the user's to resolve, and
    said as such by the CLI)."""


class RunLock:
    """`with RunLock(dir, job="name", run="submission id"):` the run's lifetime."""

    def __init__(self, directory: str, *, job: str, run: str = ""):
        self.path = os.path.join(directory, LOCK_NAME)
        self.directory, self.job, self.run = directory, job, run
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise CheckpointInUseError(
                f"checkpoint directory {self.directory} is in use by another run of job {holder.get('job', '?')!r}"
                f" ({_who(holder)}); one run per checkpoint directory at a time: wait for it to end or stop it "
                "(`remesh stop`), or give this run another checkpoint.dir"
            ) from None
        holder = {
            "job": self.job,
            "run": self.run,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing lets go of the flock
            self._fd = None


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (ValueError, OSError):
        return {}


def _who(holder: dict) -> str:
    parts = [
        f"run {holder['run']}" if holder.get("run") else "",
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}",
    ]
    if holder.get("since"):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])))
    return ", ".join(p for p in parts if p)
