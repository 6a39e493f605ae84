"""mok-bench: how fast the MoE layer runs here, against what a JAX user would write instead.

For every (model, tokens per GPU, pass, implementation): warm up, time many calls with device
synchronisation (``mok_jax.bench.timing.time_fn``), and report median/min/max, TFLOP/s, the fraction
of the compute roofline and of the NVLink communication floor (the H200's figures, on GPU only: a CPU
run reports neither unless --peak-tflops / --nvlink-gbps give them), and the ratio to a baseline
measured in the same process (accounting: ``mok_jax.bench.accounting``; implementations:
``mok_jax.bench.baselines``). Writes a table, and on request a JSON report, a plot and a profile.
``mok`` rows run the KernelConfig the knob options give (else the one mok_jax.tuning resolves) and record
it with their memory; ``--tune`` times mok over a grid of knobs and writes the device's tuned table
(``mok_jax.bench.tune``).

``--dtype fp8`` also times ``mok-fp8``, the layer with FP8 routed experts (MoEConfig(precision="fp8")), right
after the bf16 ``mok`` (added when --impl lacks it) in the same process, with the same inputs and kernel knobs;
its row carries the ratio to that mok ("vs bf16"). Inputs, weights and the other implementations stay bf16. Its
forward takes the E4M3 weights quantised once outside the timed call (as a user quantises once per optimizer
step); its fwd+bwd quantises them inside the step, so that cost is timed. Its compute floor counts the forward's
routed GEMMs at the FP8 dense peak and the rest (shared expert, backward) at the bf16 peak
(``accounting.compute_floor_ms``), and its communication floor its E4M3 dispatch rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from typing import Any

from mok_jax.bench import accounting as acc
from mok_jax.bench.report import eprint
from mok_jax.bench.routing import ROUTINGS

__all__ = ["BenchOptions", "Unavailable", "UsageError", "build_parser", "implementations", "kernel_settings", "main",
           "parse_args", "parse_experts_per_gpu", "parse_tokens", "run"]

# Defaults. The rooflines are measurements on the H200 machines, used on GPU only (a CPU run has no roofline
# unless one is given).
# dense GEMM 8192^3 on one H200: cuBLAS bf16, torch._scaled_mm e4m3 (HARDWARE.md)
PEAK_TFLOPS = {"bf16": 805.0, "fp8": 1477.0}
NVLINK_GBPS = 394.0  # peer copy GPU0 -> GPU1 of the 2-GPU H200 machine (NV18), one direction
GPU_DEFAULTS = {"model": "kimi-k2", "tokens": 2048, "ep_mode": "ep64-slice", "impls": ("mok", "xla", "xla-capacity")}
ONE_GPU_EXPERTS = "E/32"  # default --experts-per-gpu on a machine with one GPU (and no --ep-mode given)
CPU_DEFAULTS = {"model": "ci", "tokens": 32, "ep_mode": "full", "impls": ("reference", "xla", "xla-capacity")}
# ms a timed sample lasts (at least 3 calls, mok_jax.bench.timing), and the most calls in it. On CPU shorter: its
# times are indicative only, and with 64 calls of an EP program in flight the 8 host devices' collectives abort
# (XLA's CPU rendezvous times out waiting for threads the queued calls hold).
TARGET_SAMPLE_MS = {"gpu": 100.0, "cpu": 20.0}
MAX_CALLS_PER_SAMPLE = {"gpu": 64, "cpu": 16}
CPU_DEVICES = 8  # host devices the CLI asks for on a CPU-only machine (unless XLA_FLAGS sets a count)
IMPLEMENTATIONS = ("xla", "xla-capacity", "ragged", "tokamax", "reference", "mok", "mok-ring", "mok-keep", "mok-fp8")
# the megakernel: kernel knobs apply (mok-ring: MoEConfig(keep="ring"), mok-keep: MoEConfig(keep="everything"),
# mok-fp8: MoEConfig(precision="fp8"))
MOK_IMPLS = ("mok", "mok-ring", "mok-keep", "mok-fp8")
DTYPES = ("bf16", "fp8")
FP8_IMPL, FP8_REFERENCE = "mok-fp8", "mok"  # --dtype fp8: the FP8 layer, and the bf16 layer it is compared with
CPU_NOTICE = ("CPU NUMBERS: no GPU found, so mok-bench ran the pure-JAX paths on CPU devices; the times below "
              "are CPU times, not GPU performance, and no GPU roofline applies to them.")

EXAMPLES = """\
examples:
  mok-bench                                   # defaults: kimi-k2, ep64-slice, 2048 tokens/GPU (ci model on CPU)
  mok-bench --model bench --pass fwd,fwd+bwd --impl xla,xla-capacity --json out.json
  mok-bench glm-5 --tokens 512..16384 --plot sweep.png        # 512, 1024, ..., 16384
  mok-bench kimi-k2 --routing zipf --zipf-s 1.2 --impl xla,xla-capacity --capacity-factor 2
  mok-bench kimi-k2 --profile /tmp/prof       # jax.profiler trace per run (TensorBoard / Perfetto)
  mok-bench bench --devices 1 --experts-per-gpu E/32   # the 2-GPU ep64-slice problem on one GPU
  mok-bench kimi-k2 --impl mok,xla --granularity 512,1024,2048 --comm-sms 16   # a mok granularity sweep
  mok-bench bench --tune --tokens 512..8192   # time mok's knobs, write configs/tuned/<device>/kernel.toml
  mok-bench bench --dtype fp8 --pass fwd,fwd+bwd --impl xla,mok   # mok-fp8 beside mok, ratio in 'vs bf16'
