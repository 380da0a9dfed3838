"""Candidates priced two at a time: here, and in a helper process on a second core.

Pricing a candidate (`propagate`, then `estimate`) is most of a search once the step is read, and
each candidate's price depends on nothing but the folded graph and its own annotations: the
tactics' candidates are independent, and a refinement's trials are too until one is kept. Python
prices one at a time per process, so `Pricer.each` hands every other job to a helper that holds a
copy of the folded graph, and gives the prices back in the order asked, the same as this process
would have found them (the same code on the same graph). A refinement reads them one by one and
stops at the first it keeps; what the helper priced past it is dropped (`each` is closed).

The helper is started at a search's start, so that its imports overlap the step's tracing, and
lives as long as this process (it exits when its input closes); one graph is sent to it per
search (or per `StepPlanner`). Where no second core is free, where the helper is not ready yet,
has failed or is slow to answer, this process prices alone: a plan never waits on the helper
for more than HELPER_WAIT_S, and never depends on it for its result.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import dataclasses
import gc
import io
import itertools
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence

from .cost import Cost, estimate
from .fold import Fold
from .hardware import Hardware
from .ir import Graph
from .propagate import Propagation, Sharding, _static, propagate

HELPER_WAIT_S = 30.0  # the longest a plan waits on one answer before pricing without the helper
HELPER_QUEUE = 2  # jobs out at the helper at once: it starts the next while this process reads its answer


@dataclasses.dataclass(frozen=True)
class PricingTask:
    """One candidate to price: `annotations` (optimizer state already mirrored) spread with
    `first` (the batch) first; None back where it takes `beyond` seconds or more."""

    mesh: Mapping[str, int]
    annotations: Mapping[int, Sharding]
    first: tuple[int, ...]
    beyond: float = math.inf


def price(fold: Fold, hw: Hardware, job: PricingTask) -> tuple[Cost | None, Propagation]:
    prop = propagate(fold.graph, job.annotations, job.mesh, first=job.first)
    return estimate(prop, hw, fold, beyond=job.beyond), prop


class Pricer:
    """Prices jobs on one folded graph and hardware, with the helper where it is ready.

    Example:
        >>> for cost, prop in Pricer(inputs.fold, hw).each(jobs):  # prop None where the helper priced it
        ...     print(cost.total_seconds)
    """

    def __init__(self, fold: Fold, hw: Hardware):
        self.fold, self.hw = fold, hw

    def share(self) -> None:
        """The graph sent to the helper now, ahead of the first jobs, where it is free and ready."""
        helper = _helper() if _HELPING.get() else None
        if helper is not None and helper.lock.acquire(blocking=False):
            try:
                helper.load(self.fold, self.hw)
            finally:
                helper.lock.release()

    def each(
        self, jobs: Iterable[PricingTask], whole: bool = False
    ) -> Iterator[tuple[Cost | None, Propagation | None]]:
        """Each job's cost and propagation, in order (the propagation None where the helper
        priced it). While the helper prices one job, this process prices the next ones. `whole`:
        the reader reads them all, so the helper starts from the last job and works back (jobs
        on one mesh, next to each other, share their batch's spreading), where a reader that may
        stop has it price the job after the one read next."""
        jobs = jobs if isinstance(jobs, Sequence) else list(jobs)  # a sequence may make its jobs when asked
        helper = _helper() if len(jobs) > 1 and _HELPING.get() else None
        if helper is None or not helper.lock.acquire(blocking=False):  # another thread's plan has it
            helper = None
        elif not helper.load(self.fold, self.hw):
            helper.lock.release()
            helper = None
        if helper is None:
            for job in jobs:
                yield price(self.fold, self.hw, job)
            return
        done: dict[int, tuple] = {}
        unstarted, given = collections.deque(range(len(jobs))), collections.deque()  # given: out at the helper
        try:
            for want in range(len(jobs)):
                while want not in done:
                    if given and (not unstarted or helper.answered()):
                        i = given.popleft()
                        done[i] = (helper.answer(self.fold, self.hw, jobs[i]), None)
                    elif _room(given, unstarted) and helper.alive and (i := _ahead(unstarted, want, whole)) is not None:
                        unstarted.remove(i)
                        helper.send(jobs[i])
                        given.append(i)
                    else:
                        i = unstarted.popleft()
                        done[i] = price(self.fold, self.hw, jobs[i])
                yield done.pop(want)
        finally:
            for _ in given:  # priced past where the reader stopped
                helper.drop()
            helper.lock.release()


def _room(given: collections.deque, unstarted: collections.deque) -> bool:
    """Whether the helper takes another job: a second one queued only while this process has
    more than that left, so that neither waits long on the other at the end."""
    return not given or (len(given) < HELPER_QUEUE and len(unstarted) > 2 * len(given) + 1)


def _ahead(unstarted: collections.deque, want: int, whole: bool) -> int | None:
    """The helper's next job while this process prices `want` (or the first not started): the
    last not started, or the first after `want`."""
    if whole:
        return unstarted[-1] if len(unstarted) > 1 else None
    return next((i for i in itertools.islice(unstarted, 2) if i != want), None)


class _Helper:
    """The helper process and this side of its pipes (unbuffered, so that `select` sees every
    byte not yet read), with at most HELPER_QUEUE jobs out, answered in the order sent."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT.format(package=os.path.dirname(os.path.abspath(__file__)))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
        )
        self.to, self.back = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.to, False)  # a write takes what the pipe has room for (`_write`)
        self.alive, self.ready, self.loaded = True, False, None
        self.lock = threading.Lock()  # one plan's jobs at a time

    def load(self, fold: Fold, hw: Hardware) -> bool:
        """Whether the helper is ready and holds `fold`'s graph and `hw` (sent now where not)."""
        if not self.alive or not (self.ready or self._poll_ready()):
            return False
        if self.loaded is None or self.loaded[0]() is not fold or self.loaded[1] != hw:
            try:
                message = _dumps(("load", (fold, hw)))
            except Exception:  # a graph that holds something pickle cannot take: priced here
                return False
            self._write(message)
            self.loaded = (weakref.ref(fold), hw)
        return self.alive

    def send(self, job: PricingTask) -> None:
        self._write(_dumps(("price", job)))

    def answered(self) -> bool:
        return self._waiting(0)

    def answer(self, fold: Fold, hw: Hardware, job: PricingTask) -> Cost | None:
        """The helper's price for `job`, or this process's where the helper fails or is slow."""
        reply = _read(self.back) if self.alive and self._waiting(HELPER_WAIT_S) else None
        if reply is not None and reply[0] == "ok":
            return reply[1]
        self.close()
        return price(fold, hw, job)[0]

    def drop(self) -> None:
        """The answer to the job out read and dropped."""
        if not (self.alive and self._waiting(HELPER_WAIT_S) and _read(self.back) is not None):
            self.close()

    def close(self) -> None:
        self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait_ready(self, seconds: float) -> bool:
        """Whether the helper is ready within `seconds` (a search never waits: tests do)."""
        return self.ready or (self._waiting(seconds) and self._poll_ready())

    def _waiting(self, seconds: float) -> bool:
        return bool(select.select([self.back], [], [], seconds)[0])

    def _poll_ready(self) -> bool:
        if self.proc.poll() is not None:
            self.alive = False
        elif self._waiting(0):
            self.ready = self.alive = os.read(self.back, 1) == b"r"
        return self.ready

    def _write(self, data: bytes) -> None:
        try:
            _write(self.to, data, HELPER_WAIT_S)
        except OSError:  # the helper is gone or stalled: each job it held is priced here
            self.close()


