"""mok-bench's standard problems (mok_jax.bench.problems): the table, and the problem each model runs on a GPU
(runner._problem) with and without the options that override it. No device work: shapes and tokens only."""

import pytest

from mok_jax.bench import problems, runner
from mok_jax.bench.options import CPU_DEFAULTS, GPU_DEFAULTS, parse_args
from mok_jax.config import list_models, load_model


def test_the_standard_set_is_the_four_bench_models_and_qwen3_30b():
    assert set(list_models(tag="bench")) <= set(problems.STANDARD_PROBLEMS)  # every model tagged bench has one
    assert problems.standard_models() == ["kimi-k2", "glm-5", "qwen3.5-397b-a17b", "deepseek-v4-pro", "qwen3-30b-a3b"]
    for name in problems.standard_models():
        load_model(name)  # each is a shipped model
    assert problems.STANDARD_PROBLEMS["qwen3-30b-a3b"] == problems.StandardProblem(
        tokens_per_gpu=8192, one_gpu_experts="16", several_gpus_experts="16")


def test_standard_problem_is_validated():
    assert problems.StandardProblem(tokens_per_gpu=8, one_gpu_experts="e/4").one_gpu_experts == "E/4"  # normalised
    for bad in (0, -8, 8.0):
        with pytest.raises(ValueError, match="tokens_per_gpu"):
            problems.StandardProblem(tokens_per_gpu=bad, one_gpu_experts="E/32")
    with pytest.raises(ValueError, match="--experts-per-gpu"):
        problems.StandardProblem(tokens_per_gpu=8, one_gpu_experts="E/0")


def _problem(model, argv=(), *, on_gpu=True, num_gpus=1):
    opts = parse_args(list(argv))
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    shape, tokens = runner._problem(load_model(model), opts, on_gpu, num_gpus, opts.ep_mode or defaults["ep_mode"],
                                    defaults)
    return shape.ep_mode, shape.experts_per_gpu, tokens


@pytest.mark.parametrize("model,experts", [("kimi-k2", 12), ("glm-5", 8), ("qwen3.5-397b-a17b", 16),
                                           ("deepseek-v4-pro", 12)])
def test_one_gpu_runs_the_whole_two_gpu_slice_of_the_paper_models(model, experts):
    assert _problem(model) == ("E/32", experts, (2048,))
    assert _problem(model, num_gpus=2) == ("ep64-slice", experts // 2, (2048,))  # E/64 each: --ep-mode's split


def test_qwen3_30b_runs_16_experts_per_gpu_at_8192_tokens():
    assert _problem("qwen3-30b-a3b") == ("16/gpu", 16, (8192,))
    assert _problem("qwen3-30b-a3b", num_gpus=2) == ("16/gpu", 16, (8192,))  # E/64 would leave 4 < k experts


def test_options_override_the_standard_problem():
    assert _problem("qwen3-30b-a3b", ["--tokens", "512,1024"]) == ("16/gpu", 16, (512, 1024))
    assert _problem("qwen3-30b-a3b", ["--experts-per-gpu", "E/4"]) == ("E/4", 32, (8192,))
    assert _problem("kimi-k2", ["--ep-mode", "full"]) == ("full", 384, (2048,))  # the split asked for, tokens kept
    assert _problem("qwen3-30b-a3b", ["--ep-mode", "full"], num_gpus=2) == ("full", 64, (8192,))


def test_models_without_a_standard_problem_and_cpu_runs_keep_the_defaults():
    assert _problem("deepseek-v3") == ("E/32", 8, (2048,))  # one GPU: ONE_GPU_EXPERTS, the GPU default tokens
    assert _problem("deepseek-v3", num_gpus=2) == ("ep64-slice", 4, (2048,))
    assert _problem("kimi-k2", on_gpu=False, num_gpus=8) == ("full", 48, (32,))  # CPU: CPU_DEFAULTS, no standard


def test_bench_names_the_standard_models_in_their_order():
    assert [m.name for m in runner._resolve_models(("bench", "ci"))] == [*problems.standard_models(), "ci"]