"""


class UsageError(ValueError):
    """A bad option: main() prints it and returns 2."""


def parse_tokens(text: str) -> tuple[int, ...]:
    """'2048' | '512,1024,4096' | '512..16384' (doubling from the first to the last) | mixes of those."""
    out: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            if ".." in part:
                lo, hi = (int(v) for v in part.split(".."))
                if lo <= 0 or hi < lo:
                    raise ValueError
                v = lo
                while v <= hi:
                    out.append(v)
                    v *= 2
            else:
                out.append(int(part))
        except ValueError:
            raise UsageError(f"--tokens: cannot read {part!r}; give N, N1,N2,... or LO..HI (doubling)") from None
    if not out or min(out) <= 0:
        raise UsageError(f"--tokens must be positive integers, got {text!r}")
    return tuple(dict.fromkeys(out))


def parse_experts_per_gpu(text: str) -> str:
    """'12' | 'E/32' (the model's experts over 32), normalised; UsageError naming --experts-per-gpu otherwise."""
    try:
        return acc.parse_experts_per_gpu(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        out = tuple(dict.fromkeys(int(v) for v in str(text).split(",")))
    except ValueError:
        raise UsageError(f"{option}: cannot read {text!r}; give integers, comma-separated") from None
    return out


def _names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise UsageError(f"empty list {text!r}")
    return names


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """The parsed command line. None means "the platform's default" (GPU_DEFAULTS / CPU_DEFAULTS)."""

    models: tuple[str, ...] | None = None
    tokens: tuple[int, ...] | None = None
    ep_mode: str | None = None
    dtype: str = "bf16"
    passes: tuple[str, ...] = ("fwd",)
    impls: tuple[str, ...] | None = None
    baseline: str | None = None
    routing: str = "uniform"
    zipf_s: float = 1.2
    seed: int = 0
    capacity_factor: float = 1.25
    warmup: int = 3
    samples: int = 20
    target_sample_ms: float | None = None  # None: TARGET_SAMPLE_MS of the platform
    ragged_samples: int = 3
    experts_per_gpu: str | None = None  # 'N' or 'E/d'; None: the split of ep_mode
    granularity: tuple[int, ...] | None = None  # mok knobs; None: mok_jax.tuning picks
    comm_sms: int | None = None
    ring_slots: int | None = None
    dispatch: str | None = None
    combine: str | None = None
    tune: bool = False
    peak_tflops: float | None = None
    peak_tflops_fp8: float | None = None
    nvlink_gbps: float | None = None
    devices: int | None = None
    reference_max_gb: float = 8.0
    time_budget_s: float | None = None
    json: str | None = None
    plot: str | None = None
    profile: str | None = None
    progress: bool = True
    quiet: bool = False
    markdown: bool = False
    from_json: tuple[str, ...] | None = None

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise UsageError(msg)

        need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        need(self.dtype == "fp8" or FP8_IMPL not in (*(self.impls or ()), self.baseline),
             f"--impl/--baseline {FP8_IMPL} is the FP8 layer: give --dtype fp8 (which times it beside the bf16 "
             f"{FP8_REFERENCE})")
        need(self.ep_mode in (None, *acc.EP_MODES), f"--ep-mode must be one of {', '.join(acc.EP_MODES)}")
        for p in self.passes:
            need(p in acc.PASSES, f"--pass: {p!r} is not one of {', '.join(acc.PASSES)}")
        for i in self.impls or ():
            need(i in IMPLEMENTATIONS, f"--impl: {i!r} is not one of {', '.join(IMPLEMENTATIONS)}")
        need(self.baseline is None or self.baseline in IMPLEMENTATIONS,
             f"--baseline must be one of {', '.join(IMPLEMENTATIONS)}")
        need(self.routing in ROUTINGS, f"--routing must be one of {', '.join(ROUTINGS)}")
        need(self.zipf_s >= 0, "--zipf-s must be >= 0")
        need(self.capacity_factor > 0, "--capacity-factor must be > 0")
        need(self.warmup >= 1 and self.samples >= 1 and self.ragged_samples >= 1,
             "--warmup, --samples and --ragged-samples must be >= 1")
        need(self.target_sample_ms is None or self.target_sample_ms > 0, "--target-sample-ms must be > 0")
        need(self.peak_tflops is None or self.peak_tflops > 0, "--peak-tflops must be > 0")
        need(self.peak_tflops_fp8 is None or self.peak_tflops_fp8 > 0, "--peak-tflops-fp8 must be > 0")
        need(self.nvlink_gbps is None or self.nvlink_gbps > 0, "--nvlink-gbps must be > 0")
        need(self.devices is None or self.devices >= 1, "--devices must be >= 1")
        need(self.time_budget_s is None or self.time_budget_s > 0, "--time-budget must be > 0")
        if self.experts_per_gpu is not None:
            object.__setattr__(self, "experts_per_gpu", parse_experts_per_gpu(self.experts_per_gpu))
        self._check_knobs()
        if self.tune:
            set_knobs = [o for o, v in (("--granularity", self.granularity), ("--comm-sms", self.comm_sms),
                                        ("--ring-slots", self.ring_slots), ("--dispatch", self.dispatch),
                                        ("--combine", self.combine)) if v is not None]
            need(not set_knobs, f"--tune sweeps the kernel knobs itself; drop {', '.join(set_knobs)}")
            need(self.impls in (None, ("mok",)), "--tune times implementation mok only; drop --impl")
            need(self.baseline in (None, "mok"), "--tune times implementation mok only; drop --baseline")
            need(self.passes == ("fwd",), "--tune times the forward only (the knobs are the forward megakernel's); "
                 "drop --pass")
            need(self.dtype == "bf16", "--tune times the bf16 mok (its table is the bf16 kernel's); drop --dtype fp8")

    def _check_knobs(self) -> None:
        """Each knob option as mok_jax.KernelConfig checks it, the error naming the option."""
        from mok_jax.config import KernelConfig

        checks = [("--granularity", {"granularity": g}) for g in self.granularity or ()]
        if self.granularity is not None and not self.granularity:
            raise UsageError("--granularity: give at least one value")
        if self.comm_sms is not None:
            checks.append(("--comm-sms", {"comm_sms_fwd": self.comm_sms, "comm_sms_bwd": self.comm_sms}))
        for option, field in (("--ring-slots", "ring_slots"), ("--dispatch", "dispatch"), ("--combine", "combine")):
            if getattr(self, field) is not None:
                checks.append((option, {field: getattr(self, field)}))
        for option, knobs in checks:
            try:
                KernelConfig(**knobs)
            except (ValueError, TypeError) as e:
                raise UsageError(f"{option}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok-bench", description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model name (configs/models), TOML path, comma list, or 'bench' for "
                   f"the four benchmark models (default: {GPU_DEFAULTS['model']}; {CPU_DEFAULTS['model']} on CPU)")
    w = p.add_argument_group("what to run")
    w.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="same as the positional MODEL")
    w.add_argument("-t", "--tokens", help=f"tokens per GPU: N, N1,N2,... or LO..HI doubling (default "
                   f"{GPU_DEFAULTS['tokens']}; {CPU_DEFAULTS['tokens']} on CPU)")
    w.add_argument("--ep-mode", choices=acc.EP_MODES, help="full: the model's experts split over the GPUs; "
                   "ep64-slice: E/64 experts per GPU (default ep64-slice on GPU, full on CPU; on one GPU without "
                   "--ep-mode the default is --experts-per-gpu E/32, the whole 2-GPU problem)")
    w.add_argument("--dtype", default="bf16", choices=DTYPES, help=f"bf16 (default), or fp8: also time {FP8_IMPL} "
                   f"(MoEConfig(precision='fp8'): the routed experts' forward in FP8 E4M3) right after the bf16 "
                   f"{FP8_REFERENCE} (added if --impl lacks it), its ratio to it in 'vs bf16'; all else stays bf16. "
                   "Its fwd takes E4M3 weights quantised once outside the timed call, its fwd+bwd quantises in the "
                   "step. H and I must be multiples of 128")
    w.add_argument("--pass", dest="passes", default="fwd", help="fwd, fwd+bwd or both: 'fwd,fwd+bwd'")
    w.add_argument("--impl", help=f"comma list of {', '.join(IMPLEMENTATIONS)} (default: "
                   f"{','.join(GPU_DEFAULTS['impls'])} on GPU, mok only once it is available; "
                   f"{','.join(CPU_DEFAULTS['impls'])} on CPU; {FP8_IMPL} only with --dtype fp8, which adds it)")
    w.add_argument("--baseline", help="implementation the others are compared with (default: xla if run, else "
                   "the first)")
    w.add_argument("--routing", default="uniform", choices=ROUTINGS, help="uniform (balanced), zipf or one-expert")
    w.add_argument("--zipf-s", type=float, default=1.2, help="zipf exponent s: expert popularity ~ 1/rank**s")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--capacity-factor", type=float, default=1.25,
                   help="xla-capacity: slots per (source rank, expert) = ceil(cf * T*k / E)")
    w.add_argument("--devices", type=int, help="EP degree: use the first N devices (default: all)")
    w.add_argument("--experts-per-gpu", metavar="N|E/d", help="routed experts each GPU holds, overriding the split "
                   "of --ep-mode: a count, or E/d for the model's E experts over d (E/32 on one GPU is the 2-GPU "
                   "ep64-slice problem)")
    k = p.add_argument_group("mok kernel knobs (mok_jax.KernelConfig; unset: the tuned table or the heuristic, "
                             "mok_jax.tuning; other implementations ignore them)")
    k.add_argument("--granularity", help="tokens per microbatch: a multiple of 64 in 512..32768, or a comma list "
                   "to sweep (mok runs once per value)")
    k.add_argument("--comm-sms", type=int, help="SMs moving rows at once (forward and backward)")
    k.add_argument("--ring-slots", type=int, help="microbatch slots of the receive ring")
    k.add_argument("--dispatch", choices=("pull", "push"), help="dispatch direction")
    k.add_argument("--combine", choices=("push", "pull"), help="combine direction")
    k.add_argument("--tune", action="store_true", help="time mok over granularity x comm SMs x ring slots per model "
                   "and token count, and write the fastest to configs/tuned/<device>/kernel.toml (GPU only)")
    t = p.add_argument_group("timing and rooflines")
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--samples", type=int, default=20, help="timed samples (each several calls)")
    t.add_argument("--target-sample-ms", type=float, help="calls per sample chosen to last this long (default "
                   f"{TARGET_SAMPLE_MS['gpu']:g} on GPU, {TARGET_SAMPLE_MS['cpu']:g} on CPU)")
    t.add_argument("--ragged-samples", type=int, default=3, help="samples for 'ragged' (slow: 1 call each)")
    t.add_argument("--peak-tflops", type=float, help=f"compute roofline, bf16 (default on GPU: "
                   f"{PEAK_TFLOPS['bf16']:g}, one H200; on CPU: none)")
    t.add_argument("--peak-tflops-fp8", type=float, help=f"the FP8 dense peak that {FP8_IMPL}'s forward routed "
                   f"GEMMs are floored at, the rest at --peak-tflops (default on GPU: {PEAK_TFLOPS['fp8']:g}, one "
                   "H200; on CPU: none)")
    t.add_argument("--nvlink-gbps", type=float, help=f"GB/s per GPU per direction of the communication floor "
                   f"(default on GPU: {NVLINK_GBPS:g}, two H200s; on CPU: none)")
    t.add_argument("--reference-max-gb", type=float, default=8.0,
                   help="on GPU, skip 'reference' when its dense activations exceed this")
    t.add_argument("--time-budget", dest="time_budget_s", type=float,
                   help="seconds; runs not started by then are recorded as skipped")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write every figure, device, versions, git commit, config")
    o.add_argument("--plot", metavar="FILE.png", help="time and TFLOP/s against tokens per GPU")
    o.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of each run under DIR/<run>/")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    o.add_argument("-q", "--quiet", action="store_true", help="no per-run lines")
    o.add_argument("--markdown", action="store_true", help="print the table as markdown (for the README)")
    o.add_argument("--from-json", nargs="+", metavar="FILE", help="run nothing: print the table of saved "
                   "reports (and --plot them)")
    o.add_argument("--list-models", action="store_true", help="print the known model shapes and exit")
    return p


