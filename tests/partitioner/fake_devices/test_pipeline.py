"""Pipelines: the layer scan found (or not, and why), plans with a stage axis, and the pipelined
program computing what the step computes."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

import partitioner
from partitioner.errors import PlanInputError
from partitioner.layerscan import find_layer_scan
from tests.corpus import equinox_scan, llama_gqa, maxtext_scan

SMALL = dict(vocab=256, embed=64, heads=4, head_dim=16, mlp=128, seq=16, batch=8)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _numerics(model: str, *shapes: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "tests.helpers.pipeline_numerics", model, *shapes],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


# stages:microbatches[:repeats][r: remat][f: FSDP inside each stage][g: its weights gathered per microbatch]
SHAPES = ("2:2", "2:8", "4:4", "4:8:2", "2:4r", "4:8:2r", "2:4f", "2:4fg", "4:8:2fg")


@pytest.mark.parametrize("model", ["maxtext_scan", "equinox_scan", pytest.param("nnx_scan", marks=pytest.mark.slow),
                                   pytest.param("linen_scan", marks=pytest.mark.slow)])  # fmt: skip
def test_pipelined_program_computes_the_step(model):
    rows = _numerics(model, *SHAPES)
    assert len(rows) == len(SHAPES)
    for row, shape in zip(rows, SHAPES):
        stages, microbatches, *repeats = map(int, shape.rstrip("rfg").split(":"))
        p = row["pipeline"]
        assert (p["stages"], p["microbatches"], p["repeats"]) == (stages, microbatches, repeats[0] if repeats else 1)
        assert p["remat"] == ("r" in shape) and p["gather_once"] == ("g" not in shape)
        assert ("f" not in shape) or row["tactic"] == "pipeline+fsdp", row  # (weights split: gathers to make)
        assert row["mesh"]["stage"] == stages
        assert row["loss"] <= 1e-5 and row["state"] <= 1e-5, row


def test_layer_scan_found_with_its_stacked_state():
    step, args = maxtext_scan.build(layers=4, c=SMALL)
    scan, why = find_layer_scan(step, args, (1,))
    assert why == "" and scan.pipelinable
    assert (scan.length, scan.batch) == (4, 8)
    keys = {k for _, k in scan.stacked}
    assert "params/decoder/layers/mlp/wi/kernel" in keys and "opt_state/0/mu/decoder/layers/mlp/wi/kernel" in keys
    assert "params/token_embedder/embedding" not in keys


def test_a_python_loop_of_layers_is_not_pipelined_and_says_why():
    step, args = llama_gqa.build(layers=2)
    plan = partitioner.plan(step, *args, devices=8, hardware="cpu", compile_check=False)
    assert plan.pipeline is None and any("Python loop" in n for n in plan.notes)
    with pytest.raises(PlanInputError, match="Python loop"):
        partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=2, compile_check=False)


def test_a_scan_applied_per_example_under_vmap_is_found_with_its_batch():
    # An Equinox model applies its scan to one sequence, and the step vmaps the model over the
    # batch: the batch shows outside the vmap, where the scan is pipelined.
    step, args = equinox_scan.build(layers=4)
    scan, why = find_layer_scan(step, args, (1,))
    assert why == "" and scan.vmapped and scan.pipelinable and (scan.length, scan.batch) == (4, 8)


def test_a_body_that_mixes_examples_is_not_pipelined():
    def layer(x, w):
        y = x @ w
        return (y - y.mean(0)) / (y.std(0) + 1e-5), None  # batch norm: statistics over the batch

    def step(state, batch):
        def loss(p):
            x, _ = jax.lax.scan(layer, batch["x"], p["w"])
            return (x**2).mean()

        g = jax.grad(loss)(state)
        return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), {"loss": loss(state)}

    state = {"w": jax.ShapeDtypeStruct((4, 32, 32), "float32")}
    batch = {"x": jax.ShapeDtypeStruct((16, 32), "float32")}
    scan, _ = find_layer_scan(step, (state, batch), (1,))
    assert scan is not None and not scan.pipelinable and "mixes examples" in scan.why_not


def test_pipelined_plan_has_a_stage_axis_and_round_trips():
    step, args = maxtext_scan.build(layers=8, c=SMALL)
    plan = partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=4, compile_check=False)
    assert plan.pipeline is not None and plan.pipeline.stages == 4 and plan.pipeline.axis == "stage"
    assert list(plan.mesh)[0] == "stage" and plan.mesh["stage"] == 4
    specs = plan.specs_like(args[0], argnum=0)
    assert specs["params"]["decoder"]["layers"]["mlp"]["wi"]["kernel"][0] == "stage"
    assert "stage" in (plan.specs_like(args[1], argnum=1)["inputs"][0] or ())
    assert "stage" not in str(specs["params"]["token_embedder"]["embedding"])  # outside the pipeline
    again = partitioner.Plan.from_json(plan.to_json())
    assert again.pipeline == plan.pipeline and again.layer_scan == plan.layer_scan
    assert any("bubble" in n for n in plan.notes) and any("without a pipeline" in n for n in plan.notes)


def test_stage_count_that_does_not_fit_moves_to_the_nearest_and_says_so():
    step, args = maxtext_scan.build(layers=8, c=SMALL)
    plan = partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=3, compile_check=False)
    assert plan.pipeline.stages in (2, 4)
    assert any("pipeline=3 does not fit" in n for n in plan.notes)


def test_bad_pipeline_values_are_refused():
    step, args = maxtext_scan.build(layers=8, c=SMALL)
    for bad in (1, "yes", True):
        with pytest.raises(PlanInputError, match="pipeline must be"):
            partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=bad, compile_check=False)
    with pytest.raises(PlanInputError, match="microbatches must divide"):
        partitioner.Pipeline(2, 3).checked(8, 8)
    with pytest.raises(PlanInputError, match="divisible by"):
        partitioner.Pipeline(3, 2).checked(8, 8)


def test_program_without_a_pipeline_constrains_the_carry():
    step, args = maxtext_scan.build(layers=4, c=SMALL)
    plan = partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline="off", compile_check=False)
    assert plan.pipeline is None and plan.layer_scan is not None
    text = jax.jit(plan.program(step)).lower(*args).as_text()
    assert "sharding_constraint" in text
    assert dataclasses.replace(plan, layer_scan=None).program(step) is step


def test_a_pipeline_that_does_not_divide_is_refused_when_the_program_is_made():
    step, args = maxtext_scan.build(layers=8, c=SMALL)
    plan = partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=2, compile_check=False)
    bad = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatches=3))
    with pytest.raises(PlanInputError, match="3 microbatches must divide the batch of 8"):
        partitioner.Plan.from_json(bad.to_json()).program(step)


def test_a_pipeline_keeps_less_where_memory_asks():
    step, args = maxtext_scan.build(layers=8, c=dict(SMALL, seq=1024, batch=16))
    roomy = partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=2, compile_check=False)
    # (Each way to keep less costs time: the forward pass again, or the weights moved at every tick.)
    assert roomy.pipeline.gather_once and not roomy.pipeline.remat
    limit = roomy.cost.peak_bytes_per_device - 1
    tight = partitioner.plan(step, *args, devices=8, hardware="cpu", pipeline=2, compile_check=False,
                             memory_limit=limit)  # fmt: skip
    assert tight.cost.peak_bytes_per_device <= limit < roomy.cost.peak_bytes_per_device
    assert tight.cost.total_seconds > roomy.cost.total_seconds
    assert tight.pipeline.remat or not tight.pipeline.gather_once, tight.pipeline
    said = "stages rematerialised" if tight.pipeline.remat else "weights gathered per microbatch"
    assert any(said in n for n in tight.notes), tight.notes
    temp = {}
    # A stage rematerialised keeps less in the compile too, the pipeline otherwise the same. (No
    # repeats: each stage applies several layers a tick, whose inputs remat does not keep. The
    # compile of a stage gathered per microbatch keeps less only where weights outweigh the
    # activations: at 13B, not at this size; see benchmarks/history.md.)
    for remat in (False, True):
        pipe = dataclasses.replace(tight.pipeline, gather_once=True, remat=remat, repeats=1)
        plan = dataclasses.replace(tight, pipeline=pipe)
        compiled = plan.jit(plan.program(step), args, jax.devices()).lower(*args).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[True] < temp[False], temp


def test_a_stage_too_large_to_gather_is_split_with_megatron_or_gathered_per_microbatch():
    """A Llama-13B-shaped scanned step on 4 slices of 8 tpu-v5e chips: a stage of FSDP gathered
    once holds its 10 layers' weights and their gradients' sums on every chip, over 16 GB. The
    planner still pipelines it, a stage split with Megatron over 2 of its chips; with less memory
    still, each stage's weights gathered per microbatch; with less again, no pipeline fits."""
    from tests.corpus import llama_scan

    step, args = llama_scan.build(layers=40, c=dict(llama_scan.THIRTEEN_B, seq=2048))
    fits = partitioner.plan(step, *args, devices=32, slices=4, hardware="tpu-v5e", compile_check=False)
    assert fits.pipeline is not None and fits.pipeline.gather_once and fits.mesh["stage"] == 4
    assert fits.mesh.get("model", 1) > 1 and fits.cost.peak_bytes_per_device <= 16e9
    tighter = partitioner.plan(step, *args, devices=32, slices=4, hardware="tpu-v5e", compile_check=False,
                               memory_limit=10 * 2**30)  # fmt: skip
    assert tighter.pipeline is not None and not tighter.pipeline.gather_once
    assert any("weights gathered per microbatch" in n for n in tighter.notes)
    flat = partitioner.plan(step, *args, devices=32, slices=4, hardware="tpu-v5e", compile_check=False,
                            memory_limit=6 * 2**30)  # fmt: skip
    assert flat.pipeline is None
    assert any(n.startswith("no pipeline: none of") and "per microbatch" in n for n in flat.notes), flat.notes
