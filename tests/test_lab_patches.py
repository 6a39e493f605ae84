"""The lab patches (scripts/lab/*.patch: kernel changes waiting for a GPU run, or measured and not merged) still apply
to this tree, so that the run their docs ask for can start from `git apply`."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "scripts" / "lab").glob("*.patch"))


def test_there_are_lab_patches():
    assert PATCHES, "scripts/lab holds no .patch: drop this test file with the last patch"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_lab_patch_applies(patch):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of the repository")
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{patch.name} no longer applies:\n{r.stderr}"
