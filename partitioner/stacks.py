"""Where a training step's depth lives: stacks of identically shaped layers in its arguments
(a list or tuple, or dict entries keyed `0`, `1`, ... or `layers_0`, `layers_1`, ...: the
parameters, and the optimizer state that mirrors them) and in what it closes over, found and
cut to a few layers or grown, for `depth` to plan a deep stack from two shallow traces."""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from collections.abc import Mapping, Sequence

import jax

from .arguments import key_name

MIN_DEPTH = 8  # a shallower stack is traced whole: the two shallow traces would cost as much

_MEMBER = re.compile(r"^(.*?)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Stack:
    """Members 0..depth-1 of a container at `path` (key names): a sequence's items
    (`prefix` None) or a dict's entries named `prefix` + index."""

    path: tuple[str, ...]
    prefix: str | None
    depth: int


def stacks(tree, min_depth: int = MIN_DEPTH, named: Sequence[tuple] | None = None) -> list[Stack]:
    """The outermost stacks of identically shaped members in `tree` (a pytree of arrays or
    ShapeDtypeStructs), at least `min_depth` deep. `named`: `named_leaves(tree)`, where the
    caller has it."""
    members: dict[tuple, dict[int, list]] = {}
    for keys, names, leaf in named if named is not None else named_leaves(tree):
        kind = None
        for j, k in enumerate(keys):
            slot = _slot(k)
            if slot is not None:
                prefix, index = slot
                kind = kind or (tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None))
                members.setdefault((names[:j], prefix), {}).setdefault(index, []).append((names[j + 1 :], kind))
    found = []
    for (path, prefix), by_index in members.items():
        n = len(by_index)
        first = by_index.get(0)
        if n >= min_depth and set(by_index) == set(range(n)) and all(by_index[i] == first for i in range(n)):
            found.append(Stack(path, prefix, n))
    return [s for s in found if not any(_inside(s, t) for t in found if t is not s)]


@functools.lru_cache(maxsize=1 << 16)  # (a deep model's ~10^4 leaves share a few hundred keys)
def _slot(key) -> tuple[str | None, int] | None:
    """(prefix, index) where `key` names a stack member: a sequence index, or a dict key that is
    an integer or ends in one."""
    if isinstance(key, jax.tree_util.SequenceKey):
        return None, key.idx
    if isinstance(key, jax.tree_util.DictKey):
        if isinstance(key.key, int):
            return "", key.key
        m = _MEMBER.match(str(key.key))
        if m:
            return m.group(1), int(m.group(2))
    return None


def _inside(s: Stack, t: Stack) -> bool:
    """Whether `s` lies within a member of `t`."""
    return len(s.path) > len(t.path) and s.path[: len(t.path)] == t.path and _index(t, s.path[len(t.path)]) is not None


def _index(s: Stack, name: str) -> int | None:
    """The member index a key name denotes in `s`'s container, or None."""
    if s.prefix is None:
        return int(name) if name.isdigit() else None
    m = _MEMBER.match(name)
    return int(m.group(2)) if m and m.group(1) == s.prefix else None


def resized(tree, found: Sequence[Stack], depth: int, period: int = 1):
    """`tree` with every stack in `found` cut to its first `depth` members, or grown to `depth`
    by repeating its last whole pattern of `period` members (its last member, for a stack of one
    kind). None where a stack's container is of a kind this cannot rebuild (only lists, tuples
    and dicts are)."""
    try:
        return _resized(tree, found, depth, (), period)
    except _Unbuildable:
        return None


class _Unbuildable(Exception):
    pass


def _resized(tree, found: Sequence[Stack], depth: int, path: tuple[str, ...], period: int = 1):
    here = [s for s in found if s.path == path]
    if here:
        return _resized_container(tree, here[0], found, depth, path, period)
    if not any(s.path[: len(path)] == path for s in found):
        return tree  # no stack below: kept as it is (a deep model's members are most of its nodes)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)
    if len(flat) == 1 and flat[0][0] == ():
        return tree  # a leaf
    children = [_resized(child, found, depth, path + (key_name(keys[0]),), period) for keys, child in flat]
    return jax.tree_util.tree_unflatten(treedef, children)


