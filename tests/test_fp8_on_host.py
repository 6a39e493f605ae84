"""The FP8 grouped FFN's data movement run on the CPU from its CUDA source (scripts/lab/fp8_on_host.py): the row
quantiser (fp8_quantize_rows_kernel) against mok_jax.fp8.quantize_rows, and the FP8 tile's two epilogues
(store_bf16_half, store_swiglu_quant) against their values placed by row and column; a check of the code's logic
where no GPU is lent. The tests of the compiled kernels on the GPU are tests/test_fp8_grouped_ffn_gpu.py and
tests/test_moe_fp8_gpu.py."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

LAB = pathlib.Path(__file__).resolve().parent.parent / "scripts/lab/fp8_on_host.py"


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the kernels' source for the host")
def test_fp8_quantiser_and_epilogues_on_the_host():
    spec = importlib.util.spec_from_file_location("fp8_on_host", LAB)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    try:
        lab.cuda_include_dir()
    except FileNotFoundError as e:
        pytest.skip(f"no CUDA headers for the host build: {e}")
    assert lab.main(seed=1) == 12  # every case ran; each asserts its outputs
