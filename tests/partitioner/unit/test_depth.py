"""A deep stack of layers planned from two shallow traces (`partitioner.depth`): the stacks found
in arguments as people hold them (`partitioner.stacks`), cut and grown with what the step closes
over, and every candidate priced from the shallow traces as from one trace of the whole step; a
step that reads its depth elsewhere is traced whole."""

import jax
import jax.numpy as jnp
import pytest

from partitioner import depth, stacks
from partitioner.analysis import read_inputs
from partitioner.hardware import profile
from partitioner.tactics import tactic_candidates
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
    found = sorted(stacks.stacks((tree,)), key=lambda s: s.path)
    assert [(s.path, s.prefix, s.depth) for s in found] == [
        (("0", "blocks"), None, 9),
        (("0", "by_index"), "", 9),
        (("0", "decoder"), "layers_", 9),
    ]


def test_members_that_differ_or_are_few_are_no_stack():
    unlike = [layer() for _ in range(8)] + [layer(32)]
    assert stacks.stacks((unlike,)) == []
    assert stacks.stacks(([layer() for _ in range(stacks.MIN_DEPTH - 1)],)) == []
    nested = [{"experts": [layer() for _ in range(9)]} for _ in range(9)]
    assert [s.path for s in stacks.stacks((nested,))] == [("0",)]  # the outermost only


def test_resized_cuts_and_grows_and_maps_leaves_back():
    tree = {"decoder": {f"layers_{i}": layer() for i in range(9)} | {"norm": S((16,), jnp.float32)}, "h": [1.0] * 9}
    found = stacks.stacks((tree,), min_depth=8)
    cut = stacks.resized((tree,), found, 3)[0]
    assert sorted(cut["decoder"]) == ["layers_0", "layers_1", "layers_2", "norm"] and len(cut["h"]) == 3
    grown = stacks.resized((cut,), [stacks.Stack(s.path, s.prefix, 3) for s in found], 5)[0]
    assert "layers_4" in grown["decoder"] and len(grown["h"]) == 5
    sources = stacks.source_leaves((tree,), (cut,), found, 3)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((cut,))[0]]
    full = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((tree,))[0]]
    for f, s in zip(full, sources):
        if "layers_7" in f:
            assert names[s] == f.replace("layers_7", "layers_2")
    # Alternating layers stand in by their place in the last whole pattern.
    pairs = stacks.resized((tree,), found, 4)
    sources = stacks.source_leaves((tree,), pairs, found, 4, period=2)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(pairs)[0]]
    for f, s in zip(full, sources):
        for deep, stand_in in (("layers_7", "layers_3"), ("layers_8", "layers_2"), ("layers_1", "layers_1")):
            if deep in f:
                assert names[s] == f.replace(deep, stand_in)


def test_stand_ins_read_from_the_grown_tree_are_those_found_by_name(monkeypatch):
    plain = {"decoder": {f"layers_{i}": layer() for i in range(10)} | {"norm": S((16,), jnp.float32)}, "h": [1.0] * 10}
    padded = {"decoder": {f"layers_{i:02d}": layer() for i in range(10)}, "h": [1.0] * 10}  # grows to other names
    by_name = stacks._sources_by_name
    for tree, grows_alike in ((plain, True), (padded, False)):
        found = stacks.stacks((tree,))
        cut = stacks.resized((tree,), found, 4)
        for period in (1, 2):
            expected = by_name((tree,), cut, found, 4, period)
            if grows_alike:  # read from the grown tree, not by name
                monkeypatch.setattr(stacks, "_sources_by_name", lambda *_: pytest.fail("looked up by name"))
            assert stacks.source_leaves((tree,), cut, found, 4, period) == expected
            monkeypatch.setattr(stacks, "_sources_by_name", by_name)


