import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import partitioner
from orchestrator import check_program


@pytest.fixture(scope="module")
def gpt():
    from examples.gpt.model import program

    state, batch = check_program(program, 24)
    return program, state, batch


@pytest.mark.parametrize("devices, used", [(8, 8), (7, 6), (6, 6), (5, 4), (1, 1)])
def test_uses_the_most_devices_that_divide_the_batch(gpt, devices, used):
    program, state, batch = gpt
    plan = partitioner.plan_by_shapes(program.step, state, batch, devices=devices, hardware="cpu")
    assert plan.devices_used == used and plan.mesh == {"data": used}
    if used < devices:
        assert plan.notes and f"using {used} of {devices} devices" in plan.notes[0]
        assert (
            plan.notes[0]
            == f"using {used} of {devices} devices: the batch dimension 24 does not divide by any count from {used + 1} to {devices}"
        )
    batch_specs = plan.specs_like(batch, argnum=1)
    assert batch_specs["inputs"] == (P(("data",)) if used > 1 else P())
    assert all(s == P() for s in jax.tree.leaves(plan.specs_like(state, argnum=0), is_leaf=lambda x: isinstance(x, P)))


def test_shards_parameters_when_replicated_state_does_not_fit(gpt):
    program, state, batch = gpt
    dp = partitioner.plan_by_shapes(program.step, state, batch, devices=8, hardware="cpu")
    limit = dp.cost.peak_bytes_per_device // 2
    plan = partitioner.plan_by_shapes(program.step, state, batch, devices=8, hardware="cpu", memory_limit=limit)
    assert plan.mesh.get("data", 1) > 1 and plan.tactic == "fsdp" and plan.cost.peak_bytes_per_device <= limit
    wte = plan.specs_like(state, argnum=0)["params"]["wte"]
    assert "data" in wte  # the one FSDP axis, as the search's plans shard over
    assert any("FSDP" in n for n in plan.notes)
    with pytest.raises(partitioner.PlanMemoryError, match=r"over\. Add devices"):
        partitioner.plan_by_shapes(program.step, state, batch, devices=8, hardware="cpu", memory_limit=1000)


def test_plan_round_trips_through_json_and_rejects_other_trees(gpt):
    program, state, batch = gpt
    plan = partitioner.plan(program.step, state, batch, devices=6, hardware="h100", compile_check=False)
    again = partitioner.Plan.from_json(plan.to_json())
    assert again.mesh == plan.mesh and again.cost == plan.cost and again.notes == plan.notes
    assert jax.tree.leaves(again.specs_like(state, argnum=0)) == jax.tree.leaves(plan.specs_like(state, argnum=0))
    with pytest.raises(partitioner.PlanMismatchError, match="no spec for argument 0 leaf"):
        again.specs_like({"other": state}, argnum=0)
    with pytest.raises(partitioner.UnknownHardwareError, match="expected one of"):
        partitioner.plan(program.step, state, batch, devices=6, hardware="a100", compile_check=False)


def test_bound_plan_computes_what_one_device_computes(gpt, devices8):
    from examples.gpt.model import GPTConfig, loss_fn

    program, state, batch = gpt
    plan = partitioner.Plan.from_json(  # as the hosts receive it
        partitioner.plan(program.step, state, batch, devices=7, hardware="cpu", compile_check=False).to_json()
    )
    real_state = program.init(jax.random.key(0))
    real_batch = program.batch(3, 24)

    step = plan.jit(program.step, (real_state, real_batch), devices8[:7])  # binds 6 of the 7
    sharded_state, metrics = step(real_state, real_batch)
    _, ref_metrics = jax.jit(program.step)(real_state, real_batch)
    assert len(sharded_state["params"]["wte"].sharding.device_set) == 6
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(ref_metrics["grad_norm"]), rtol=1e-6)

    # What sharding changes is the order in which the batch's gradient is summed: each gradient
    # leaf agrees to float32 rounding of its own magnitude.
    mesh = plan.bind(devices8[:7])
    grad = jax.grad(lambda p, b: loss_fn(p, b, GPTConfig()))
    sharded = jax.jit(
        grad, in_shardings=(plan.shardings(mesh, state, argnum=0)["params"], plan.shardings(mesh, batch, argnum=1))
    )(real_state["params"], real_batch)
    reference = jax.jit(grad)(real_state["params"], real_batch)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(reference)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_plan_jit_keeps_a_carried_state_in_place_without_tracing_for_outputs(gpt, devices8, monkeypatch):
    """The orchestrator's one compile path: the new state keeps the state's shardings (donated
    buffers reused), metrics replicated, and `fn` is not traced to learn the output tree."""
    import jax

    program, state, batch = gpt
    plan = partitioner.plan_by_shapes(program.step, state, batch, devices=8, hardware="cpu")
    plan = partitioner.Plan.from_json(plan.to_json())  # as the hosts get it
    traced = []
    monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: traced.append(a))
    step = plan.jit(program.step, (state, batch), devices8, carry={0: 0}, donate_argnums=(0,))
    compiled = step.lower(state, batch).compile()
    assert not traced
    state_out, metrics_out = compiled.output_shardings
    mesh = plan.bind(devices8)
    assert jax.tree.leaves(state_out) == jax.tree.leaves(plan.shardings(mesh, state, argnum=0))
    assert all(s.spec == P() for s in jax.tree.leaves(metrics_out))


def test_fast_level_fills_the_cluster_with_model_within_a_host(gpt):
    from partitioner.analysis import read_inputs
    from partitioner.hardware import profile
    from partitioner.meshes import mesh_shapes

    program, state, batch = gpt
    hw = profile("h100")
    meshes = mesh_shapes(1024, read_inputs(program.step, (state, batch), None), hw, "fast")
    whole = [m for m in meshes if m["data"] * m["seq"] * m["model"] == 1024]
    assert whole, "with a batch of 24 no mesh of 1,024 devices was priced"
    assert all(m["model"] <= hw.devices_per_host for m in whole), whole
    assert {m["data"] for m in whole} == {8}  # the largest data axis a batch of 24 allows on 1,024
