"""Model shapes from configs/models and the static config dataclasses."""

import dataclasses

import pytest

import mok_jax as mj

# The benchmark shapes (README, benchmarks/results/moe_forward_h200.md): (routed experts, hidden, intermediate, top-k)
BENCH_SHAPES = {
    "kimi-k2": (384, 7168, 2048, 8),
    "glm-5": (256, 6144, 2048, 8),
    "qwen3.5-397b-a17b": (512, 4096, 1024, 10),
    "deepseek-v4-pro": (384, 7168, 3072, 6),
}


def test_bench_models_match_hardware_table():
    assert set(mj.list_models(tag="bench")) == set(BENCH_SHAPES)
    for name, (E, H, I, k) in BENCH_SHAPES.items():
        s = mj.load_model(name)
        assert (s.num_experts, s.hidden_size, s.intermediate_size, s.top_k) == (E, H, I, k)
        assert s.num_shared_experts == 1 and s.shared_size == I  # one shared expert of the routed size
        assert s.num_experts % 64 == 0  # the ep64-slice mode needs E/64 experts per GPU


def test_all_models_load():
    names = mj.list_models()
    for required in ["ci", "deepseek-v3", "qwen3-30b-a3b", *BENCH_SHAPES]:
        assert required in names
    for n in names:
        assert mj.load_model(n).name == n
    assert mj.list_models(tag="ci") == ["ci"]


def test_load_from_path_and_bad_keys(tmp_path):
    good = tmp_path / "m.toml"
    good.write_text('name = "m"\nnum_experts = 4\ntop_k = 2\nhidden_size = 8\nintermediate_size = 4\n')
    assert mj.load_model(good).num_experts == 4
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "m"\nnum_experts = 4\ntop_k = 2\nhidden_size = 8\nintermediate_size = 4\nexperts = 3\n')
    with pytest.raises(ValueError, match=r"unknown keys \['experts'\]"):
        mj.load_model(bad)


def test_shape_validation():
    s = mj.load_model("ci")
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        s.replace(hidden_size=0)
    with pytest.raises(ValueError, match="shared_intermediate_size"):
        s.replace(shared_intermediate_size=0)
    with pytest.raises(ValueError, match="score_func"):
        s.replace(score_func="tanh")


def test_configs_are_frozen_and_keyword_only():
    c = mj.MoEConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.implementation = "mok"
    with pytest.raises(TypeError):
        mj.MoEConfig("xla")  # keyword-only
    k = mj.KernelConfig(granularity=4096, comm_sms_fwd=16)
    assert hash(mj.MoEConfig(kernel=k)) == hash(mj.MoEConfig(kernel=mj.KernelConfig(granularity=4096, comm_sms_fwd=16)))


def test_ci_runs_the_readme_test_command():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    ci = [l for l in (root / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    readme = (root / "README.md").read_text()
    assert len(ci) == 1 and ci[0] in readme, "the README's test command and .ci/run must stay the same"
