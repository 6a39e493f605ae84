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


def test_ab_tree_refuses_a_bad_name_or_revision_before_building():
    """scripts/ab_tree.sh NAME REV builds a tree for gpu_backward_ab.sh under ab/NAME: a NAME that is a path or a REV
    this repository lacks is refused at once (exit 2, naming it), before a worktree or a build exists."""
    script = str(REPO / "scripts" / "ab_tree.sh")
    for args, said in ((["x/y", "HEAD"], "NAME must be a plain directory name, got 'x/y'"),
                       (["t", "no-such-rev-of-mok"], "not a revision of this repository: no-such-rev-of-mok"),
                       (["t"], "usage: bash scripts/ab_tree.sh NAME REV")):
        run = subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and said in run.stderr, (args, run.returncode, run.stderr)
    assert not (REPO / "ab" / "t").exists()
