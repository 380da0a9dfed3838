"""The program contract: a user's single-device training program, with no sharding code.

    program = orchestrator.Program(
        init=lambda key: state,                 # PRNG key -> train state (any pytree of arrays)
        step=train_step,                        # (state, batch) -> (state, {"loss": scalar, ...})
        data=TokenFiles(paths, seq_len).dataset(),  # data[i]: example i of the job's global order
        tokens_per_example=seq_len,             # for tokens/s
        evaluation=orchestrator.Evaluation(eval_step, held_out, every=100),  # optional
    )

`data` is any random-access dataset (a Grain `MapDataset`, or anything with `__getitem__`) whose
items are dicts of numpy arrays: each process reads only the rows of each global batch its
devices hold (`orchestrator.job.data`). Instead, `batch=lambda step, size: {...}` may build the whole
global batch for a step index (numpy, leading dim `size`) on every host: for synthetic data.
Either must be deterministic, so a resized or resumed job sees exactly the same data; any
randomness in the step (dropout) must come from a PRNG key kept in the state, so that it is
checkpointed and restored with it. `evaluation` runs an evaluation step on held-out data every
so many steps, planned like the training step, its metrics reported like the training loss.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


class ProgramError(ValueError):
    """The program named by a job is missing, or does not honour the contract."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """`step(state, batch) -> {"loss": scalar, ...}` on `batches` global batches of `data` (a
    random-access dataset of held-out examples shaped as the training data's: examples 0 to
    batches * global_batch - 1, the same ones every time), after every `every`-th training step;
    each metric is reported as its mean over the batches."""

    step: Callable[[Any, Any], Mapping[str, Any]]
    data: Any
    every: int
    batches: int = 1

    def __post_init__(self):
        if self.every < 1 or self.batches < 1:
            raise ProgramError(
                f"Evaluation every= and batches= must be at least 1, got every={self.every}, batches={self.batches}"
            )
        if not hasattr(self.data, "__getitem__"):
            raise ProgramError(
                f"Evaluation data must support data[i] (held-out examples, e.g. a TokenFiles(...).dataset()), "
                f"got {type(self.data).__name__}"
            )


@dataclasses.dataclass(frozen=True)
class Program:
    init: Callable[[Any], Any]
    step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]]
    batch: Callable[[int, int], Any] | None = None
    tokens_per_example: int = 1
    data: Any = None  # a random-access dataset of examples (`orchestrator.job.data`)
    evaluation: Evaluation | None = None

    def __post_init__(self):
        if (self.batch is None) == (self.data is None):
            raise ProgramError(
                "a Program takes exactly one of data= (a random-access dataset: data[i] is example i, a dict of "
                "numpy arrays) and batch= (step, size) -> a whole global batch; got "
                + ("both" if self.batch is not None else "neither")
            )
        if self.data is not None and not hasattr(self.data, "__getitem__"):
            raise ProgramError(
                f"Program data must support data[i] (a Grain MapDataset, a TokenFiles(...).dataset()), "
                f"got {type(self.data).__name__}"
            )


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What a program factory is given: the job's settings a program may need (the steps for a
    learning-rate schedule, the global batch, the seed) and the job file's free `[options]`
    table (token file paths, a model size, a learning rate)."""

    steps: int
    global_batch: int
    seed: int = 0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def importable_from_here() -> None:
    """Programs (and plan targets) are named relative to the directory remesh runs in, as
    `python -m` finds modules: that directory goes first on `sys.path`, once."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def load_program(ref: str, settings: JobSettings | None = None) -> Program:
    """Import `module:attribute`: a Program, or a factory that makes one from the job's
    `settings` (`def make_program(settings: JobSettings) -> Program`)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ProgramError(f"program must look like 'module:attribute', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ProgramError(
            f"cannot import module {module_name!r} of program {ref!r}: {e}. Run from the directory that holds it, or add it to PYTHONPATH"
        ) from e
    if not hasattr(module, attr):
        raise ProgramError(f"module {module_name!r} has no attribute {attr!r} (program {ref!r})")
    program = getattr(module, attr)
    if callable(program) and not isinstance(program, Program):
        program = _made(ref, program, settings)
    if not isinstance(program, Program):
        raise ProgramError(
            f"{ref} must be an orchestrator.Program (init, step, data or batch), got {type(program).__name__}"
        )
    return program


def _made(ref: str, factory, settings: JobSettings | None) -> Program:
    if settings is None:
        raise ProgramError(
            f"{ref} is a program factory: it needs the job's settings (load_program({ref!r}, JobSettings(...)))"
        )
    try:
        program = factory(settings)
    except ProgramError:
        raise
    except Exception as e:  # the user's traceback stays chained below this one
        raise ProgramError(f"the program factory {ref}(settings) failed: {type(e).__name__}: {e}") from e
    if not isinstance(program, Program):
        raise ProgramError(
            f"the program factory {ref} must return an orchestrator.Program, got {type(program).__name__}"
        )
    return program


def abstract_inputs(program: Program, global_batch: int, seed: int = 0):
    """(abstract state, abstract batch): shapes and dtypes of the step's arguments, no arrays."""
    import jax

    try:
        state = jax.eval_shape(program.init, jax.random.key(seed))
    except Exception as e:
        raise ProgramError(f"program.init(key) failed: {type(e).__name__}: {e}") from e
    if program.data is not None:
        from .data import abstract_batch

        try:
            return state, abstract_batch(program.data, global_batch)
        except Exception as e:
            raise ProgramError(f"program.data[0] failed: {type(e).__name__}: {e}") from e
    return state, _synthetic_shapes(program, global_batch)


