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
    assert {n: (key, k) for n, key, k in backward.LAUNCHES}["weight grads (2)"] == ("Sm90WeightGrad", 2)


def test_without_a_gpu_says_so_in_one_line(capsys):
    assert backward.main([]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("mok_jax.bench.backward: ")