def _resized_container(tree, s: Stack, found, depth: int, path, period: int = 1):
    n = len(tree)
    if s.prefix is None and type(tree) in (list, tuple):
        items = list(tree[:depth]) + [tree[n - period + i % period] for i in range(n, depth)]
        return type(tree)(_resized(c, found, depth, path + (str(i),), period) for i, c in enumerate(items))
    if s.prefix is None or not isinstance(tree, Mapping):
        raise _Unbuildable(path)
    members = {_index(s, str(k)): k for k in tree if _index(s, str(k)) is not None}
    order, n = sorted(members), len(members)
    name = (lambda i: i) if isinstance(members[order[-1]], int) else (lambda i: f"{s.prefix}{i}")
    out = {
        k: _resized(child, found, depth, path + (str(k),), period)
        for k, child in tree.items()
        if _index(s, str(k)) is None or _index(s, str(k)) < depth
    }
    for i in range(n, depth):
        stand_in = tree[members[order[n - period + i % period]]]
        out[name(i)] = _resized(stand_in, found, depth, path + (str(name(i)),), period)
    if type(tree) is dict:
        return out
    try:  # a mapping pytree (Flax NNX's State) built from a dict
        return type(tree)(out)
    except Exception as e:
        raise _Unbuildable(path) from e


def statics_resized(tree, found: Sequence[Stack], depth: int, k: int) -> tuple:
    """`tree` with what its dataclass nodes hold outside the pytree cut to `k` alike: a Flax
    TrainState's `apply_fn`, the bound `apply` of a Linen module whose layer count is `depth`,
    cut as a closed-over module is; and the swaps made (the cut module's id -> (it, the
    original)), for `statics_restored`."""
    swaps: dict[int, tuple] = {}

    def node(n):
        updates = {}
        for name, v in _static_fields(n):
            if isinstance(v, types.MethodType):
                cut = _free_value_resized(v.__self__, found, depth, k)
                if cut is not v.__self__:
                    updates[name] = types.MethodType(v.__func__, cut)
                    swaps[id(cut)] = (cut, v)
        return dataclasses.replace(n, **updates) if updates else n

    return _map_nodes(tree, node), swaps


def statics_restored(tree, swaps: Mapping[int, tuple]):
    """`tree` (a shallow trace's output) with the originals back where `statics_resized` swapped
    (the new TrainState carries the cut `apply_fn`; the step's own output, the real one)."""

    def node(n):
        updates = {
            name: swaps[id(v.__self__)][1]
            for name, v in _static_fields(n)
            if isinstance(v, types.MethodType) and id(v.__self__) in swaps
        }
        return dataclasses.replace(n, **updates) if updates else n

    return _map_nodes(tree, node) if swaps else tree


def _static_fields(n) -> list[tuple[str, object]]:
    """A dataclass pytree node's fields kept outside the pytree (Flax's `pytree_node=False`)."""
    if isinstance(n, type) or not dataclasses.is_dataclass(n):
        return []
    return [
        (f.name, getattr(n, f.name, None)) for f in dataclasses.fields(n) if not f.metadata.get("pytree_node", True)
    ]


def _map_nodes(tree, fn):
    """`fn` applied to every node of `tree` that is not a leaf, children first."""
    flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda y: y is not tree)
    if jax.tree_util.treedef_is_leaf(treedef):
        return tree
    return fn(jax.tree_util.tree_unflatten(treedef, [_map_nodes(c, fn) for c in flat]))


def source_leaves(full, shallow, found: Sequence[Stack], depth: int, period: int = 1) -> list[int] | None:
    """Per leaf of `full`, the index of the leaf of `shallow` (the same tree with its stacks
    `depth` deep) that stands for it: a member beyond the shallow ones is the member at its place
    in the last whole pattern of `period` layers (the last member, for a stack of one kind).
    Found by growing `shallow` with its leaves' indices for leaves (`resized`): where that has
    `full`'s structure, its leaves are the answer, read at C speed (a deep model has ~10^4);
    else by key names."""
    leaves, treedef = jax.tree_util.tree_flatten(shallow)
    full_depths = {s.depth for s in found}
    if len(full_depths) == 1:
        try:
            grown = resized(jax.tree_util.tree_unflatten(treedef, range(len(leaves))), found, *full_depths, period)
        except Exception:  # a node that will not hold integers for leaves
            grown = None
        if grown is not None:
            got, got_def = jax.tree_util.tree_flatten(grown)
            if got_def == jax.tree_util.tree_structure(full):
                return got
    return _sources_by_name(full, shallow, found, depth, period)


