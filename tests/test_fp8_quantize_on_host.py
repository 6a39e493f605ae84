"""The FP8 grouped FFN's row quantiser (fp8_quantize_rows_kernel) run on the CPU from its CUDA source, against
mok_jax.fp8.quantize_rows (scripts/lab/fp8_quantize_on_host.py): a check of the kernel's logic where no GPU is lent.
The test of the compiled kernel on the GPU is tests/test_fp8_grouped_ffn_gpu.py."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

LAB = pathlib.Path(__file__).resolve().parent.parent / "scripts/lab/fp8_quantize_on_host.py"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the kernel's source for the host")
def test_row_quantiser_on_the_host_gives_quantize_rows_bits():
    spec = importlib.util.spec_from_file_location("fp8_quantize_on_host", LAB)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    try:
        lab.cuda_include_dir()
    except FileNotFoundError as e:
        pytest.skip(f"no CUDA headers for the host build: {e}")
    assert lab.main(seed=1) == 6  # every case ran; each asserts its bits
