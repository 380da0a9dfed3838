"""The exact level: choose one option per variable (a sharding per weight of the folded graph) to
minimise a sum of unary and pairwise costs under a memory budget, as an integer linear program
solved by HiGHS (Alpa's formulation, over TAP's folded graph).

    min  sum_i sum_o u[i][o] x[i,o] + sum_(i,j) sum_(o,p) w[i,j][o][p] y[i,j,o,p]
    s.t. sum_o x[i,o] = 1                                  one option per variable
         y[i,j,o,p] >= x[i,o] + x[j,p] - 1, y <= x[i,o], y <= x[j,p]   y = x[i,o] and x[j,p]
         sum of the same terms with memory coefficients <= budget
         x binary, y in [0, 1] (integral whenever x is)

`k_best` yields the optimum, then the optimum with each earlier answer cut off (a no-good cut per
answer), so a caller can price a few of the best exactly and keep the one that truly wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class PairwiseProblem:
    unary: Sequence[Sequence[float]]  # per variable, per option
    pair: Mapping[tuple[int, int], Sequence[Sequence[float]]]  # (i, j) -> [option of i][option of j]
    unary_memory: Sequence[Sequence[float]] | None = None
    pair_memory: Mapping[tuple[int, int], Sequence[Sequence[float]]] | None = None
    budget: float | None = None  # on the memory terms' sum


def k_best(problem: PairwiseProblem, k: int) -> Iterator[tuple[int, ...]]:
    """Up to `k` assignments (an option index per variable), best first; fewer when the
    constraints leave fewer.

    Example:
        >>> next(k_best(PairwiseProblem([[0, -1], [0, 2]], {(0, 1): [[0, 0], [0, -3]]}), 1))
        (1, 1)
    """
    # Imported here: only the thorough level solves ILPs, and a bare worker process (a GPU
    # machine running plans, not searching them) need not have HiGHS.
    import highspy

    with _stdout_to_devnull():  # the constructor prints HiGHS's banner from C++, before silent() can
        h = highspy.Highs()
    h.silent()
    x = [[h.addBinary(obj=_clean(c)) for c in costs] for costs in problem.unary]
    for row in x:
        h.addConstr(sum(row) == 1)
    memory = [_clean(m) * v for mem, row in zip(problem.unary_memory or (), x) for m, v in zip(mem, row) if _clean(m)]
    for (i, j), table in problem.pair.items():
        for o, costs in enumerate(table):
            for p, c in enumerate(costs):
                c = _clean(c)
                mem = _clean(problem.pair_memory[(i, j)][o][p]) if problem.pair_memory else 0.0
                if c == 0.0 and mem == 0.0:
                    continue
                y = h.addVariable(lb=0.0, ub=1.0, obj=float(c))
                h.addConstr(y >= x[i][o] + x[j][p] - 1)
                h.addConstr(y <= x[i][o])
                h.addConstr(y <= x[j][p])
                if mem:
                    memory.append(mem * y)
    if problem.budget is not None and memory:
        h.addConstr(sum(memory) <= float(problem.budget))
    for _ in range(k):
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return
        choice = tuple(max(range(len(row)), key=lambda o: h.val(row[o])) for row in x)
        yield choice
        h.addConstr(sum(row[o] for row, o in zip(x, choice)) <= len(x) - 1)  # not this one again


def _clean(c: float) -> float:
    """Coefficients are relative (about 1); below 1e-7 they are noise, and HiGHS refuses
    matrix entries under 1e-9."""
    return 0.0 if abs(c) < 1e-7 else float(c)


@contextlib.contextmanager
def _stdout_to_devnull():
    """File descriptor 1 to /dev/null for the duration (output written from C++ included)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
