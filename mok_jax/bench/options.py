"""mok-bench's command line: its defaults, the options (``BenchOptions``, frozen and validated, each error naming
its option), the parser, and what the options select (the implementations to run, mok's kernel settings).
Parsing imports no JAX."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

from mok_jax.bench import accounting as acc
from mok_jax.bench.project import COMBINE_ROWS  # --project: combine rows per (token, remote owner) or per remote slot
from mok_jax.bench.routing import ROUTINGS

__all__ = ["CPU_DEFAULTS", "CPU_NOTICE", "DENSE", "DTYPES", "FP8_IMPL", "FP8_REFERENCE", "GPU_DEFAULTS",
           "IMPLEMENTATIONS", "MAX_CALLS_PER_SAMPLE", "MOK_IMPLS", "NVLINK_GBPS", "ONE_GPU_EXPERTS", "PEAK_TFLOPS",
           "PLOT_FORMATS", "TARGET_SAMPLE_MS", "BenchOptions", "UsageError", "build_parser", "implementations",
           "kernel_settings", "parse_args", "parse_experts_per_gpu", "parse_tokens", "print_models"]

DESCRIPTION = "mok-bench: how fast the MoE layer runs here, against what a JAX user would write instead."

# Defaults. The rooflines are measurements on the H200 machines, used on GPU only (a CPU run has no roofline
# unless one is given).
# dense GEMM 8192^3 on one H200: cuBLAS bf16, torch._scaled_mm e4m3 (HARDWARE.md)
PEAK_TFLOPS = {"bf16": 805.0, "fp8": 1477.0}
NVLINK_GBPS = 394.0  # peer copy GPU0 -> GPU1 of the 2-GPU H200 machine (NV18), one direction
DENSE = "dense"  # the layer's FLOPs as one dense FFN (mok_jax.bench.dense): the practical limit, its own inputs
# tokens: for a model without a standard problem (mok_jax.bench.problems); tokamax is dropped, with the reason,
# where it is not installed
GPU_DEFAULTS = {"model": "kimi-k2", "tokens": 2048, "ep_mode": "ep64-slice",
                "impls": ("mok", DENSE, "xla", "xla-capacity", "tokamax")}
ONE_GPU_EXPERTS = "E/32"  # --experts-per-gpu on one GPU (no --ep-mode given) for a model without a standard problem
CPU_DEFAULTS = {"model": "ci", "tokens": 32, "ep_mode": "full", "impls": ("reference", DENSE, "xla", "xla-capacity")}
# ms a timed sample lasts (at least 3 calls, mok_jax.bench.timing), and the most calls in it. On CPU shorter: its
# times are indicative only, and with 64 calls of an EP program in flight the 8 host devices' collectives abort
# (XLA's CPU rendezvous times out waiting for threads the queued calls hold).
TARGET_SAMPLE_MS = {"gpu": 100.0, "cpu": 20.0}
MAX_CALLS_PER_SAMPLE = {"gpu": 64, "cpu": 16}
IMPLEMENTATIONS = ("xla", "xla-capacity", "ragged", "tokamax", "reference", DENSE, "mok", "mok-recompute", "mok-ring",
                   "mok-keep", "mok-fp8")
# the megakernel: kernel knobs apply (mok: the default MoEConfig, keep="balanced"; mok-recompute: keep="nothing",
# mok-ring: keep="ring", mok-keep: keep="everything", mok-fp8: precision="fp8")
MOK_IMPLS = ("mok", "mok-recompute", "mok-ring", "mok-keep", "mok-fp8")
DTYPES = ("bf16", "fp8")
PLOT_FORMATS = ("png", "pdf", "svg")  # --plot: matplotlib writes each of these with any backend
FP8_IMPL, FP8_REFERENCE = "mok-fp8", "mok"  # --dtype fp8: the FP8 layer, and the bf16 layer it is compared with
CPU_NOTICE = ("CPU NUMBERS: no GPU found, so mok-bench ran the pure-JAX paths on CPU devices; the times below "
              "are CPU times, not GPU performance, and no GPU roofline applies to them.")

EXAMPLES = """\
examples:
  mok-bench                                   # defaults: kimi-k2, ep64-slice, 2048 tokens/GPU (ci model on CPU)
  mok-bench bench --pass fwd,fwd+bwd --json out.json   # the five standard problems; every row also 'x dense'
  mok-bench --model bench --pass fwd,fwd+bwd --impl xla,xla-capacity --tokens 4096   # all at 4096 tokens
  mok-bench glm-5 --tokens 512..16384 --plot sweep.png        # 512, 1024, ..., 16384
  mok-bench kimi-k2 --routing zipf --zipf-s 1.2 --impl xla,xla-capacity --capacity-factor 2
  mok-bench kimi-k2 --profile /tmp/prof       # jax.profiler trace per run (TensorBoard / Perfetto)
  mok-bench kimi-k2 --devices 1 --experts-per-gpu E/32   # the 2-GPU ep64-slice problem on one GPU
  mok-bench kimi-k2 --impl mok,xla --granularity 512,1024,2048 --comm-items 16,24   # a sweep of mok's knobs
  mok-bench bench --tune --tokens 512..8192   # time mok's knobs, write configs/tuned/<device>/kernel.toml
  mok-bench bench --dtype fp8 --pass fwd,fwd+bwd --impl xla,mok   # mok-fp8 beside mok, ratio in 'vs bf16'
  mok-bench --project --json proj.json        # per-rank time at EP 8-72 projected from the committed results
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
    granularity: tuple[int, ...] | None = None  # mok knobs, each a sweep; None: mok_jax.tuning picks
    comm_items: tuple[int, ...] | None = None
    ring_slots: tuple[int, ...] | None = None
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
    project: bool = False  # mok_jax.bench.project: no run, a projection from the committed results
    combine_rows: str = "per-slot"

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
        need(self.combine_rows in COMBINE_ROWS, f"--combine-rows must be one of {', '.join(COMBINE_ROWS)}")
        need(not (self.project and (self.tune or self.from_json)), "--project runs nothing: drop --tune / --from-json")
        if self.plot is not None:
            suffix = self.plot.rsplit(".", 1)[-1].lower() if "." in self.plot else ""
            need(suffix in PLOT_FORMATS, f"--plot: {self.plot!r} must end in "
                 f"{', '.join('.' + f for f in PLOT_FORMATS)} (the formats the plot is written in)")
            need(importlib.util.find_spec("matplotlib") is not None,
                 "--plot needs matplotlib, which is not installed: pip install 'mok_jax[bench]'")
        if self.experts_per_gpu is not None:
            object.__setattr__(self, "experts_per_gpu", parse_experts_per_gpu(self.experts_per_gpu))
        self._check_knobs()
        if self.tune:
            set_knobs = [o for o, v in (("--granularity", self.granularity), ("--comm-items", self.comm_items),
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

        for option, values in (("--granularity", self.granularity), ("--comm-items", self.comm_items),
                               ("--ring-slots", self.ring_slots)):
            if values is not None and not values:
                raise UsageError(f"{option}: give at least one value")
        checks = [("--granularity", {"granularity": g}) for g in self.granularity or ()]
        checks += [("--comm-items", {"comm_items_fwd": c, "comm_items_bwd": c}) for c in self.comm_items or ()]
        checks += [("--ring-slots", {"ring_slots": r}) for r in self.ring_slots or ()]
        for option, field in (("--dispatch", "dispatch"), ("--combine", "combine")):
            if getattr(self, field) is not None:
                checks.append((option, {field: getattr(self, field)}))
        for option, knobs in checks:
            try:
                KernelConfig(**knobs)
            except (ValueError, TypeError) as e:
                raise UsageError(f"{option}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok-bench", description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model name (configs/models), TOML path, comma list, or 'bench' for "
                   "the models of the standard problems, each at its own tokens and experts per GPU on a GPU "
                   f"(mok_jax.bench.problems) (default: {GPU_DEFAULTS['model']}; {CPU_DEFAULTS['model']} on CPU)")
    w = p.add_argument_group("what to run")
    w.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="same as the positional MODEL")
    w.add_argument("-t", "--tokens", help="tokens per GPU: N, N1,N2,... or LO..HI doubling, for every model "
                   f"(default on GPU a model's standard problem's, else {GPU_DEFAULTS['tokens']}; "
                   f"{CPU_DEFAULTS['tokens']} on CPU)")
    w.add_argument("--ep-mode", choices=acc.EP_MODES, help="full: the model's experts split over the GPUs; "
                   "ep64-slice: E/64 experts per GPU (default on GPU: a model's standard problem, else ep64-slice, "
                   f"and on one GPU --experts-per-gpu {ONE_GPU_EXPERTS}, the whole 2-GPU problem; full on CPU)")
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
    w.add_argument("--experts-per-gpu", metavar="N|E/d", help="routed experts each GPU holds, for every model, "
                   "overriding the split of --ep-mode and the standard problems: a count, or E/d for the model's E "
                   "experts over d (E/32 on one GPU is the 2-GPU ep64-slice problem)")
    k = p.add_argument_group("mok kernel knobs (mok_jax.KernelConfig; unset: the tuned table or the heuristic, "
                             "mok_jax.tuning; other implementations ignore them)")
    k.add_argument("--granularity", help="tokens per microbatch: a multiple of 64 in 512..32768, or a comma list "
                   "to sweep (mok runs once per value)")
    k.add_argument("--comm-items", help="work items each communication phase is split into, so how many CTAs move "
                   "rows at once (KernelConfig.comm_items_fwd and comm_items_bwd), or a comma list to sweep")
    k.add_argument("--comm-sms", dest="renamed_comm_sms", help=argparse.SUPPRESS)  # refused: now --comm-items
    k.add_argument("--ring-slots", help="microbatch slots of the receive ring, or a comma list to sweep")
    k.add_argument("--dispatch", choices=("pull", "push"), help="dispatch direction")
    k.add_argument("--combine", choices=("push", "pull"), help="combine direction")
    k.add_argument("--tune", action="store_true", help="time mok over granularity x comm items x ring slots per model "
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
    o.add_argument("--plot", metavar="FILE.png", help="time and TFLOP/s against tokens per GPU (.png, .pdf or .svg)")
    o.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace of each run under DIR/<run>/")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    o.add_argument("-q", "--quiet", action="store_true", help="no per-run lines")
    o.add_argument("--markdown", action="store_true", help="print the table as markdown (for the README)")
    o.add_argument("--from-json", nargs="+", metavar="FILE", help="run nothing: print the table of saved "
                   "reports (and --plot them)")
    o.add_argument("--list-models", action="store_true", help="print the known model shapes and exit")
    o.add_argument("--project", action="store_true", help="run nothing: project the per-rank fwd and fwd+bwd time "
                   "at EP 8-72 on H200 NVL8 and a GB200/GB300-class NVL72 from the committed results, beside an "
                   "all-to-all layer and the paper's EP-64 figures, and check the model against the EP-2 "
                   "measurements (mok_jax.bench.project, docs/projection.md); reads --model, --combine-rows, --json "
                   "and --markdown only")
    o.add_argument("--combine-rows", default="per-slot", choices=COMBINE_ROWS, help="--project: combine sends a "
                   "row per token and remote owner rank (per-owner, today's kernel) or per remote slot (per-slot, "
                   "default)")
    return p


def parse_args(argv: list[str] | None = None) -> BenchOptions | None:
    """BenchOptions from a command line (None for --list-models, which prints and returns).

    Raises UsageError (ValueError) for a bad value; argparse's own errors exit with status 2."""
    ns = build_parser().parse_args(argv)
    if ns.renamed_comm_sms is not None:
        raise UsageError("--comm-sms is now --comm-items (KernelConfig.comm_items_fwd and comm_items_bwd): it counts "
                         "the communication work items, not SMs set aside")
    if ns.list_models:
        print_models()
        return None
    if ns.model and ns.model_opt:
        raise UsageError("give the model once: positional MODEL or --model")
    return BenchOptions(
        models=_names(ns.model or ns.model_opt), tokens=parse_tokens(ns.tokens) if ns.tokens else None,
        ep_mode=ns.ep_mode, dtype=ns.dtype, passes=_names(ns.passes), impls=_names(ns.impl), baseline=ns.baseline,
        routing=ns.routing, zipf_s=ns.zipf_s, seed=ns.seed, capacity_factor=ns.capacity_factor, warmup=ns.warmup,
        samples=ns.samples, target_sample_ms=ns.target_sample_ms, ragged_samples=ns.ragged_samples,
        experts_per_gpu=ns.experts_per_gpu, granularity=_ints(ns.granularity, "--granularity"),
        comm_items=_ints(ns.comm_items, "--comm-items"), ring_slots=_ints(ns.ring_slots, "--ring-slots"),
        dispatch=ns.dispatch, combine=ns.combine, tune=ns.tune,
        peak_tflops=ns.peak_tflops, peak_tflops_fp8=ns.peak_tflops_fp8, nvlink_gbps=ns.nvlink_gbps, devices=ns.devices,
        reference_max_gb=ns.reference_max_gb, time_budget_s=ns.time_budget_s, json=ns.json, plot=ns.plot,
        profile=ns.profile, progress=ns.progress, quiet=ns.quiet, markdown=ns.markdown,
        from_json=tuple(ns.from_json) if ns.from_json else None, project=ns.project, combine_rows=ns.combine_rows)


def print_models() -> None:
    from mok_jax.bench.problems import STANDARD_SET, standard_models
    from mok_jax.config import list_models, load_model

    bench = set(standard_models())
    print(f"{'model':<20} {'E':>4} {'k':>3} {'H':>6} {'I':>6} {'Is':>6}  tags")
    for name in list_models():
        m = load_model(name)
        tags = ",".join(m.tags) + (f" (in '{STANDARD_SET}')" if name in bench else "")
        print(f"{name:<20} {m.num_experts:>4} {m.top_k:>3} {m.hidden_size:>6} {m.intermediate_size:>6} "
              f"{m.shared_size:>6}  {tags}")


def kernel_settings(opts: BenchOptions, tokens: int) -> list[dict | None]:
    """The mok knob settings to run at ``tokens`` per GPU: one per combination of the --granularity, --comm-items and
    --ring-slots values (granularity slowest, ring slots fastest; with --dispatch and --combine), the --tune grid,
    or [None] (no knob option: mok_jax.tuning resolves every knob). Knobs not given are left to the resolved
    config."""
    from mok_jax.bench import tune

    if opts.tune:
        return tune.grid(tokens)
    fixed = {field: getattr(opts, field) for field in ("dispatch", "combine") if getattr(opts, field) is not None}
    sweeps = [[{"granularity": g} for g in opts.granularity or ()] or [{}],
              [{"comm_items_fwd": c, "comm_items_bwd": c} for c in opts.comm_items or ()] or [{}],
              [{"ring_slots": r} for r in opts.ring_slots or ()] or [{}]]
    settings = [{**fixed, **g, **c, **r} for g in sweeps[0] for c in sweeps[1] for r in sweeps[2]]
    return [s or None for s in settings]


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
