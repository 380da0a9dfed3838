"""Throughput accounting in the worker: FLOPs counted by XLA, MFU, and laps that cover a segment."""

import time

import numpy as np
import pytest

import partitioner
from orchestrator import check_program
from orchestrator.worker import run_segment
from orchestrator.worker.compile import step_flops
from tests.helpers.segments import collect, spec


def formula_flops(cfg, batch):
    """6 x parameters x tokens for the matmuls (forward 2, backward 4), parameters counted as
    those used in matmuls (the layers' weights and the tied embedding as the output projection;
    the input lookup is a gather), plus attention's QK^T and AV: 2 x 2 x s x d per token and layer
    forward, 3x that with backward."""
    d, f, L, V, s = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab, cfg.seq_len
    params = L * (4 * d * d + 2 * d * f) + V * d
    tokens = batch * s
    return 6 * params * tokens + 12 * L * s * d * tokens


@pytest.mark.parametrize("size", ["example", "wider"])
def test_model_flops_of_the_example_gpt_match_6_params_tokens_plus_attention(size, devices8):
    import jax

    from examples.gpt.model import GPTConfig, make_program

    cfg = (
        GPTConfig()
        if size == "example"
        else GPTConfig(d_model=512, n_heads=8, d_ff=2048, n_layers=4, seq_len=256, vocab=1024)
    )
    program = make_program(cfg)
    state, batch = check_program(program, 24)
    plan = partitioner.plan(program.step, state, batch, devices=8, hardware="cpu")
    mesh = plan.bind(devices8)
    shardings = (plan.shardings(mesh, state, argnum=0), plan.shardings(mesh, batch, argnum=1))
    compiled = jax.jit(program.step, in_shardings=shardings).lower(state, batch).compile()
    flops = step_flops(program.step, (state, batch), compiled)
    expected = formula_flops(cfg, 24)
    assert flops["model_flops"] == pytest.approx(expected, rel=0.10), (flops, expected)
    # The partitioned program on one device does at least its share (more where work is replicated).
    assert flops["device_flops"] >= 0.95 * flops["model_flops"] / 8


def test_step_reports_carry_mfu_and_the_laps_cover_the_segment(tmp_path, devices8):
    reports = []
    s = spec(tmp_path, 8, 6)
    t0 = time.time()
    run_segment(s, collect(reports))
    t1 = time.time()
    compile_ = next(r for r in reports if r["kind"] == "compile")
    peak = 8 * partitioner.profile("cpu").peak_flops
    for r in (r for r in reports if r["kind"] == "step"):
        assert r["mfu"] == pytest.approx(compile_["model_flops"] / (r["seconds"] * peak))
        assert r["tokens_per_second"] == pytest.approx(24 * 64 / r["seconds"])
    # Back-to-back laps: each starts where the previous ended, and together they span the call.
    laps = [r for r in reports if "at" in r]
    assert [r["kind"] for r in laps][:4] == ["group_start", "load", "compile", "init"]
    ends = np.array([r["at"] for r in laps])
    starts = ends - np.array([r["seconds"] for r in laps])
    assert np.allclose(starts[1:], ends[:-1], atol=1e-6)
    assert t0 <= starts[0] + 1e-3 and ends[-1] <= t1
    assert sum(r["seconds"] for r in laps) == pytest.approx(t1 - t0, abs=0.5)
