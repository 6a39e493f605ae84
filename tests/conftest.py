"""Test setup: 8 host devices for the multi-device CPU tests, and GPU markers that skip with a reason."""

import os

# Must precede the first import of jax anywhere in the test session.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Under `pytest -n 2` (the README's command) two worker processes may share one GPU: neither may take 75% of
# its memory up front, as XLA's client does by default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (not a pass)"))
        elif "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs; this machine has {gpus} (not a pass)"))


@pytest.fixture
def gpu_kernels():
    """Skip (with the reason, not a pass) unless a CUDA GPU and the native library are both here: the gate of
    the tests that run mok's kernels (``pytest.mark.usefixtures("gpu_kernels")``)."""
    from helpers import gpu_skip_reason

    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def cpu_devices():
    devs = jax.devices("cpu")
    if len(devs) < 8:
        pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax import)")
    return devs
