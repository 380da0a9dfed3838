"""Data each host loads for itself (`orchestrator.job.data`): token files as nanoGPT and Megatron write
them, a global example order that no mesh changes, each process reading only its rows, and the
data position carried through checkpoints so that a resume on another mesh goes on exactly."""

import os

import numpy as np
import pytest

from orchestrator.job.data import DataError, DataPosition, HostBatches, TokenFiles, Windows, rows_held


def write(path, tokens, dtype="uint16"):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return str(path)


def test_windows_cover_raw_and_npy_files_without_crossing_them(tmp_path):
    a = write(tmp_path / "a.bin", np.arange(0, 21))  # 21 tokens: 5 windows of 4 + 1
    b = str(tmp_path / "b.npy")
    np.save(b, np.arange(100, 110, dtype=np.uint32))  # 10 tokens: 2 windows
    w = Windows([a, b], seq_len=4)
    assert len(w) == 7
    assert w[0].tolist() == [0, 1, 2, 3, 4] and w[4].tolist() == [16, 17, 18, 19, 20]
    assert w[5].tolist() == [100, 101, 102, 103, 104] and w[6].tolist() == [104, 105, 106, 107, 108]
    assert w.bytes_read == 2 * 5 * 2 + 2 * 5 * 4  # two windows of uint16, two of uint32


def test_examples_shift_targets_and_reshuffle_every_epoch(tmp_path):
    path = write(tmp_path / "t.bin", np.arange(401) % 60000)
    ds = TokenFiles((path,), seq_len=8, seed=3, epochs=2).dataset()
    assert len(ds) == 2 * 50
    first = [int(ds[i]["inputs"][0]) // 8 for i in range(50)]
    second = [int(ds[i]["inputs"][0]) // 8 for i in range(50, 100)]
    assert sorted(first) == sorted(second) == list(range(50)), "each epoch sees every window once"
    assert first != second and first != list(range(50)), "shuffled, and again each epoch"
    ex = ds[17]
    assert ex["inputs"].dtype == np.int32 and ex["inputs"].shape == (8,)
    assert (ex["targets"][:-1] == ex["inputs"][1:]).all()
    again = TokenFiles((path,), seq_len=8, seed=3, epochs=2).dataset()
    assert all((again[i]["inputs"] == ds[i]["inputs"]).all() for i in range(0, 100, 7)), "seeded"


def test_packed_documents_carry_their_segments(tmp_path):
    eos = 0
    path = write(tmp_path / "t.bin", [5, 6, eos, 7, 8, 9, eos, 4, 3])
    ex = TokenFiles((path,), seq_len=8, eos=eos).dataset()[0]
    assert ex["inputs"].tolist() == [5, 6, 0, 7, 8, 9, 0, 4]
    assert ex["segments"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]  # a separator ends its document


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: (write(d / "odd.bin", [1, 2, 3], "uint8"), "uint16"), "not a whole number of uint16 tokens"),
        (lambda d: (str(d / "missing.bin"), "uint16"), "does not exist"),
        (lambda d: (np.save(d / "m.npy", np.zeros((4, 4), np.int32)) or str(d / "m.npy"), "uint16"), "one dimension"),
        (lambda d: (write(d / "short.bin", [1, 2]), "uint16"), "hold no window"),
    ],
)
def test_unreadable_token_files_say_what_was_expected(tmp_path, make, expected):
    path, dtype = make(tmp_path)
    with pytest.raises(DataError, match=expected):
        TokenFiles((path,), seq_len=4, dtype=dtype).dataset()


def mesh_shardings(devices, axes, shape):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices).reshape(shape), axes)
    spec = PartitionSpec(("data",) if "data" in axes else None)
    return {"inputs": NamedSharding(mesh, spec), "targets": NamedSharding(mesh, spec)}, jax


def test_host_batches_are_the_global_order_on_any_mesh(tmp_path, devices8):
    """Step 5 of a batch of 24 is the same examples on 4 hosts of 2 devices, on 3 hosts (6 devices),
    laid out data-parallel or data x model, and after a resume that left off at step 3."""
    path = write(tmp_path / "t.bin", np.arange(8001) % 50000)
    ds = TokenFiles((path,), seq_len=16, seed=1).dataset()
    expected = np.stack([ds[5 * 24 + r]["inputs"] for r in range(24)])
    layouts = [
        (devices8, (8,), ("data",)),
        (devices8, (4, 2), ("data", "model")),
        (devices8, (2, 4), ("data", "model")),
        (devices8[:6], (6,), ("data",)),
        (devices8[:6], (3, 2), ("data", "model")),
    ]
    for devices, shape, axes in layouts:
        shardings, jax = mesh_shardings(devices, axes, shape)
        batch = HostBatches(ds, DataPosition(24), shardings)(5)
        assert batch["inputs"].sharding == shardings["inputs"]
        np.testing.assert_array_equal(np.asarray(batch["inputs"]), expected)
        resumed = HostBatches(ds, DataPosition(24, first_step=3, first_example=72), shardings)  # left off at step 3
        np.testing.assert_array_equal(np.asarray(resumed(5)["inputs"]), expected)


