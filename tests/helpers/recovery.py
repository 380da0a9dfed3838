"""What a summary of a run with host losses must show of its recoveries."""


def kinds(run, *names):
    return [e for e in run["events"] if e["kind"] in names]


def assert_at_most_the_snapshot_interval_recomputed(run):
    """After each host loss the group resumes from the newest state kept, at most one snapshot
    interval (measured against its budget; 1 on the demo, more on a loaded machine) behind the step
    reached: a peer snapshot; or the newest commit, where no complete snapshot was newer (a loss
    right after a commit: with an interval of 3, the loss at 41 found snapshot 39 and commit 40,
    and computed 41 again)."""
    lost = kinds(run, "host_lost")
    assert lost, "no host was lost"
    restores = [next(e for e in kinds(run, "restore") if e["at"] >= loss["at"]) for loss in lost]
    assert run["recomputed_steps"] == [e["recomputed"] for e in restores]
    for loss, restore in zip(lost, restores):
        if restore["source"] == "disk":  # the newest commit, all that was computed since it again
            assert restore["step"] == restore["committed"], restore
            assert restore["recomputed"] == loss["step"] - restore["step"], (loss, restore)
        else:
            assert restore["source"] == "memory", restore
        assert 0 <= restore["recomputed"] <= max(1, loss["snapshot_every"]), (loss, restore)
