"""mok-bench FLOP and byte accounting, on small cases worked by hand and on the figures of the measured H200 tables (benchmarks/results/)."""

import numpy as np
import pytest

from mok_jax import KernelConfig, load_model
from mok_jax.bench import accounting as acc


def _shape(**kw):
    base = dict(model="hand", ep_mode="full", num_gpus=2, experts_per_gpu=2, top_k=2, hidden_size=4,
                intermediate_size=2, shared_size=3)
    return acc.BenchShape(**{**base, **kw})


def test_flops_by_hand():
    s = _shape()
    # T = 5: routed 2*T*k*3*H*I = 2*5*2*3*4*2 = 480; shared 2*T*3*H*Is = 2*5*3*4*3 = 360
    assert acc.flops_per_gpu(s, 5, "fwd") == 480 + 360
    assert acc.flops_per_gpu(s, 5, "fwd+bwd") == 3 * 840  # backward ~ 2x forward
    assert acc.flops_per_gpu(_shape(shared_size=0), 5) == 480  # no shared expert


def test_executed_flops_and_rows_by_hand():
    s = _shape()  # 2 GPUs x 2 experts = 4 experts, k = 2
    # dropless xla runs every (source rank, token) slot of each local expert: E_total*T = 4*5 = 20 rows
    assert acc.executed_rows_per_gpu("xla", s, 5, 1.25) == 20
    # capacity ceil(1.0 * T*k/E) = ceil(10/4) = 3 per (source rank, expert): 4*3 = 12 rows
    assert acc.capacity(5, 2, 4, 1.0) == 3
    assert acc.executed_rows_per_gpu("xla-capacity", s, 5, 1.0) == 12
    assert acc.executed_rows_per_gpu("ragged", s, 5, 1.0) is None
    # 20 rows: 2*20*3*4*2 = 960 routed, plus the shared 360
    assert acc.executed_flops_per_gpu(s, 5, 20, "fwd") == 960 + 360
    assert acc.capacity(1, 1, 100, 0.01) == 1  # never zero slots
    with pytest.raises(ValueError, match="capacity factor"):
        acc.capacity(5, 2, 4, 0.0)


