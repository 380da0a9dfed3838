import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from orchestrator import Program, ProgramError, check_program, load_program

pytestmark = pytest.mark.unit


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def good_program(**overrides):
    fields = dict(
        init=lambda key: {"w": jnp.zeros((4,))},
        step=lambda s, b: (s, {"loss": jnp.sum(s["w"]) + jnp.sum(b["x"])}),
        batch=lambda step, size: {"x": np.full((size, 4), step, np.float32)},
    )
    fields.update(overrides)
    return Program(**fields)


def test_load_program_errors_name_the_missing_piece():
    with pytest.raises(ProgramError, match="cannot import module 'no_such_mod'"):
        load_program("no_such_mod:program")
    _module("remesh_test_mod", other=1, notaprogram=lambda: 0)
    with pytest.raises(ProgramError, match="has no attribute 'program'"):
        load_program("remesh_test_mod:program")
    with pytest.raises(ProgramError, match="must be an orchestrator.Program"):
        load_program("remesh_test_mod:notaprogram")
    with pytest.raises(ProgramError, match="module:attribute"):
        load_program("remesh_test_mod")


def test_check_program_accepts_a_good_program():
    state, batch = check_program(good_program(), 8)
    assert state["w"].shape == (4,) and batch["x"].shape == (8, 4)


@pytest.mark.parametrize("overrides, message", [
    ({"batch": lambda step, size: {"x": np.zeros((size + 1, 4), np.float32)}}, "expected leading dimension 8"),
    ({"step": lambda s, b: (s, {"acc": 1.0})}, "holding 'loss'"),
    ({"step": lambda s, b: ({"other": s["w"]}, {"loss": 0.0})}, "same structure"),
    ({"init": lambda key: 1 / 0}, "program.init"),
    ({"step": lambda s, b: s["missing"]}, "program.step"),
])
def test_check_program_rejects_broken_programs(overrides, message):
    with pytest.raises(ProgramError, match=message):
        check_program(good_program(**overrides), 8)


def test_example_program_batches_are_deterministic_in_the_step():
    from examples.gpt.model import program

    a, b, c = program.batch(7, 4), program.batch(7, 4), program.batch(8, 4)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