def parse_args(argv: list[str] | None = None) -> BenchOptions | None:
    """BenchOptions from a command line (None for --list-models, which prints and returns).

    Raises UsageError (ValueError) for a bad value; argparse's own errors exit with status 2."""
    ns = build_parser().parse_args(argv)
    if ns.list_models:
        _print_models()
        return None
    if ns.model and ns.model_opt:
        raise UsageError("give the model once: positional MODEL or --model")
    return BenchOptions(
        models=_names(ns.model or ns.model_opt), tokens=parse_tokens(ns.tokens) if ns.tokens else None,
        ep_mode=ns.ep_mode, dtype=ns.dtype, passes=_names(ns.passes), impls=_names(ns.impl), baseline=ns.baseline,
        routing=ns.routing, zipf_s=ns.zipf_s, seed=ns.seed, capacity_factor=ns.capacity_factor, warmup=ns.warmup,
        samples=ns.samples, target_sample_ms=ns.target_sample_ms, ragged_samples=ns.ragged_samples,
        experts_per_gpu=ns.experts_per_gpu, granularity=_ints(ns.granularity, "--granularity"),
        comm_sms=ns.comm_sms, ring_slots=ns.ring_slots, dispatch=ns.dispatch, combine=ns.combine, tune=ns.tune,
        peak_tflops=ns.peak_tflops, peak_tflops_fp8=ns.peak_tflops_fp8, nvlink_gbps=ns.nvlink_gbps, devices=ns.devices,
        reference_max_gb=ns.reference_max_gb, time_budget_s=ns.time_budget_s, json=ns.json, plot=ns.plot,
        profile=ns.profile, progress=ns.progress, quiet=ns.quiet, markdown=ns.markdown,
        from_json=tuple(ns.from_json) if ns.from_json else None)


