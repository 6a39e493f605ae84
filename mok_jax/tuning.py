"""Where the megakernel's tuning comes from: an explicit KernelConfig, else a tuned table, else a heuristic.

Tuned tables live under ``configs/tuned/<device>/kernel.toml`` (``<device>`` is the JAX device kind in
lower case with spaces as dashes, e.g. ``nvidia-h200``); ``mok-bench --tune`` writes them. Each
``[[entry]]`` names a problem (hidden, intermediate, top_k, experts_per_rank, ep, tokens) and the knobs
that ran it fastest; a call takes the entry of its problem whose token count is nearest (in log scale),
else the heuristic. Every choice gives the same bits: only speed depends on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import tomllib

from mok_jax.config import RENAMED_KERNEL_FIELDS, KernelConfig, renamed_kernel_field

__all__ = ["ProblemKey", "check_entry_keys", "device_slug", "heuristic", "load_table", "resolve", "table_path"]

_KNOBS = tuple(f.name for f in dataclasses.fields(KernelConfig))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProblemKey:
    """The problem a tuned entry is for (per rank)."""

    hidden: int
    intermediate: int
    top_k: int
    experts_per_rank: int
    ep: int
    tokens: int

    def same_shape(self, other: "ProblemKey") -> bool:
        return dataclasses.replace(self, tokens=0) == dataclasses.replace(other, tokens=0)


def device_slug(device_kind: str) -> str:
    return "-".join(device_kind.lower().split())


def _tuned_dirs() -> list[pathlib.Path]:
    here = pathlib.Path(__file__).resolve().parent
    return [here / "configs" / "tuned", here.parent / "configs" / "tuned"]


def table_path(device_kind: str, root: pathlib.Path | None = None) -> pathlib.Path:
    """Where the table of ``device_kind`` is (or would be written, under ``root`` when given)."""
    if root is not None:
        return pathlib.Path(root) / device_slug(device_kind) / "kernel.toml"
    for d in _tuned_dirs():
        p = d / device_slug(device_kind) / "kernel.toml"
        if p.is_file():
            return p
    return _tuned_dirs()[-1] / device_slug(device_kind) / "kernel.toml"


def check_entry_keys(entry: dict, where: str) -> None:
    """A tuned-table entry's keys (``where`` names the entry in the error): a knob name from before issue 35 is refused
    naming the field it became (RENAMED_KERNEL_FIELDS), and any key that is neither a ProblemKey field, a knob,
    median_ms nor model as unknown. load_table and mok-bench's tuned-table writer (mok_jax.bench.tune) both check
    their entries here."""
    renamed = sorted(set(entry) & set(RENAMED_KERNEL_FIELDS))
    if renamed:
        raise ValueError(f"{where} has the key {renamed[0]}: {renamed_kernel_field(renamed[0])}")
    unknown = set(entry) - {f.name for f in dataclasses.fields(ProblemKey)} - set(_KNOBS) - {"median_ms", "model"}
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}")


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> tuple[tuple[ProblemKey, KernelConfig], ...]:
    """The entries of a tuned table (empty when the file is absent). Bad entries raise ValueError."""
    p = pathlib.Path(path)
    if not p.is_file():
        return ()
    with open(p, "rb") as f:
        raw = tomllib.load(f)
    out = []
    key_fields = {f.name for f in dataclasses.fields(ProblemKey)}
    for i, e in enumerate(raw.get("entry", [])):
        check_entry_keys(e, f"{p}: entry {i}")
        try:
            key = ProblemKey(**{k: int(e[k]) for k in key_fields})
        except KeyError as missing:
            raise ValueError(f"{p}: entry {i} lacks {missing}") from None
        out.append((key, KernelConfig(**{k: e[k] for k in _KNOBS if k in e})))
    return tuple(out)


HEURISTIC_MAX_GRANULARITY_EP1 = 4096
HEURISTIC_MAX_GRANULARITY = 2048  # above EP 1
HEURISTIC_COMM_ITEMS = 32


def heuristic(key: ProblemKey) -> KernelConfig:
    """Knobs without a tuned entry. One microbatch up to 4096 tokens at EP 1 and 2048 above it (small microbatches
    cost GEMM efficiency: a rank's experts see fewer rows per tile; a ring slot holds ``ep * G * min(k, L)`` rows,
    the dropless worst case, so above EP 1 the cap stays where it was until a measurement over NVLink says
    otherwise); two ring slots, so that dispatch of the next microbatch overlaps compute of this one; 32
    communication items, so 32 CTAs move rows at a time (the backward's items alike, as the tuner sets both).
    Measured on one H100 (thirty-fourth session, benchmarks/results/forward.md, "Knobs"): qwen3-30b-a3b at 8192
    tokens ran its forward in 1.260 ms with these knobs against 1.466 with the earlier (2048 tokens, 16 items), and
    kimi-k2 at 2048 tokens in 2.775 against 2.854."""
    cap = HEURISTIC_MAX_GRANULARITY_EP1 if key.ep == 1 else HEURISTIC_MAX_GRANULARITY
    g = min(max(512, 64 * math.ceil(min(key.tokens, cap) / 64)), 32768)
    return KernelConfig(granularity=g, comm_items_fwd=HEURISTIC_COMM_ITEMS, comm_items_bwd=HEURISTIC_COMM_ITEMS,
                        ring_slots=2)


def resolve(kernel: KernelConfig | None, key: ProblemKey, device_kind: str | None = None) -> KernelConfig:
    """``kernel`` when given; else the tuned entry of ``key`` on ``device_kind``; else the heuristic."""
    if kernel is not None:
        return kernel
    if device_kind:
        entries = [(k, c) for k, c in load_table(str(table_path(device_kind))) if k.same_shape(key)]
        if entries:
            best = min(entries, key=lambda kc: abs(math.log(kc[0].tokens) - math.log(max(key.tokens, 1))))
            return best[1]
    return heuristic(key)
