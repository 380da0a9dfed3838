"""Tactics over the folded factor graph: on each mesh, each tactic annotates a few inputs (the
batch, some weights), propagation shards everything else, and the cost model prices the result
(`Candidate`); `refined` improves the best of them one weight at a time.

Meshes are every factoring of the devices (and of the most devices the batch divides, 6 of 7 for
a batch of 24) into (data, seq, model); `data` must divide the batch and `seq` the sequence
dimension of every batch leaf that has one.

Tactics, on each mesh:
    dp        batch over data (and its sequence dimension over seq), state replicated
    fsdp      dp, and every state leaf sharded over data on its largest dimension that divides
    megatron  each matmul weight, in program order, split over model on its major output dimension
              (column-parallel) unless the activation it multiplies already arrives split along
              the contracted dimension, then on that one (row-parallel): Megatron's alternation,
              read from the graph rather than from layer names; a table read by lookup (a gather,
              a one-hot matmul) larger than what it makes split by rows, vocabulary-parallel
    megatron+fsdp  both, the weights' other dimension over data
    expert    weights whose leading dimension is a batch factor of their matmul (stacked experts)
              split over model on it, the rest replicated (expert x data parallelism)
    expert+megatron  experts so, the other weights as Megatron splits them (and +fsdp)
    expert (across slices)  on slices, a mesh whose `expert` axis spans whole slices: stacked
              experts split over it, the batch over data and expert (the other weights
              replicated, their gradients reduced over every device), tokens sent to their
              experts across slices in place of the experts' gradients: where expert weights
              outweigh the tokens routed to them
    refined   the best tensor-parallel candidates, each weight's split chosen by price in turn
              (a table's by rows or by columns among them)
On a mesh with seq > 1 every tactic is also sequence (context) parallel: activations are split
along the sequence, and attention gathers keys and values, as propagation finds.
Optimizer state follows its parameter (same shape, same path below its container).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

from .analysis import (
    MATMULS,
    Inputs,
    Weight,
    experts,
    mirror_optimizer_state,
    split_over,
    state_values,
    weights_in_order,
)
from .candidates import Candidate, Tactic, TacticPlan, priced_each
from .fsdp import AXIS as FSDP_AXIS
from .fsdp import fsdp_dim
from .hardware import Hardware
from .ir import FactorKind, Graph
from .propagate import Sharding, Spreading

# What the Megatron tactic decided, per step analysed (by model size and preset), and whether a
# column split lasts (per matmul and output factor): asked for on every mesh, found once. Kept
# here, by what computes them, and gone with the `Inputs` they were found in.
_DECIDED: weakref.WeakKeyDictionary[Inputs, dict] = weakref.WeakKeyDictionary()
_LASTING: weakref.WeakKeyDictionary[Inputs, dict] = weakref.WeakKeyDictionary()


TACTICS = (
    "dp",
    "fsdp",
    "megatron",
    "megatron+fsdp",
    "expert",
    "expert+megatron",
    "expert+megatron+fsdp",
    "refined",
    "exact",
)


def batch_shardings(inputs: Inputs, mesh: Mapping[str, int]) -> dict[int, Sharding]:
    g, out = inputs.graph, {}
    for v in inputs.batch_values:
        shape = g.values[v].shape
        if shape:
            split = [tuple(a for a in ("replica", "data", "expert") if mesh.get(a, 1) > 1)] + [()] * (len(shape) - 1)
            if mesh["seq"] > 1 and len(shape) >= 2:
                split[1] = ("seq",)
            if any(split):
                out[v] = tuple(split)
    return out


def tactic_candidates(inputs: Inputs, mesh: dict[str, int], hw: Hardware) -> list[Candidate]:
    return priced_each(inputs, tactic_plans(inputs, mesh), hw)


def tactic_plans(inputs: Inputs, mesh: dict[str, int]) -> list[TacticPlan]:
    """Each tactic's annotations on `mesh`, to price."""
    g = inputs.graph
    batch = batch_shardings(inputs, mesh)
    state = state_values(inputs)
    plans = {}
    if mesh.get("expert", 1) > 1:  # experts across slices, and nothing else on the expert axis
        ep = experts(inputs, mesh, "expert")
        return [TacticPlan(Tactic("expert"), mesh, {**batch, **ep}, batch)] if ep else []
    seq = mesh["seq"] > 1
    plans: dict[Tactic, dict] = {}
    if mesh["model"] == 1:  # a model axis no weight uses would only repeat the same work
        plans[Tactic("dp", sequence=seq)] = dict(batch)
        if mesh["data"] > 1:
            state_fsdp = {v: s for v in state if (s := fsdp(g.values[v].shape, mesh["data"]))}
            plans[Tactic("fsdp", sequence=seq)] = {**batch, **state_fsdp}
    else:
        tp = _megatron(inputs, mesh)
        plans[Tactic("megatron", sequence=seq)] = {**batch, **tp}
        if mesh["data"] > 1:
            plans[Tactic("megatron", True, seq)] = {**batch, **add_fsdp(inputs, tp, state, mesh["data"])}
        ep = experts(inputs, mesh)
        if ep:
            plans[Tactic("expert", sequence=seq)] = {**batch, **ep}
            em = _megatron(inputs, mesh, preset=ep)
            plans[Tactic("expert+megatron", sequence=seq)] = {**batch, **em}
            if mesh["data"] > 1:
                plans[Tactic("expert+megatron", True, seq)] = {**batch, **add_fsdp(inputs, em, state, mesh["data"])}
    if mesh.get("replica", 1) > 1:  # without FSDP, replica x data is the data axis of their product
        plans = {k: v for k, v in plans.items() if k.shards_state}
    return [
        TacticPlan(tactic, mesh, chosen, batch)
        for tactic, chosen in plans.items()
        # A tactic that found nothing to split: the model axis would only repeat work.
        if mesh["model"] == 1 or any("model" in axes for sh in chosen.values() for axes in sh)
    ]


