"""Plans for the meshes a job runs on: made when needed, made ahead while a group trains, cached,
and the executables compiled ahead for them.

A resize or a recovery needs a plan for another device count, and planning is on that path; so
while a group trains, plans for a host fewer and a host more are made on a thread of their own. A
plan made ahead for a smaller mesh goes to the training group, whose process 0 compiles its programs
beside training (worker/compile.py): the group that runs that plan loads them instead of compiling.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator

from ..protocol import CompileAhead, plan_key


@dataclasses.dataclass(frozen=True)
class Planned:
    plan: object
    cached: bool  # made before this request: for this mesh earlier, or ahead
    ahead: bool  # made ahead, while an earlier group trained


class PlanCache:
    """Plans by (program fingerprint, device count). `planner(devices) -> Plan`."""

    def __init__(self, planner: Callable[[int], object], fingerprint: str):
        self.planner, self.fingerprint = planner, fingerprint
        self._plans: dict[tuple[str, int], object] = {}
        self._ahead: dict[tuple[str, int], concurrent.futures.Future] = {}  # plans being made ahead
        self._made_ahead: set[tuple[str, int]] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._executables: dict[str, dict] = {}  # plan key -> programs compiled ahead for it

    def plan(self, devices: int) -> Planned:
        """The plan for `devices`: from the cache, from a planning ahead (waited for), or made now
        (on the planning thread if there is one: one search at a time)."""
        key = (self.fingerprint, devices)
        if key in self._ahead:
            self._plans[key] = self._ahead.pop(key).result()
        ahead, cached = key in self._made_ahead, key in self._plans
        if not cached:
            pool = self._pool
            self._plans[key] = pool.submit(self.planner, devices).result() if pool else self.planner(devices)
        return Planned(self._plans[key], cached, ahead)

    def ready(self, devices: int) -> bool:
        """Whether a group on `devices` would start at once: its plan made, and its programs
        compiled ahead (a resize to it neither plans nor compiles)."""
        plan = self._plans.get((self.fingerprint, devices))
        return plan is not None and self.executables(plan.to_json()) is not None

    def plan_ahead(self, devices: int) -> None:
        """Begin planning for `devices` on the planning thread, unless planned or begun already."""
        key = (self.fingerprint, devices)
        if key in self._plans or key in self._ahead:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-plan")
        self._ahead[key] = self._pool.submit(self.planner, devices)

    def made_ahead(self) -> Iterator[tuple[int, object]]:
        """(devices, plan or the exception that planning raised) of each planning ahead that has
        finished since the last call."""
        for key in [k for k, f in self._ahead.items() if f.done()]:
            future = self._ahead.pop(key)
            if future.exception() is not None:
                yield key[1], future.exception()  # a resize plans again, on its own path
                continue
            self._plans[key] = future.result()
            self._made_ahead.add(key)
            yield key[1], self._plans[key]

    def compiled_ahead(self, report: CompileAhead) -> None:
        """Keep what a group compiled ahead for the group that runs that plan: held here, where a
        host loss cannot take it."""
        if report.executables is not None:
            self._executables[report.executables["plan"]] = report.executables

    def executables(self, plan_json: str) -> dict | None:
        return self._executables.get(plan_key(plan_json))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def program_fingerprint(ref: str, abstract_state, abstract_batch) -> str:
    """Identifies a program's shapes for the plan cache: same shapes, same plan."""
    import jax

    leaves = [
        (jax.tree_util.keystr(p), list(x.shape), str(x.dtype))
        for tree in (abstract_state, abstract_batch)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    return hashlib.sha256(json.dumps([ref, leaves]).encode()).hexdigest()[:16]
