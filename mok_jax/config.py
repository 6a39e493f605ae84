"""Static configuration of the layer: model shapes, kernel tuning, and the op's config.

Every static argument of ``mok_jax.moe`` lives in one frozen, keyword-only, validated dataclass
(``MoEConfig``). Model shapes come from ``configs/models/*.toml`` through ``load_model`` so tests,
benchmarks and the Flax module share one source of truth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import tomllib
from typing import Literal

__all__ = ["KernelConfig", "ModelShape", "MoEConfig", "list_models", "load_model"]

Implementation = Literal["xla", "mok"]
KEEP = ("nothing", "ring", "balanced", "everything")  # MoEConfig.keep (its docstring: the memory of each)
PRECISIONS = ("bf16", "fp8")  # MoEConfig.precision: the routed experts' forward
ScoreFunc = Literal["softmax", "sigmoid"]


def _require(cond: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    if not cond:
        raise exc(msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The MoE block of one model. Shared expert absent when ``num_shared_experts == 0``."""

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    score_func: ScoreFunc = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        _require(isinstance(self.name, str) and self.name, f"ModelShape.name must be a non-empty str, got "
                 f"{self.name!r}", TypeError)
        for f in ("num_experts", "top_k", "hidden_size", "intermediate_size", "num_shared_experts",
                  "shared_intermediate_size"):
            v = getattr(self, f)  # a bool is an int to Python, not a size
            _require(isinstance(v, int) and not isinstance(v, bool), f"ModelShape.{f} must be an int, got {v!r}",
                     TypeError)
            least = 0 if f.startswith(("num_shared", "shared")) else 1
            _require(v >= least, f"ModelShape.{f} must be a {'non-negative' if least == 0 else 'positive'} int, "
                     f"got {v!r}")
        _require(
            self.top_k <= self.num_experts,
            f"ModelShape.top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})",
        )
        if self.num_shared_experts:
            _require(self.shared_intermediate_size > 0, "ModelShape.shared_intermediate_size must be > 0")
        _require(self.score_func in ("softmax", "sigmoid"), f"ModelShape.score_func must be 'softmax' or "
                 f"'sigmoid', got {self.score_func!r}")
        _require(isinstance(self.norm_topk_prob, bool), f"ModelShape.norm_topk_prob must be a bool, got "
                 f"{self.norm_topk_prob!r}", TypeError)
        scale = self.routed_scaling_factor
        _require(isinstance(scale, (int, float)) and not isinstance(scale, bool), f"ModelShape.routed_scaling_factor "
                 f"must be a number, got {scale!r}", TypeError)
        _require(math.isfinite(scale) and scale > 0, f"ModelShape.routed_scaling_factor must be finite and > 0, got "
                 f"{scale!r}")
        _require(isinstance(self.tags, tuple) and all(isinstance(t, str) for t in self.tags),
                 f"ModelShape.tags must be a tuple of str, got {self.tags!r}", TypeError)

    @property
    def shared_size(self) -> int:
        """Intermediate size of the (fused) shared expert; 0 when there is none."""
        return self.num_shared_experts * self.shared_intermediate_size

    def replace(self, **changes) -> "ModelShape":
        return dataclasses.replace(self, **changes)


def _config_dirs() -> list[pathlib.Path]:
    here = pathlib.Path(__file__).resolve().parent
    return [here / "configs" / "models", here.parent / "configs" / "models"]


def list_models(tag: str | None = None) -> list[str]:
    """Names of the model shapes under configs/models (optionally only those tagged ``tag``)."""
    names = set()
    for d in _config_dirs():
        for f in d.glob("*.toml"):
            if tag is None or tag in load_model(f).tags:
                names.add(f.stem)
    return sorted(names)


def _shipped(name: str) -> list[pathlib.Path]:
    """The shipped model files of that name (configs/models/<name>.toml)."""
    return [d / f"{name}.toml" for d in _config_dirs() if (d / f"{name}.toml").is_file()]