def test_compute_floor_by_hand():
    """At a peak of 1e-9 TFLOP/s (1e3 FLOP/s) a FLOP takes a ms, so the floor in ms is the FLOPs it counts."""
    s = _shape()  # T = 5: routed forward 480 FLOPs, shared 360 (test_flops_by_hand)
    floor = lambda pass_, **kw: acc.compute_floor_ms(s, 5, pass_, peak_tflops=1e-9, **kw)  # noqa: E731
    assert acc.forward_flops_per_gpu(s, 5) == (480, 360)
    assert floor("fwd") == pytest.approx(840) and floor("fwd+bwd") == pytest.approx(3 * 840)
    # fp8 at twice the peak: only the forward's routed GEMMs go faster: 480/2 + 360; fwd+bwd adds the bf16 backward
    assert floor("fwd", precision="fp8", fp8_peak_tflops=2e-9) == pytest.approx(240 + 360)
    assert floor("fwd+bwd", precision="fp8", fp8_peak_tflops=2e-9) == pytest.approx(240 + 360 + 2 * 840)
    assert floor("fwd", precision="bf16", fp8_peak_tflops=2e-9) == pytest.approx(840)  # bf16 ignores the fp8 peak
    with pytest.raises(ValueError, match="fp8_peak_tflops"):
        floor("fwd", precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of bf16, fp8"):
        floor("fwd", precision="int8")


@pytest.mark.parametrize("name", ["kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro"])
def test_fp8_compute_floor_between_the_two_peaks(name):
    """The FP8 layer's floor: at an FP8 peak equal to bf16's, the bf16 floor; at HARDWARE.md's 1477 vs 805 TFLOP/s
    between the all-FP8 floor and the bf16 one, by exactly the routed share's saving."""
    s = acc.bench_shape(load_model(name), 2, "ep64-slice")
    bf16 = acc.compute_floor_ms(s, 2048, "fwd", peak_tflops=805)
    fp8 = acc.compute_floor_ms(s, 2048, "fwd", peak_tflops=805, precision="fp8", fp8_peak_tflops=1477)
    assert acc.compute_floor_ms(s, 2048, "fwd", peak_tflops=805, precision="fp8",
                                fp8_peak_tflops=805) == pytest.approx(bf16)
    assert bf16 * 805 / 1477 < fp8 < bf16
    routed, shared = acc.forward_flops_per_gpu(s, 2048)
    assert bf16 - fp8 == pytest.approx(routed / 805e9 - routed / 1477e9)


def test_bytes_by_hand():
    s = _shape()
    # T*k*H*2 bytes: 5*2*4*2 = 80; half of it remote at 2 GPUs
    assert acc.dispatch_bytes_per_gpu(s, 5) == 80
    assert acc.uniform_remote_fraction(2) == 0.5
    assert acc.uniform_remote_fraction(8) == 7 / 8
    assert acc.uniform_remote_fraction(1) == 0.0
    assert acc.transfers_per_pass("fwd") == 2 and acc.transfers_per_pass("fwd+bwd") == 4


def test_fp8_row_bytes_by_hand():
    # an E4M3 row: H bytes and one f32 scale per 1 x 128 tile (a partial tile still has one)
    assert acc.row_bytes(7168) == 14336 and acc.row_bytes(7168, "fp8") == 7168 + 4 * 56
    assert acc.row_bytes(64, "fp8") == 64 + 4 and acc.row_bytes(200, "fp8") == 200 + 4 * 2
    s = _shape(hidden_size=256)
    assert acc.dispatch_bytes_per_gpu(s, 5, "fp8") == 5 * 2 * (256 + 8)
    # the forward's dispatch in E4M3, its combine and the backward's two transfers in bf16
    assert acc.link_bytes_per_row(256, "fwd") == 2 * 512 and acc.link_bytes_per_row(256, "fwd+bwd") == 4 * 512
    assert acc.link_bytes_per_row(256, "fwd", "fp8") == 264 + 512
    assert acc.link_bytes_per_row(256, "fwd+bwd", "fp8") == 264 + 3 * 512
    with pytest.raises(ValueError, match="precision"):
        acc.row_bytes(256, "fp16")


def test_traffic_by_hand():
    # 2 ranks x 2 experts (rank 0 owns 0,1; rank 1 owns 2,3), 2 tokens per rank, k = 2
    idx = np.array([[0, 2], [2, 3],    # rank 0: t0 -> ranks {0,1}, t1 -> {1,1}
                    [0, 1], [3, 1]])   # rank 1: t2 -> {0,0},   t3 -> {1,0}
    t = acc.routing_traffic(idx, num_gpus=2, experts_per_gpu=2)
    # remote (token, slot) rows: rank 0 sends t0's slot 1 and both of t1's = 3; rank 1 both of t2's + t3's
    # slot 1 = 3
    np.testing.assert_array_equal(t.sent_slots, [3, 3])
    np.testing.assert_array_equal(t.recv_slots, [3, 3])
    # counted once per (token, destination rank): t0, t1 -> rank 1; t2, t3 -> rank 0
    np.testing.assert_array_equal(t.sent_unique, [2, 2])
    np.testing.assert_array_equal(t.recv_unique, [2, 2])
    # rows per owner: rank 0 owns t0.0, t2.0, t2.1, t3.1 = 4; rank 1 the other 4
    np.testing.assert_array_equal(t.owner_rows, [4, 4])
    assert t.link_rows == 3 and t.link_rows_unique == 2 and t.load_imbalance == 1.0


def test_traffic_skewed_by_hand():
    # every token picks experts 0 and 1, both on rank 0: rank 1 sends 2 tokens x 2 slots, rank 0 nothing
    idx = np.tile([0, 1], (4, 1))
    t = acc.routing_traffic(idx, num_gpus=2, experts_per_gpu=2)
    np.testing.assert_array_equal(t.sent_slots, [0, 4])
    np.testing.assert_array_equal(t.recv_slots, [4, 0])
    np.testing.assert_array_equal(t.sent_unique, [0, 2])
    np.testing.assert_array_equal(t.owner_rows, [8, 0])
    assert t.link_rows == 4 and t.link_rows_unique == 2
    assert t.load_imbalance == 2.0  # rank 0 does all 8 rows, the mean is 4


@pytest.mark.parametrize("name,floor_ms", [("kimi-k2", 2.02), ("glm-5", 1.73), ("qwen3.5-397b-a17b", 0.70),
                                           ("deepseek-v4-pro", 2.35)])
def test_compute_floors_match_hardware_md(name, floor_ms):
    s = acc.bench_shape(load_model(name), 2, "ep64-slice")
    ms = acc.flops_per_gpu(s, 2048, "fwd") / 805e12 * 1e3
    assert round(ms, 2) == floor_ms


def test_kimi_dispatch_bytes_match_hardware_md():
    s = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    remote = acc.dispatch_bytes_per_gpu(s, 2048) * acc.uniform_remote_fraction(2)
    assert round(remote / 1e6) == 117  # "117 MB remote"
    assert round(remote / 394e9 * 1e3, 1) == 0.3  # "about 0.3 ms at 394 GB/s"


def test_bench_shape_modes():
    kimi = load_model("kimi-k2")
    s = acc.bench_shape(kimi, 2, "ep64-slice")
    assert (s.experts_per_gpu, s.total_experts) == (6, 12)
    assert acc.bench_shape(kimi, 2, "full").experts_per_gpu == 192
    assert acc.bench_shape(load_model("ci"), 8, "full").total_experts == 16
    with pytest.raises(ValueError, match="fewer than top_k"):
        acc.bench_shape(kimi, 1, "ep64-slice")  # 6 experts < k = 8
    with pytest.raises(ValueError, match="not a multiple of 64"):
        acc.bench_shape(load_model("ci"), 2, "ep64-slice")
    with pytest.raises(ValueError, match="not divisible"):
        acc.bench_shape(load_model("ci"), 3, "full")
    with pytest.raises(ValueError, match="ep mode"):
        acc.bench_shape(kimi, 2, "ep8")


def _hand_model(**kw):
    from mok_jax.config import ModelShape

    base = dict(name="hand", num_experts=8, top_k=2, hidden_size=4, intermediate_size=2, num_shared_experts=1,
                shared_intermediate_size=3)
    return ModelShape(**{**base, **kw})


def test_experts_per_gpu_by_hand():
    # E/2 on 1 GPU: 4 experts there, 4 in all; E/2 of 8 experts is the same as "4"
    s = acc.bench_shape(_hand_model(), 1, "full", experts_per_gpu="E/2")
    assert (s.ep_mode, s.experts_per_gpu, s.total_experts, s.num_gpus) == ("E/2", 4, 4, 1)
    assert acc.bench_shape(_hand_model(), 1, "ep64-slice", experts_per_gpu="4").experts_per_gpu == 4
    # T = 5: useful routed 2*T*k*3*H*I = 2*5*2*3*4*2 = 480, shared 2*T*3*H*Is = 2*5*3*4*3 = 360 (no split in it)
    assert acc.flops_per_gpu(s, 5) == 840
    # dropless xla runs E_total*T = 4*5 = 20 rows: 2*20*3*4*2 = 960, plus the shared 360
    assert acc.executed_rows_per_gpu("xla", s, 5, 1.25) == 20
    assert acc.executed_flops_per_gpu(s, 5, 20) == 960 + 360
    # "3" on 2 GPUs: 6 in all, rows 6*5 = 30: 2*30*3*4*2 = 1440 (full mode would have 8 experts, 40 rows)
    s3 = acc.bench_shape(_hand_model(), 2, "full", experts_per_gpu=3)
    assert (s3.ep_mode, s3.total_experts, acc.executed_rows_per_gpu("xla", s3, 5, 1.25)) == ("3/gpu", 6, 30)
    assert acc.executed_flops_per_gpu(s3, 5, 30) == 1440 + 360
    # capacity ceil(1.0 * 5*2/6) = 2 per (source rank, expert): 6*2 = 12 rows
    assert acc.executed_rows_per_gpu("xla-capacity", s3, 5, 1.0) == 12
    # traffic follows the split: rank 0 owns experts 0..2, rank 1 3..5
    t = acc.routing_traffic(np.array([[0, 3], [1, 2], [4, 5], [2, 5]]), s3.num_gpus, s3.experts_per_gpu)
    np.testing.assert_array_equal(t.sent_slots, [1, 1])  # t0's expert 3; t3's expert 2
    np.testing.assert_array_equal(t.owner_rows, [4, 4])


def test_experts_per_gpu_errors():
    with pytest.raises(ValueError, match=r"--experts-per-gpu E/3: hand has E = 8 experts, which is not divisible"):
        acc.bench_shape(_hand_model(), 1, "full", experts_per_gpu="E/3")
    with pytest.raises(ValueError, match=r"--experts-per-gpu 1: hand on 1 GPU\(s\) would have 1 experts in all, "
                                         r"fewer than top_k=2"):
        acc.bench_shape(_hand_model(), 1, "full", experts_per_gpu=1)
    with pytest.raises(ValueError, match="--experts-per-gpu E/8: .* fewer than top_k=2"):
        acc.bench_shape(_hand_model(), 1, "full", experts_per_gpu="E/8")
    with pytest.raises(ValueError, match="more than hand's 8 experts"):
        acc.bench_shape(_hand_model(), 1, "full", experts_per_gpu="9")
    for bad in ("0", "E/0", "E/", "x/2", "-3", "2.5", ""):
        with pytest.raises(ValueError, match="--experts-per-gpu: cannot read"):
            acc.parse_experts_per_gpu(bad)
    assert acc.parse_experts_per_gpu(" e/32 ") == "E/32" and acc.parse_experts_per_gpu("012") == "12"


@pytest.mark.parametrize("name,experts,fwd_ms,fwd_bwd_ms", [("kimi-k2", 12, 2.02, 6.06), ("glm-5", 8, 1.73, 5.19),
                                                             ("qwen3.5-397b-a17b", 16, 0.70, 2.10),
                                                             ("deepseek-v4-pro", 12, 2.35, 7.05)])
def test_one_gpu_e32_matches_hardware_md(name, experts, fwd_ms, fwd_bwd_ms):
    # The one-H200 layer table (benchmarks/results/forward.md): E/32 experts, the floors of the 2-GPU ep64-slice setting
    model = load_model(name)
    s = acc.bench_shape(model, 1, "ep64-slice", experts_per_gpu="E/32")
    assert s.experts_per_gpu == s.total_experts == experts
    assert s.total_experts == acc.bench_shape(model, 2, "ep64-slice").total_experts
    assert round(acc.flops_per_gpu(s, 2048, "fwd") / 805e12 * 1e3, 2) == fwd_ms
    # the table's fwd+bwd floor is 3x its forward floor as printed (rounded first): ours is 3x the exact one
    assert acc.flops_per_gpu(s, 2048, "fwd+bwd") == 3 * acc.flops_per_gpu(s, 2048, "fwd")
    assert round(3 * fwd_ms, 2) == fwd_bwd_ms
    assert acc.uniform_remote_fraction(s.num_gpus) == 0.0  # one GPU: no link traffic


def test_mok_memory_per_rank():
    from mok_jax import _native
    from mok_jax.config import KernelConfig

    if _native.library() is None:
        pytest.skip(f"sizes come from the native library: {_native.native_status()}")
    from mok_jax.ops.moe_forward import scratch_bytes
    from mok_jax.workspace import CommConfig

    s = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    k = KernelConfig(granularity=512, ring_slots=2)  # 4 microbatches of 512: the ring holds 2 of them
    m = acc.mok_memory_per_rank(s, 2048, k)
    assert m["workspace_bytes_per_rank"] == CommConfig(ep=2, max_tokens=2048, hidden_size=7168, top_k=8,
                                                       num_experts=12).workspace_bytes()
    assert m["scratch_bytes_per_rank"] == scratch_bytes(tokens=2048, hidden=7168, inter=2048, shared_inter=2048,
                                                        top_k=8, local_experts=6, ep=2, kernel=k)
    assert m["residual_bytes_per_rank"] == (2048 * 8 + 128 * 6) * 2 * 2048 * 2  # the default keep ("balanced")
    # the backward op's scratch over M = ep T k + 128 L rows: x, dy and dx rows (bf16 H each), g | u and dgu (bf16
    # 2I each), w h (bf16 I), the router weight and its gradient (f32), the dw partials (f32 per 256 columns of I),
    # then 4 bytes each of 4 * ceil((40 time words + 4 (m-blocks + L) + 2 (L + 1) + 5) / 4) counter words
    rows = 2 * 2048 * 8 + 128 * 6
    per_row = 3 * 7168 * 2 + 2 * 2 * 2048 * 2 + 2048 * 2 + 2 * 4 + 2048 // 256 * 4
    counters = 4 * -(-(60 + 4 * (-(-rows // 128) + 6) + 2 * 7 + 5) // 4) * 4
    assert m["backward_scratch_bytes_per_rank"] == rows * per_row + counters == 2_130_479_616
    # the two bf16 row buffers (dispatch_rows, combine_rows), 2 * ep * T * H * 2 bytes, are most of the workspace
    assert m["workspace_bytes_per_rank"] >= 2 * 2 * 2048 * 7168 * 2
    # a third ring slot costs scratch
    more = acc.mok_memory_per_rank(s, 2048, k.replace(ring_slots=3))["scratch_bytes_per_rank"]
    assert more > m["scratch_bytes_per_rank"]
    # the FP8 layer's scratch is its own ring's (E4M3 rows and their scales)
    fp8 = acc.mok_memory_per_rank(s, 2048, k, precision="fp8")
    assert fp8["scratch_bytes_per_rank"] == scratch_bytes(tokens=2048, hidden=7168, inter=2048, shared_inter=2048,
                                                          top_k=8, local_experts=6, ep=2, kernel=k, fp8=True)
    assert fp8["workspace_bytes_per_rank"] == m["workspace_bytes_per_rank"]


def test_kept_gu_bytes_are_the_kernels_dtype():
    """accounting counts the kept g, u in the dtype the kernels store them in (it imports no jax at its own import)."""
    import jax.numpy as jnp

    from mok_jax.validation import KEPT_GU_DTYPE

    assert acc.KEPT_GU_BYTES == jnp.dtype(KEPT_GU_DTYPE).itemsize


def test_mok_keep_residuals_are_the_kept_bf16_gate_up_rows():
    """mok-keep (MoEConfig(keep="everything")) keeps bf16 [ep T k + 128 L, 2I] per rank, the default ("balanced")
    bf16 [T k + 128 L, 2I] whatever the EP size, keep="nothing" none."""
    s = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    T = 2048
    kept = acc.mok_memory_per_rank(s, T, KernelConfig(), keep="everything")["residual_bytes_per_rank"]
    assert kept == (2 * T * 8 + 128 * s.experts_per_gpu) * 2 * 2048 * 2
    balanced = acc.mok_memory_per_rank(s, T, KernelConfig(), keep="balanced")["residual_bytes_per_rank"]
    assert balanced == (T * 8 + 128 * s.experts_per_gpu) * 2 * 2048 * 2
    assert acc.mok_memory_per_rank(s, T, KernelConfig(), keep="nothing")["residual_bytes_per_rank"] == 0


def test_mok_backward_scratch_takes_the_kept_gate_up_as_its_own():
    """At EP 1 keep="everything" and the default hand the backward op the kept g, u as its g, u scratch (XLA aliases
    them): bf16 [M, 2I] less than keep="nothing"; at EP 2 the default keeps only the first T k + 128 L rows, so the op
    has its own; the forward's knobs do not change it (M is the layout's)."""
    one = acc.bench_shape(load_model("kimi-k2"), 1, "ep64-slice", experts_per_gpu="E/32")  # 12 experts, EP 1
    backward = lambda s, keep, k=KernelConfig(): acc.mok_memory_per_rank(  # noqa: E731
        s, 2048, k, keep=keep)["backward_scratch_bytes_per_rank"]
    gu = (2048 * 8 + 128 * 12) * 2 * 2048 * 2
    assert backward(one, "nothing") - backward(one, "everything") == gu
    assert backward(one, "balanced") == backward(one, "everything")
    two = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    assert backward(two, "balanced") == backward(two, "nothing") > backward(two, "everything")
    assert backward(two, "balanced", KernelConfig(granularity=512, ring_slots=3)) == backward(two, "balanced")
    assert acc.mok_memory_per_rank(two, 2048, KernelConfig(), precision="fp8")["backward_scratch_bytes_per_rank"] == (
        backward(two, "nothing"))  # the FP8 layer's backward is the bf16 one, recomputing


def test_mok_ring_residuals_are_the_ring_tokens_rows():
    """mok-ring (MoEConfig(keep="ring")) keeps bf16 [ep T' k, 2I] for the ring's T' tokens per rank: with 8192
    tokens in microbatches of 2048 and 3 ring slots the last 6144; when every token fits, what mok-keep keeps."""
    s = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    ring = lambda T, g, slots: acc.mok_memory_per_rank(  # noqa: E731
        s, T, KernelConfig(granularity=g, ring_slots=slots), keep="ring")["residual_bytes_per_rank"]
    assert ring(8192, 2048, 3) == 2 * 6144 * 8 * 2 * 2048 * 2
    assert ring(2048, 2048, 3) == acc.mok_memory_per_rank(s, 2048, KernelConfig(), keep="everything")[
        "residual_bytes_per_rank"]


def test_fp8_weight_bytes_are_the_quantised_arrays():
    """fp8_weight_bytes_per_rank counts the arrays mok_jax.fp8.quantize_expert_weights makes (E4M3 values and f32
    block scales), and by hand for kimi-k2's 6 experts per GPU: 3*H*I bytes + 4*(2*16*56 + 56*16) per expert."""
    import jax
    import jax.numpy as jnp

    from mok_jax.fp8 import quantize_expert_weights

    s = _shape(experts_per_gpu=3, hidden_size=256, intermediate_size=384)
    arrays = jax.eval_shape(quantize_expert_weights, jax.ShapeDtypeStruct((3, 256, 768), jnp.bfloat16),
                            jax.ShapeDtypeStruct((3, 384, 256), jnp.bfloat16))
    assert acc.fp8_weight_bytes_per_rank(s) == sum(a.size * a.dtype.itemsize for a in arrays)
    kimi = acc.bench_shape(load_model("kimi-k2"), 2, "ep64-slice")
    assert acc.fp8_weight_bytes_per_rank(kimi) == 6 * (3 * 7168 * 2048 + 4 * (2 * 16 * 56 + 56 * 16))
    assert acc.mok_memory_per_rank(kimi, 2048, KernelConfig(), precision="fp8")["fp8_weight_bytes_per_rank"] == (
        acc.fp8_weight_bytes_per_rank(kimi))
    assert acc.mok_memory_per_rank(kimi, 2048, KernelConfig())["fp8_weight_bytes_per_rank"] is None
    assert acc.mok_memory_per_rank(kimi, 2048, KernelConfig(), precision="fp8")["residual_bytes_per_rank"] == 0
    with pytest.raises(ValueError, match="precision"):
        acc.mok_memory_per_rank(kimi, 2048, KernelConfig(), precision="e5m2")


def test_min_bytes_per_gpu_counts_what_every_implementation_holds():
    # ci (H 64, I 32, Is 48, k 4) on 2 GPUs, full: 8 experts per GPU; T = 16
    shape = acc.bench_shape(load_model("ci"), 2, "full")
    weights = (8 * 3 * 64 * 32 + 3 * 64 * 48) * 2
    assert acc.min_bytes_per_gpu(shape, 16, "fwd") == 16 * 64 * 2 * 2 + 16 * 4 * 8 + weights  # x, y; ids, weights
    # fwd+bwd: x, dy, dx; the routing and its weights' gradient; the weights and theirs
    assert acc.min_bytes_per_gpu(shape, 16, "fwd+bwd") == 16 * 64 * 2 * 3 + 16 * 4 * 12 + 2 * weights
    with pytest.raises(ValueError, match="pass"):
        acc.min_bytes_per_gpu(shape, 16, "bwd")
