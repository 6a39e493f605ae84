"""Dispatch and combine alone on the GPUs of one process: ``python -m mok_jax.bench.comm``.

Measures, per EP size (``--ranks``: every visible GPU by default, or a list such as ``8,4,2``), op
(dispatch, combine), mode (pull, push), tokens per GPU and communication SM count:
the time per call (``reps`` calls unrolled in one jitted program, timed with ``time_fn``, divided by
``reps``) and the unique remote bytes per second per GPU: token rows that must cross NVLink,
counted once per destination rank (dispatch: rows a rank receives from other ranks; combine: the
partial rows it receives back; the same count for uniform routing). Reported against the measured
394 GB/s peer-copy bandwidth of the 2-GPU H200 machine, next to XLA's ``all_to_all`` of the same bytes in the
same process. ``--experts-per-gpu`` fixes the local experts and lets E grow with the EP size (the
ep64-slice setting: kimi-k2's 384/64 = 6 per GPU). On NVSwitch machines (4 or 8 GPUs) the 394 GB/s is
the 2-GPU NV18 figure, not a measurement of that machine: ``--peer-gbps`` replaces it.
Without a CUDA GPU (or the native library) it says so in one line and exits 1.

Also holds the seeded routing cases and self-identifying token rows that the comm tests share.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mok_jax.bench.timing import kernels_unavailable

__all__ = ["ROUTING_KINDS", "experts_for", "main", "parse_ranks", "routing_case", "self_identifying_tokens",
           "unique_remote_rows"]

PEER_COPY_GBPS = 394.0  # measured on the 2-GPU H200 machine: copy-engine peer copy GPU0 -> GPU1, one direction
ROUTING_KINDS = ("uniform", "zipf", "one-expert", "sparse-experts", "with-invalid")


def routing_case(kind: str, *, ep: int, tokens: int, top_k: int, num_experts: int,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(topk_idx int32[ep, T, k], topk_weight f32[ep, T, k]) of a seeded routing.

    uniform: k distinct experts uniformly at random; zipf: k distinct experts, popularity 1/rank^1.2
    (Gumbel top-k; the popular experts land on random ranks); one-expert: slot j of every token picks
    expert (j + 1) mod E, so with k = 1 every token goes to expert 1; sparse-experts: only every third
    expert is ever picked (the others get zero tokens); with-invalid: uniform, then about 10% of the
    slots set to -1 (nobody receives them)."""
    rng = np.random.default_rng(seed)
    n = ep * tokens
    if kind in ("uniform", "with-invalid"):
        idx = np.argsort(rng.random((n, num_experts)), axis=1)[:, :top_k]
    elif kind == "zipf":
        pop = rng.permutation(num_experts)
        scores = -1.2 * np.log1p(pop.astype(np.float64))[None, :] + rng.gumbel(size=(n, num_experts))
        idx = np.argsort(-scores, axis=1)[:, :top_k]
    elif kind == "one-expert":
        idx = np.tile((np.arange(top_k) + 1) % num_experts, (n, 1))
    elif kind == "sparse-experts":
        allowed = np.arange(0, num_experts, 3)
        if top_k > allowed.size:
            raise ValueError(f"sparse-experts needs top_k <= {allowed.size}")
        idx = allowed[np.argsort(rng.random((n, allowed.size)), axis=1)[:, :top_k]]
    else:
        raise ValueError(f"unknown routing kind {kind!r}; known: {ROUTING_KINDS}")
    idx = idx.astype(np.int32)
    if kind == "with-invalid":
        idx = np.where(rng.random(idx.shape) < 0.1, np.int32(-1), idx)
    w = rng.random((n, top_k)).astype(np.float32) + 0.05
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    return idx.reshape(ep, tokens, top_k), w.reshape(ep, tokens, top_k)