# The helper imports the pricing modules under a bare `partitioner` package, without its
# __init__ (which imports JAX for the rest): it starts in a fraction of a second.
_BOOT = """
import sys, types
import ml_dtypes  # bfloat16 and the float8s as numpy dtypes, as JAX registers them
package = types.ModuleType("partitioner")
package.__path__ = [{package!r}]
sys.modules["partitioner"] = package
from partitioner.helper import _serve
_serve()
"""

_HELPER: list[_Helper] = []  # this process's, once started


def start_helper(enabled: bool = True, always: bool = False) -> None:
    """Starts the helper where a second core is free and none runs: at a search's start, so its
    imports overlap the tracing. `enabled` False (`PlanOptions.pricing_helper`) starts none;
    `always` starts one on a single core too (tests)."""
    if not enabled or _helper() is not None or (_cores() < 2 and not always):
        return
    if not _HELPER:
        atexit.register(lambda: _HELPER[0].close())
    _HELPER[:] = [_Helper()]


# Whether the search this thread runs prices with the helper (`PlanOptions.pricing_helper`): set
# by the search around its work, read by every `Pricer` it makes.
_HELPING: contextvars.ContextVar[bool] = contextvars.ContextVar("remesh_pricing_helper", default=True)


@contextlib.contextmanager
def helping(enabled: bool):
    """Within the block, this thread's pricers use the helper only where `enabled`."""
    token = _HELPING.set(enabled)
    try:
        yield
    finally:
        _HELPING.reset(token)


