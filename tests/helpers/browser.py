"""Headless Chromium (Debian's `chromium`) for the dashboard tests: the DOM after the page's
scripts ran, and a screenshot kept as a test artefact."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ARTIFACTS = os.environ.get("REMESH_TEST_ARTIFACTS") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "runs", "test-artifacts"
)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("the dashboard tests need Debian's chromium; `make test` installs it (apt-get install chromium)")
    return path


def _run(args: list[str], url: str, profile: str) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,2000",
        "--virtual-time-budget=15000",
        *args,
        url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {proc.stderr[-2000:]}"
    return proc


def dom(url: str, profile: str) -> str:
    return _run(["--dump-dom"], url, profile).stdout


def screenshot(url: str, name: str, profile: str) -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    _run([f"--screenshot={path}"], url, profile)
    assert os.path.getsize(path) > 10_000, f"screenshot {path} is nearly empty"
    return path