def test_each_process_reads_only_the_rows_its_devices_hold(devices8):
    """Eight devices as four processes of two: each reads a quarter of the batch's rows."""
    shardings, jax = mesh_shardings(devices8, ("data", "model"), (4, 2))
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct((8, 16), np.int32), shardings)
    seen = []
    for process in range(4):
        mine = set(devices8[2 * process : 2 * process + 2])
        rows = rows_held(shardings, shapes, devices=mine)
        assert len(rows) == 2
        seen += rows
    assert sorted(seen) == list(range(8))
    assert rows_held(shardings, shapes) == list(range(8))  # this one process holds every row


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    from examples.gpt.model import write_tokens

    folder = tmp_path_factory.mktemp("tokens")
    path, held_out = str(folder / "train.bin"), str(folder / "eval.bin")
    write_tokens(path, 40_000)
    write_tokens(held_out, 4_000, seed=1)
    os.environ["REMESH_TEST_TOKENS"], os.environ["REMESH_TEST_EVAL_TOKENS"] = path, held_out
    return path


def test_a_job_on_token_files_resumes_exactly_on_other_meshes(tmp_path, devices8, token_file):
    """8 -> 6 -> 8 devices, stopping at checkpoints, against one run on 8: the same loss at every
    step (within 1e-4 relative), each resume starts where the data left off, and the held-out
    evaluations every 5 steps agree too."""
    from orchestrator.worker import run_segment
    from tests.helpers.segments import collect, spec

    ref = "tests.programs.token_gpt:evaluated"
    static = []
    run_segment(spec(tmp_path / "static", 8, 15, program_ref=ref), collect(static))
    elastic = []
    for devices, steps in ((8, 5), (6, 10), (8, 15)):
        run_segment(spec(tmp_path / "elastic", devices, steps, program_ref=ref), collect(elastic))
    restores = [r for r in elastic if r["kind"] == "restore"]
    assert [r["step"] for r in restores] == [5, 10]
    losses = lambda reports: [r["loss"] for r in reports if r["kind"] == "step"]  # noqa: E731
    assert len(losses(elastic)) == len(losses(static)) == 15
    np.testing.assert_allclose(losses(elastic), losses(static), rtol=1e-4)
    evals = lambda reports: {r["step"]: r["loss"] for r in reports if r["kind"] == "eval"}  # noqa: E731
    assert sorted(evals(elastic)) == sorted(evals(static)) == [5, 10, 15]
    np.testing.assert_allclose(
        [evals(elastic)[s] for s in (5, 10, 15)], [evals(static)[s] for s in (5, 10, 15)], rtol=1e-4
    )
    assert evals(static)[15] < evals(static)[5]  # what it learnt holds on data it never saw
    meta = __import__("json").load(open(tmp_path / "elastic" / "ckpt" / "15" / "remesh.json"))
    assert meta["meta"]["examples_seen"] == 15 * 24


RECIPES = [
    "examples.nnx_lm.model:make_program",
    "examples.linen_lm.model:make_program",
    "examples.equinox_lm.model:make_program",
]


@pytest.mark.slow  # (40 to 80 s each: `make test-slow`, which CI runs)
@pytest.mark.parametrize("ref", RECIPES, ids=lambda r: r.split(".")[1])
def test_a_recipe_program_made_by_a_factory_trains_on_its_token_files_across_meshes(
    tmp_path, devices8, token_file, ref
):
    """The recipes for Flax NNX, Flax Linen and Equinox (`examples/*_lm`): a factory given the
    job's settings (its steps set the schedule, `[options]` the token files), bfloat16 compute,
    resumed from 8 devices on 4 at a checkpoint: the same losses as one run on 8 (within 1e-4
    relative), the first segment's exactly."""
    from orchestrator.protocol import Stop
    from orchestrator.worker import run_segment
    from tests.helpers.segments import collect, spec

    options = {"train_tokens": [token_file]}
    job = lambda folder, devices: spec(folder, devices, 10, program_ref=ref, global_batch=16, options=options)  # noqa: E731
    static = []
    run_segment(job(tmp_path / "static", 8), collect(static))
    elastic = []
    for devices in (8, 4):
        run_segment(job(tmp_path / "elastic", devices), collect(elastic), should_stop=lambda: Stop.AT_CHECKPOINT)
    assert [r["step"] for r in elastic if r["kind"] == "restore"] == [5]
    losses = lambda reports: np.array([r["loss"] for r in reports if r["kind"] == "step"])  # noqa: E731
    a, b = losses(static), losses(elastic)
    assert len(a) == len(b) == 10 and a[-1] < a[0]
    np.testing.assert_array_equal(a[:5], b[:5])
    np.testing.assert_allclose(b, a, rtol=1e-4)
