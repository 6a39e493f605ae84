"""Device-synchronised timing of jitted JAX callables.

A sample enqueues ``calls`` back-to-back executions (JAX dispatches asynchronously, so the host
runs ahead of the device), then blocks until the last result is ready; the sample's time is the
wall time over ``calls``. With enough calls per sample the device never idles between executions,
so this is device time per call (host dispatch overhead is hidden whenever it is shorter than one
call). Each sample still pays once for the host getting ahead (the first call's launches, until the
device has a queue) and for the final wait: about 1 ms for a layer's fwd+bwd program of some 180
launches on the H200 machine, so a sample holds at least ``min_calls_per_sample`` calls and lasts
about ``target_sample_ms`` (100 ms keeps that share near 1%). Warm-up calls (compilation,
autotuning, allocation) are excluded. Reported: median, min, max.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax

__all__ = ["Timing", "kernels_unavailable", "time_fn"]


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    samples: int
    calls_per_sample: int

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def untuned_xla_warning(xla_flags: str | None, prog: str = "mok-bench") -> str | None:
    """The warning for XLA_FLAGS that turn XLA's GPU GEMM autotuning off (gpu_tests.sh does, for the tests): the
    `dense` row and the XLA baselines would then run untuned GEMMs (kimi-k2's dense FFN once took 314 ms instead of
    6.4 on an H100), so every "x dense" and speed-up would stand against a handicapped baseline. None otherwise."""
    if "--xla_gpu_autotune_level=0" not in (xla_flags or "").split():
        return None
    return (f"{prog}: warning: XLA_FLAGS has --xla_gpu_autotune_level=0, so the dense row and the XLA baselines "
            "run untuned GEMMs and the ratios against them overstate mok; unset it for numbers to report")


def warn_if_untuned_xla(prog: str) -> None:
    """Print untuned_xla_warning for this process's XLA_FLAGS on stderr, if there is one (before any timing)."""
    if warning := untuned_xla_warning(os.environ.get("XLA_FLAGS"), prog):
        print(warning, file=sys.stderr, flush=True)


def time_fn(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 3,
    samples: int = 20,
    target_sample_ms: float = 100.0,
    max_calls_per_sample: int = 64,
    min_calls_per_sample: int = 3,
) -> Timing:
    """Time ``fn(*args)`` (a jitted callable). Calls per sample are chosen so a sample lasts about
    ``target_sample_ms`` (at least ``min_calls_per_sample``, at most ``max_calls_per_sample``)."""
    out = None
    for _ in range(max(1, warmup)):
        out = fn(*args)
    jax.block_until_ready(out)

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one_ms = (time.perf_counter() - t0) * 1e3
    calls = int(max(1, min(max_calls_per_sample, max(min_calls_per_sample, target_sample_ms // max(one_ms, 1e-3)))))

    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return Timing(statistics.median(times), min(times), max(times), samples, calls)


def kernels_unavailable() -> str | None:
    """Why the CUDA kernels cannot be timed here (no CUDA GPU, or no native library), in one line; None when
    they can. The kernel benchmarks print it and exit instead of timing nothing."""
    from mok_jax import _native

    platforms = sorted({d.platform for d in jax.devices()})
    if "gpu" not in platforms:
        return f"needs a CUDA GPU; this machine has only {', '.join(platforms)} devices, so nothing was timed"
    if _native.library() is None:
        return _native.native_status()
    return None
