"""Test tiers (markers in pyproject.toml). Fake devices must be configured before jax is imported,
and pytest imports this file first, so the whole test process gets 8 fake CPU devices. Ray host
actors set their own device count through their runtime environment."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def devices8():
    import jax

    devices = jax.devices()
    if len(devices) < 8:
        pytest.fail(f"this test needs 8 fake CPU devices, got {len(devices)}: XLA_FLAGS was set too late")
    return devices[:8]