def _sources_by_name(full, shallow, found: Sequence[Stack], depth: int, period: int) -> list[int] | None:
    """`source_leaves`, each leaf of `full` renamed to its stand-in and looked up in `shallow`."""
    index = {key_names(keys): i for i, (keys, _) in enumerate(jax.tree_util.tree_flatten_with_path(shallow)[0])}
    renamed: dict[tuple[int, str], str | None] = {}  # (stack, member's name) -> its stand-in's, None: itself

    def stand_in(j: int, s: Stack, name: str) -> str | None:
        if (j, name) not in renamed:
            i = _index(s, name)
            keep = i is None or i < depth
            renamed[j, name] = None if keep else name[: len(name) - len(str(i))] + str(depth - period + i % period)
        return renamed[j, name]

    out = []
    for keys, _ in jax.tree_util.tree_flatten_with_path(full)[0]:
        names = key_names(keys)
        for j, s in enumerate(found):
            n = len(s.path)
            if len(names) > n and names[:n] == s.path and (m := stand_in(j, s, names[n])) is not None:
                names = (*names[:n], m, *names[n + 1 :])
        src = index.get(names)
        if src is None:
            return None
        out.append(src)
    return out


def layer_groups(names: Sequence[tuple[str, ...]], found: Sequence[Stack], period: int = 1) -> list[list[int]]:
    """Of leaves named `names` (key names, in a tree whose stacks are `found`), the indices of
    those that are one layer's leaf in each member at its place in the pattern of `period`
    layers (`layers/0/wq`, `layers/1/wq`, ...; with `period` 2, members 0, 2, ... and 1, 3, ...
    apart): groups of two or more, each a weight that one sharding serves in every layer."""
    groups: dict[tuple, list[int]] = {}
    for j, n in enumerate(names):
        for s in found:
            k = len(s.path)
            if n[:k] == s.path and len(n) > k and (i := _index(s, n[k])) is not None:
                groups.setdefault((s.path, i % period, n[k + 1 :]), []).append(j)
                break
    return [g for g in groups.values() if len(g) > 1]


def key_names(keys) -> tuple[str, ...]:
    return tuple(map(_name, keys))


def named_leaves(tree) -> list[tuple[tuple, tuple[str, ...], object]]:
    """(key path, key names, leaf) per leaf of `tree`, in flatten order: flattened once for every
    walk over a deep model's ~10^4 leaves that reads them."""
    return [(keys, key_names(keys), leaf) for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


_name = functools.lru_cache(maxsize=1 << 16)(key_name)  # (a deep model's ~10^4 leaves share a few hundred keys)


_DEPTH_NAME = re.compile(r"layer|depth|block", re.IGNORECASE)  # num_layers, n_layer, depth, num_blocks, ...
_NESTING = 3  # how deep config objects are searched for the depth


def with_free_variables_resized(fn, found: Sequence[Stack], depth: int, k: int, abstract: tuple = (), memo=None):
    """`fn` with what it closes over (or a `functools.partial` binds) that holds the stacks' depth
    cut to `k` alike: a pytree holding a `depth`-long container at a stack's path (or a suffix of
    it: Equinox's static half of a model, `eqx.partition`'s other output), and an integer equal to
    `depth` named for layers, depth or blocks in a config dict, a dataclass or a Flax Linen module
    (`ViT(layers=96)`, `config.num_layers`), and a Flax NNX graphdef that one of the arguments
    (`abstract`) is the state of. Where nothing matches, `fn` itself. `memo`: a dict kept between
    calls for the same `fn` at other `k`s (an NNX graph is merged once for all of them)."""
    memo = {} if memo is None else memo
    resize = functools.partial(_free_value_resized, found=found, depth=depth, k=k, abstract=abstract, memo=memo)
    if isinstance(fn, functools.partial):
        args, keywords = [resize(a) for a in fn.args], {n: resize(v) for n, v in fn.keywords.items()}
        if all(a is b for a, b in zip(args, fn.args)) and all(keywords[n] is v for n, v in fn.keywords.items()):
            return fn
        return functools.partial(fn.func, *args, **keywords)
    cells = getattr(fn, "__closure__", None)
    if not isinstance(fn, types.FunctionType) or not cells:
        return fn
    values = [_cell_value(c) for c in cells]
    new = [
        v if v is _EMPTY else _depth_resized(n, v, found, depth, k, -1, abstract, memo)
        for n, v in zip(fn.__code__.co_freevars, values)
    ]
    if all(a is b for a, b in zip(new, values)):
        return fn
    out = types.FunctionType(
        fn.__code__,
        fn.__globals__,
        fn.__name__,
        fn.__defaults__,
        tuple(c if v is _EMPTY else types.CellType(v) for c, v in zip(cells, new)),
    )
    out.__kwdefaults__, out.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    return out


_EMPTY = object()


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # (a cell not yet bound)
        return _EMPTY


def _free_value_resized(
    value, found: Sequence[Stack], depth: int, k: int, nesting: int = 0, abstract: tuple = (), memo=None
):
    if type(value).__name__ == "GraphDef" and type(value).__module__.startswith("flax.nnx"):
        return _nnx_graphdef_resized(value, abstract, depth, k, {} if memo is None else memo)
    if callable(value) and not dataclasses.is_dataclass(value):
        return value
    if isinstance(value, dict) and nesting < _NESTING:
        new = {n: _depth_resized(n, v, found, depth, k, nesting, abstract, memo) for n, v in value.items()}
        if any(new[n] is not v for n, v in value.items()):
            return type(value)(new) if type(value) is not dict else new
    if _is_pytree_node(value):
        matched = _free_stacks(value, found, depth)
        return (resized(value, matched, k) or value) if matched else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and nesting < _NESTING:
        updates = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name, None)
            if f.init and (n := _depth_resized(f.name, v, found, depth, k, nesting, abstract, memo)) is not v:
                updates[f.name] = n
        if updates:
            try:  # a Linen module is copied by `clone`, which keeps it unbound
                return value.clone(**updates) if hasattr(value, "clone") else dataclasses.replace(value, **updates)
            except Exception:
                return value
    return value