def test_layer_groups_join_one_leaf_of_every_layer_at_its_place_in_the_pattern():
    tree = {"decoder": {f"layers_{i}": layer() for i in range(9)} | {"norm": S((16,), jnp.float32)}}
    found = stacks.stacks((tree,))
    cut = stacks.resized((tree,), found, 4)
    names = ["/".join(stacks.key_names(p)) for p, _ in jax.tree_util.tree_flatten_with_path(cut)[0]]
    keys = [stacks.key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(cut)[0]]
    named = lambda groups: sorted(sorted(names[j] for j in g) for g in groups)  # noqa: E731
    assert named(stacks.layer_groups(keys, found)) == [
        [f"0/decoder/layers_{i}/norm" for i in range(4)],
        [f"0/decoder/layers_{i}/w" for i in range(4)],
    ]
    # Alternating layers: a leaf joins those at its place in every pattern, the norm outside none.
    assert named(stacks.layer_groups(keys, found, period=2)) == [
        [f"0/decoder/layers_{i}/norm" for i in (0, 2)],
        [f"0/decoder/layers_{i}/w" for i in (0, 2)],
        [f"0/decoder/layers_{i}/norm" for i in (1, 3)],
        [f"0/decoder/layers_{i}/w" for i in (1, 3)],
    ]


MESHES = ({"data": 8, "seq": 1, "model": 1}, {"data": 2, "seq": 1, "model": 4})


def _priced_both_ways(name, monkeypatch, layers=10, traced=(3, 4)) -> list[tuple[dict, dict]]:
    """Per mesh of MESHES, every candidate's cost (tactic -> cost) for a corpus model of `layers`
    layers, planned from shallow traces (of `traced` layers) and from a trace of the whole step."""
    module, options = load(name)
    fn, args = module.build(layers=layers, **options)
    hw = profile("h100")
    shallow = read_inputs(fn, args, None)
    assert isinstance(shallow.fold, depth.Deepened), "the step should have been planned from shallow traces"
    assert shallow.fold.depths == (*traced, layers)
    monkeypatch.setattr(depth, "shallow", lambda *_: None)
    whole = read_inputs(fn, args, None)
    assert shallow.fold.original_ops == whole.fold.original_ops
    return [
        tuple({c.tactic: c.cost for c in tactic_candidates(i, mesh, hw)} for i in (shallow, whole)) for mesh in MESHES
    ]


def _assert_priced_alike(costs) -> None:
    """The same candidates, with the same bytes and peaks, and seconds that agree to a few
    picoseconds: ops on scalars that fold differently at the two depths are counted exactly by
    signature, but which of them fuse (and so move no bytes) is not."""
    for mesh, (shallow, whole) in zip(MESHES, costs):
        assert shallow.keys() == whole.keys(), mesh
        for tactic, cost in whole.items():
            got = shallow[tactic]
            assert got.collective_bytes == cost.collective_bytes, (mesh, tactic)
            assert got.peak_bytes_per_device == cost.peak_bytes_per_device, (mesh, tactic)
            assert got.compute_seconds == pytest.approx(cost.compute_seconds, rel=1e-9), (mesh, tactic)
            assert got.communication_seconds == pytest.approx(cost.communication_seconds, rel=1e-9), (mesh, tactic)


@pytest.mark.parametrize("name", ["llama-maxtext", "llama-gqa-repeat"])
def test_shallow_traces_price_every_candidate_as_the_whole_step(name, monkeypatch):
    for mesh, (shallow, whole) in zip(MESHES, _priced_both_ways(name, monkeypatch)):
        assert shallow == whole, mesh


@pytest.mark.parametrize("name", ["vit", "equinox-gpt", "nnx-llama"])
def test_a_depth_held_outside_the_arguments_is_cut_alike(name, monkeypatch):
    """ViT (Flax Linen) loops over its module's `layers` field, Equinox combines its arguments with
    the model's closed-over static half, Flax NNX merges them with a closed-over graphdef: each is
    cut with the arguments. ViT's global norm is a chain of scalar adds that folds differently at
    the two depths (`_assert_priced_alike`)."""
    _assert_priced_alike(_priced_both_ways(name, monkeypatch))


