"""A digest of a train state that is the same on every mesh, computed without gathering the state.

Each leaf's bits are read as 32-bit words (typed PRNG keys through their key data; 8- and 16-bit
types widened, 64-bit types split), every word is mixed with its global flat index, and the mixed
words are summed modulo 2**32, twice with different mixes. Integer addition modulo 2**32 does not
depend on the order of the terms, so each device sums its own shard and XLA adds the partial sums
with one all-reduce of a few scalars: no host holds more than its shards, and the result is the
same whichever mesh and specs the state is laid out with. A word that changes, or moves to another
index, changes the digest (unless two 32-bit sums collide: a check against corruption and wrong
resharding, not against an adversary).

    fn = compile_digest(abstract_state_with_shardings)   # once per segment, beside the step
    digest(fn, state)                                      # a hex string, equal on every process
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any


def _words(x):
    """A leaf's bits as uint32 words, shaped like the leaf (plus a trailing axis where one element
    takes more than one word)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([_words(jnp.real(x)), _words(jnp.imag(x))], axis=-1)
    width = x.dtype.itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
    bits = lax.bitcast_convert_type(x, unsigned)  # 8-byte types gain a trailing axis of 2 words
    return bits.astype(jnp.uint32)


def _leaf_sums(x):
    import jax.numpy as jnp
    from jax import lax

    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= w.shape[d]
    # Each step is a bijection of the word for a fixed index, so one changed word changes the first
    # sum; the second mixes further, so that moved words are caught by one of the two.
    h = (w ^ index * jnp.uint32(0x9E3779B1)) * jnp.uint32(0x85EBCA77)
    h = h ^ (h >> 15)
    g = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE3D)
    return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(g ^ (g >> 16), dtype=jnp.uint32)])


def _digest_sums(state):
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(state)
    return jnp.stack([_leaf_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def compile_digest(abstract_state: Any, compile: Callable | None = None):
    """The digest's device program for states shaped (and sharded) like `abstract_state`;
    `compile(lowered)` compiles it (default: `lowered.compile()`)."""
    import jax

    meshes = [x.sharding.mesh for x in jax.tree.leaves(abstract_state) if hasattr(getattr(x, "sharding", None), "mesh")]
    out = jax.sharding.NamedSharding(meshes[0], jax.sharding.PartitionSpec()) if meshes else None
    lowered = jax.jit(_digest_sums, out_shardings=out).lower(abstract_state)
    return compile(lowered) if compile else lowered.compile()


def check_digestible(abstract_state: Any) -> None:
    """Trace the digest for `abstract_state` (no arrays): fails here on a leaf it cannot read."""
    import jax

    jax.eval_shape(_digest_sums, abstract_state)


def digest(compiled, state: Any) -> str:
    """Hex digest of `state`: its leaves' paths, shapes, dtypes and the device sums."""
    return digest_later(compiled, state)()


def digest_later(compiled, state: Any) -> Callable[[], str]:
    """Dispatch `state`'s digest now (the device reads the state before any later step donates
    it); the function returned waits for the sums and gives `digest`'s hex string."""
    import jax
    import numpy as np

    from checkpoint import leaf_path

    sums = compiled(state)
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        h.update(f"{leaf_path(path)}:{leaf.shape}:{leaf.dtype};".encode())

    def finish() -> str:
        done = h.copy()
        done.update(np.asarray(sums.addressable_data(0)).tobytes())
        return KIND + done.hexdigest()

    return finish


KIND = "sum32x2:"  # digests saved by earlier versions (a SHA-256 of the gathered state) are not compared
