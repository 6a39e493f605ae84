"""mok_jax.bench.train_step on the CPU: its NNX training step trains (with the xla-capacity layer at the ci shape),
its table, and its one-line refusal without a GPU (the steps per second need the H200)."""

import math

import pytest

from mok_jax.bench import train_step
from mok_jax.config import load_model


def test_the_step_trains_the_model():
    """Two layers at the ci shape, 64 tokens: every loss finite, the last below the first (adam on a fixed batch)."""
    shape = load_model("ci")
    case = train_step._case("xla-capacity", shape, shape.num_experts, layers=2, tokens=64, steps=2, samples=2,
                            seed=0)
    assert len(case["losses"]) == 2 + 2 and all(math.isfinite(v) for v in case["losses"])
    assert case["last_loss"] < case["first_loss"], case["losses"]
    assert case["ms_per_step"] > 0 and case["steps_per_s"] == pytest.approx(1e3 / case["ms_per_step"])


def test_table_gives_the_ratio_to_the_first_implementation():
    cases = [dict(impl="mok", ms_per_step=40.0, steps_per_s=25.0, first_loss=1.0, last_loss=0.5),
             dict(impl="xla-capacity", ms_per_step=60.0, steps_per_s=16.67, first_loss=1.0, last_loss=0.5)]
    res = dict(model="kimi-k2", layers=4, tokens=2048, experts=12, device="H200", cases=cases)
    lines = train_step.table(res).splitlines()
    assert lines[0].startswith("kimi-k2: 4 x (router + MoE + residual), 12 experts, 2048 tokens per step")
    assert lines[2].split()[:4] == ["mok", "40.00", "25.00", "1.00x"]
    assert lines[3].split()[:4] == ["xla-capacity", "60.00", "16.67", "0.67x"]


def test_without_a_gpu_says_so_in_one_line(capsys):
    assert train_step.main([]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("python -m mok_jax.bench.train_step: ")


def test_bad_options_exit_with_status_2():
    with pytest.raises(SystemExit) as e:
        train_step.main(["--impl", "nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        train_step.main(["--layers", "0"])
    assert e.value.code == 2