def fsdp(shape, d: int) -> Sharding | None:
    """A state leaf alone sharded FSDP over `d` (`fsdp.fsdp_dim`), or None."""
    i = fsdp_dim(shape, d)
    return None if i is None else split_over(shape, i, FSDP_AXIS)


def add_fsdp(inputs: Inputs, tp: Mapping[int, Sharding], state: list[int], d: int) -> dict[int, Sharding]:
    """`tp` with every state leaf also sharded FSDP over `d`, on a dimension `tp` leaves whole.
    Optimizer state takes its parameter's `tp` split first, so that it is split as its parameter
    is (FSDP's dimension chosen alike): else its parameter's Megatron split would be lost on it."""
    g = inputs.graph
    tp = mirror_optimizer_state(inputs, tp)
    out = dict(tp)
    for v in state:
        shape = g.values[v].shape
        current = list(tp.get(v, ((),) * len(shape)))
        i = fsdp_dim(shape, d, [bool(axes) for axes in current])
        if i is not None:
            current[i] = (FSDP_AXIS,)
            out[v] = tuple(current)
    return out


def _megatron(
    inputs: Inputs, mesh: dict[str, int], preset: Mapping[int, Sharding] | None = None
) -> dict[int, Sharding]:
    """Decide weights in program order, each decision spreading (`Spreading`) before the next
    weight's activation is read; weights in `preset` (stacked experts) take the sharding given
    there. A weight is row-parallel where its
    activation arrives split along the contracted dimension, or comes from a column-parallel
    projection through ops that lost the split (a fused QKV cut by `jnp.split`): Megatron's pairs,
    read from the dataflow. The graph is folded, so a repeated layer's weights are decided once
    for every copy (TAP). The decisions read only where the model axis goes, which the batch's
    axes never contest (they split other dimensions), so they are made on the model axis alone,
    once per model size and preset, for every mesh (the same decisions as with the batch beside
    them on all 150 cases of the corpus's first 15 models on five meshes)."""
    key = (mesh["model"], tuple(sorted((preset or {}).items())))
    decided = _DECIDED.setdefault(inputs, {})
    if key not in decided:
        alone = {axis: 1 for axis in mesh} | {"model": mesh["model"]}
        decided[key] = _megatron_on(inputs, alone, preset)
    return dict(decided[key])


def _megatron_on(inputs: Inputs, mesh: dict[str, int], preset: Mapping[int, Sharding] | None) -> dict[int, Sharding]:
    g, t = inputs.graph, mesh["model"]
    chosen: dict[int, Sharding] = {}
    column: set[int] = set()  # matmuls whose weight went column-parallel
    weights, feeders = weights_in_order(inputs), inputs.feeders
    spread = Spreading(g, mesh)
    for weight in weights:
        op, k, w = weight.op, weight.k, weight.value
        if preset and w in preset:
            chosen[w] = preset[w]
            spread.add({w: preset[w]})
            continue
        if weight.lookup or _one_hot(inputs, op.operands[1 - k]):
            _vocabulary(inputs, weight, t, chosen, spread)
            continue
        other = op.operands[1 - k]
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        x_sharding = spread.of(other, len(g.values[other].shape)) if other >= 0 else ()
        kind = lambda dims: op.factors[dims[0]].kind if dims else None  # noqa: B023 (called within the iteration)
        arrives_split = any(
            "model" in axes and kind(dims) is FactorKind.REDUCE for axes, dims in zip(x_sharding, x_dims)
        )
        shared = {dims[0] for dims in x_dims if dims}
        if arrives_split:  # row-parallel: split the contracted dimension the activation is split on
            split = {ds[0] for axes, ds in zip(x_sharding, x_dims) if "model" in axes and ds}
            dims = [d for d, ds in enumerate(w_dims) if ds and ds[0] in split]
        elif feeders[op.id] & column:  # row-parallel after a split the dataflow lost: the major contracted dim
            dims = [d for d, ds in enumerate(w_dims) if kind(ds) is FactorKind.REDUCE]
        else:  # column-parallel: split an output dimension whose split lasts, the major one (heads)
            dims = [
                d
                for d, ds in enumerate(w_dims)
                if kind(ds) is FactorKind.PASS and ds[0] not in shared and _lasts(inputs, op, ds[0])
            ]
        shape = weight.shape(g)
        dims = [d for d in dims if shape[d] % t == 0]
        if not dims:
            continue
        if kind(w_dims[dims[0]]) is FactorKind.PASS:
            column.add(op.id)
        chosen[w] = weight.sharding(split_over(shape, dims[0], "model"))
        spread.add({w: chosen[w]})
    return chosen


