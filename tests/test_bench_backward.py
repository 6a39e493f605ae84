"""mok_jax.bench.backward on the CPU: its trace reading on synthetic profiler events, and its one-line refusal
without a GPU (the timing itself needs the H200)."""

from mok_jax.bench import backward
from mok_jax.bench.breakdown import _kernel_times


def _events():
    gpu, host = 7, 1
    ev = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}}]
    t = 0
    for _ in range(2):  # two calls of the op: one gather, two weight-gradient launches each
        for name, dur in (("gather_rows_kernel(...)", 200), ("Sm90WeightGrad a", 1000), ("Sm90WeightGrad b", 1200)):
            ev.append({"ph": "X", "name": name, "pid": gpu, "ts": t, "dur": dur})
            t += dur
    ev.append({"ph": "X", "name": "gather_rows_kernel(...)", "pid": host, "ts": t, "dur": 5})  # host-side: not a kernel
    return ev


def test_kernel_times_and_top_kernels_per_call():
    ev = _events()
    assert _kernel_times(ev, "Sm90WeightGrad") == [1.0, 1.2, 1.0, 1.2]
    top = backward._top_kernels(ev, calls=2)
    assert top == [("Sm90WeightGrad b", 1.2, 1), ("Sm90WeightGrad a", 1.0, 1), ("gather_rows_kernel(...)", 0.2, 1)]
    assert [(key, k) for _, key, k in backward.LAUNCHES] == [("experts_backward_kernel", 1)]


def test_without_a_gpu_says_so_in_one_line(capsys):
    assert backward.main([]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("mok_jax.bench.backward: ")


def test_table_reports_the_keep_settings_against_dense():
    ms = lambda v: {"ms": v}  # noqa: E731
    case = {"model": "kimi-k2", "tokens": 2048, "E": 12, "fwd_flops": 1e12, "dense fwd": ms(1.6), "fwd": ms(2.0),
            "dense fwd+bwd": ms(6.0), "fwd+bwd": ms(7.5), "fwd+bwd recompute": ms(9.0), "fwd+bwd keep": ms(7.5),
            "fwd+bwd ring": ms(8.1), "experts op": ms(5.0), "op_flops": 4e12, "kept_bytes": 294_000_000,
            "ring_kept_bytes": 201_000_000}
    lines = backward.table({"dense": {"tflops": 500.0}, "cases": [case]}).splitlines()
    assert lines[0] == "dense bf16 8192^3 GEMM: 500 TFLOP/s"
    assert "kept MB" in lines[2] and lines[2].endswith("ring  ring MB")
    row = lines[3].split()
    # fwd 2.0 against 1.6 dense: 1.25x; fwd+bwd 7.5 against 6.0: 1.25x, recompute 9.0: 1.5x; backward 5.5 ms; the op
    # 4 TFLOP in 5 ms; keep 7.5 with 294 MB; ring 8.1 with 201 MB
    assert row[:12] == ["kimi-k2", "2048", "12", "1.600", "2.000", "1.250x", "6.000", "7.500", "1.250x", "9.000",
                        "1.500x", "5.500"]
    assert row[12:] == ["5.000", "800", "7.500", "294", "8.100", "201"]


def test_timeline_finds_the_idle_gaps_between_device_events():
    """Span, busy time (the union of overlapping device events) and the gaps between them, per call; host events
    do not count."""
    gpu, host = 7, 1
    ev = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}}]
    for t0 in (0, 100):  # two calls: a, b overlapping a, then c after a 10 us gap
        ev += [{"ph": "X", "name": "a", "pid": gpu, "ts": t0, "dur": 40},
               {"ph": "X", "name": "b", "pid": gpu, "ts": t0 + 30, "dur": 20},
               {"ph": "X", "name": "c", "pid": gpu, "ts": t0 + 60, "dur": 30}]
    ev.append({"ph": "X", "name": "host", "pid": host, "ts": 500, "dur": 50})
    tl = backward._timeline(ev, calls=2)
    # span 0..190 us, busy 2 x (50 + 30) = 160 us: per call 95 us span, 80 busy, 15 idle
    assert (tl["span_ms"], tl["busy_ms"], tl["events"]) == (0.095, 0.08, 3)
    assert abs(tl["idle_ms"] - 0.015) < 1e-12
    assert tl["gaps_us"] == [("b -> c", 10.0), ("c -> a", 5.0)]


def test_clock_samples_parse_mhz_watts_and_reasons():
    from mok_jax.bench.breakdown import _Clocks, _parse_clock_line

    assert _parse_clock_line("1980, 412.30, 0x0000000000000000\n") == (1980.0, 412.3, 0)
    assert _parse_clock_line("1215, 280.1, 0x0000000000000024") == (1215.0, 280.1, 0x24)
    assert _parse_clock_line("1215, 280.1, [N/A]") == (1215.0, 280.1, 0)
    assert _parse_clock_line("[N/A], [N/A], [N/A]") is None
    clk = _Clocks()
    clk.samples = [(1980.0, 300.0, 0), (1215.0, 280.0, 0x24), (1500.0, 290.0, 0x4)]
    got = clk.summary()
    assert (got["sm_mhz"], got["sm_mhz_min"], got["watts"]) == (1500.0, 1215.0, 290.0)
    assert got["clock_reasons"] == ["sw power cap", "sw thermal"]


