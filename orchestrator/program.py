"""The program contract: a user's single-device training program, with no sharding code.

    program = remesh.Program(
        init=lambda key: state,                 # PRNG key -> train state (any pytree of arrays)
        step=train_step,                        # (state, batch) -> (state, {"loss": scalar, ...})
        data=TokenFiles(paths, seq_len).dataset(),  # data[i]: example i of the job's global order
        tokens_per_example=seq_len,             # for tokens/s
    )

`data` is any random-access dataset (a Grain `MapDataset`, or anything with `__getitem__`) whose
items are dicts of numpy arrays: each process reads only the rows of each global batch its
devices hold (`orchestrator.data`). Instead, `batch=lambda step, size: {...}` may build the whole
global batch for a step index (numpy, leading dim `size`) on every host: for synthetic data.
Either must be deterministic, so a resized or resumed job sees exactly the same data; any
randomness in the step (dropout) must come from a PRNG key kept in the state, so that it is
checkpointed and restored with it.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


class ProgramError(ValueError):
    """The program named by a job is missing, or does not honour the contract."""


@dataclasses.dataclass(frozen=True)
class Program:
    init: Callable[[Any], Any]
    step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]]
    batch: Callable[[int, int], Any] | None = None
    tokens_per_example: int = 1
    data: Any = None  # a random-access dataset of examples (`orchestrator.data`)

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
    batch = program.batch(0, global_batch)
    return state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)


def check_program(program: Program, global_batch: int, seed: int = 0):
    """Abstractly evaluate init, batch and step once; returns (abstract state, abstract batch).

    Catches a broken program at submission instead of on every host after start-up."""
    import jax

    from checkpoint import leaf_path

    state, abstract_batch = abstract_inputs(program, global_batch, seed)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_batch)[0]:
        shape = leaf.shape
        if not shape or shape[0] != global_batch:
            raise ProgramError(
                f"program.batch(step, {global_batch}) leaf {leaf_path(path)} has shape {shape}; "
                f"expected leading dimension {global_batch} (the job's global_batch)"
            )
    try:
        out = jax.eval_shape(program.step, state, abstract_batch)
    except Exception as e:
        raise ProgramError(f"program.step(state, batch) failed: {type(e).__name__}: {e}") from e
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping) and "loss" in out[1]):
        raise ProgramError("program.step must return (state, metrics) with metrics a dict holding 'loss'")
    if jax.tree.structure(out[0]) != jax.tree.structure(state):
        raise ProgramError("program.step must return a new state with the same structure as program.init's")
    _check_metrics(out[1])
    _check_state_handling(state)
    return state, abstract_batch


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