def load_model(name_or_path: str | pathlib.Path) -> ModelShape:
    """A ModelShape from a shipped model's name (``configs/models/<name>.toml``: "kimi-k2", "ci", ...) or from a
    TOML file: anything ending in ".toml" is a path (a relative one from the working directory). A name never reads
    a file of the working directory, and a path never falls back to a shipped model: a path that is no file raises
    FileNotFoundError, naming the shipped model of that name if there is one. Errors about a file's contents name
    the file."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"load_model takes a model name or a path to a TOML file, got {type(name_or_path).__name__}")
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        found = _shipped(str(name_or_path))
        if not found:
            known = sorted({f.stem for d in _config_dirs() for f in d.glob("*.toml")})
            raise ValueError(f"unknown model {str(name_or_path)!r}; known models: {', '.join(known)} (or a path to a "
                             f"TOML file, ending in .toml)")
        path = found[0]
    elif not path.is_file():
        hint = f"; the shipped model {path.stem!r} is load_model({path.stem!r})" if _shipped(path.stem) else ""
        raise FileNotFoundError(f"load_model: no file {str(path)!r} (a name ending in .toml is a path; a relative one "
                                f"is read from the working directory, {os.getcwd()}){hint}")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(ModelShape)}
    unknown = set(raw) - set(fields)
    _require(not unknown, f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(fields)}")
    required = sorted(n for n, f in fields.items() if f.default is dataclasses.MISSING)
    missing = [n for n in required if n not in raw]
    _require(not missing, f"{path}: missing keys {missing}; required: {required}")
    tags = raw.get("tags", [])
    _require(isinstance(tags, list), f'{path}: tags must be a list of strings, such as ["ci"], got {tags!r}',
             TypeError)
    try:
        return ModelShape(**{**raw, "tags": tuple(tags)})
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None


MAX_RING_SLOTS = 8  # kMaxRingSlots in ffi/include/mok/moe/forward.cuh
# KernelConfig fields renamed in issue 35 (old name: new name). The old names are refused, saying where each went:
# KernelConfig(...) and .replace(...) (TypeError), a tuned table's TOML (ValueError) and mok-bench's flags; a result
# file written before the rename is read with the new names (mok_jax.bench.report.load_results).
RENAMED_KERNEL_FIELDS = {"comm_sms_fwd": "comm_items_fwd", "comm_sms_bwd": "comm_items_bwd"}


def renamed_kernel_field(old: str) -> str:
    """Why a KernelConfig field name from before issue 35 is refused, naming the field it became."""
    return (f"KernelConfig.{old} is now {RENAMED_KERNEL_FIELDS[old]}: it counts the communication work items "
            f"(how many CTAs move rows at once), not SMs set aside")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Tuning of the megakernel (docs/kernel.md). Ignored by implementation='xla'.
    Every value gives bitwise the same outputs; only the speed and the memory change.

    granularity: tokens per microbatch (a multiple of 64 in 512..32768; clipped to the tokens of a call).
    comm_items_fwd: the work items each dispatch and combine phase of the forward is split into, so how many CTAs
        move rows at once (no SM is set aside: the other CTAs run GEMM tiles meanwhile). Formerly comm_sms_fwd.
    comm_items_bwd: the items the fused expert-parallel backward (ops.experts_backward_ep) splits its SHARE of x
        and dy into; its row moves after that go one item per 128-row block. Unused at EP 1. Formerly comm_sms_bwd.
    dispatch: the dispatch's direction (owners pull the sources' posted rows, or sources push them).
    combine: the standalone combine op's direction (``mok_jax.ops.combine``). The layer's forward always pushes one
        row per slot, so that y has the same bits at every EP size, and refuses "pull".
    ring_slots: microbatch slots in the device-side receive ring (memory: ring_slots x the worst case of
        one microbatch's rows, whatever the routing).
    """

    granularity: int = 2048
    comm_items_fwd: int = 24
    comm_items_bwd: int = 24
    dispatch: Literal["pull", "push"] = "pull"
    combine: Literal["push", "pull"] = "push"
    ring_slots: int = 2

    def __post_init__(self):
        for f in ("granularity", "comm_items_fwd", "comm_items_bwd", "ring_slots"):
            v = getattr(self, f)
            _require(isinstance(v, int) and not isinstance(v, bool), f"KernelConfig.{f} must be an int, got {v!r}",
                     TypeError)
        _require(512 <= self.granularity <= 32768 and self.granularity % 64 == 0,
                 f"KernelConfig.granularity must be a multiple of 64 in [512, 32768], got {self.granularity}")
        for f in ("comm_items_fwd", "comm_items_bwd"):
            v = getattr(self, f)
            _require(1 <= v <= 128, f"KernelConfig.{f} must be in [1, 128], got {v}")
        _require(self.dispatch in ("pull", "push"), f"KernelConfig.dispatch must be 'pull' or 'push', "
                 f"got {self.dispatch!r}")
        _require(self.combine in ("push", "pull"), f"KernelConfig.combine must be 'push' or 'pull', "
                 f"got {self.combine!r}")
        _require(1 <= self.ring_slots <= MAX_RING_SLOTS,
                 f"KernelConfig.ring_slots must be in [1, {MAX_RING_SLOTS}], got {self.ring_slots}")

    def replace(self, **changes) -> "KernelConfig":
        return dataclasses.replace(self, **changes)

    def microbatches(self, tokens: int) -> tuple[int, int, int]:
        """How the forward cuts a rank's ``tokens`` (mok/moe/plan.cuh's make_plan): (G, the microbatches, the ring
        slots in use), G = min(granularity, tokens) rounded up to whole 64-token chunks, microbatch m = tokens
        [m G, (m + 1) G)."""
        g = -(-min(self.granularity, tokens) // 64) * 64
        count = -(-tokens // g)
        return g, count, min(self.ring_slots, count)

    def first_ring_token(self, tokens: int) -> int:
        """The first of a rank's ``tokens`` whose microbatch is still in the receive ring when the forward ends:
        the last ``ring_slots`` microbatches (0 when every microbatch fits)."""
        g, count, slots = self.microbatches(tokens)
        return (count - slots) * g


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Static arguments of ``mok_jax.moe``: pure data (frozen, hashable, compared by value), no runtime resources.
    The megakernel's symmetric workspace is a runtime resource (device memory), passed beside the config:
    ``moe(..., workspace=)``, ``expert_parallel_moe(..., workspace=)``, ``MoELayer(..., workspace=)``.

    implementation: "xla" (pure JAX, runs anywhere; the correctness oracle) or "mok" (the CUDA
        megakernel: bf16; differentiable at every EP size; it never falls back to another
        implementation).
    ep_axis: name of the expert-parallel mesh axis when ``moe`` runs inside ``shard_map``; None
        when it runs on one device with every expert local.
    kernel: tuning of the megakernel; None picks the tuned table or the heuristic (mok_jax.tuning).
    checkify_ids: report an invalid expert id under jit through ``jax.experimental.checkify`` (a
        ``checkify.debug_check``, free unless the caller checkifies). Its effect cannot be serialized by
        ``jax.export``: set False to export the layer (invalid ids still give NaN rows, and the megakernel
        still records them for ``Workspace.check()``).
    keep: what ``implementation="mok"``'s forward keeps for its backward beyond the inputs, trading memory for
        recompute of the routed experts' gate/up GEMM (two thirds of their forward FLOPs, a quarter of their
        backward's). The forward writes its fp32 gate/up accumulators g | u of the kept slots, rounded to bf16 as the
        backward's recompute stores them, into its backward's rows, and the backward recomputes only the others. Kept
        per rank and layer, bf16 [rows, 2I]:
        "nothing": none; the backward recomputes every slot.
        "balanced" (the default with precision "bf16"): the first T k + 128 L rows of the rank's padded
            expert-major layout (L its experts): every row a balanced routing fills, so the memory does not grow
            with the EP size. At EP 1 that is every slot ("everything"'s rows); at EP > 1 only a skewed routing
            fills the rows past it, which are recomputed.
        "everything": every slot, M = ep T k + 128 L rows (the static bound of a dropless layout: ep times what a
            balanced routing fills at EP > 1).
        "ring": only the slots of the microbatches still in the forward's receive ring at its end (the last
            ``ring_slots`` microbatches of ``granularity`` tokens, as the call's KernelConfig resolves them):
            ep T' k rows with T' <= ring_slots * granularity the ring's tokens per rank, bounded by the ring, not
            by T (when every token fits in the ring it keeps what "everything" keeps).
        With any of them but "nothing" the forward also keeps the shared expert's g | u of the rank's tokens, bf16
        [T, 2Is], so that its backward (in XLA) recomputes none of it.
        The routed experts' gradients are the same bits for each; with a shared expert, dx and its gradients may
        differ from "nothing"'s by a rounding of its g, u (XLA's recompute accumulates in another order). The
        default (None) is "balanced" with precision "bf16" and "nothing" with "fp8". Measured on one H200
        (benchmarks/results/training.md), keeping g | u takes 11.7-13.8% off the fwd+bwd of the five benchmark
        problems. Ignored by ``implementation="xla"``.
    precision: the routed experts' forward on ``implementation="mok"``: "bf16", or "fp8": E4M3 with DeepSeek-V3
        block scales (mok_jax.fp8): each token row is quantised in 1 x 128 tiles once, as its source posts it
        (so FP8 rows and their scales cross NVLink: about half the bytes), the gate/up and down GEMMs run in FP8
        with fp32 scales promoted per 128-long K block, h is quantised in the SwiGLU epilogue; the shared expert,
        the combine and y stay bf16. H and I must be multiples of 128. The weights' E4M3 form comes from
        ``mok_jax.fp8.quantize_expert_weights`` (``moe(..., fp8_weights=)``, else each call quantises them). The
        backward stays bf16: it recomputes the experts from the bf16 weights (the gradient of the bf16 layer at
        the FP8 forward's point, as straight-through training takes it), so keep must be "nothing" (its default).
    """

    implementation: Implementation = "xla"
    ep_axis: str | None = None
    kernel: KernelConfig | None = None
    checkify_ids: bool = True
    keep: str | None = None
    precision: str = "bf16"

    def __post_init__(self):
        if self.keep is None:  # the default: keep what a balanced routing fills, where the backward can use it
            object.__setattr__(self, "keep", "balanced" if self.precision == "bf16" else "nothing")
        _require(self.implementation in ("xla", "mok"),
                 f"MoEConfig.implementation must be 'xla' or 'mok', got {self.implementation!r}")
        _require(self.ep_axis is None or (isinstance(self.ep_axis, str) and self.ep_axis),
                 f"MoEConfig.ep_axis must be a mesh axis name or None, got {self.ep_axis!r}", TypeError)
        _require(self.keep in KEEP,
                 f"MoEConfig.keep must be one of {', '.join(map(repr, KEEP))}, got {self.keep!r}")
        _require(self.precision in PRECISIONS,
                 f"MoEConfig.precision must be one of {', '.join(map(repr, PRECISIONS))}, got {self.precision!r}")
        if self.precision == "fp8":
            _require(self.implementation == "mok",
                     "MoEConfig.precision='fp8' runs on implementation='mok' (the megakernel); implementation='xla' "
                     "is bf16/f32 (the FP8 layer's pure-JAX oracle is mok_jax.fp8.moe_reference)")
            _require(self.keep == "nothing",
                     f"MoEConfig.precision='fp8' needs keep='nothing', got keep={self.keep!r}: the backward recomputes "
                     f"the experts in bf16, so the forward's FP8 accumulators are not its values")
        _require(isinstance(self.checkify_ids, bool),
                 f"MoEConfig.checkify_ids must be a bool, got {self.checkify_ids!r}", TypeError)
        _require(self.kernel is None or isinstance(self.kernel, KernelConfig),
                 f"MoEConfig.kernel must be a KernelConfig or None, got {type(self.kernel).__name__}", TypeError)


def _without_workspace(init):
    """MoEConfig's dataclass __init__, refusing ``workspace=`` with where it went (MoEConfig held the workspace
    until issue 35) rather than "unexpected keyword argument"; dataclasses.replace comes through here too."""

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        _require("workspace" not in kwargs,
                 "MoEConfig has no workspace: the workspace is a runtime resource, passed beside the config as "
                 "mok_jax.moe(..., workspace=), mok_jax.expert_parallel_moe(..., workspace=) or "
                 "mok_jax.flax.MoELayer(..., workspace=)", TypeError)
        init(self, *args, **kwargs)

    return checked


MoEConfig.__init__ = _without_workspace(MoEConfig.__init__)


def _without_renamed_fields(init):
    """KernelConfig's dataclass __init__, refusing a field name from before issue 35 (RENAMED_KERNEL_FIELDS) with
    the name it became rather than "unexpected keyword argument"; dataclasses.replace comes through here too."""

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        for old in RENAMED_KERNEL_FIELDS:
            _require(old not in kwargs, renamed_kernel_field(old), TypeError)
        init(self, *args, **kwargs)

    return checked


KernelConfig.__init__ = _without_renamed_fields(KernelConfig.__init__)