def _depth_resized(name, value, found, depth: int, k: int, nesting: int, abstract: tuple = (), memo=None):
    if type(value) is int:
        return k if value == depth and _DEPTH_NAME.search(str(name)) else value
    return _free_value_resized(value, found, depth, k, nesting + 1, abstract, memo)


def _nnx_graphdef_resized(graphdef, abstract: tuple, depth: int, k: int, memo: dict):
    """The graphdef of the object graph that `graphdef` and one of the arguments merge into, with
    every `depth`-long `nnx.List` (the layers) and every stack in a pytree attribute (an
    optimizer's state mirroring them) cut to `k`; `graphdef` itself where no argument merges.
    The merge (most of the cost, at full depth) is done once per graphdef and kept in `memo`."""
    from flax import nnx  # (only a step that closes over an NNX graphdef gets here)

    if id(graphdef) not in memo:
        memo[id(graphdef)] = (graphdef, _nnx_merged(nnx, graphdef, abstract, depth))
    objects, stacked = memo[id(graphdef)][1]
    if objects is None:
        return graphdef
    # Plain attribute writes: NNX's own would check every layer of the list put back, and these
    # objects are this function's alone.
    for node, name, _, cut in stacked:
        object.__setattr__(node, name, cut(k))
    try:
        return nnx.graphdef(objects)
    finally:
        for node, name, value, _ in stacked:
            object.__setattr__(node, name, value)


def _nnx_merged(nnx, graphdef, abstract: tuple, depth: int):
    """(the objects `graphdef` and an argument merge into, their `_nnx_stacks`), or (None, [])
    where no argument merges or some stack cannot be cut."""
    for state in abstract:
        try:
            objects = nnx.merge(graphdef, state)
        except Exception:
            continue
        stacked = _nnx_stacks(nnx, objects, depth)
        return (objects, stacked) if stacked else (None, [])
    return None, []


def _nnx_stacks(nnx, objects, depth: int) -> list[tuple]:
    """(node, attribute, its value, k -> the value cut to k) for `_nnx_graphdef_resized`, walking
    the NNX objects' attributes but not into the layers it cuts (a deep model's nodes are nearly
    all in them)."""
    out, seen, todo = [], set(), list(objects) if isinstance(objects, (tuple, list)) else [objects]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for name, value in vars(node).items():
            if name.startswith("_") or isinstance(value, nnx.Variable):
                continue
            if isinstance(value, nnx.List) and len(value) == depth:
                out.append((node, name, value, lambda k, value=value: nnx.List(list(value)[:k])))
            elif isinstance(value, nnx.Pytree):
                todo.append(value)
            elif inner := [s for s in stacks(value) if s.depth == depth]:
                out.append((node, name, value, lambda k, value=value, inner=inner: resized(value, inner, k)))
    return out


def _is_pytree_node(value) -> bool:
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value, is_leaf=lambda x: x is None))


def _free_stacks(tree, found: Sequence[Stack], depth: int) -> list[Stack]:
    """The containers in `tree`, `depth` long, whose paths end a stack's path in `found`."""
    ends = {s.path[-n:]: s.prefix for s in found for n in range(1, len(s.path) + 1)}
    out = []

    def walk(node, path):
        if path in ends and isinstance(node, (list, tuple, dict)) and len(node) == depth:
            out.append(Stack(path, ends[path], depth))
            return
        flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
        for keys, child in flat:
            if keys != ():
                walk(child, path + (key_name(keys[0]),))

    walk(tree, ())
    return out
