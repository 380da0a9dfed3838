"""Test tiers, set by directory: a test module lives in `tests/<package>/<tier>/`, and gets the
tier's marker (markers in pyproject.toml) from there, so no module falls outside every tier; a
module elsewhere fails the collection. `slow` is set in the modules that are.

Fake devices must be configured before jax is imported, and pytest imports this file first, so
the whole test process gets 8 fake CPU devices. Ray host actors set their own device count through
their runtime environment."""

import os
import pathlib

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

TESTS = pathlib.Path(__file__).parent
TIERS = ("unit", "fake_devices", "multiprocess", "ray", "browser")


def tier_of(path: pathlib.Path) -> str:
    """The tier of the test module at `path`: the directory it is in, under its package's."""
    parts = path.relative_to(TESTS).parts
    if len(parts) != 3 or parts[1] not in TIERS:
        raise pytest.UsageError(
            f"test module tests/{'/'.join(parts)} is in no tier: put it in tests/<package>/<tier>/ "
            f"with <tier> one of {TIERS}, so that `make test` runs it in that tier"
        )
    return parts[1]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))


@pytest.fixture
def devices8():
    import jax

    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail(f"this test needs 8 fake CPU devices, got {len(devices)}: XLA_FLAGS was set too late")
    return devices[:8]
