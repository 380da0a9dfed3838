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
`solved` is the thorough level's use of it: on the meshes whose best tactic is cheapest, every
weight of the folded graph gets an option (replicated, or one dimension over model), costs
measured by propagation around the tactic's plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence

from .analysis import Inputs, Weight, split_over, state_values, weights_in_order
from .candidates import Candidate, Tactic, TacticPlan, priced_each
from .hardware import Hardware
from .tactics import add_fsdp, batch_shardings


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


# -- the thorough level's driver: the solver around the tactics' best plans ------------------

REFINED_MESHES = 4  # thorough: meshes the exact solver refines, best tactic first


K_BEST = 3  # the solver's best answers priced exactly, per mesh


ROUNDS = 2  # re-linearisations around an improved answer, per mesh

# A mesh whose best tactic is predicted this much slower than the best plan that fits is not
# solved: the solver's answers improve on their start by a few percent (t5: 1.8%, the most in
# the corpus), and pricing a wide model's weights pairwise costs minutes (a diffusion UNet's 100
# weights, 11 minutes, for a mesh twice as slow as data parallelism).
EXACT_REACH = 1.5


def solved(inputs: Inputs, candidates: list[Candidate], hw: Hardware, limit: int) -> list[Candidate]:
    """The exact level on the meshes whose best tactic is cheapest, within EXACT_REACH of the
    best plan (Rhino: the coarse level narrows where the fine one searches), starting from that
    tactic's plan."""
    by_mesh: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        by_mesh.setdefault(tuple(c.mesh.items()), []).append(c)

    def best(cs):
        fitting = [c for c in cs if c.cost.peak_bytes_per_device <= limit]
        return (
            min(fitting, key=lambda c: c.cost.total_seconds)
            if fitting
            else min(cs, key=lambda c: c.cost.peak_bytes_per_device)
        )

    def rank(cs):
        b = best(cs)
        return (b.cost.peak_bytes_per_device > limit, b.cost.total_seconds)

    fitting = [c.cost.total_seconds for c in candidates if c.cost.peak_bytes_per_device <= limit]
    reach = EXACT_REACH * min(fitting) if fitting else math.inf
    meshes = sorted(
        (k for k in by_mesh if dict(k)["model"] > 1 and best(by_mesh[k]).cost.total_seconds <= reach),
        key=lambda k: rank(by_mesh[k]),
    )[:REFINED_MESHES]
    return [c for k in meshes for c in _solve_mesh(inputs, dict(k), hw, limit, best(by_mesh[k]))]


def _solve_mesh(inputs: Inputs, mesh: dict[str, int], hw: Hardware, limit: int, start: Candidate) -> list[Candidate]:
    """Every weight of the folded graph gets an option: replicated, or one dimension over model.
    Around a reference plan (first the best tactic's), a plan's cost is modelled as the
    reference's, plus each weight's own change, plus a correction for each pair of weights next
    to each other in program order (and the last with the first: the next layer's), all measured
    by propagation; the ILP's best answers are priced exactly, and the best of them becomes the
    next reference while it improves (at most ROUNDS times). Each answer is also priced with FSDP."""
    g, t = inputs.graph, mesh["model"]
    batch = batch_shardings(inputs, mesh)
    found = weights_in_order(inputs)
    options = [[None] + [d for d, n in enumerate(w.shape(g)) if n % t == 0 and n >= t] for w in found]
    name = Tactic("exact", sequence=mesh["seq"] > 1)
    cache: dict[tuple, Candidate] = {}

    def plan(key: tuple[int, ...]) -> TacticPlan:
        ann = {
            w.value: w.sharding(split_over(w.shape(g), opts[o], "model"))
            for w, opts, o in zip(found, options, key)
            if o
        }
        return TacticPlan(name, mesh, {**batch, **ann}, batch)

    def price_all(choices: Iterable[Sequence[int]]) -> list[Candidate]:
        """Each choice's candidate, in order: those not priced yet are priced together, two at a
        time (`candidates.priced_each`), the rest read from the cache."""
        keys = [tuple(c) for c in choices]
        new = [k for k in dict.fromkeys(keys) if k not in cache]
        cache.update(zip(new, priced_each(inputs, [plan(k) for k in new], hw)))
        return [cache[k] for k in keys]

    def option_of(w: Weight, opts: list) -> int:
        given = w.operand_sharding(start.annotations.get(w.value, ()))
        dims = [d for d, axes in enumerate(given) if "model" in axes]
        return opts.index(dims[0]) if dims and dims[0] in opts else 0

    ref = tuple(option_of(w, opts) for w, opts in zip(found, options))
    out = []
    for _ in range(ROUNDS):
        chosen = [tuple(c) for c in k_best(_linearised(price_all, ref, options, limit), K_BEST)]
        answers = price_all(chosen)
        out += answers
        fitting = [a for a in answers if a.cost.peak_bytes_per_device <= limit]
        better = min(fitting, key=lambda a: a.cost.total_seconds, default=None)
        if better is None or better.cost.total_seconds >= cache[ref].cost.total_seconds:
            break
        ref = next(k for k, a in zip(chosen, answers) if a is better)
    if mesh["data"] > 1:
        state = state_values(inputs)
        plans = []
        for c in out:
            tp = {w.value: c.annotations[w.value] for w in found if w.value in c.annotations}
            plans.append(
                TacticPlan(
                    dataclasses.replace(name, fsdp=True),
                    mesh,
                    {**batch, **add_fsdp(inputs, tp, state, mesh["data"])},
                    batch,
                )
            )
        out += priced_each(inputs, plans, hw)
    return out


def _linearised(price_all, ref: tuple[int, ...], options: list[list], limit: int) -> PairwiseProblem:
    """The pairwise model around `ref`: each weight moved alone, and each adjacent pair moved
    together, measured against `ref`. Every choice it reads goes to `price_all` at once, so that
    they are priced two at a time."""
    n = len(ref)
    adjacent = [(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if n > 2 else [])
    moved = lambda changes: tuple(changes.get(k, o) for k, o in enumerate(ref))
    single = {(i, o): moved({i: o}) for i in range(n) for o in range(len(options[i])) if o != ref[i]}
    double = {
        (i, j, o, p): moved({i: o, j: p})
        for i, j in adjacent
        for o in range(len(options[i]))
        for p in range(len(options[j]))
        if o != ref[i] and p != ref[j]
    }
    every = [ref, *single.values(), *double.values()]
    price = dict(zip(every, price_all(every)))
    base = price[ref]
    sec = lambda c: c.cost.total_seconds / base.cost.total_seconds - 1.0
    mem = lambda c: (c.cost.peak_bytes_per_device - base.cost.peak_bytes_per_device) / limit

    def table(measure):
        alone = [
            [measure(price[single[i, o]]) if (i, o) in single else 0.0 for o in range(len(options[i]))]
            for i in range(n)
        ]
        pairs = {
            (i, j): [
                [
                    measure(price[double[i, j, o, p]]) - alone[i][o] - alone[j][p] if (i, j, o, p) in double else 0.0
                    for p in range(len(options[j]))
                ]
                for o in range(len(options[i]))
            ]
            for i, j in adjacent
        }
        return alone, pairs

    (unary, pair), (unary_mem, pair_mem) = table(sec), table(mem)
    return PairwiseProblem(unary, pair, unary_mem, pair_mem, budget=(limit - base.cost.peak_bytes_per_device) / limit)
