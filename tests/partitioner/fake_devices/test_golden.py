"""Golden plans per (model, devices, hardware): the tactic search's choice, diffed against JSON
files in tests/golden/. A missing golden file fails; regenerate deliberately with
`REMESH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/partitioner/fake_devices/test_golden.py` and
review the diff. Every leaf of every argument is compared: a leaf added or gone fails too. Eight full
searches: the fake-devices tier, not the unit one."""

import json
import os

import pytest

from examples.targets import TARGETS
from partitioner.search import search
from tests.helpers.paths import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden")


CASES = [
    ("llama-gqa-swiglu", 8, "h100"),
    ("gpt-d8192", 8, "h100"),
    ("gpt-example", 8, "h100"),
    ("gpt-example", 6, "cpu"),
    ("mlp-small-weights", 8, "h100"),
    ("mlp-8k", 8, "h100"),
    ("mlp-8k", 8, "tpu-v5e"),
    ("moe-8x", 8, "h100"),
]


@pytest.mark.parametrize("model, devices, hardware", CASES, ids=lambda x: str(x))
def test_plan_matches_its_golden_file(model, devices, hardware):
    fn, args = TARGETS[model]()
    plan, _ = search(fn, *args, devices=devices, hardware=hardware, compile_check=False)  # (the model's choice)
    doc = plan.to_dict()
    got = {"mesh": doc["mesh"], "in_specs": doc["in_specs"], "tactic": plan.tactic}
    path = os.path.join(GOLDEN, f"{model}-{devices}-{hardware}.json")
    if os.environ.get("REMESH_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
    if not os.path.exists(path):
        pytest.fail(f"golden plan {path} is missing: run with REMESH_UPDATE_GOLDEN=1 to write it, then review it")
    with open(path) as f:
        want = json.load(f)
    assert got["tactic"] == want["tactic"] and got["mesh"] == want["mesh"], (got["tactic"], got["mesh"], plan.notes)
    assert len(got["in_specs"]) == len(want["in_specs"]), "the step's arguments changed in number"
    for i, (g, w) in enumerate(zip(got["in_specs"], want["in_specs"])):
        assert set(g) == set(w), f"argument {i}: leaves added {sorted(set(g) - set(w))}, gone {sorted(set(w) - set(g))}"
        diff = {k: (g[k], w[k]) for k in w if g[k] != w[k]}
        assert not diff, f"argument {i}: {len(diff)} leaves changed sharding, e.g. {list(diff.items())[:3]}"