def _vocabulary(inputs: Inputs, weight: Weight, t: int, chosen: dict, spread: Spreading) -> None:
    """A table read by lookup (a gather, or a matmul against a one-hot) split by rows, over model:
    Megatron-LM's VocabParallelEmbedding (MaxText shards the vocabulary on its tensor axis too).
    Each device looks up the rows it holds and an all-reduce of the activations sums the parts,
    so it pays where the table outweighs the activations it makes (a token embedding, not a
    learned position table read once per position)."""
    g, op = inputs.graph, weight.op
    lookup_kind = FactorKind.GATHER if weight.lookup else FactorKind.REDUCE
    dims = op.operand_dims[weight.k]
    shape = weight.shape(g)
    rows = [d for d, fs in enumerate(dims) if fs and op.factors[fs[0]].kind is lookup_kind and shape[d] % t == 0]
    if not rows or g.values[weight.value].nbytes <= g.values[op.results[0]].nbytes:
        return
    chosen[weight.value] = weight.sharding(split_over(shape, rows[0], "model"))
    spread.add({weight.value: chosen[weight.value]})


def _one_hot(inputs: Inputs, v: int) -> bool:
    """Whether `v` is a one-hot encoding (`jax.nn.one_hot`: ids compared with an iota, then cast):
    a matmul against it is a lookup."""
    op = inputs.producer.get(v)
    while op is not None and op.primitive in ("convert_element_type", "broadcast_in_dim", "reshape"):
        op = inputs.producer.get(op.operands[0])
    return op is not None and op.primitive == "eq"


def _lasts(inputs: Inputs, op, factor: int) -> bool:
    """Whether a column-parallel split of matmul `op`'s output along `factor` lasts to the next
    matmuls on every path forward: not sliced away (a stacked K/V kernel's selector, read as
    kv[0] and kv[1]) nor contracted against another activation (head_dim in q . k); a reduction,
    a lookup along it (the labels' logits) or a matmul against a weight (Megatron's row-parallel
    pair) keeps it. Where no output dimension lasts (two K/V heads on a model axis of four), the
    weight stays whole, as Megatron-LM replicates K/V heads fewer than its tensor-parallel degree."""
    key, lasting = (op.id, factor), _LASTING.setdefault(inputs, {})
    if key not in lasting:
        dim = next((d for d, fs in enumerate(op.result_dims[0]) if fs and fs[0] == factor), None)
        lasting[key] = dim is not None and not _cut(inputs, op.results[0], dim)
    return lasting[key]


def _cut(inputs: Inputs, value: int, dim: int, budget: int = 512) -> bool:
    """Whether a split of `value`'s dimension `dim` is cut on some path forward (`_lasts`), each
    (value, dimension) followed once; after `budget` of them it is taken to last (a layer's
    forward is well within it, and a split kept too long costs a reshard, not a wrong result)."""
    g, weights, readers = inputs.graph, inputs.weight_operands, inputs.readers
    stack, seen = [(value, dim)], set()
    while stack and len(seen) < budget:
        v, d = stack.pop()
        if (v, d) in seen:
            continue
        seen.add((v, d))
        for op in readers.get(v, ()):
            if op.body is not None or not op.results:  # a loop body or a tie: nothing to follow
                continue
            for k in (k for k, o in enumerate(op.operands) if o == v):
                fs = op.operand_dims[k][d] if d < len(op.operand_dims[k]) else ()
                kind = op.factors[fs[0]].kind if fs else None
                if op.primitive in MATMULS:
                    if kind is FactorKind.REDUCE and (op.id, 1 - k) not in weights:
                        return True
                    continue
                if kind in (FactorKind.REDUCE, FactorKind.GATHER):  # a reduction or a lookup along it
                    continue
                after = _goes_on(g, op, fs[0] if fs else None, len(g.values[v].shape), d)
                if after is None:
                    return True
                stack.extend(after)
    return False


def _goes_on(g: Graph, op, factor: int | None, rank: int, d: int) -> list[tuple[int, int]] | None:
    """Where dimension `d` (carrying `factor` into `op`) goes on in `op`'s results: the dims
    its factor leads; else, where `op` cuts it into pieces longer than one (RoPE's halves, a
    fused QKV cut in three by `jnp.split`), each piece's; [] where it goes on as a minor factor
    (not followed). None where it is indexed away (kv[0]: a piece of one)."""
    if factor is not None:
        led = [
            (r, i) for r, dims in zip(op.results, op.result_dims) for i, fs in enumerate(dims) if fs and fs[0] == factor
        ]
        if led or any(factor in fs for dims in op.result_dims for fs in dims):
            return led
    pieces = [r for r in op.results if len(g.values[r].shape) == rank and g.values[r].shape[d] > 1]
    return [(r, d) for r in pieces] or None
