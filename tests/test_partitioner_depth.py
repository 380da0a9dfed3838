"""A deep stack of layers planned from two shallow traces (`partitioner.depth`): the stacks found
in arguments as people hold them, cut and grown, and every candidate priced from the shallow
traces exactly as from one trace of the whole step; a step that reads its depth elsewhere is
traced whole."""

import jax
import jax.numpy as jnp
import pytest

from partitioner import depth
from partitioner.hardware import profile
from partitioner.tactics import read_inputs, tactic_candidates
from tests.corpus import load

S = jax.ShapeDtypeStruct


def layer(d=16):
    return {"w": S((d, d), jnp.float32), "norm": S((d,), jnp.float32)}


def test_stacks_are_found_in_lists_int_keys_and_numbered_names():
    tree = {
        "blocks": [layer() for _ in range(9)],
        "decoder": {f"layers_{i}": layer() for i in range(9)} | {"final_norm": S((16,), jnp.float32)},
        "by_index": {i: layer() for i in range(9)},
        "mlp": {"w1": S((4, 4), jnp.float32), "w2": S((4, 4), jnp.float32), "w3": S((4, 4), jnp.float32)},
    }
    found = sorted(depth.stacks((tree,)), key=lambda s: s.path)
    assert [(s.path, s.prefix, s.depth) for s in found] == [
        (("0", "blocks"), None, 9),
        (("0", "by_index"), "", 9),
        (("0", "decoder"), "layers_", 9),
    ]


def test_members_that_differ_or_are_few_are_no_stack():
    unlike = [layer() for _ in range(8)] + [layer(32)]
    assert depth.stacks((unlike,)) == []
    assert depth.stacks(([layer() for _ in range(depth.MIN_DEPTH - 1)],)) == []
    nested = [{"experts": [layer() for _ in range(9)]} for _ in range(9)]
    assert [s.path for s in depth.stacks((nested,))] == [("0",)]  # the outermost only


def test_resized_cuts_and_grows_and_maps_leaves_back():
    tree = {"decoder": {f"layers_{i}": layer() for i in range(9)} | {"norm": S((16,), jnp.float32)}, "h": [1.0] * 9}
    found = depth.stacks((tree,), min_depth=8)
    cut = depth.resized((tree,), found, 3)[0]
    assert sorted(cut["decoder"]) == ["layers_0", "layers_1", "layers_2", "norm"] and len(cut["h"]) == 3
    grown = depth.resized((cut,), [depth.Stack(s.path, s.prefix, 3) for s in found], 5)[0]
    assert "layers_4" in grown["decoder"] and len(grown["h"]) == 5
    sources = depth.source_leaves((tree,), (cut,), found, 3)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((cut,))[0]]
    full = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((tree,))[0]]
    for f, s in zip(full, sources):
        if "layers_7" in f:
            assert names[s] == f.replace("layers_7", "layers_2")


@pytest.mark.parametrize("name", ["llama-maxtext", "llama-gqa-repeat"])
def test_shallow_traces_price_every_candidate_as_the_whole_step(name, monkeypatch):
    module, options = load(name)
    fn, args = module.build(layers=10, **options)
    hw = profile("h100")
    shallow = read_inputs(fn, args, None)
    assert isinstance(shallow.fold, depth.Deepened), "the step should have been planned from shallow traces"
    monkeypatch.setattr(depth, "shallow", lambda fn, abstract: None)
    whole = read_inputs(fn, args, None)
    assert shallow.fold.original_ops == whole.fold.original_ops
    for mesh in ({"data": 8, "seq": 1, "model": 1}, {"data": 2, "seq": 1, "model": 4}):
        priced = [{c.tactic: c.cost for c in tactic_candidates(i, mesh, hw)} for i in (shallow, whole)]
        assert priced[0] == priced[1], mesh


def test_a_step_that_reads_its_depth_elsewhere_is_traced_whole():
    depth_of = 9

    def step(params, x):
        for i in range(depth_of):  # the config's layer count, not the arguments'
            x = jnp.tanh(x @ params["blocks"][i]["w"])
        return params, x.sum()

    params = {"blocks": [layer() for _ in range(depth_of)]}
    inputs = read_inputs(step, (params, S((8, 16), jnp.float32)), None)
    assert not isinstance(inputs.fold, depth.Deepened)
    assert inputs.fold.original_ops >= depth_of
