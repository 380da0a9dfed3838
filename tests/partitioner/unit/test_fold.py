"""Folding (TAP): a model's repeated layers, mirrored optimizer state and per-leaf update chains
collapse onto one representative, so the search's graph does not grow with depth, and pricing the
folded graph gives what pricing the unrolled one gives."""

import pytest

from examples.targets import gpt, mlp
from partitioner.analysis import read_inputs
from partitioner.capture import capture
from partitioner.cost import estimate
from partitioner.hardware import profile
from partitioner.propagate import propagate
from partitioner.search import search


def folded_ops(layers):
    step, args = gpt(256, 4, 1024, 512, 64, layers, 8)
    inputs = read_inputs(step, args, None)
    return len(inputs.graph.ops), inputs.fold.original_ops


def test_the_folded_graph_does_not_grow_with_depth():
    (two, unrolled_two), (eight, unrolled_eight) = folded_ops(2), folded_ops(8)
    assert unrolled_eight > 3 * unrolled_two
    assert abs(eight - two) <= 0.1 * two, (two, eight)  # the same layer; the norm's chain folds a little differently


def test_folded_pricing_matches_the_unrolled_graph():
    h100 = profile("h100")
    step, args = mlp(1024, 4096, 4, 4096)
    graph = capture(step, *args)
    inputs = read_inputs(step, args, None)
    leaves = graph.inputs[len(graph.inputs) - len(inputs.keys) :]
    mesh = {"data": 2, "seq": 1, "model": 4}
    w1 = [v for v, k in zip(leaves, inputs.keys) if k[:1] == ("params",) and k[-1] == "w1"]
    w2 = [v for v, k in zip(leaves, inputs.keys) if k[:1] == ("params",) and k[-1] == "w2"]
    x = leaves[-1]
    ann = {x: (("data",), (), ()), **{w: ((), ("model",)) for w in w1}, **{w: (("model",), ()) for w in w2}}
    full = estimate(propagate(graph, ann, mesh), h100)
    f = inputs.fold
    reps = {f.of(v): s for v, s in ann.items()}
    assert len({f.of(w) for w in w1}) == 1 and len({f.of(w) for w in w2}) == 1  # four layers, one class each
    folded = estimate(propagate(f.graph, reps, mesh), h100, f)
    assert folded.collective_bytes == full.collective_bytes
    assert folded.peak_bytes_per_device == full.peak_bytes_per_device
    assert folded.communication_seconds == pytest.approx(full.communication_seconds, rel=1e-9)
    # Compute differs by what folding approximates: the one layer priced reads its input (the
    # step's argument) from memory, where layers 2-4 recompute a cheap residual sum in-fusion.
    assert folded.compute_seconds == pytest.approx(full.compute_seconds, rel=0.02)


def test_mirrored_optimizer_state_joins_its_parameters_class():
    step, args = gpt(256, 4, 1024, 512, 64, 3, 8)
    inputs = read_inputs(step, args, None)
    by_key = dict(zip(inputs.keys, inputs.ids))
    mu = [by_key[("opt", "0", "mu", "layers", str(i), "attn", "wq")] for i in range(3)]
    assert len(set(mu)) == 1
    assert by_key[("params", "layers", "2", "attn", "wq")] == by_key[("params", "layers", "0", "attn", "wq")]
    assert by_key[("params", "layers", "0", "attn", "wq")] != by_key[("params", "layers", "0", "attn", "wk")]


def test_a_deep_model_plans_like_a_shallow_one():
    step2, args2 = gpt(2048, 16, 8192, 4096, 256, 2, 8)
    step6, args6 = gpt(2048, 16, 8192, 4096, 256, 6, 8)
    p2, _ = search(step2, *args2, devices=8, hardware="h100", compile_check=False)
    p6, _ = search(step6, *args6, devices=8, hardware="h100", compile_check=False)
    assert p2.mesh == p6.mesh and p2.notes[0].split()[1] == p6.notes[0].split()[1]
    layer2, layer6 = p2.in_specs[0]["params"]["layers"], p6.in_specs[0]["params"]["layers"]
    assert all(layer6[i] == layer2[0] for i in range(6))


def test_the_remat_estimate_matches_the_rematerialised_program():
    """What the memory error promises for `jax.checkpoint` around each layer: the estimate from
    the plain program's liveness is within 10% of the predicted peak of the same program written
    with it (MaxText's loop, FSDP over 8), and nothing is left to save in the latter."""
    from partitioner import analysis, candidates, profile, tactics
    from tests.corpus import llama_maxtext

    mesh, hw, found = {"data": 8, "seq": 1, "model": 1}, profile("h100"), {}
    for remat in (False, True):
        fn, args = llama_maxtext.build(layers=8, remat=remat)
        inputs = read_inputs(fn, args, None)
        batch = tactics.batch_shardings(inputs, mesh)
        fsdp = {v: s for v in analysis.state_values(inputs) if (s := tactics.fsdp(inputs.graph.values[v].shape, 8))}
        c = candidates.priced(inputs, candidates.Tactic("fsdp"), mesh, {**batch, **fsdp}, hw, batch)
        sizes = {v: int(c.propagation.device_bytes[v]) for v in inputs.fold.materialized}
        found[remat] = (c.cost.peak_bytes_per_device, *inputs.fold.remat_peak(sizes))
    (plain, estimate, saved), (rematerialised, _, left) = found[False], found[True]
    assert saved > 0.4 * plain and left == 0
    assert abs(estimate - rematerialised) <= 0.1 * rematerialised, (estimate, rematerialised)


def test_a_plan_that_does_not_fit_says_whether_remat_would_make_it():
    from partitioner import PlanMemoryError
    from tests.corpus import llama_maxtext

    fn, args = llama_maxtext.build(layers=8)
    with pytest.raises(PlanMemoryError, match=r"Rematerialising each repeated layer .* it would fit"):
        search(fn, *args, devices=8, hardware="h100", memory_limit=int(0.9 * 2**30), compile_check=False)
    fn, args = llama_maxtext.build(layers=8, remat=True)
    with pytest.raises(PlanMemoryError, match="remat would not help"):
        search(fn, *args, devices=8, hardware="h100", memory_limit=int(0.5 * 2**30), compile_check=False)