def _print_models() -> None:
    from mok_jax.config import list_models, load_model

    bench = set(list_models(tag="bench"))
    print(f"{'model':<20} {'E':>4} {'k':>3} {'H':>6} {'I':>6} {'Is':>6}  tags")
    for name in list_models():
        m = load_model(name)
        tags = ",".join(m.tags) + (" (in 'bench')" if name in bench else "")
        print(f"{name:<20} {m.num_experts:>4} {m.top_k:>3} {m.hidden_size:>6} {m.intermediate_size:>6} "
              f"{m.shared_size:>6}  {tags}")


def _resolve_models(names: tuple[str, ...]):
    from mok_jax.config import list_models, load_model

    out = []
    for name in names:
        for n in (list_models(tag="bench") if name == "bench" else [name]):
            out.append(load_model(n))
    return out


def _ask_for_cpu_devices() -> None:
    """On a CPU-only machine, run EP over CPU_DEVICES host devices (unless XLA_FLAGS already sets a count)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    except RuntimeError:  # backends already initialised (mok-bench called in-process): keep what exists
        pass


# ----------------------------------------------------------------------------------------------- running


class Unavailable(RuntimeError):
    """An implementation asked for by name cannot run here (main() prints it and returns 2)."""


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise _Interrupted(f"stopped by signal {signum}")


def _init_weights(shape: acc.BenchShape, mesh, dtype, seed: int):
    """Random routed (sharded over ep) and shared (replicated) weights, made on the devices."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mok_jax.weights import MoEWeights

    E, H, I, Is = shape.total_experts, shape.hidden_size, shape.intermediate_size, shape.shared_size
    routed, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())

    def make(key):
        k = jax.random.split(key, 4)
        normal = lambda key, s, fan_in: jax.random.normal(key, s, dtype) * jax.numpy.asarray(fan_in**-0.5, dtype)
        return MoEWeights(normal(k[0], (E, H, 2 * I), H), normal(k[1], (E, I, H), I),
                          normal(k[2], (H, 2 * Is), H) if Is else None, normal(k[3], (Is, H), Is) if Is else None)

    out = MoEWeights(routed, routed, rep if Is else None, rep if Is else None)
    return jax.jit(make, out_shardings=out)(jax.random.key(seed))


def _routing(shape: acc.BenchShape, tokens: int, opts: BenchOptions):
    """(topk_idx, topk_weight) as numpy arrays, and their Traffic."""
    from mok_jax.bench.routing import make_routing

    idx, w = make_routing(opts.routing, num_ranks=shape.num_gpus, tokens_per_rank=tokens,
                          num_experts=shape.total_experts, top_k=shape.top_k, seed=opts.seed, zipf_s=opts.zipf_s)
    return (idx, w), acc.routing_traffic(idx, shape.num_gpus, shape.experts_per_gpu)


