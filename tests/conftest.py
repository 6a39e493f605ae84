"""Test setup: 8 host devices for the multi-device CPU tests, GPU markers that skip with a reason, and seeds that a
failing test's report names (MOK_TEST_SEED)."""

import os

# Must precede the first import of jax anywhere in the test session.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Under `pytest -n 2` (the README's command) two worker processes may share one GPU: neither may take 75% of
# its memory up front, as XLA's client does by default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# On a machine without a GPU (CI's), a persistent compilation cache for each of the run's pytest processes: the
# tests build the same reference programs again and again in new closures, and XLA's CPU compile is most of their
# time (the whole run on a 2-core machine: 605-637 s without it, 554-579 s with it). It is fresh per run (made
# here, in the controller, before the workers start, and removed at its end), so nothing compiled by an earlier
# tree is ever loaded. Each process has a directory of its own: JAX does not write an entry atomically, and a
# worker that read another's half-written entry warned and compiled again. The directory is set in JAX's config,
# not its environment, so the processes a test starts (some run at once) do not share it. A cache directory the
# user set is used as it is. Off on a GPU machine, so that its runs stay as they were measured.
_JIT_CACHE_MADE = None
_JIT_CACHE_ROOT = "MOK_TEST_JIT_CACHE_ROOT"
if (not os.environ.get("PYTEST_XDIST_WORKER") and not os.path.exists("/dev/nvidiactl")
        and "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("MOK_TEST_JIT_CACHE", "1") != "0"):
    import tempfile

    _JIT_CACHE_MADE = tempfile.mkdtemp(prefix="mok_jax_test_jit_cache_")
    os.environ[_JIT_CACHE_ROOT] = _JIT_CACHE_MADE

import jax  # noqa: E402
import pytest  # noqa: E402

if os.environ.get(_JIT_CACHE_ROOT):
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(os.environ[_JIT_CACHE_ROOT], os.environ.get("PYTEST_XDIST_WORKER", "controller")))
    for _name in ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes"):
        if _name.upper() not in os.environ:  # every program, however small or quick to compile, unless set
            jax.config.update(_name, 0)


def pytest_unconfigure(config):
    if _JIT_CACHE_MADE is not None:
        import shutil

        shutil.rmtree(_JIT_CACHE_MADE, ignore_errors=True)


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


# Seeds (tests/helpers.py, "Seeds a failed GPU run can reproduce"): the base seed and the seeds a test drew through
# the ``seed`` fixture, kept on its item for the failure report.
_SEEDS_DRAWN = pytest.StashKey[tuple]()


@pytest.fixture
def seed(request):
    """``seed(today)``: the seed a test written with the fixed seed ``today`` draws its inputs from: ``today`` itself
    unless MOK_TEST_SEED is set, else helpers.derived_seed's mix of it with the test's name. A failing test's report
    names the base seed and what was drawn; JUnit XML carries the base as a property."""
    from helpers import SEED_ENV, base_seed, derived_seed

    base, drawn = request.node.stash.setdefault(_SEEDS_DRAWN, (base_seed(), {}))
    request.node.user_properties.append((SEED_ENV, base))

    def draw(today: int) -> int:
        drawn[today] = derived_seed(request.node.name, today, base)
        return drawn[today]

    return draw


def _seed_report(item) -> str | None:
    """The failure report's line on seeds: the MOK_TEST_SEED value that draws the test's inputs again, or None for a
    test that drew none through helpers' seeds."""
    import sys

    helpers = sys.modules.get("helpers")  # not imported: no test drew a seed through it
    if helpers is None:
        return None
    module = getattr(getattr(item, "module", None), "__name__", None)
    if module in helpers.MODULE_SEEDS:
        value, what = helpers.MODULE_SEEDS[module], f"the seed of {module}'s inputs"
    elif _SEEDS_DRAWN in item.stash:
        value, drawn = item.stash[_SEEDS_DRAWN]
        pairs = ", ".join(f"{today} -> {s}" for today, s in drawn.items()) or "none yet"
        what = f"the base of the test's fixed seeds (drawn: {pairs})"
    else:
        return None
    env = helpers.SEED_ENV
    return f"{env}={value}: {what}. Again: {env}={value} python -m pytest '{item.nodeid}'"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and (line := _seed_report(item)):
        report.sections.append(("MOK_TEST_SEED", line))
    return report


@pytest.fixture
def cpu_devices():
    devs = jax.devices("cpu")
    if len(devs) < 8:
        pytest.skip("needs 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax import)")
    return devs
