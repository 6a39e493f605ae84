"""The GPU scripts, checked without a GPU: their lists against the tests they name, and their warnings."""

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_tests_parts_hold_every_one_gpu_test_file_once():
    """scripts/gpu_tests.sh runs the one-GPU suite in parts: a new *_gpu.py file must be in exactly one part."""
    text = (REPO / "scripts" / "gpu_tests.sh").read_text()
    body = text[text.index('case $part in'):text.index("esac")]
    named = re.findall(r"\b(test_\w+_gpu)\b", body)
    on_disk = sorted(p.stem for p in (REPO / "tests").glob("test_*_gpu.py"))
    assert sorted(named) == on_disk, f"parts: {sorted(named)}; files: {on_disk}"


def test_ab_scripts_warn_when_xla_autotuning_is_off():
    """ab_backward.py and ab_forward.py time the dense FFN beside each tree: run on their own (not through
    gpu_backward_ab.sh, which drops the flag) under gpu_tests.sh's XLA_FLAGS, they say so before timing."""
    env = {**os.environ, "XLA_FLAGS": "--xla_gpu_autotune_level=0", "PYTHONPATH": str(REPO),
           "JAX_PLATFORMS": "cpu"}
    for script in ("ab_backward.py", "ab_forward.py"):
        run = subprocess.run([sys.executable, str(REPO / "scripts" / script)], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert f"{script}: warning: XLA_FLAGS has --xla_gpu_autotune_level=0" in run.stderr, run.stderr
