import sys
import traceback
import types

import jax.numpy as jnp
import numpy as np
import pytest

from orchestrator import Evaluation, Program, ProgramError, check_program, load_program


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
    _module("remesh_test_mod", other=1, notaprogram=0)
    with pytest.raises(ProgramError, match="has no attribute 'program'"):
        load_program("remesh_test_mod:program")
    with pytest.raises(ProgramError, match="must be an orchestrator.Program"):
        load_program("remesh_test_mod:notaprogram")
    with pytest.raises(ProgramError, match="module:attribute"):
        load_program("remesh_test_mod")


def test_a_program_factory_gets_the_job_settings_and_its_errors_name_it():
    from orchestrator import JobSettings

    def broken(settings):
        return {}["train_tokens"]

    made = []
    _module(
        "remesh_factory_mod",
        make=lambda settings: made.append(settings) or good_program(),
        broken=broken,
        wrong=lambda settings: 3,
    )
    settings = JobSettings(100, 8, 1, {"lr": 0.1})
    assert isinstance(load_program("remesh_factory_mod:make", settings), Program) and made == [settings]
    with pytest.raises(ProgramError, match="is a program factory: it needs the job's settings"):
        load_program("remesh_factory_mod:make")
    with pytest.raises(ProgramError, match=r"remesh_factory_mod:broken\(settings\) failed: KeyError") as e:
        load_program("remesh_factory_mod:broken", settings)
    assert "in broken" in "".join(traceback.format_exception(e.value.__cause__)), "the user's own frame is kept"
    with pytest.raises(ProgramError, match="must return an orchestrator.Program, got int"):
        load_program("remesh_factory_mod:wrong", settings)


def test_a_program_takes_data_or_batch():
    with pytest.raises(ProgramError, match="exactly one of data="):
        good_program(data=[{"x": np.zeros(4, np.float32)}])
    with pytest.raises(ProgramError, match="got neither"):
        good_program(batch=None)
    with pytest.raises(ProgramError, match="must support data"):
        good_program(batch=None, data=3)
    program = good_program(batch=None, data=[{"x": np.full(4, i, np.float32)} for i in range(32)])
    state, batch = check_program(program, 8)
    assert batch["x"].shape == (8, 4) and batch["x"].dtype == np.float32


def test_an_evaluation_must_match_the_training_data_and_return_a_scalar_loss():
    examples = lambda width: [{"x": np.full(width, i, np.float32)} for i in range(32)]  # noqa: E731
    evaluate = lambda s, b: {"loss": jnp.sum(s["w"]) + jnp.sum(b["x"])}  # noqa: E731
    check_program(good_program(evaluation=Evaluation(evaluate, examples(4), every=5, batches=2)), 8)
    with pytest.raises(ProgramError, match="shaped as the training data"):
        check_program(good_program(evaluation=Evaluation(evaluate, examples(3), every=5)), 8)
    with pytest.raises(ProgramError, match="scalar 'loss'"):
        check_program(good_program(evaluation=Evaluation(lambda s, b: {"acc": 1.0}, examples(4), every=5)), 8)
    with pytest.raises(ProgramError, match="at least 1"):
        Evaluation(evaluate, examples(4), every=0)
    with pytest.raises(ProgramError, match="must support data"):
        Evaluation(evaluate, 3, every=5)


def test_check_program_accepts_a_good_program():
    state, batch = check_program(good_program(), 8)
    assert state["w"].shape == (4,) and batch["x"].shape == (8, 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch": lambda step, size: {"x": np.zeros((size + 1, 4), np.float32)}}, "expected leading dimension 8"),
        ({"step": lambda s, b: (s, {"acc": 1.0})}, "holding 'loss'"),
        ({"step": lambda s, b: ({"other": s["w"]}, {"loss": 0.0})}, "same structure"),
        ({"init": lambda key: 1 / 0}, "program.init"),
        ({"batch": lambda step, size: {"x": np.zeros((size, 4 if size > 1 else 3), np.float32)}}, "a batch of 1"),
        ({"step": lambda s, b: s["missing"]}, "program.step"),
    ],
)
def test_check_program_rejects_broken_programs(overrides, message):
    with pytest.raises(ProgramError, match=message):
        check_program(good_program(**overrides), 8)


def test_example_program_batches_are_deterministic_in_the_step():
    from examples.gpt.model import program

    a, b, c = program.batch(7, 4), program.batch(7, 4), program.batch(8, 4)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], c["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])


def test_a_state_that_cannot_be_checkpointed_is_refused_before_any_host_starts():
    clash = good_program(
        init=lambda key: {"w": jnp.zeros((4,)), "a/b": jnp.zeros(2), "a": {"b": jnp.zeros(2)}},
        step=lambda s, b: (s, {"loss": jnp.sum(s["w"]) + jnp.sum(b["x"])}),
    )
    with pytest.raises(ProgramError, match="cannot be checkpointed.*would both be saved as 'a/b'"):
        check_program(clash, 8)


def test_typed_prng_keys_in_the_state_pass_every_check():
    import jax

    keyed = good_program(
        init=lambda key: {"w": jnp.zeros((4,)), "rng": jax.random.split(key, 2)},
        step=lambda s, b: (s, {"loss": jnp.sum(s["w"]) + jnp.sum(b["x"])}),
    )
    state, _ = check_program(keyed, 8)
    assert jax.dtypes.issubdtype(state["rng"].dtype, jax.dtypes.prng_key)


def test_metrics_that_are_not_scalars_are_named_in_a_warning():
    from orchestrator.job.program import ProgramWarning

    wide = good_program(step=lambda s, b: (s, {"loss": jnp.sum(s["w"]), "per_example": jnp.sum(b["x"], axis=1)}))
    with pytest.warns(ProgramWarning, match="not recorded: per_example"):
        check_program(wide, 8)
