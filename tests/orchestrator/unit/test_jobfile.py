import pytest

from orchestrator import JobFileError, load_job, parse_job
from orchestrator.job.jobfile import HealthSpec

GOOD = {
    "name": "j",
    "program": "examples.gpt.model:program",
    "steps": 10,
    "global_batch": 8,
    "hosts": {"min": 1, "max": 2, "devices_per_host": 2},
    "checkpoint": {"dir": "ck", "every": 5},
}


def with_(**changes):
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in GOOD.items()}
    for dotted, value in changes.items():
        *tables, key = dotted.split("__")
        target = raw
        for t in tables:
            target = target[t]
        if value is None:
            del target[key]
        else:
            target[key] = value
    return raw


def test_parses_with_defaults_and_resolves_dir(tmp_path):
    job = parse_job(GOOD, base_dir=str(tmp_path))
    assert job.steps == 10 and job.seed == 0 and job.hardware == "cpu" and job.checkpoint.keep == 3
    assert job.checkpoint.keep_every == 0 and parse_job(with_(checkpoint__keep_every=100)).checkpoint.keep_every == 100
    assert job.planner == "fast" and parse_job(with_(planner="thorough")).planner == "thorough"
    assert job.checkpoint.dir == str(tmp_path / "ck")
    assert job.hosts.devices_per_host == 2
    assert job.priority == 0 and job.queue == "default"
    assert parse_job(with_(priority=7, queue="research")).priority == 7
    assert parse_job(with_(checkpoint__memory_budget=0.2)).checkpoint.snapshot_time_share == 0.2  # its old name
    assert (
        job.checkpoint.snapshot_every == 0
        and parse_job(with_(checkpoint__snapshot_every=4)).checkpoint.snapshot_every == 4
    )


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"stepz": 3}, ["unknown key stepz"]),
        ({"hosts__gpus": 3}, ["unknown key hosts.gpus"]),
        ({"steps": "10"}, ["key steps must be int", "str"]),
        ({"steps": True}, ["key steps must be int", "bool"]),
        ({"checkpoint__every": 1.5}, ["checkpoint.every must be int"]),
        ({"global_batch": None}, ["missing key global_batch"]),
        ({"hosts": None}, ["missing table [hosts]"]),
        ({"program": "no_colon"}, ["module:attribute", "no_colon"]),
        ({"hosts__min": 3}, ["1 <= min <= max", "min=3 max=2"]),
        ({"steps": 0}, ["steps must be positive"]),
        ({"checkpoint__keep_every": -5}, ["checkpoint.keep_every must be 0 (none) or positive, got -5"]),
        ({"checkpoint__snapshot_every": -1}, ["checkpoint.snapshot_every must be 0", "got -1"]),
        ({"checkpoint__snapshot_every": 2, "checkpoint__snapshot_time_share": 0.0}, ["snapshot_time_share = 0 turns"]),
        ({"checkpoint__memory_budget": 0.1, "checkpoint__snapshot_time_share": 0.1}, ["sets both memory_budget and"]),
        ({"planner": "greedy"}, ["key planner must be one of ('fast', 'thorough', 'shapes'), got 'greedy'"]),
        ({"options": "train.bin"}, ["options must be a table ([options])", "str 'train.bin'"]),
        ({"priority": "high"}, ["key priority must be int, got str 'high'"]),
        ({"priority": 1.5}, ["key priority must be int, got float 1.5"]),
        ({"queue": " "}, ["key queue must name a fleet queue, got ' '"]),
    ],
)
def test_bad_job_files_name_the_key(changes, words):
    with pytest.raises(JobFileError) as e:
        parse_job(with_(**changes))
    for w in words:
        assert w in str(e.value)


def test_options_reach_a_program_factory_as_job_settings(tmp_path):
    job = parse_job(with_(options={"train_tokens": ["a.bin", "b.bin"], "learning_rate": 0.01}))
    settings = job.settings()
    assert (settings.steps, settings.global_batch, settings.seed) == (10, 8, 0)
    assert settings.options == {"train_tokens": ["a.bin", "b.bin"], "learning_rate": 0.01}
    assert parse_job(GOOD).settings().options == {}
    dated = tmp_path / "dated.toml"
    dated.write_text(
        'name = "j"\nprogram = "m:p"\nsteps = 1\nglobal_batch = 1\n[hosts]\nmin = 1\nmax = 1\n'
        'devices_per_host = 1\n[checkpoint]\ndir = "c"\nevery = 1\n[options]\nstart = 2026-11-24\n'
    )
    with pytest.raises(JobFileError, match="hosts cannot be sent"):
        load_job(dated)


def test_load_job_errors_on_missing_and_invalid_toml(tmp_path):
    with pytest.raises(JobFileError, match="does not exist"):
        load_job(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(JobFileError, match="not valid TOML"):
        load_job(bad)


def test_example_job_file_is_valid():
    job = load_job("examples/gpt/job.toml")
    assert job.global_batch % 8 == 0 and job.global_batch % 6 == 0


def test_pipeline_key_takes_auto_off_or_a_stage_count():
    assert parse_job(GOOD).pipeline == "auto"
    assert parse_job(with_(pipeline="off")).pipeline == "off" and parse_job(with_(pipeline=4)).pipeline == 4
    for bad in (1, "yes", True, 2.0):
        with pytest.raises(JobFileError, match='key pipeline must be "auto", "off" or a number of stages'):
            parse_job(with_(pipeline=bad))


def test_health_table_takes_a_straggler_mode_and_a_digest_interval():
    assert parse_job(GOOD).health == HealthSpec("act", 0)
    job = parse_job(with_(health={"stragglers": "warn", "digest_every": 50}))
    assert job.health == HealthSpec("warn", 50)
    with pytest.raises(JobFileError, match="key health.stragglers must be one of act, warn, off"):
        parse_job(with_(health={"stragglers": "evict"}))
    with pytest.raises(JobFileError, match=r"key health.digest_every must be a number of steps, 0 .* or -1 \(never\)"):
        parse_job(with_(health={"digest_every": -2}))
    assert parse_job(with_(health={"digest_every": -1})).health.digest_every == -1  # never
    with pytest.raises(JobFileError, match="unknown key health.straglers"):
        parse_job(with_(health={"straglers": "act"}))
