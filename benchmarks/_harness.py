"""What every benchmark here shares: fake devices set before JAX is imported, work run in a fresh
process of a given checkout, and A/B rounds that alternate which tree runs first (neither always
finds the machine as the other left it), summed up by medians and their ratio.

    from _harness import fake_devices          # (benchmarks/ is on sys.path for its scripts)
    fake_devices(8)                            # before `import jax`
    medians = ab({"base": "/tmp/base", "this": ROOT}, rounds=3, measure=one_round)

Imports nothing heavy: a benchmark calls `fake_devices` first, then imports JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ab_parser(doc: str, rounds: int | None = 3) -> argparse.ArgumentParser:
    """The arguments every A/B script takes: `--base`, the other checkout (a `git worktree` of the
    baseline commit), and `--rounds` (unless `rounds` is None)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout (a git worktree of the baseline commit)")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def fake_devices(n: int, env: dict | None = None, *, unless_set: bool = False) -> dict:
    """`n` fake CPU devices for JAX in `env` (default: this process's, which must not have
    imported JAX yet); returns the environment. `unless_set`: a device count already there stays
    (a script's own subprocesses, started with fewer)."""
    env = os.environ if env is None else env
    if env is os.environ and "jax" in sys.modules:
        raise RuntimeError(f"fake_devices({n}) after jax was imported: call it first, the flag is read at import")
    if unless_set and "--xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        env.setdefault("JAX_PLATFORMS", "cpu")
        return env
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def in_turn(trees: Sequence, r: int) -> Sequence:
    """`trees` in round `r`'s order: as given in even rounds, reversed in odd ones."""
    return trees if r % 2 == 0 else list(trees)[::-1]


def run_in(root: str, argv: Sequence[str], *, devices: int | None = None, timeout: float = 1800) -> str:
    """`python ARGV` in a fresh process in the checkout at `root` (its own code first on the path),
    with `devices` fake CPU devices where given; its standard output."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.path.join(root, "benchmarks")) if p)
    if devices is not None:
        fake_devices(devices, env)
    done = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {root} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def run_code(root: str, code: str, *, devices: int | None = None, timeout: float = 1800) -> str:
    """`python -c CODE` as `run_in` runs it."""
    return run_in(root, ["-c", code], devices=devices, timeout=timeout)


def ab(
    trees: Mapping[str, str], rounds: int, measure: Callable[[str], Mapping[str, float]], figures: Sequence[str]
) -> dict[str, dict[str, float]]:
    """`measure(root)` for each tree in every round, alternating which goes first; prints each run
    as a JSON line, then each figure's medians and their ratio (the second tree over the first).
    Returns the medians."""
    runs: dict[str, list] = {name: [] for name in trees}
    for r in range(rounds):
        for name in in_turn(list(trees), r):
            got = dict(measure(trees[name]))
            runs[name].append(got)
            print(json.dumps({"round": r, "tree": name, **{k: got[k] for k in figures}}), flush=True)
    medians = {name: {k: statistics.median(f[k] for f in fs) for k in figures} for name, fs in runs.items()}
    first, second = list(trees)
    for k in figures:
        a, b = medians[first][k], medians[second][k]
        print(f"{k:>20}: {first} {a:10.4f}  {second} {b:10.4f}  {second}/{first} {b / a if a else float('nan'):.3f}")
    return medians
