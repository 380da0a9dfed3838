"""Meshes on fewer devices are priced only where their compute alone could beat the best plan
that fits on more: the floor is a bound every candidate's compute stays above."""

import jax
import jax.numpy as jnp

from partitioner.analysis import read_inputs
from partitioner.cost import compute_floor
from partitioner.hardware import profile
from partitioner.search import search
from partitioner.tactics import tactic_candidates


def sgd_step(params, batch):
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def arguments(batch, d, hidden):
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    return {"w1": f32(d, hidden), "w2": f32(hidden, d)}, {"x": f32(batch, d), "y": f32(batch, d)}


def test_no_candidate_computes_faster_than_its_device_counts_floor():
    hw = profile("h100")
    args = arguments(64, 512, 2048)
    inputs = read_inputs(sgd_step, args, None)
    meshes = [{"data": 8, "seq": 1, "model": 1}, {"data": 2, "seq": 1, "model": 4}, {"data": 4, "seq": 1, "model": 1}]
    priced = [c for mesh in meshes for c in tactic_candidates(inputs, mesh, hw)]
    assert len(priced) >= 5
    for c in priced:
        floor = compute_floor(inputs.graph, inputs.fold, hw, c.mesh["data"] * c.mesh["model"])
        assert 0 < floor <= c.cost.compute_seconds, (c.line(), floor)


def test_fewer_devices_are_left_out_where_their_floor_loses_and_priced_where_it_may_win():
    # Compute-bound (a large batch): half the devices cannot catch up, and the plan says why.
    plan, ranked = search(sgd_step, *arguments(65536, 1024, 4096), devices=8, batch_argnums=(1,), compile_check=False)
    assert {c.mesh["data"] * c.mesh["model"] for c in ranked} == {8}
    assert any(n.startswith("not priced on 4 devices: their compute alone would take at least") for n in plan.notes)
    # Bound by the gradients' all-reduce (a batch of 8 rows): fewer devices may be cheaper, so priced.
    plan, ranked = search(sgd_step, *arguments(8, 1024, 4096), devices=8, batch_argnums=(1,), compile_check=False)
    assert 4 in {c.mesh["data"] * c.mesh["model"] for c in ranked}
    assert not any(n.startswith("not priced on") for n in plan.notes)
