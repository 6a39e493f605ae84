"""Seeds a failed GPU run can reproduce (issue 35, item 5; tests/helpers.py and conftest.py): with MOK_TEST_SEED
unset a test draws the seeds it was written with, with it set others of its own, a module of fresh inputs takes the
variable's value, and a failing test's report names the value that draws its inputs again."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import MODULE_SEEDS, SEED_ENV, base_seed, derived_seed, module_seed, random_problem

import mok_jax as mj

TESTS = pathlib.Path(__file__).resolve().parent
SUBPROCESS_TIMEOUT_S = 240


def test_unset_gives_the_written_seeds_and_a_set_base_others(monkeypatch):
    name = "test_dispatch_combine_bitwise[ep2-uniform-300-8]"
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert base_seed() == 0
    assert [derived_seed(name, s) for s in (0, 7, 300, 2**31 - 1)] == [0, 7, 300, 2**31 - 1]
    # the same keys, so the same inputs, as the seed written in the test
    want = random_problem(mj.load_model("ci"), 8, seed=30)
    got = random_problem(mj.load_model("ci"), 8, seed=derived_seed("test_reference_layer_on_gpu_matches_cpu", 30))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    monkeypatch.setenv(SEED_ENV, "12345")
    assert base_seed() == 12345
    mixed = derived_seed(name, 300)
    assert mixed != 300 and 0 <= mixed < 2**31 and mixed == derived_seed(name, 300), mixed
    assert derived_seed(name, 7) not in (7, mixed), "each written seed gets its own"
    assert derived_seed(name.replace("ep2", "ep4"), 300) != mixed, "each test (parameters included) gets its own"
    assert derived_seed(name, 300, base=54321) != mixed and derived_seed(name, 300, base=0) == 300
    monkeypatch.setenv(SEED_ENV, "0")
    assert derived_seed(name, 300) == 300, "MOK_TEST_SEED=0 is the written seeds, as unset"
    for bad, why in (("abc", "not an integer"), ("-1", "outside"), (str(2**32), "outside")):
        monkeypatch.setenv(SEED_ENV, bad)
        with pytest.raises(ValueError, match=f"{SEED_ENV}.*{why}"):
            base_seed()


def test_a_module_of_fresh_inputs_takes_the_variable(monkeypatch, capsys):
    monkeypatch.setattr("helpers.MODULE_SEEDS", dict(MODULE_SEEDS))
    import helpers

    monkeypatch.setenv(SEED_ENV, "4242")
    assert module_seed("test_fresh_x") == 4242 and helpers.MODULE_SEEDS["test_fresh_x"] == 4242
    assert "test_fresh_x: seed 4242" in capsys.readouterr().out
    monkeypatch.delenv(SEED_ENV)
    fresh = module_seed("test_fresh_y")  # a new one each run, as before
    assert 0 <= fresh < 2**32 and helpers.MODULE_SEEDS["test_fresh_y"] == fresh
    assert f"test_fresh_y: seed {fresh}" in capsys.readouterr().out


_FIXED = '''
def test_fixed_fails(seed):
    print("drew", seed(300), seed(7))
    assert False, "on purpose"


def test_fixed_passes(seed):
    seed(300)


def test_no_seed_fails():
    assert False, "on purpose"
'''

_FRESH = '''
from helpers import module_seed

_SEED = module_seed(__name__)


def test_fresh_fails():
    assert False, "on purpose"
'''


def _run_failing_tests(tmp_path, seed: str | None) -> str:
    """pytest, with this directory's conftest.py as a plugin, on a test file that draws fixed seeds through the
    ``seed`` fixture and one of fresh inputs (module_seed); some of their tests fail on purpose."""
    (tmp_path / "test_fixed_seeds.py").write_text(_FIXED)
    (tmp_path / "test_fresh_seeds.py").write_text(_FRESH)
    env = {k: v for k, v in os.environ.items()
           if k not in (SEED_ENV, "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST", "MOK_TEST_JIT_CACHE_ROOT",
                        "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(TESTS) + os.pathsep + env.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu",
               MOK_TEST_JIT_CACHE="0", **({SEED_ENV: seed} if seed is not None else {}))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                        "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert "3 failed, 1 passed" in r.stdout, (r.returncode, r.stdout[-4000:], r.stderr[-4000:])
    return r.stdout


def _section(out: str, test: str) -> str:
    """The failure block of ``test`` in pytest's output."""
    start = out.index(f"_ {test} _")
    end = min((i for i in (out.find("\n___", start + 1), out.find("short test summary", start)) if i > 0),
              default=len(out))
    return out[start:end]


def test_a_failing_tests_report_names_its_seed(tmp_path):
    """Unset: the fixed-seed test's report names MOK_TEST_SEED=0 and the written seeds it drew, the fresh module's
    this run's fresh seed. Set: both name the variable's value and the seeds drawn from it. A test that drew no seed
    gets no such line."""
    out = _run_failing_tests(tmp_path, None)
    fixed = _section(out, "test_fixed_fails")
    assert "MOK_TEST_SEED=0: the base of the test's fixed seeds (drawn: 300 -> 300, 7 -> 7)" in fixed, fixed
    assert "Again: MOK_TEST_SEED=0 python -m pytest 'test_fixed_seeds.py::test_fixed_fails'" in fixed, fixed
    fresh = _section(out, "test_fresh_fails")
    value = int(fresh.split("MOK_TEST_SEED=")[1].split(":")[0])  # this run's fresh seed
    assert 0 <= value < 2**32 and f"MOK_TEST_SEED={value}: the seed of test_fresh_seeds's inputs" in fresh, fresh
    assert "MOK_TEST_SEED" not in _section(out, "test_no_seed_fails")

    out = _run_failing_tests(tmp_path, "777")
    a, b = derived_seed("test_fixed_fails", 300, base=777), derived_seed("test_fixed_fails", 7, base=777)
    fixed = _section(out, "test_fixed_fails")
    assert f"MOK_TEST_SEED=777: the base of the test's fixed seeds (drawn: 300 -> {a}, 7 -> {b})" in fixed, fixed
    assert f"drew {a} {b}" in fixed, fixed
    fresh = _section(out, "test_fresh_fails")
    assert "MOK_TEST_SEED=777: the seed of test_fresh_seeds's inputs" in fresh, fresh
    assert "Again: MOK_TEST_SEED=777 python -m pytest 'test_fresh_seeds.py::test_fresh_fails'" in fresh, fresh
