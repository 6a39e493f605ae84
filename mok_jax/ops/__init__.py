"""One thin Python function per FFI target of the native library (CUDA only).

Each function checks shapes and dtypes at trace time with errors that name the argument, then
calls ``jax.ffi.ffi_call``. None of them falls back to another implementation: on a machine
without the kernels they raise ``NativeLibraryUnavailable``.
"""

from mok_jax.ops.comm import DispatchLayout, combine, dispatch
from mok_jax.ops.grouped_ffn import Fp8GroupedFfnOutput, fp8_grouped_ffn, grouped_ffn
from mok_jax.ops.moe_backward import (ExpertsBackwardEpOutput, ExpertsBackwardOutput, experts_backward,
                                      experts_backward_ep)
from mok_jax.ops.moe_forward import moe_forward
from mok_jax.ops.routing import expert_counts, expert_layout

__all__ = ["DispatchLayout", "ExpertsBackwardEpOutput", "ExpertsBackwardOutput", "Fp8GroupedFfnOutput", "combine",
           "dispatch", "expert_counts", "expert_layout", "experts_backward", "experts_backward_ep", "fp8_grouped_ffn",
           "grouped_ffn", "moe_forward"]
