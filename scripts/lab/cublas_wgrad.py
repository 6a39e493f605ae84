"""cuBLAS (torch.bmm) on wgrad_pingpong.cu's default problem: 12 groups, out[g] = A_g^T B_g with A_g [1408, 7168] and
B_g [1408, 4096] bf16 (kimi-k2's d_gate_up at T = 2048 on one GPU, 992 GFLOP): the rate the backward's weight-gradient
mainloop is to reach on the same card, and the kernels cuBLAS picks for it (their names give the tile and cluster).
Beside it, dense GEMMs of the same FLOPs: the same rows as one reduction (K = 12 x 1408, one [7168, 4096] output, as a
dense layer's weight gradient), and a forward-like [16896, 7168] x [7168, 4096].
Run it in the same call as wgrad_pingpong, on the same card: python3 scripts/lab/cublas_wgrad.py
Fresh random operands (never zeros), 5 warm-up calls, then the median of 10 samples of 10 calls each.
Ran on one H100 (thirty-third session; the dense cases from a copy of this code, folded in here after): grouped
1.375 / 1.352 ms (722 / 734 TFLOP/s, nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA), then in a second call grouped
1.426 (696), one reduction 1.248 (795), forward-like 1.314 (755)."""
import statistics

import torch

GROUPS, ROWS, M_DIM, N_DIM = 12, 1408, 7168, 4096


def run(name, f, flop):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    ms = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            f()
        e1.record()
        torch.cuda.synchronize()
        ms.append(e0.elapsed_time(e1) / 10)
    med = statistics.median(ms)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    print(f"{name}: median {med:.3f} ms, {flop / med / 1e9:.0f} TFLOP/s; kernels {kernels}")


def main():
    torch.manual_seed(0)
    a = torch.randn(GROUPS, ROWS, M_DIM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GROUPS, ROWS, N_DIM, device="cuda", dtype=torch.bfloat16)
    flop = 2.0 * GROUPS * ROWS * M_DIM * N_DIM
    print(torch.cuda.get_device_name(), f"{flop / 1e9:.1f} GFLOP")
    run("bmm(A^T, B), A [rows, m] and B [rows, n] row-major (the layout the backward has)",
        lambda: torch.bmm(a.transpose(1, 2), b), flop)
    at = a.transpose(1, 2).contiguous()
    run("bmm(At, B), At [m, rows] contiguous", lambda: torch.bmm(at, b), flop)
    a2, b2 = a.view(GROUPS * ROWS, M_DIM), b.view(GROUPS * ROWS, N_DIM)
    run("one GEMM A^T B over all rows (same FLOPs, one [m, n] output)", lambda: torch.mm(a2.t(), b2), flop)
    w = torch.randn(M_DIM, N_DIM, device="cuda", dtype=torch.bfloat16)
    run("one GEMM [rows, m] x [m, n] (forward-like, same FLOPs)", lambda: torch.mm(a2, w), flop)


if __name__ == "__main__":
    main()