def test_alternating_layers_are_traced_as_whole_patterns(monkeypatch):
    """Gemma's layers alternate local (sliding-window) and global attention: 3 and 4 layers fold
    to different graphs, 4 and 6 (two and three pairs, each leaf of a pair's layers one weight
    from the start) to one, and every candidate is priced as from the whole step
    (tests/corpus/gemma.py); its optimizer's per-leaf steps over 7 leaves a layer are runs
    shorter than a fold's blocks, matched on the timelines all the same. The 4-layer trace,
    folded both ways first, tells the layers alternate: no 3-layer trace is made."""
    made, trace = [], depth._trace
    monkeypatch.setattr(depth, "_trace", lambda *args: made.append(args[4]) or trace(*args))  # (fn, ..., layers, memo)
    _assert_priced_alike(_priced_both_ways("gemma", monkeypatch, layers=12, traced=(4, 6)))
    assert made == [4, 6]


def test_a_train_states_apply_fn_is_cut_with_the_arguments(monkeypatch):
    """Flax's TrainState holds the model's `apply` outside its pytree (`apply_fn`, a Linen
    module's bound method, the module holding the depth): cut with the arguments, every candidate
    is priced as from the whole step, and the plan's output tree is the step's own, with the
    real `apply_fn` back in the new state (tests/corpus/hf_gpt2.py)."""
    _assert_priced_alike(_priced_both_ways("hf-gpt2", monkeypatch))
    module, options = load("hf-gpt2")
    fn, args = module.build(layers=10, **options)
    monkeypatch.undo()
    inputs = read_inputs(fn, args, None)
    assert isinstance(inputs.fold, depth.Deepened)
    assert jax.tree.structure(inputs.graph.out_shape) == jax.tree.structure(jax.eval_shape(fn, *args))
    assert inputs.graph.out_shape[0].apply_fn == args[0].apply_fn


def block(p, x):
    """A layer long enough to fold (`fold.MIN_PERIOD` ops)."""
    h = jax.nn.gelu(x @ p["w"]) * p["norm"]
    h = h / (1.0 + jnp.abs(h).sum(-1, keepdims=True))
    return x + jnp.tanh(h @ p["w"].T) * jax.nn.sigmoid(h)


def test_closed_over_depths_are_cut_and_other_numbers_kept():
    config = {"num_layers": 9, "heads": 9}

    def step(params, x):
        for i in range(config["num_layers"]):
            x = block(params["blocks"][i], x)
        return params, x.sum()

    params = {"blocks": [layer() for _ in range(9)]}
    found = stacks.stacks((params,))
    cut = stacks.with_free_variables_resized(step, found, 9, 3)
    assert cut.__closure__[0].cell_contents == {"num_layers": 3, "heads": 9}
    assert config == {"num_layers": 9, "heads": 9}, "the user's config must be left as it was"
    inputs = read_inputs(step, (params, S((8, 16), jnp.float32)), None)
    assert isinstance(inputs.fold, depth.Deepened)
    assert (
        inputs.fold.original_ops
        == read_inputs(step, (params, S((8, 16), jnp.float32)), None, shallow_trace=False).fold.original_ops
    )


LAYERS = 9


def test_a_step_that_reads_its_depth_elsewhere_is_traced_whole():
    def step(params, x):
        for i in range(LAYERS):  # a module constant: nothing the partitioner can cut
            x = block(params["blocks"][i], x)
        return params, x.sum()

    params = {"blocks": [layer() for _ in range(LAYERS)]}
    inputs = read_inputs(step, (params, S((8, 16), jnp.float32)), None)
    assert not isinstance(inputs.fold, depth.Deepened)
    assert inputs.fold.original_ops >= LAYERS