def _cores() -> int:
    """The cores this process may run on (all of them where the platform cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _helper() -> _Helper | None:
    """This process's helper, where it runs."""
    if _HELPER and _HELPER[0].alive and _HELPER[0].proc.poll() is not None:
        _HELPER[0].alive = False
    return _HELPER[0] if _HELPER and _HELPER[0].alive else None


class _Pickler(pickle.Pickler):
    """Pickles a fold without what each of its graphs (the folded one, a deep fold's shallow
    ones, loop bodies) keeps for this process's propagations, and without their output trees
    (JAX's and the optimizer's classes, which the helper does not import)."""

    def reducer_override(self, obj):
        if type(obj) is not Graph:
            return NotImplemented
        g = obj
        return Graph, (g.values, g.ops, g.inputs, g.outputs, g.input_paths, g.unknown, None, g.copies)


def _dumps(message) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def _write(fd: int, data: bytes, wait: float | None = None) -> None:
    """One message; within `wait` seconds for each part the pipe takes (TimeoutError), where given."""
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        if wait is not None and not select.select([], [fd], [], wait)[1]:
            raise TimeoutError(f"the pipe took nothing for {wait} s")
        view = view[os.write(fd, view) :]


def _read(fd: int):
    """One message, or None where the pipe closed first."""
    head = _exactly(fd, 8)
    data = None if head is None else _exactly(fd, struct.unpack("<Q", head)[0])
    return None if data is None else pickle.loads(data)


def _exactly(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        part = os.read(fd, min(n, 1 << 20))
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _serve() -> None:
    """The helper: reads graphs and jobs from stdin, writes each job's cost to stdout (the
    process's own output goes to stderr, so nothing else reaches the pipe). It exits where its
    input closes, or where it cannot read a message (a graph holding a class it cannot import):
    the planner then prices alone."""
    into, out = 0, os.dup(1)
    os.dup2(2, 1)
    os.write(out, b"r")
    gc.disable()
    fold = hw = None
    try:
        while (message := _read(into)) is not None:
            kind, body = message
            if kind == "load":
                fold, hw = body
                gc.collect()  # the graph before this one; none between (as `search._without_gc`)
                _static(fold.graph)  # what every propagation reads, while the planner finds its candidates
                continue
            try:
                reply = ("ok", price(fold, hw, body)[0])
            except Exception as e:  # the planner prices it again, and raises there
                reply = ("error", repr(e))
            _write(out, _dumps(reply))
    except Exception as e:  # said once; the planner prices on alone
        sys.stderr.write(f"remesh: the pricing helper stopped ({e!r}); plans are priced without it\n")