def _inputs(shape: acc.BenchShape, tokens: int, routing, mesh, dtype, seed: int):
    """(x, topk_idx, topk_weight, dy) on the devices, sharded over ep."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    tok = NamedSharding(mesh, P("ep"))
    kx, kdy = jax.random.split(jax.random.key(seed + 1))
    normal = jax.jit(lambda key: jax.random.normal(key, (shape.num_gpus * tokens, shape.hidden_size), dtype),
                     out_shardings=tok)
    return normal(kx), jax.device_put(routing[0], tok), jax.device_put(routing[1], tok), normal(kdy)


def _step(fn, pass_: str, *, fp8_weights: bool = False):
    """What one timed call runs: fn itself for fwd; for fwd+bwd the gradient of sum(y * dy) with respect to
    x, topk_weight and the weights (fixed random dy). ``fp8_weights`` (mok-fp8's fwd): the step takes the E4M3
    weights as a sixth argument, made outside it; its fwd+bwd passes none, so the layer quantises inside."""
    if pass_ == "fwd" and fp8_weights:
        return lambda x, idx, w, W, dy, W8: fn(x, idx, w, W, fp8_weights=W8)
    if pass_ == "fwd":
        return lambda x, idx, w, W, dy: fn(x, idx, w, W)
    import jax
    import jax.numpy as jnp

    def loss(x, idx, w, W, dy):
        y, _ = fn(x, idx, w, W)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 2, 3)))


def _precision(impl: str) -> str:
    """What the routed experts' forward of ``impl`` runs in (the record's dtype)."""
    return "fp8" if impl == FP8_IMPL else "bf16"


def _compute_floor(shape: acc.BenchShape, tokens: int, pass_: str, impl: str, peaks: dict) -> float | None:
    """The compute floor of ``impl`` at ``peaks`` ({"bf16", "fp8"} TFLOP/s, None where not known: CPU)."""
    precision = _precision(impl)
    if peaks["bf16"] is None or peaks[precision] is None:
        return None
    return acc.compute_floor_ms(shape, tokens, pass_, peak_tflops=peaks["bf16"], precision=precision,
                                fp8_peak_tflops=peaks["fp8"])


def _record(shape: acc.BenchShape, tokens: int, pass_: str, impl: str, opts: BenchOptions, traffic: acc.Traffic,
            peaks: dict, nvlink_gbps: float | None) -> dict:
    """A result record with everything known before timing (the accounting). A roofline of None (CPU) leaves its
    floor None."""
    from mok_jax.bench.report import RESULT_KEYS

    r: dict[str, Any] = dict.fromkeys(RESULT_KEYS)
    d = shape.as_dict()
    r.update({k: d[k] for k in ("model", "ep_mode", "num_gpus", "experts_per_gpu", "total_experts", "top_k",
                                "hidden_size", "intermediate_size", "shared_size")})
    precision = _precision(impl)
    r.update(tokens_per_gpu=tokens, dtype=precision, routing=opts.routing, seed=opts.seed, impl=impl,
             status="pending", zipf_s=opts.zipf_s if opts.routing == "zipf" else None)
    r["pass"] = pass_
    row_bytes = acc.row_bytes(shape.hidden_size, precision)  # a dispatched row
    flops = acc.flops_per_gpu(shape, tokens, pass_)
    r["flops_per_gpu"] = flops
    r["compute_floor_ms"] = _compute_floor(shape, tokens, pass_, impl, peaks)
    rows = acc.executed_rows_per_gpu(impl, shape, tokens, opts.capacity_factor)
    if rows is not None:
        r["executed_flops_per_gpu"] = acc.executed_flops_per_gpu(shape, tokens, rows, pass_)
        r["padding_overhead"] = r["executed_flops_per_gpu"] / flops
    r["load_imbalance"] = traffic.load_imbalance
    r["dispatch_bytes_per_gpu"] = acc.dispatch_bytes_per_gpu(shape, tokens, precision)
    r["remote_dispatch_bytes_per_gpu_uniform"] = r["dispatch_bytes_per_gpu"] * acc.uniform_remote_fraction(
        shape.num_gpus)
    r["remote_dispatch_bytes_per_gpu"] = float(traffic.sent_slots.mean()) * row_bytes
    r["unique_remote_dispatch_bytes_per_gpu"] = float(traffic.sent_unique.mean()) * row_bytes
    link_bytes = acc.link_bytes_per_row(shape.hidden_size, pass_, precision)  # over the pass's transfers
    to_ms = lambda rows_: rows_ * link_bytes / (nvlink_gbps * 1e9) * 1e3 if nvlink_gbps else None
    r["comm_floor_ms"] = to_ms(traffic.link_rows)
    r["comm_floor_unique_ms"] = to_ms(traffic.link_rows_unique)
    if impl == "xla-capacity":
        r["capacity"] = acc.capacity(tokens, shape.top_k, shape.total_experts, opts.capacity_factor)
    return r


def _fill_timing(r: dict, timing) -> None:
    """The timing figures; the fractions are floor / median (for a bf16 row the compute one is TFLOP/s / peak;
    mok-fp8's floor mixes the two peaks)."""
    r.update(status="ok", median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms,
             samples=timing.samples, calls_per_sample=timing.calls_per_sample)
    r["tflops"] = r["flops_per_gpu"] / (timing.median_ms * 1e-3) / 1e12
    over_median = lambda floor_ms: None if floor_ms is None else floor_ms / timing.median_ms
    r["compute_fraction"] = over_median(r["compute_floor_ms"])
    r["comm_fraction"] = over_median(r["comm_floor_ms"])
    r["comm_fraction_unique"] = over_median(r["comm_floor_unique_ms"])


def _dtype_text(dtype: str) -> str:
    return f"bf16, {FP8_IMPL} with FP8 routed experts" if dtype == "fp8" else dtype


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _reference_gb(shape: acc.BenchShape, tokens: int, pass_: str) -> float:
    """The dense reference's fp32 activations per GPU: every local expert on every received row."""
    rows = shape.total_experts * tokens
    per_row = 2 * shape.intermediate_size * 4 + shape.hidden_size * 4
    return rows * per_row * (1 if pass_ == "fwd" else 2) / 1e9


def kernel_settings(opts: BenchOptions, tokens: int) -> list[dict | None]:
    """The mok knob settings to run at ``tokens`` per GPU: one per --granularity value (with the other knob
    options), the --tune grid, or [None] (no knob option: mok_jax.tuning resolves every knob)."""
    from mok_jax.bench import tune

    if opts.tune:
        return tune.grid(tokens)
    fixed: dict[str, Any] = {}
    if opts.comm_sms is not None:
        fixed.update(comm_sms_fwd=opts.comm_sms, comm_sms_bwd=opts.comm_sms)
    for field in ("ring_slots", "dispatch", "combine"):
        if getattr(opts, field) is not None:
            fixed[field] = getattr(opts, field)
    if opts.granularity:
        return [{**fixed, "granularity": g} for g in opts.granularity]
    return [fixed or None]


def _on_gpu(devices) -> bool:
    return devices[0].platform == "gpu"


def _gpu_kind() -> str | None:
    """The device kind mok_jax.moe resolves kernels for (the first GPU's), None without a GPU."""
    import jax

    return next((d.device_kind for d in jax.devices() if d.platform == "gpu"), None)


def _availability(impl: str, mesh, shape: acc.BenchShape, tokens: int, dtype, kernel=None) -> str | None:
    """None when ``impl`` can run here, else why not (traced with abstract inputs: no device work)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mok_jax.bench import baselines
    from mok_jax.weights import MoEWeights

    if impl not in (*MOK_IMPLS, "reference"):
        return None
    try:
        fn = baselines.build(impl, mesh, kernel=kernel)
        n, E, H, I, Is, k = (shape.num_gpus * tokens, shape.total_experts, shape.hidden_size,
                             shape.intermediate_size, shape.shared_size, shape.top_k)
        tok, rep = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
        sds = lambda s, dt, sh: jax.ShapeDtypeStruct(s, dt, sharding=sh)
        W = MoEWeights(sds((E, H, 2 * I), dtype, tok), sds((E, I, H), dtype, tok),
                       sds((H, 2 * Is), dtype, rep) if Is else None, sds((Is, H), dtype, rep) if Is else None)
        jax.eval_shape(fn, sds((n, H), dtype, tok), sds((n, k), jnp.int32, tok), sds((n, k), jnp.float32, tok), W)
    except Exception as e:  # noqa: BLE001 - the reason is the message
        return _error_text(e)
    return None


def implementations(opts: BenchOptions, defaults: dict) -> tuple[list[str], set[str]]:
    """(the implementations to run, in order, before availability; those asked for by name). --tune: mok only.
    --dtype fp8: FP8_IMPL right after FP8_REFERENCE, each added when --impl lacks it (and then not asked for by
    name: an FP8 layer that cannot run here is dropped with the reason, like a default)."""
    if opts.tune:
        return ["mok"], {"mok"}
    impls = list(opts.impls or defaults["impls"])
    asked = set(opts.impls or ())
    if opts.dtype == "fp8":
        impls = [i for i in impls if i != FP8_IMPL]
        if FP8_REFERENCE not in impls:
            impls.append(FP8_REFERENCE)
        impls.insert(impls.index(FP8_REFERENCE) + 1, FP8_IMPL)
    return impls, asked


def _runnable(opts: BenchOptions, defaults: dict, mesh, shape: acc.BenchShape, tokens: int,
              gpu_kind: str | None) -> tuple[list[str], str, dict[str, str]]:
    """(the implementations that can run here, the baseline first; the baseline; {dropped: why}). One asked for by
    name that cannot run raises Unavailable."""
    import jax.numpy as jnp

    from mok_jax.bench import tune

    impls, asked = implementations(opts, defaults)
    dropped = {}
    for impl in list(impls):
        kernel = None
        if impl in MOK_IMPLS:
            knobs = kernel_settings(opts, tokens)[0]
            kernel = tune.resolve_kernel(tune.problem_key(shape, tokens), knobs, gpu_kind)[0]
        why = _availability(impl, mesh, shape, tokens, jnp.bfloat16, kernel)
        if why is None:
            continue
        if impl in asked:  # asked for by name: say why it cannot run, in one line, and stop
            raise Unavailable(f"implementation {impl!r} is not available here: {why.splitlines()[0]}")
        impls.remove(impl)
        dropped[impl] = why
    if not impls:
        raise Unavailable(f"no implementation can run here: {dropped}")
    baseline = opts.baseline or ("xla" if "xla" in impls else impls[0])
    if baseline not in impls:
        impls.insert(0, baseline)
    impls.sort(key=lambda i: i != baseline)  # the baseline first, so every ratio has its denominator
    return impls, baseline, dropped


def run(opts: BenchOptions, argv: list[str] | None = None) -> dict:
    """Run every configuration of ``opts``; print the table; write JSON / plot / profile as asked.
    Returns the report (the JSON's content)."""
    import jax
    from jax.sharding import AxisType

    from mok_jax.bench import baselines, report as rep, tune

    t_start = time.perf_counter()
    devices = jax.devices()
    on_gpu = _on_gpu(devices)
    if opts.tune and not on_gpu:
        raise Unavailable(f"--tune needs a GPU (it times the mok megakernel); this machine has only "
                          f"{devices[0].platform} devices")
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    n = opts.devices or len(devices)
    if n > len(devices):
        raise UsageError(f"--devices {n}: only {len(devices)} {devices[0].platform} device(s) here")
    models = _resolve_models(opts.models or (defaults["model"],))
    tokens_list = opts.tokens or (defaults["tokens"],)
    ep_mode = opts.ep_mode or defaults["ep_mode"]
    # the H200's rooflines on GPU; on CPU only what the command line gives (none by default)
    peaks = {"bf16": opts.peak_tflops or (PEAK_TFLOPS["bf16"] if on_gpu else None),
             "fp8": opts.peak_tflops_fp8 or (PEAK_TFLOPS["fp8"] if on_gpu else None)}
    peak = peaks["bf16"]
    nvlink = opts.nvlink_gbps or (NVLINK_GBPS if on_gpu else None)
    dtype = jax.numpy.bfloat16  # inputs and weights, for either --dtype (fp8 is mok-fp8's math inside the layer)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices[:n], axis_types=(AxisType.Explicit,))
    # ValueError -> usage error in main()
    experts_per_gpu = opts.experts_per_gpu
    if experts_per_gpu is None and on_gpu and n == 1 and not opts.ep_mode:
        # one GPU: the whole 2-GPU ep64-slice problem (E/32 experts)
        experts_per_gpu = parse_experts_per_gpu(ONE_GPU_EXPERTS)
    shapes = [acc.bench_shape(m, n, ep_mode, experts_per_gpu=experts_per_gpu) for m in models]
    gpu_kind = _gpu_kind()

    impls, baseline, dropped_impls = _runnable(opts, defaults, mesh, shapes[0], tokens_list[0], gpu_kind)

    config = dataclasses.asdict(opts)
    config.update(models=[m.name for m in models], tokens=list(tokens_list), ep_mode=ep_mode, impls=impls,
                  baseline=baseline, peak_tflops=peak, peak_tflops_fp8=peaks["fp8"], nvlink_gbps=nvlink, devices=n,
                  passes=list(opts.passes))
    report = {"schema": rep.SCHEMA, "created_utc": rep.now_utc(), "command": argv or ["mok-bench"], "config": config,
              "cpu_numbers": not on_gpu, "notice": None if on_gpu else CPU_NOTICE,
              **rep.environment(devices, n), "git": rep.git_info(),
              "roofline": {"peak_tflops": peak, "peak_tflops_fp8": peaks["fp8"], "nvlink_gbps": nvlink},
              "unavailable_impls": dropped_impls, "results": []}
    results = report["results"]
    # pass-major, so a sweep cut short by --time-budget still has whole curves for the first pass; mok once per
    # kernel setting (--granularity list, --tune grid), the others once
    plan = [(s, p, t, i, knobs) for s in shapes for p in opts.passes for t in tokens_list for i in impls
            for knobs in (kernel_settings(opts, t) if i in MOK_IMPLS else [None])]

    if not on_gpu:  # once, above everything the runs print (stdout: it heads the table in a redirected file)
        print(CPU_NOTICE, flush=True)
    from tqdm import tqdm

    # disable=None: a bar on a terminal only (a log file gets the per-run lines instead)
    bar = tqdm(total=len(plan), desc="mok-bench", unit="run", file=sys.stderr,
               disable=None if opts.progress else True, dynamic_ncols=True)
    say = (lambda msg: None) if opts.quiet else (lambda msg: tqdm.write(msg, file=sys.stderr))
    try:  # SIGTERM (e.g. from `timeout`) ends the sweep cleanly: finished runs are written, the rest skipped
        old_handler = signal.signal(signal.SIGTERM, _raise_interrupted)
    except ValueError:  # not the main thread: no handler
        old_handler = None
    fns: dict[tuple, Any] = {}  # per (impl, kernel)
    steps: dict[tuple, Any] = {}
    cur = {"shape": None, "weights": None, "fp8_weights": None, "tokens": None, "problem": None}
    routings: dict[int, Any] = {}  # per tokens, for the current model (host arrays)
    base_ms: dict[tuple, float] = {}  # baseline median per (model, tokens, pass)
    dropped: dict[tuple, int] = {}  # dropped slots per (model, tokens, impl)
    stop_reason = None
    try:
        for shape, pass_, tokens, impl, knobs in plan:
            if cur["shape"] is not shape:
                cur.update(shape=shape, weights=None, fp8_weights=None, tokens=None, problem=None)
                routings.clear()
            if tokens not in routings:
                routings[tokens] = _routing(shape, tokens, opts)
            routing, traffic = routings[tokens]
            r = _record(shape, tokens, pass_, impl, opts, traffic, peaks, nvlink)
            r["baseline"] = baseline
            results.append(r)
            label = f"[{len(results)}/{len(plan)}] {shape.model} T={tokens} {pass_} {impl}"
            try:
                kernel = None  # what the builder gets: None lets mok_jax.tuning resolve inside the layer
                if impl in MOK_IMPLS:
                    kernel, ran, r["kernel_source"] = tune.resolve_kernel(tune.problem_key(shape, tokens), knobs,
                                                                          gpu_kind)
                    r["kernel"] = dataclasses.asdict(ran)
                    label += f" [{rep.kernel_label(r, ('comm_sms_fwd', 'ring_slots'))}]"
                    if pass_ == "fwd":  # the forward's memory; the backward's is not sized yet
                        r.update(acc.mok_memory_per_rank(shape, tokens, ran,
                                                         **baselines.MOK_IMPLEMENTATIONS[impl]._asdict()))
                if stop_reason:
                    raise _Skip(stop_reason)
                if opts.time_budget_s and time.perf_counter() - t_start > opts.time_budget_s:
                    raise _Skip(f"time budget of {opts.time_budget_s:g} s (--time-budget) spent")
                gb = _reference_gb(shape, tokens, pass_)
                if impl == "reference" and on_gpu and gb > opts.reference_max_gb:
                    raise _Skip(f"reference is dense: {gb:.1f} GB of activations > --reference-max-gb "
                                f"{opts.reference_max_gb:g}")
                if cur["weights"] is None:
                    cur["weights"] = _init_weights(shape, mesh, dtype, opts.seed)
                if cur["tokens"] != tokens:
                    cur.update(tokens=None, problem=None)  # free the previous inputs first
                    cur.update(tokens=tokens, problem=_inputs(shape, tokens, routing, mesh, dtype, opts.seed))
                if (impl, kernel) not in fns:
                    fns[impl, kernel] = baselines.build(impl, mesh, capacity_factor=opts.capacity_factor,
                                                        kernel=kernel)
                fp8_weights = impl == FP8_IMPL and pass_ == "fwd"  # made outside the timed call (module doc)
                if (impl, kernel, pass_) not in steps:
                    steps[impl, kernel, pass_] = _step(fns[impl, kernel], pass_, fp8_weights=fp8_weights)
                step = steps[impl, kernel, pass_]
                x, idx, w, dy = cur["problem"]
                args = (x, idx, w, cur["weights"], dy)
                if fp8_weights:
                    if cur["fp8_weights"] is None:
                        cur["fp8_weights"] = baselines.quantize_weights(cur["weights"], mesh)
                    args += (cur["fp8_weights"],)
                _measure(r, step, args, slow=impl == "ragged", opts=opts)
                if impl == "xla-capacity":
                    key = (shape.model, tokens, impl)
                    if key not in dropped:
                        dropped[key] = int(fns[impl, kernel](*args[:4])[1]["dropped_slots"])
                    r["dropped_slots"] = dropped[key]
                    r["dropped_fraction"] = dropped[key] / (n * tokens * shape.top_k)
                if impl == baseline and (shape.model, tokens, pass_) not in base_ms:  # mok as baseline: its first
                    base_ms[shape.model, tokens, pass_] = r["median_ms"]  # kernel setting (--tune, --granularity)
                if (shape.model, tokens, pass_) in base_ms:
                    r["baseline_median_ms"] = base_ms[shape.model, tokens, pass_]
                    r["speedup_vs_baseline"] = r["baseline_median_ms"] / r["median_ms"]
                if impl in (FP8_IMPL, FP8_REFERENCE):
                    rep.fill_fp8_ratios(results, fp8_impl=FP8_IMPL, reference=FP8_REFERENCE)
                of_peak = "" if r["compute_fraction"] is None else f", {r['compute_fraction'] * 100:.1f}% of peak"
                vs_bf16 = "" if r["speedup_vs_bf16"] is None else f", {r['speedup_vs_bf16']:.2f}x {FP8_REFERENCE}"
                say(f"{label}: {r['median_ms']:.3f} ms ({rep.fmt(r['tflops'], '.1f')} TFLOP/s{of_peak}{vs_bf16}; "
                    f"first call {r['first_call_s']:.1f} s)")
                if opts.profile:
                    try:  # a trace that cannot be taken (no CUPTI, say) costs the trace, not the timing
                        _profile(opts.profile, r, step, args)
                    except Exception as e:  # noqa: BLE001
                        r["error"] = f"profile not written: {_error_text(e)}"
                        say(f"{label}: {r['error'].splitlines()[0][:300]}")
            except _Skip as e:
                r.update(status="skipped", error=str(e))
                say(f"{label}: skipped ({e})")
            except _Interrupted as e:
                stop_reason = str(e)
                r.update(status="skipped", error=stop_reason)
            except NotImplementedError as e:  # a pass an implementation lacks (raised at trace time): this pass only
                r.update(status="unsupported", error=_error_text(e))
                say(f"{label}: unsupported ({_error_text(e).splitlines()[0][:300]})")
            except Exception as e:  # noqa: BLE001 - recorded; the other runs go on
                r.update(status="error", error=_error_text(e))
                say(f"{label}: ERROR {_error_text(e).splitlines()[0][:300]}")
            bar.update(1)
            if opts.json:
                rep.write_json(opts.json, report)
    except KeyboardInterrupt:
        stop_reason = "interrupted (Ctrl-C)"
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        bar.close()
        cur.clear()
    if opts.tune:
        report["tuned"] = _write_tuned(results, devices[0].device_kind, report["git"])
    report["elapsed_s"] = time.perf_counter() - t_start
    report["stopped"] = stop_reason
    if opts.json:
        rep.write_json(opts.json, report)
    title = f"{report['device']['kind']} x{n}"
    if opts.markdown:
        print(rep.format_markdown(results, peak_tflops=peak), flush=True)
    else:
        print(rep.format_table(results), flush=True)
    memory = rep.format_memory(results) if on_gpu else ""
    if memory:
        print(memory, flush=True)
    if opts.tune:
        t = report["tuned"]
        for e in t["entries"]:
            eprint(f"mok-bench: tuned {e['model']} T={e['tokens']}: granularity {e['granularity']}, comm SMs "
                   f"{e['comm_sms_fwd']}, ring slots {e['ring_slots']} ({e['median_ms']:.3f} ms)")
        if t["incomplete"]:
            eprint(f"mok-bench: not tuned (grid cut short or every setting failed): {', '.join(t['incomplete'])}")
        eprint(f"mok-bench: tuned table {'written to ' + t['path'] if t['entries'] else 'unchanged: nothing to write'}")
    if dropped_impls:
        eprint(f"mok-bench: not run (unavailable here): {', '.join(dropped_impls)}")
    if FP8_IMPL in dropped_impls:  # --dtype fp8 asked for it: say why, the bf16 rows above ran without it
        eprint(f"mok-bench: --dtype fp8: {FP8_IMPL} (the FP8 layer) cannot run here: "
               f"{dropped_impls[FP8_IMPL].splitlines()[0][:300]}")
    if opts.plot:
        models_txt = ",".join(dict.fromkeys(r["model"] for r in results))
        modes = ",".join(dict.fromkeys(s.ep_mode for s in shapes))
        path = rep.plot_sweep(opts.plot, results, peak_tflops=peak if on_gpu else None,
                              fp8_peak_tflops=peaks["fp8"] if on_gpu and opts.dtype == "fp8" else None,
                              title=f"{models_txt} ({modes}, {_dtype_text(opts.dtype)}, {opts.routing} routing) on "
                                    f"{title}")
        eprint(f"mok-bench: plot written to {path}")
    if opts.json:
        eprint(f"mok-bench: JSON written to {opts.json}")
    failed = [r for r in results if r["status"] == "error"]
    if failed:  # the last line, so a log's tail says why the exit status is 1
        first, impls_failed = failed[0], ", ".join(dict.fromkeys(r["impl"] for r in failed))
        eprint(f"mok-bench: failed: {len(failed)} of {len(results)} runs ({impls_failed}); first: {first['model']} "
               f"T={first['tokens_per_gpu']} {first['pass']} {first['impl']}: {first['error'].splitlines()[0][:200]}")
    return report


class _Skip(Exception):
    pass


def _write_tuned(results: list[dict], device_kind: str, git: dict) -> dict:
    """--tune: the fastest setting of each fully timed problem, merged into the device's tuned table."""
    from mok_jax import tuning
    from mok_jax.bench import tune

    entries, incomplete = tune.best_entries(results)
    path = tuning.table_path(device_kind, root=tune.tuned_root())
    if entries:
        tune.write_table(path, entries, commit=git.get("commit", "unknown"), dirty=git.get("dirty"))
    return {"path": str(path), "entries": entries, "incomplete": incomplete}


def _measure(r: dict, step, args, *, slow: bool, opts: BenchOptions) -> None:
    """First call (compilation included), then time_fn; fills r's timing figures. ``slow``: 'ragged', timed with
    one warm-up and one call per sample."""
    import jax

    from mok_jax.bench.timing import time_fn

    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    r["first_call_s"] = time.perf_counter() - t0
    r["warmup"] = 1 if slow else opts.warmup
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    target = opts.target_sample_ms or TARGET_SAMPLE_MS[platform]
    timing = time_fn(step, *args, warmup=r["warmup"], samples=opts.ragged_samples if slow else opts.samples,
                     target_sample_ms=target, max_calls_per_sample=1 if slow else MAX_CALLS_PER_SAMPLE[platform])
    _fill_timing(r, timing)


def _profile(directory: str, r: dict, step, args) -> None:
    """A jax.profiler trace of three calls under DIR/<model>_<mode>_T<tokens>_<pass>_<impl>/."""
    import jax

    label = f"{r['model']}_{r['ep_mode']}_T{r['tokens_per_gpu']}_{r['pass'].replace('+', '_')}_{r['impl']}"
    if r.get("kernel"):
        k = r["kernel"]
        label += f"_g{k['granularity']}_s{k['comm_sms_fwd']}_r{k['ring_slots']}_{k['dispatch']}_{k['combine']}"
    label = label.replace("/", "-")  # ep_mode E/32
    with jax.profiler.trace(os.path.join(directory, label)):
        with jax.profiler.TraceAnnotation(f"mok-bench {label}"):
            out = None
            for _ in range(3):
                out = step(*args)
            jax.block_until_ready(out)


def _from_json(opts: BenchOptions) -> int:
    """Print (and plot) saved reports without running anything."""
    from mok_jax.bench import report as rep

    results, reports = rep.load_results(opts.from_json)
    cpu = any(r.get("cpu_numbers") for r in reports)
    peak = reports[0]["roofline"]["peak_tflops"] if reports else None
    if cpu:
        print(next(r.get("notice") for r in reports if r.get("cpu_numbers")) or CPU_NOTICE, flush=True)
    if opts.markdown:
        print(rep.format_markdown(results, peak_tflops=peak), flush=True)
    else:
        print(rep.format_table(results), flush=True)
    if opts.plot:
        dev = reports[0]["device"] if reports else {}
        models = ",".join(dict.fromkeys(r["model"] for r in results))
        r0 = results[0] if results else {}
        title = (f"{models} ({r0.get('ep_mode')}, {r0.get('dtype')}, {r0.get('routing')} routing) on "
                 f"{dev.get('kind')} x{dev.get('used')}")
        fp8_peak = None if cpu or not any(r.get("dtype") == "fp8" for r in results) else (
            reports[0]["roofline"].get("peak_tflops_fp8"))
        path = rep.plot_sweep(opts.plot, results, peak_tflops=None if cpu else peak, fp8_peak_tflops=fp8_peak,
                              title=title)
        eprint(f"mok-bench: plot written to {path}")
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns 0 when at least one run succeeded and none failed (skipped and unsupported
    runs are not failures: --time-budget, a signal, a pass an implementation lacks), 1 when a run failed or none ran,
    2 on bad options or an implementation asked for by name that cannot run here (one line saying why)."""
    try:
        opts = parse_args(argv)
        if opts is None:
            return 0
        if opts.from_json:
            return _from_json(opts)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent GPU machines
        _ask_for_cpu_devices()
        report = run(opts, argv=["mok-bench", *(sys.argv[1:] if argv is None else argv)])
    except (ValueError, NotImplementedError, Unavailable) as e:
        eprint(f"mok-bench: error: {e}")
        return 2
    statuses = {r["status"] for r in report["results"]}
    return 0 if "ok" in statuses and "error" not in statuses else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
