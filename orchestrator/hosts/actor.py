"""The host actor: one Ray actor per host, running one segment of the per-host worker in a thread."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import traceback
from collections.abc import Sequence

import ray

from ..protocol import Report, ReportKind, SegmentSpec, Stop


class HostActor:
    """Runs `worker.run_segment` in a thread; `poll` drains its reports. Threaded (max_concurrency)
    so that poll and request_stop answer while the segment trains."""

    def __init__(self):
        import jax  # noqa: F401  paid here, while the group forms, not on the critical path later

        self._reports: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = Stop.RUN
        self._ahead: queue.SimpleQueue = queue.SimpleQueue()  # plans to compile ahead
        self._done = False
        self._error: str | None = None
        self._port: socket.socket | None = None  # the coordinator's port, held until the segment starts
        # Held while `warm` imports: a segment waits for it, since two threads importing one library
        # at once can meet its modules half-initialised (optax imports itself in a circle).
        self._importing = threading.Lock()
        self._progress = None  # the segment's loop's `worker.progress.Progress`, once it starts

    def warm(self, modules: Sequence[str]) -> float:
        """Import what a segment will (the program's module, the partitioner and checkpoint code)
        while the actor waits in the standby pool; returns the seconds it took."""
        import importlib
        import time

        t = time.perf_counter()
        with self._importing:
            for name in ("checkpoint", "partitioner", "orchestrator.job.program", "orchestrator.worker", *modules):
                try:
                    importlib.import_module(name)
                except ImportError:
                    pass  # the segment imports it again and reports the error where it belongs
        return time.perf_counter() - t

    def where(self) -> dict:
        """Where this host is, with a free port for the group's coordinator should it be process 0.
        The port stays bound here until the segment starts, so that nothing else on the node (a
        standby actor, another group's `where`) is handed it in between; it is let go just before
        `jax.distributed` binds it."""
        if self._port is None:
            self._port = socket.socket()
            self._port.bind(("", 0))
        ip = ray.util.get_node_ip_address()
        port = self._port.getsockname()[1]
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "port": port, "pid": os.getpid()}

    def start(self, spec_json: str, snapshots=None, executables: bytes | None = None) -> None:
        """`snapshots`: a `keepers.HostSnapshots`, where peer snapshots go and come from;
        `executables`: compiled ahead by an earlier group (`protocol.CompileAhead`), pickled."""
        spec = SegmentSpec.from_json(spec_json)
        if self._port is not None:
            self._port.close()
            self._port = None
        args = (spec, snapshots, executables)
        threading.Thread(target=self._run, args=args, daemon=True, name="segment").start()

    def _run(self, spec: SegmentSpec, snapshots, executables: bytes | None) -> None:
        from ..metrics import RayMetrics

        metrics = RayMetrics()
        peers = snapshots.open() if snapshots is not None else None

        def report(r: Report) -> None:
            if r.KIND is ReportKind.STEP:  # exported from the host that measured it, labelled by host
                metrics.step(spec.job, spec.process_id, r)
            self._reports.put(r.to_dict())

        try:
            with self._importing:  # after `warm`, never beside it
                from ..worker import run_segment
                from ..worker.progress import Progress

                executables = pickle.loads(executables) if executables else None
            self._progress = Progress()
            run_segment(spec, report, lambda: self._stop, peers=peers, ahead=self._next_ahead, executables=executables,
                        progress=self._progress)  # fmt: skip
        except BaseException:
            self._error = traceback.format_exc()
        finally:
            if peers is not None:
                peers.close()  # the last share sent before the segment counts as done
            self._done = True

    def _next_ahead(self) -> str | None:
        try:
            return self._ahead.get_nowait()
        except queue.Empty:
            return None

    def compile_ahead(self, plan_json: str) -> None:
        """Compile `plan_json`'s programs beside training, for a later group (process 0)."""
        self._ahead.put(plan_json)

    def poll(self) -> dict:
        """The reports since the last poll, as dicts (`group.HostStatus.from_wire` types them)."""
        done = self._done  # read before draining, so no report is left behind when done
        reports = []
        while True:
            try:
                reports.append(self._reports.get_nowait())
            except queue.Empty:
                progress = self._progress.read() if self._progress is not None else None
                return {"reports": reports, "done": done, "error": self._error, "progress": progress}

    def stacks(self) -> str:
        """Every thread's stack in this host's process (a hung step's evidence)."""
        from ..worker.progress import stacks

        return stacks()

    def request_stop(self, now: bool = False) -> None:
        """Finish at the next checkpoint boundary, or (`now`) save the step reached and finish."""
        self._stop = max(self._stop, Stop.NOW if now else Stop.AT_CHECKPOINT)


def actor_cls():
    return ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(HostActor)