def test_op_args_and_item_ms_as_the_bench_uses_them():
    """The op's arguments are the layer's at EP 1 (the padded layout of the routing, f32 weights, the shared
    expert's weights), and the counters become ms per SM."""
    import jax.numpy as jnp
    import numpy as np

    from mok_jax.bench.breakdown import _problem
    from mok_jax.expert_layout import padded_layout
    from mok_jax.ops.moe_backward import EXPERTS_BACKWARD_GROUP_ALIGN, ITEM_KINDS

    m, x, idx, w, W, _ = _problem("ci", 32, 0, 4)
    dy = jnp.ones_like(x)
    (xa, dya, w32, pos, src_slot, sizes, gu, dn), shared = backward.op_args(x, dy, idx, w, W)
    lay = padded_layout(idx, 4, block=EXPERTS_BACKWARD_GROUP_ALIGN)
    assert xa is x and dya is dy and gu is W.gate_up and dn is W.down and w32.dtype == jnp.float32
    for got, want in ((pos, lay.pos), (src_slot, lay.src_slot), (sizes, lay.group_sizes)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert set(shared) == ({"shared_gate_up", "shared_down"} if W.has_shared else set())
    ns = np.zeros((3, len(ITEM_KINDS)), np.uint64)
    ns[0, 1], ns[1, 2], ns[2, 3] = 132_000_000, 264_000_000, 66_000_000  # summed over 132 CTAs (the CPU has none)
    ms = backward.item_ms(ns)
    assert list(ms) == list(ITEM_KINDS)
    assert ms[ITEM_KINDS[1]] == {"busy_ms": 1.0, "wait_ms": 0.0, "epilogue_ms": 0.0}
    assert ms[ITEM_KINDS[2]]["wait_ms"] == 2.0 and ms[ITEM_KINDS[3]]["epilogue_ms"] == 0.5


def test_item_bytes_model():
    """The bytes model against the numbers worked out by hand in training.md (qwen3-30b-a3b at 8192 tokens, 16
    experts, kept g | u; kimi-k2's routed rows with its shared expert)."""
    mb = lambda d: {k: round(v / 1e6) for k, v in d.items()}  # noqa: E731
    q = backward.item_bytes(65536, 8192, 2048, 768, kept=True)
    assert mb(q) == {"gather": 1074, "down dgrad + SwiGLU bwd": 772, "gate/up dgrad": 470, "d_down": 369,
                     "d_gate_up": 470, "slot sum": 336}
    # without kept g | u the recompute reads the x rows and writes g | u: M H 2 + M 2I 2 bytes
    assert backward.item_bytes(65536, 8192, 2048, 768, kept=False)["gate/up recompute"] == 65536 * (2048 + 1536) * 2
    k = backward.item_bytes(16384, 2048, 7168, 2048, kept=True, shared_inter=2048)
    assert mb(k) == {"gather": 940, "gate/up recompute": 46, "down dgrad + SwiGLU bwd": 642, "gate/up dgrad": 445,
                     "d_down": 340, "d_gate_up": 415, "slot sum": 352}


def test_table_prints_each_items_rate_by_the_model():
    ms = lambda v: {"ms": v}  # noqa: E731
    items = {"gather": {"busy_ms": 0.5, "wait_ms": 0.0, "epilogue_ms": 0.0},
             "d_down": {"busy_ms": 0.0, "wait_ms": 0.0, "epilogue_ms": 0.0}}
    case = {"model": "m", "tokens": 8, "E": 2, "fwd_flops": 1e9, "dense fwd": ms(1.0), "fwd": ms(1.0),
            "dense fwd+bwd": ms(2.0), "fwd+bwd": ms(2.0), "fwd+bwd recompute": ms(2.0), "fwd+bwd keep": ms(2.0),
            "fwd+bwd ring": ms(2.0), "experts op": ms(1.0), "op_flops": 1e9, "kept_bytes": 0, "ring_kept_bytes": 0,
            "items kept": items, "item_bytes": {"items kept": {"gather": 1_500_000_000, "d_down": 7}}}
    lines = backward.table({"dense": {}, "cases": [case]}).splitlines()
    rate = [ln for ln in lines if "bytes by the model" in ln]
    # 1.5 GB in 0.5 ms: 3.00 TB/s; d_down has no ms in items, so no rate
    assert len(rate) == 1 and rate[0].split(": ", 1)[1] == "gather 1500 MB 3.00 TB/s"
