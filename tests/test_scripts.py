"""The GPU scripts' lists against the tests they name (no GPU needed)."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_tests_parts_hold_every_one_gpu_test_file_once():
    """scripts/gpu_tests.sh runs the one-GPU suite in parts: a new *_gpu.py file must be in exactly one part."""
    text = (REPO / "scripts" / "gpu_tests.sh").read_text()
    body = text[text.index('case $part in'):text.index("esac")]
    named = re.findall(r"\b(test_\w+_gpu)\b", body)
    on_disk = sorted(p.stem for p in (REPO / "tests").glob("test_*_gpu.py"))
    assert sorted(named) == on_disk, f"parts: {sorted(named)}; files: {on_disk}"
