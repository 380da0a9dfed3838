"""Where a segment's state comes from: the peer snapshot the controller chose, else the newest
committed step that every process reads intact, else the program's init.

A step that fails its checksums (or its digest) on any process is moved aside on all of them and
the next older one is tried; the processes agree step by step, so they all resume from the same one.
"""

from __future__ import annotations

import dataclasses

from ..job.digest import KIND as DIGEST_KIND
from ..job.digest import digest as digest_of
from ..protocol import CheckpointCorrupt, CheckpointMeta, Init, Restore, SnapshotUnusable
from .compile import DigestProgram


class RestoredStateMismatchError(ValueError):
    """A restored state differs from the state that was saved."""


@dataclasses.dataclass(frozen=True)
class Restored:
    state: object
    step: int  # the step the state is after (0: initialised)
    meta: CheckpointMeta

    @property
    def position(self) -> tuple[int, int]:
        """(the step whose data comes next, where its examples begin in the data's global order)."""
        return self.meta.data_position, self.meta.examples_seen


def restore_or_init(store, program, key, target, digest: DigestProgram, global_batch: int, lap, peers=None,
                    at_most: int | None = None) -> Restored:  # fmt: skip
    """`lap`: where the restore's reports go (a `Deferred` when it runs beside the compile);
    `at_most`: the newest committed step to restore (newer ones hold a corruption found since)."""
    import jax

    from checkpoint import CheckpointCorruptError, CheckpointFormatError

    restored = restore_snapshot(peers, target, digest, lap)
    if restored is not None:
        return restored
    committed = [s for s in store.steps() if at_most is None or s <= at_most]
    for step in reversed(committed):
        try:
            state, stats = store.restore_with_stats(step, target=target)
            meta = CheckpointMeta.from_dict(stats.meta, step=step, global_batch=global_batch)
            checked = check_digest(digest, state, meta, step, store.path)
            error = None
        except (CheckpointCorruptError, CheckpointFormatError, RestoredStateMismatchError) as e:
            error = e
        if not all_agree(error is None):
            lap(CheckpointCorrupt, step=step, error=str(error) if error else "corrupt on another host")
            if jax.process_index() == 0:
                store.quarantine(step)
            continue
        lap(Restore, step=step, source="disk", bytes_read=stats.bytes_read, bytes_needed=stats.bytes_needed,
            reported=meta.reported(), **checked)  # fmt: skip
        return Restored(state, step, meta)
    if committed:
        raise CheckpointCorruptError(
            f"no checkpoint in {store.path} restores intact: steps {committed} were all damaged and moved "
            "aside as <step>.corrupt; move one back to inspect it, or start the job in a new checkpoint directory"
        )
    state = jax.jit(program.init, out_shardings=jax.tree.map(lambda t: t.sharding, target))(key)
    jax.block_until_ready(state)
    lap(Init)
    return Restored(state, 0, CheckpointMeta(data_position=0, examples_seen=0))


def restore_snapshot(peers, target, digest: DigestProgram, lap) -> Restored | None:
    """The peer snapshot `peers` holds for this group, if every process reads its pieces intact
    (crc32 of each) and the state they make up has the digest taken with the snapshot; None, on
    every process alike, otherwise."""
    from checkpoint import CheckpointCorruptError, CheckpointNotFoundError, restore_step

    if peers is None:
        return None
    error = None
    try:
        source = peers.restore_step()
        if source is None:  # the same on every process: the controller gives all or none a snapshot
            return None
        state, stats = restore_step(source, target)
        meta = CheckpointMeta.from_dict(source.meta, step=source.step, global_batch=0)
        checked = check_digest(digest, state, meta, source.step, "a peer snapshot in host memory")
    except (CheckpointCorruptError, CheckpointNotFoundError, RestoredStateMismatchError) as e:
        error = e
    if not all_agree(error is None):
        lap(SnapshotUnusable, error=str(error) if error else "unusable on another host")
        return None
    lap(Restore, step=source.step, source="memory", bytes_read=0, bytes_needed=stats.bytes_needed,
        reported=meta.reported(), **checked)  # fmt: skip
    return Restored(state, source.step, meta)


def check_digest(digest: DigestProgram, state, meta: CheckpointMeta, step: int, where: str) -> dict:
    """The restored state's digest beside the saved one (for the restore report); raises where
    they differ. Nothing to check where digests are off or none was saved."""
    if not digest.enabled or not str(meta.digest or "").startswith(DIGEST_KIND):
        return {}
    checked = {"digest": digest_of(digest.get(), state), "saved_digest": meta.digest}
    if checked["digest"] != checked["saved_digest"]:
        raise RestoredStateMismatchError(
            f"the state restored from step {step} in {where} does not match the digest saved "
            f"with it (saved {meta.digest[:12]}, restored {checked['digest'][:12]}): it is corrupt"
        )
    return checked


def all_agree(ok: bool) -> bool:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))
