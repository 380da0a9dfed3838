"""Replayed layers: capture builds two copies of a repeated block and records the rest by what
differs. What it records must be exactly the program: expanded, the ops op-by-op capture builds;
compact, the same liveness, fold and prices as the unrolled graph."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.targets import gpt, llama, moe
from partitioner import capture, cost, ir, memory
from partitioner.fold import fold
from partitioner.hardware import profile
from partitioner.propagate import propagate
from partitioner.search import search


def built(fn, args, replay_layers: bool, compact: bool = False) -> ir.Graph:
    closed = jax.make_jaxpr(fn)(*args)
    return capture._Builder(replay_layers).build(closed.jaxpr, [], compact)


def fields(g: ir.Graph) -> list[tuple]:
    return [
        (op.primitive, op.operands, op.results, op.factors, op.operand_dims, op.result_dims, op.flops, op.trips)
        for op in g.ops
    ]


def same_program(fn, args) -> ir.Graph:
    """Replayed and expanded equals built op by op; returns the compact graph."""
    plain, replayed = built(fn, args, False), built(fn, args, True)
    assert fields(replayed) == fields(plain)
    assert [(v.shape, v.dtype) for v in replayed.values] == [(v.shape, v.dtype) for v in plain.values]
    assert replayed.unknown == plain.unknown and not replayed.copies
    compact = built(fn, args, True, compact=True)
    assert compact.unrolled_ops == len(plain.ops)
    assert compact.flops() == pytest.approx(plain.flops(), rel=1e-12)
    return compact


@pytest.mark.parametrize("name", ["gpt", "gpt-scan", "llama", "moe"])
def test_replayed_capture_is_the_op_by_op_capture(name):
    step, args = {
        "gpt": lambda: gpt(256, 4, 1024, 512, 64, 6, 8),
        "gpt-scan": lambda: gpt(256, 4, 1024, 512, 64, 4, 8, scan=True),
        "llama": llama,
        "moe": moe,
    }[name]()
    compact = same_program(step, args)
    if name == "gpt":  # six layers: forward, backward and the optimizer's passes each replayed four times
        assert compact.copies and all(len(c.shifts) == 4 for c in compact.copies)
        assert len(compact.ops) < 0.5 * compact.unrolled_ops


def _layers(widths, swap_at=None, skip_at=None, constant_at=None):
    """A residual stack of width 16 whose layer i has hidden width widths[i]."""

    def f(ws, x, scale):
        keep = x
        for i, (w1, w2) in enumerate(ws):
            h = (
                jnp.tanh(x @ w1) * (2.0 if i == constant_at else scale) + 1.0
            ) @ w2  # a literal where others read a value
            h = jnp.exp(h - jnp.mean(h, axis=-1, keepdims=True))
            x = (h + x) if i != swap_at else (x + h)  # same primitives and shapes, operands swapped
            if i == skip_at:
                x = x + keep  # a read from further back than the previous layer
            keep = x if i % 2 else keep
        return jnp.sum(x * x)

    ws = [(jax.ShapeDtypeStruct((16, n), jnp.float32), jax.ShapeDtypeStruct((n, 16), jnp.float32)) for n in widths]
    return jax.grad(f), (ws, jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32))


@pytest.mark.parametrize("case", ["alike", "swapped", "skip", "widths", "constant"])
def test_layers_that_differ_are_built_as_they_are(case):
    fn, args = {
        "alike": lambda: _layers([16] * 8),
        "swapped": lambda: _layers([16] * 8, swap_at=5),
        "skip": lambda: _layers([16] * 8, skip_at=4),
        "widths": lambda: _layers([16] * 4 + [32] * 4),
        "constant": lambda: _layers([16] * 8, constant_at=5),
    }[case]()
    compact = same_program(fn, args)
    forward = compact.copies[0]
    if case == "alike":  # eight alike layers: copies 2-7 of the forward layer are replayed
        assert len(forward.shifts) == 6
    if case in ("swapped", "constant"):  # the check stops the replay at layer 5: its add reads its
        assert len(forward.shifts) == 3  # operands swapped, or its multiply a literal for the scale


def test_compact_liveness_and_materialized_values_match_the_unrolled_graph():
    step, args = gpt(256, 4, 1024, 512, 64, 5, 8)
    unrolled, compact = capture.capture(step, *args), capture.capture(step, *args, compact=True)
    assert compact.copies
    a, b = memory.liveness(unrolled), memory.liveness(compact)
    rows = lambda life: sorted(
        zip(*(x.tolist() for x in (life.values, life.birth, life.death, life.argument, life.result, life.copy)))
    )
    assert a.end == b.end and rows(a) == rows(b)
    assert memory.materialized(unrolled) == memory.materialized(compact)


def test_compact_fold_prices_as_the_unrolled_fold():
    step, args = gpt(256, 4, 1024, 512, 64, 5, 8)
    h100 = profile("h100")
    mesh = {"data": 2, "seq": 1, "model": 4}
    f_u, f_c = fold(capture.capture(step, *args)), fold(capture.capture(step, *args, compact=True))
    assert f_c.original_ops == f_u.original_ops
    assert abs(len(f_c.graph.ops) - len(f_u.graph.ops)) <= 2
    priced = []
    for f in (f_u, f_c):
        g = f.graph
        weights = {
            v: ((), ("model",)) for v in g.inputs if len(g.values[v].shape) == 2 and g.values[v].shape[1] == 1024
        }
        batch = {
            v: (("data",),) + ((),) * (len(g.values[v].shape) - 1) for v in g.inputs if g.values[v].shape[:1] == (8,)
        }
        c = cost.estimate(propagate(g, {**weights, **batch}, mesh), h100, f)
        priced.append(c)
    assert priced[0].collective_bytes == priced[1].collective_bytes
    assert priced[0].peak_bytes_per_device == priced[1].peak_bytes_per_device
    assert priced[0].total_seconds == pytest.approx(priced[1].total_seconds, rel=1e-6)


def test_a_compact_graph_is_not_priced_as_if_unrolled():
    step, args = gpt(256, 4, 1024, 512, 64, 5, 8)
    g = capture.capture(step, *args, compact=True)
    with pytest.raises(ValueError, match="captured compact"):
        cost.estimate(propagate(g, {}, {"data": 1, "seq": 1, "model": 1}), profile("h100"))


def test_search_on_the_compact_graph_chooses_what_the_unrolled_one_does(monkeypatch):
    from partitioner import analysis

    step, args = gpt(1024, 8, 4096, 1000, 128, 6, 16)
    plans, captured = [], []
    for compact in (False, True):

        def capture_as(
            fn, *a, _compact=compact, **_
        ):  # (search asks for compact=True: this captures as the round says)
            captured.append(capture.capture(fn, *a, compact=_compact))
            return captured[-1]

        monkeypatch.setattr(analysis, "capture", capture_as)
        plan, ranked = search(step, *args, devices=8, hardware="h100", compile_check=False)
        plans.append(
            (
                plan.mesh,
                plan.cost.total_seconds,
                plan.cost.peak_bytes_per_device,
                [(c.tactic, dict(c.mesh)) for c in ranked[:4]],
                np.array([c.cost.total_seconds for c in ranked[:4]]),
            )
        )
    assert [bool(g.copies) for g in captured] == [False, True]
    (mesh_u, t_u, peak_u, order_u, costs_u), (mesh_c, t_c, peak_c, order_c, costs_c) = plans
    assert mesh_u == mesh_c and order_u == order_c and peak_u == peak_c
    assert t_c == pytest.approx(t_u, rel=1e-6) and np.allclose(costs_c, costs_u, rtol=1e-6)
