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
from collections.abc import Callable

from ..control.state import Phase, StopOutcome
from ..protocol import ControllerCallback, EventKind, ReportKind, SnapshotUnusable, Step


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


class ConsoleCallback(ControllerCallback):
    """What a person running a job reads: a line for each plan, every tenth step, each loss,
    recovery, resize, evaluation, warning and stop. `printer`: where lines go (a `Console`'s
    `print`, say)."""

    def __init__(self, printer: Callable[[str], None] | None = None):
        self.print = printer or (lambda line: print(line, flush=True))

    def on_state(self, view, previous, state) -> None:
        line = {
            Phase.STARTING: self._plan,
            Phase.PLANNING: self._decision,
            Phase.STOPPING: self._stopping,
            Phase.STOPPED: self._stopped,
            Phase.FAILED: lambda c, s: f"fail  {s.reason}",
        }.get(state.phase, lambda c, s: None)(view, state)
        if line:
            self.print(line)

    def _plan(self, view, state) -> str:
        plan, flag = state.plan, " (planned ahead)" if state.ahead else " (cached)" if state.cached else ""
        lines = [f"plan  {plan.describe()} on {state.hosts} hosts{flag}", *(f"      note: {n}" for n in plan.notes)]
        if state.hosts < state.target:
            lines.append(f"      note: {state.target - state.hosts} of {state.target} hosts left idle: "
                         f"the plan uses {plan.devices_used} devices")  # fmt: skip
        return "\n".join(lines)

    def _decision(self, view, state) -> str | None:
        d = state.decision
        return f"      {type(d).__name__.lower()} onto {d.hosts} hosts: {d.reason}" if d is not None else None

    def _stopping(self, view, state) -> str:
        grace = view.config.stop_grace_s
        return f"stop  {state.reason}: saving the step reached, then stopping (at most {grace:.0f} s)"

    def _stopped(self, view, state) -> str:
        return {
            StopOutcome.AT_ONCE: f"stop  {state.reason}: stopped at once after step {view.step_reached}",
            StopOutcome.COMMITTED: f"      step {view.step_reached} committed; hosts stopped",
            StopOutcome.HOSTS_FAILED: f"      hosts failed while stopping ({state.detail}); the newest commit stands",
            StopOutcome.GRACE_OVER: f"      hosts did not finish within {view.config.stop_grace_s:.0f} s; "
            "stopping them",
        }[state.outcome]

    def on_report(self, view, host, report, speaker) -> None:
        if not speaker:
            return
        if isinstance(report, Step):
            self._progress(view, report)
        elif isinstance(report, SnapshotUnusable):
            self.print(f"      the snapshot in host memory is unusable ({report.error[:200]}); restoring from disk")

    def _progress(self, view, r: Step) -> None:
        segment, steps = view.segment, view.job.steps
        first = segment.first_step if segment.first_step is not None else r.step
        if r.step % 10 and r.step != steps and r.step != first:
            return
        from partitioner import mesh_text

        mesh = mesh_text(segment.mesh, every=True)
        self.print(
            f"step  {r.step:>5}/{steps}  loss {r.loss:.4f}  {r.tokens_per_second:>9,.0f} tok/s  "
            f"MFU {r.mfu:.2%}  mesh {mesh}  hosts {segment.hosts}"
        )

    def on_event(self, view, event) -> None:
        f, step = event.fields, event.step
        line = {
            EventKind.HOST_LOST: lambda: (
                f"stop  the group after step {step}, every host live ({f['detail']})"
                if not f["hosts"]  # (the health loop's: a spike computed again, a hang restarted)
                else f"lost  host(s) {f['hosts']} after step {step}"
                + (f", process(es) {f['processes']} down with them" if f.get("processes") else "")
                + f" ({f['detail']})"
            ),
            EventKind.HOST_ADDED: lambda: f"grow  {f['reason']}: resizing to {f['hosts']} hosts at the next checkpoint",
            EventKind.HANG: lambda: f"hang  {f['reason']}; every host's stacks in {f['evidence']['stacks']}",
            EventKind.CORRUPTION: lambda: f"sdc   {f['reason']}",
            EventKind.STRAGGLER: lambda: (
                f"slow  after step {step}: {f['reason']}"
                + (f"; resizing to {f['hosts']} hosts now" if f.get("action") == "excluded" else "")
            ),
            ReportKind.RESTORE: lambda: (
                f"      restored step {step} from "
                f"{'host memory' if f.get('source') == 'memory' else 'disk'} in {event.seconds:.2f} s"
                + (f"; {f['recomputed']} steps to compute again" if "recomputed" in f else "")
            ),
            ReportKind.EVAL: lambda: f"eval  {step:>5}/{view.job.steps}  loss {f['loss']:.4f}  ({event.seconds:.2f} s)",
            ReportKind.COMPILE_AHEAD: lambda: (
                f"      compiling ahead for {f.get('devices', '?')} devices "
                + (f"failed: {f['error'][:200]}" if "error" in f else f"done in {event.seconds:.1f} s")
            ),
            ReportKind.CHECKPOINT_FAILED: lambda: (
                f"warn  checkpoint step {step} was not saved ({f['error'][:200]}); "
                f"the newest commit stays step {f['newest']}, and training goes on"
            ),
            ReportKind.CHECKPOINT_CORRUPT: lambda: (
                f"      checkpoint step {step} is damaged, moved aside; trying the one before: {f['error'][:200]}"
            ),
        }.get(event.kind)
        if line:
            self.print(line())

    def on_recovered(self, view, seconds: float) -> None:
        self.print(f"      recovered in {seconds:.1f} s")

    def on_warning(self, view, text: str) -> None:
        self.print(f"warn  {text}")