def self_identifying_tokens(ep: int, tokens: int, hidden: int, seed: int = 0) -> np.ndarray:
    """bf16[ep, T, H]: column 0 = rank + 1, column 1 = t % 256, column 2 = t // 256 (exact in bf16),
    the rest random normal, so a misplaced row names its source rank and token."""
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((ep, tokens, hidden)).astype(np.float32)
    t = np.arange(tokens)
    x[:, :, 0] = (np.arange(ep) + 1)[:, None]
    x[:, :, 1] = (t % 256)[None, :]
    x[:, :, 2] = (t // 256)[None, :]
    return x.astype(ml_dtypes.bfloat16)


def decode_row(row: np.ndarray) -> str:
    r = row.astype(np.float32)
    return f"(rank {int(r[0]) - 1}, token {int(r[1]) + 256 * int(r[2])})"


def unique_remote_rows(idx: np.ndarray, num_experts: int) -> np.ndarray:
    """int[ep]: per receiving rank r, the tokens of other ranks that need r (rows crossing NVLink)."""
    ep = idx.shape[0]
    num_local = num_experts // ep
    valid = (idx >= 0) & (idx < num_experts)
    owner = np.where(valid, idx // num_local, -1)
    out = np.zeros(ep, np.int64)
    for r in range(ep):
        needs = np.any(owner == r, axis=-1)  # [ep(src), T]
        out[r] = sum(int(needs[s].sum()) for s in range(ep) if s != r)
    return out


@dataclasses.dataclass
class Record:
    op: str
    mode: str
    tokens: int
    num_sms: int
    time_us: float
    remote_bytes_per_gpu: float
    gbps: float
    pct_peer: float
    zero_padding: bool = True
    note: str = ""
    ep: int = 0         # EP size (GPUs of the group)
    experts: int = 0    # E of the run (E / ep per GPU)


def parse_ranks(spec: str | int | None, num_gpus: int) -> list[int]:
    """EP sizes of a run, in the order given: '' / 0 / None / 'all' = every visible GPU, else a comma
    list of ints ('all' allowed inside: '8,4,2' or 'all,2'); duplicates dropped."""
    spec = "" if spec is None else str(spec)
    out: list[int] = []
    for tok in (spec.split(",") if spec.strip() else ["all"]):
        tok = tok.strip()
        if not tok:
            continue
        n = num_gpus if tok in ("all", "0") else int(tok)
        if n < 1:
            raise ValueError(f"--ranks: EP sizes must be >= 1, got {tok!r}")
        if n not in out:
            out.append(n)
    return out


def experts_for(ep: int, experts: int, experts_per_gpu: int = 0) -> int:
    """E of a run at EP size ep: experts_per_gpu * ep when given, else ``experts`` (a multiple of ep)."""
    if experts_per_gpu:
        return experts_per_gpu * ep
    if experts % ep:
        raise ValueError(f"--experts {experts} is not a multiple of EP {ep}; use --experts-per-gpu")
    return experts


def _shard(mesh, arr):
    return jax.device_put(arr, NamedSharding(mesh, P("ep")))


def run(args, save=None) -> tuple[list[Record], dict[int, str]]:
    """Every EP size of ``--ranks`` in turn, each with an equal share of what is left of --budget-s.
    Returns the records and {EP size: error} for sizes that failed (the others still run);
    ``save(records, errors)`` is called after each size so a run cut short keeps what it measured."""
    gpus = jax.devices()
    sizes = parse_ranks(args.ranks, len(gpus))
    if gpus[0].platform != "gpu" or len(gpus) < max(sizes):
        raise SystemExit(f"needs {max(sizes)} GPUs, this process sees {gpus}")
    records: list[Record] = []
    errors: dict[int, str] = {}
    start = time.monotonic()
    for n, ep in enumerate(sizes):
        share = max(args.budget_s - (time.monotonic() - start), 0.0) / (len(sizes) - n)
        deadline = time.monotonic() + share
        try:
            E = experts_for(ep, args.experts, args.experts_per_gpu)
            print(f"[bench] EP {ep}: {E} experts ({E // ep} per GPU), {share:.0f} s", flush=True)
            _run_ep(args, Mesh(np.array(gpus[:ep]), ("ep",)), ep, E, deadline, records)
        except Exception as e:  # noqa: BLE001 - one EP size failing must not lose the others
            errors[ep] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[bench] EP {ep} FAILED: {errors[ep]}", flush=True)
        if save is not None:
            save(records, errors)
    return records, errors


def _run_ep(args, mesh, ep: int, E: int, deadline: float, records: list[Record]) -> None:
    """Appends the records of one EP size to ``records`` as they are measured."""
    from mok_jax import ops
    from mok_jax.bench.timing import time_fn
    from mok_jax.workspace import Workspace

    H, k = args.hidden, args.top_k
    peer = args.peer_gbps
    tokens_list = [int(t) for t in args.tokens.split(",")]
    sms_list = [int(s) for s in args.sms.split(",")]
    t_max = max(tokens_list + [args.sweep_tokens])
    reps = args.reps

    def timed(fn, *a):
        t = time_fn(fn, *a, warmup=2, samples=args.samples, target_sample_ms=10.0, max_calls_per_sample=16)
        return t.median_ms * 1e3 / reps

    def record(op, mode, T, sms, us, rbytes, **kw) -> Record:
        gbps = rbytes / (us * 1e-6) / 1e9
        rec = Record(op, mode, T, sms, us, rbytes, gbps, 100.0 * gbps / peer, ep=ep, experts=E, **kw)
        records.append(rec)
        return rec

    with Workspace.create(mesh, "ep", max_tokens=t_max, hidden_size=H, top_k=k, num_experts=E,
                          timeout_s=args.timeout_s) as ws:
        spec = P("ep")
        cache: dict[int, tuple] = {}

        def inputs(T):
            if T not in cache:
                idx, w = routing_case(args.routing, ep=ep, tokens=T, top_k=k, num_experts=E, seed=T)
                x = self_identifying_tokens(ep, T, H, seed=T)
                rows = unique_remote_rows(idx, E)
                cache.clear()  # keep one size on the devices at a time
                cache[T] = (_shard(mesh, x.reshape(ep * T, H)), _shard(mesh, idx.reshape(ep * T, k)),
                            _shard(mesh, w.reshape(ep * T, k)), float(rows.mean()) * H * 2)
            return cache[T]

        def dispatch_fn(mode, sms, zero_padding=True, token_major=False):
            def body(x, i, w):
                st = [ops.dispatch(ws, x, i, w, mode=mode, num_sms=sms, zero_padding=zero_padding,
                                   token_major=token_major)[1].status for _ in range(reps)]
                return jnp.stack(st)[None]
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))

        def layout_fn():
            def body(x, i, w):
                recv, lay = ops.dispatch(ws, x, i, w)
                return recv, lay.row_table, lay.row_weight, lay.status[None]
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))

        def combine_fn(mode, sms):
            def body(recv, table, weight, i, gs):
                lay = ops.DispatchLayout(gs, table, weight, jnp.zeros(0, jnp.int32), i, jnp.zeros(4, jnp.int32))
                st = [ops.combine(ws, recv, lay, mode=mode, num_sms=sms)[1] for _ in range(reps)]
                return jnp.stack(st)[None]
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False))

        def a2a_fn():
            def body(a):
                for _ in range(reps):
                    a = jax.lax.all_to_all(a, "ep", 0, 0, tiled=False)
                return a
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

        def measure(T, sms, ops_modes):
            x, i, w, rbytes = inputs(T)
            layout = None
            for op, mode in ops_modes:
                if time.monotonic() > deadline:
                    print(f"[bench] EP {ep} budget exhausted: skipping {op} {mode} T={T} sms={sms}", flush=True)
                    return
                if op == "dispatch":
                    fn = dispatch_fn(mode, sms)
                    us = timed(fn, x, i, w)
                    status = np.asarray(fn(x, i, w))
                else:
                    if layout is None:
                        recv, table, weight, st0 = layout_fn()(x, i, w)
                        layout = (recv, table, weight, i, _shard(mesh, np.zeros((ep * (E // ep),), np.int32)))
                        if np.any(np.asarray(st0)):
                            raise RuntimeError(f"dispatch status {np.asarray(st0)}")
                    fn = combine_fn(mode, sms)
                    us = timed(fn, *layout)
                    status = np.asarray(fn(*layout))
                if np.any(status):
                    raise RuntimeError(f"{op} {mode} T={T} sms={sms}: status {status.reshape(-1, 4)[:4]}")
                rec = record(op, mode, T, sms, us, rbytes)
                print(f"[bench] EP {ep} {op:8s} {mode:4s} T={T:6d} sms={sms:3d}: {us:9.1f} us  {rec.gbps:7.1f} GB/s "
                      f"({rec.pct_peer:5.1f}% of {peer:.0f})", flush=True)

        both = [("dispatch", "pull"), ("dispatch", "push"), ("combine", "push"), ("combine", "pull")]
        # 1. the goal point and the SM sweep
        for sms in sms_list:
            measure(args.sweep_tokens, sms, both)
        # 2. tokens sweep at the default SM count
        for T in tokens_list:
            if T != args.sweep_tokens:
                measure(T, args.default_sms, both)
        # 3. zero_padding off at the goal point, per SM count: what the megakernel would need, and (by
        #    difference) the time the SMs take to store the padding rows alone (per-SM store throughput)
        x, i, w, rbytes = inputs(args.sweep_tokens)
        for sms in sms_list:
            for mode in ("pull",) if sms != args.default_sms else ("pull", "push"):
                if time.monotonic() > deadline:
                    break
                us = timed(dispatch_fn(mode, sms, zero_padding=False), x, i, w)
                rec = record("dispatch", mode, args.sweep_tokens, sms, us, rbytes, zero_padding=False)
                print(f"[bench] EP {ep} dispatch {mode} T={args.sweep_tokens} sms={sms:3d} no padding: {us:9.1f} us "
                      f"{rec.gbps:7.1f} GB/s", flush=True)
        # 4. token-major dispatch (one row per (source, token), no expansion): what a row-gathering
        #    grouped GEMM would consume
        for sms in sms_list:
            for mode in ("pull", "push"):
                if time.monotonic() > deadline:
                    break
                us = timed(dispatch_fn(mode, sms, token_major=True), x, i, w)
                rec = record("dispatch", mode, args.sweep_tokens, sms, us, rbytes, note="token_major")
                print(f"[bench] EP {ep} dispatch {mode} T={args.sweep_tokens} sms={sms:3d} token-major: {us:9.1f} us "
                      f"{rec.gbps:7.1f} GB/s ({rec.pct_peer:5.1f}%)", flush=True)
        # 5. XLA all_to_all of the same remote bytes: [ep, T, H] per GPU, (ep-1)/ep of it remote
        for T in sorted(set(tokens_list)):
            if time.monotonic() > deadline:
                break
            a = _shard(mesh, np.ones((ep * ep, T, H), ml_dtypes.bfloat16))
            us = timed(a2a_fn(), a)
            rec = record("xla_all_to_all", "-", T, 0, us, (ep - 1) * T * H * 2)
            print(f"[bench] EP {ep} all_to_all       T={T:6d}        : {us:9.1f} us  {rec.gbps:7.1f} GB/s", flush=True)
            del a


def table(records: list[Record], peer_gbps: float = PEER_COPY_GBPS) -> str:
    lines = ["| EP | experts | op | mode | tokens/GPU | SMs | time (us) | unique remote GB/s per GPU | "
             f"% of {peer_gbps:.0f} GB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        op = r.op + ("" if r.zero_padding else " (no zero padding)") + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.ep} | {r.experts} | {op} | {r.mode} | {r.tokens} | {r.num_sms or '-'} | {r.time_us:.1f} | "
                     f"{r.gbps:.1f} | {r.pct_peer:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--sms", default="24,32,16,8,4", help="SM counts swept at --sweep-tokens")
    ap.add_argument("--sweep-tokens", type=int, default=4096)
    ap.add_argument("--default-sms", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=12, help="E (a multiple of every EP size); see --experts-per-gpu")
    ap.add_argument("--experts-per-gpu", type=int, default=0,
                    help="E = this x EP size, overriding --experts (6 = kimi-k2 in ep64-slice: 384/64)")
    ap.add_argument("--routing", default="uniform", choices=ROUTING_KINDS)
    ap.add_argument("--ranks", default="", help="EP sizes, run in this order: '8,4,2', 'all,2' (default: every "
                    "visible GPU)")
    ap.add_argument("--reps", type=int, default=8, help="calls unrolled per timed program")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new measurements after this "
                    "(shared equally by the EP sizes)")
    ap.add_argument("--peer-gbps", type=float, default=PEER_COPY_GBPS,
                    help="per-GPU peer bandwidth that %% of peer refers to (default: 2-GPU NV18 measurement)")
    ap.add_argument("--out", default="out/comm_ep2/comm.json")
    args = ap.parse_args(argv)
    if args.experts_per_gpu < 0:
        ap.error("--experts-per-gpu must be >= 0")
    if why := kernels_unavailable():
        print(f"python -m mok_jax.bench.comm: {why}", file=sys.stderr, flush=True)
        return 1
    t0 = time.monotonic()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m mok_jax.bench.comm " + " ".join(argv if argv is not None else sys.argv[1:])

    def save(records: list[Record], errors: dict[int, str]) -> str:
        meta = dict(device=str(jax.devices()[0].device_kind), num_devices=len(jax.devices()), hidden=args.hidden,
                    top_k=args.top_k, experts=args.experts, experts_per_gpu=args.experts_per_gpu,
                    ranks=sorted({r.ep for r in records}, reverse=True), errors={str(k): v for k, v in errors.items()},
                    routing=args.routing, reps=args.reps, peer_copy_gbps=args.peer_gbps, jax=jax.__version__,
                    wall_s=time.monotonic() - t0, command=command)
        out.write_text(json.dumps(dict(meta=meta, records=[dataclasses.asdict(r) for r in records]), indent=1))
        md = table(records, args.peer_gbps)
        out.with_suffix(".md").write_text(f"# comm benchmark\n\n```\n{json.dumps(meta, indent=1)}\n```\n\n{md}\n")
        return md

    records, errors = run(args, save)
    print(save(records, errors))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
