"""The megakernel's knobs in mok-bench: which KernelConfig a mok row runs, the --tune grid, and the tuned table.

A mok row runs ``kernel=None`` unless a knob option is given (``mok_jax.tuning`` then resolves the knobs
inside the layer); with knob options, the knobs left unset come from what ``tuning.resolve`` would pick and
the given ones replace them. Either way the row records the KernelConfig that ran (``resolve_kernel``),
resolved with the ProblemKey that ``mok_jax.moe`` builds: hidden, intermediate, top_k, experts per rank,
ep (the mesh size) and tokens per GPU.

``mok-bench --tune`` times mok over ``grid(tokens)`` for each problem, keeps the fastest median
(``best_entries``) and merges it into ``configs/tuned/<device>/kernel.toml`` (``write_table``): an entry of
the same problem is replaced, the others kept, all sorted by problem.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import tomllib
from typing import Any, Iterable

from mok_jax import tuning
from mok_jax.config import KernelConfig

__all__ = ["KEY_FIELDS", "KNOBS", "TUNE_COMM_ITEMS", "TUNE_GRANULARITIES", "TUNE_RING_SLOTS", "best_entries", "grid",
           "problem_key", "read_entries", "resolve_kernel", "tuned_root", "write_table"]

KEY_FIELDS = tuple(f.name for f in dataclasses.fields(tuning.ProblemKey))
KNOBS = tuple(f.name for f in dataclasses.fields(KernelConfig))
TUNE_GRANULARITIES = (512, 1024, 2048, 4096)
TUNE_COMM_ITEMS = (16, 24, 32, 48)  # 8 was never the fastest; 32 and 48 were on an H100 (thirty-fourth session)
TUNE_RING_SLOTS = (2, 3)


def problem_key(shape, tokens: int) -> tuning.ProblemKey:
    """The ProblemKey mok_jax.moe builds for a bench shape (accounting.BenchShape) at ``tokens`` per GPU."""
    return tuning.ProblemKey(hidden=shape.hidden_size, intermediate=shape.intermediate_size, top_k=shape.top_k,
                             experts_per_rank=shape.experts_per_gpu, ep=shape.num_gpus, tokens=tokens)


def resolve_kernel(key: tuning.ProblemKey, knobs: dict[str, Any] | None,
                   device_kind: str | None) -> tuple[KernelConfig | None, KernelConfig, str]:
    """(what to pass as MoEConfig.kernel, the KernelConfig that runs, where it came from).

    ``knobs`` None: pass None and let the layer resolve; the config is what tuning.resolve gives (source
    "tuned" when the device's table has an entry of this shape, else "heuristic"). Otherwise the resolved
    config with ``knobs`` replaced, passed explicitly (source "explicit")."""
    resolved = tuning.resolve(None, key, device_kind)
    if knobs:
        kernel = resolved.replace(**knobs)
        return kernel, kernel, "explicit"
    tuned = device_kind and any(k.same_shape(key) for k, _ in tuning.load_table(str(tuning.table_path(device_kind))))
    return None, resolved, "tuned" if tuned else "heuristic"


def grid(tokens: int) -> list[dict[str, Any]]:
    """The --tune knob settings for ``tokens`` per GPU: granularity in TUNE_GRANULARITIES clipped to the tokens
    (rounded up to the multiple of 64 the kernel needs, at least 512) and deduplicated, x comm items (forward and
    backward alike) x ring slots; dispatch pull, combine push."""
    cap = max(512, 64 * math.ceil(tokens / 64))
    grans = list(dict.fromkeys(min(g, cap) for g in TUNE_GRANULARITIES))
    return [dict(granularity=g, comm_items_fwd=c, comm_items_bwd=c, ring_slots=r, dispatch="pull", combine="push")
            for g in grans for c in TUNE_COMM_ITEMS for r in TUNE_RING_SLOTS]


def best_entries(results: Iterable[dict]) -> tuple[list[dict], list[str]]:
    """(the fastest ok mok row of each problem as a table entry, the problems left out because part of their
    grid did not run: skipped by --time-budget or a signal). Rows are mok-bench result records."""
    by_problem: dict[tuple, list[dict]] = {}
    for r in results:
        if r["impl"] == "mok" and r["pass"] == "fwd" and r.get("kernel"):
            key = (r["hidden_size"], r["intermediate_size"], r["top_k"], r["experts_per_gpu"], r["num_gpus"],
                   r["tokens_per_gpu"])
            by_problem.setdefault(key, []).append(r)
    entries, incomplete = [], []
    for key, rows in by_problem.items():
        ok = [r for r in rows if r["status"] == "ok"]
        if any(r["status"] == "skipped" for r in rows) or not ok:
            incomplete.append(f"{rows[0]['model']} T={key[-1]}")
            continue
        best = min(ok, key=lambda r: r["median_ms"])
        entries.append({"model": best["model"], **dict(zip(KEY_FIELDS, key)),
                        **{k: best["kernel"][k] for k in KNOBS}, "median_ms": round(best["median_ms"], 4)})
    return entries, incomplete


def tuned_root() -> pathlib.Path:
    """<repo>/configs/tuned: where --tune writes (mok_jax.tuning reads it there too)."""
    return pathlib.Path(tuning.__file__).resolve().parent.parent / "configs" / "tuned"


def _problem(e: dict) -> tuple[int, ...]:
    return tuple(int(e[k]) for k in KEY_FIELDS)


def _check_entry(e: dict, where: str) -> dict:
    tuning.check_entry_keys(e, where)
    missing = [k for k in KEY_FIELDS if k not in e]
    if missing:
        raise ValueError(f"{where}: lacks {missing}")
    tuning.ProblemKey(**{k: int(e[k]) for k in KEY_FIELDS})
    KernelConfig(**{k: e[k] for k in KNOBS if k in e})  # raises for a bad knob
    return dict(e)


def read_entries(path: str | pathlib.Path) -> list[dict]:
    """The raw [[entry]] tables of a tuned table (model and median_ms kept), [] when the file is absent."""
    p = pathlib.Path(path)
    if not p.is_file():
        return []
    with open(p, "rb") as f:
        raw = tomllib.load(f)
    return [_check_entry(e, f"{p}: entry {i}") for i, e in enumerate(raw.get("entry", []))]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's


def write_table(path: str | pathlib.Path, entries: Iterable[dict], *, commit: str, dirty: bool | None = None,
                date: str | None = None) -> list[dict]:
    """Merge ``entries`` into the tuned table at ``path`` and write it (atomically); returns what it holds.

    An existing entry of the same problem (hidden, intermediate, top_k, experts_per_rank, ep, tokens) is
    replaced, the others kept; entries are sorted by problem. The first line says who wrote it:
    ``# written by mok-bench --tune on <date>, commit <sha>``."""
    path = pathlib.Path(path)
    merged = {_problem(e): e for e in read_entries(path)}
    for i, e in enumerate(entries):
        e = _check_entry(e, f"new entry {i}")
        merged[_problem(e)] = e
    date = date or datetime.date.today().isoformat()
    lines = [f"# written by mok-bench --tune on {date}, commit {commit}" + (" (with uncommitted changes)" if dirty
                                                                             else ""),
             "# One [[entry]] per problem (per rank): the knobs that ran its forward fastest, and that median.",
             "# mok_jax.tuning takes the entry of a call's shape whose token count is nearest (in log scale)."]
    order = (("model",), KEY_FIELDS, KNOBS, ("median_ms",))
    out = [merged[k] for k in sorted(merged)]
    for e in out:
        lines += ["", "[[entry]]"]
        lines += [f"{k} = {_toml_value(e[k])}" for group in order for k in group if k in e]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    tuning.load_table.cache_clear()  # the next resolve reads what was just written
    return out