def _synthetic_shapes(program: Program, global_batch: int):
    """A synthetic batch's shapes, learnt from a batch of one with its leading dimension made the
    global batch, so a host does not build a whole global batch for them (`check_program` builds
    one, once, to check it); from the whole batch where a batch of one is not shaped so."""
    import jax

    one = program.batch(0, 1)
    if all(np.ndim(x) and np.shape(x)[0] == 1 for x in jax.tree.leaves(one)):
        return _shapes(one, leading=global_batch)
    return _shapes(program.batch(0, global_batch))


def _shapes(batch, leading: int | None = None):
    """A numpy batch's shapes and dtypes; `leading` replaces its leading dimension."""
    import jax

    def spec(x):
        shape = np.shape(x) if leading is None else (leading, *np.shape(x)[1:])
        return jax.ShapeDtypeStruct(shape, np.asarray(x).dtype)

    return jax.tree.map(spec, batch)


def check_program(program: Program, global_batch: int, seed: int = 0):
    """Abstractly evaluate init, batch and step once; returns (abstract state, abstract batch).

    Catches a broken program at submission instead of on every host after start-up."""
    import jax

    from checkpoint import leaf_path

    state, abstract_batch = abstract_inputs(program, global_batch, seed)
    built = abstract_batch
    if program.batch is not None:  # the whole batch, once, as hosts will build it
        built = _shapes(program.batch(0, global_batch))
    for path, leaf in jax.tree_util.tree_flatten_with_path(built)[0]:
        shape = leaf.shape
        if not shape or shape[0] != global_batch:
            raise ProgramError(
                f"program.batch(step, {global_batch}) leaf {leaf_path(path)} has shape {shape}; "
                f"expected leading dimension {global_batch} (the job's global_batch)"
            )
    if built != abstract_batch:
        raise ProgramError(
            f"program.batch(step, size) must give the same shapes and dtypes whatever the size, but for the leading "
            f"dimension: hosts learn them from a batch of 1 ({abstract_batch}), and a batch of {global_batch} gave {built}"
        )
    out = _shapes_of(program.step, "program.step(state, batch)", state, abstract_batch)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping) and "loss" in out[1]):
        raise ProgramError("program.step must return (state, metrics) with metrics a dict holding 'loss'")
    if jax.tree.structure(out[0]) != jax.tree.structure(state):
        raise ProgramError("program.step must return a new state with the same structure as program.init's")
    _check_metrics(out[1])
    _check_state_handling(state)
    if program.evaluation is not None:
        _check_evaluation(program.evaluation, state, abstract_batch, global_batch)
    return state, abstract_batch


def _shapes_of(fn, call: str, *args):
    """`fn(*args)` evaluated on shapes; an error in it names `call` and keeps the user's traceback."""
    import jax

    try:
        return jax.eval_shape(fn, *args)
    except Exception as e:
        raise ProgramError(f"{call} failed: {type(e).__name__}: {e}") from e


def _check_evaluation(evaluation: Evaluation, state, abstract_batch, global_batch: int) -> None:
    """The held-out data must be shaped as the training data (the plan lays both out alike), and
    the evaluation step must return a scalar loss."""
    import jax

    from .data import abstract_batch as abstract_of

    try:
        held_out = abstract_of(evaluation.data, global_batch)
    except Exception as e:
        raise ProgramError(f"program.evaluation.data[0] failed: {type(e).__name__}: {e}") from e
    if held_out != abstract_batch:
        raise ProgramError(
            f"program.evaluation.data's examples must be shaped as the training data's (one plan lays out both): "
            f"expected batches of {abstract_batch}, got {held_out}"
        )
    out = _shapes_of(evaluation.step, "program.evaluation.step(state, batch)", state, abstract_batch)
    if not (isinstance(out, Mapping) and "loss" in out and jax.numpy.ndim(out["loss"]) == 0):
        raise ProgramError("program.evaluation.step must return a dict of metrics holding a scalar 'loss'")


def _check_metrics(metrics: Mapping) -> None:
    import jax

    from checkpoint import leaf_path

    if jax.numpy.ndim(metrics["loss"]) != 0:
        raise ProgramError(f"program.step's metrics['loss'] must be a scalar, got shape {metrics['loss'].shape}")
    others = [leaf_path(p) for p, v in jax.tree_util.tree_flatten_with_path(metrics)[0] if v.ndim]
    if others:
        warnings.warn(
            f"program.step returns metrics that are not scalars, which are not recorded: {', '.join(others)}. "
            "Return scalars (e.g. a mean or a norm) to see them in the summary and the dashboard",
            ProgramWarning,
            stacklevel=3,
        )


def _check_state_handling(state) -> None:
    """What hosts do to every state besides stepping it, done abstractly: the digest and a save."""
    from checkpoint import CheckpointFormatError, check_savable

    from .digest import check_digestible

    try:
        check_savable(state)
        check_digestible(state)
    except (CheckpointFormatError, TypeError, ValueError) as e:
        raise ProgramError(f"program.init's state cannot be checkpointed: {type(e).__name__}: {e}") from e


class ProgramWarning(UserWarning):
    """Something in a program that works but is probably not what its author meant."""
