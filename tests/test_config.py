"""Model shapes from configs/models and the static config dataclasses."""

import copy
import dataclasses
import inspect
import re

import pytest

import mok_jax as mj

# The benchmark shapes (README, benchmarks/results/forward.md): (routed experts, hidden, intermediate, top-k)
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


_SMALL = {"name": '"m"', "num_experts": "4", "top_k": "2", "hidden_size": "8", "intermediate_size": "4",
          "num_shared_experts": "1", "shared_intermediate_size": "4", "norm_topk_prob": "true",
          "routed_scaling_factor": "1.0", "tags": '["ci"]'}


def _toml(path, **lines):
    """A model TOML file at ``path``: _SMALL with ``lines`` (key: TOML value, None to leave the key out)."""
    items = {**_SMALL, **lines}
    path.write_text("".join(f"{k} = {v}\n" for k, v in items.items() if v is not None))
    return path


@pytest.mark.parametrize("key,value,exc,match", [
    ("top_k", "true", TypeError, "ModelShape.top_k must be an int, got True"),
    ("num_shared_experts", "1.5", TypeError, "ModelShape.num_shared_experts must be an int, got 1.5"),
    ("tags", '"ci"', TypeError, re.escape("""tags must be a list of strings, such as ["ci"], got 'ci'""")),
    ("tags", "[1]", TypeError, r"ModelShape.tags must be a tuple of str, got \(1,\)"),
    ("norm_topk_prob", "1", TypeError, "ModelShape.norm_topk_prob must be a bool, got 1"),
    ("routed_scaling_factor", "0", ValueError, "ModelShape.routed_scaling_factor must be finite and > 0, got 0"),
    ("hidden_size", None, ValueError, r"missing keys \['hidden_size'\]; required: \['hidden_size'"),
    ("name", "1", TypeError, "ModelShape.name must be a non-empty str, got 1"),
])
def test_load_model_refuses_a_bad_file_naming_it(tmp_path, key, value, exc, match):
    """A value of the wrong type (a bool where an int belongs: Python's bool is an int; a float; a string where
    a list of tags belongs, which became ('c', 'i')), or a missing key: the error names the file and the key."""
    path = _toml(tmp_path / "m.toml", **{key: value})
    with pytest.raises(exc, match=re.escape(str(path)) + ": .*" + match):
        mj.load_model(path)


def test_load_model_names_and_paths(tmp_path, monkeypatch):
    """A name is a shipped model, never a file of the working directory; anything ending in .toml is a path, never
    a shipped model: "ci.toml" reads ./ci.toml when there is one, and else says so, naming load_model("ci")."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no file 'ci.toml' .* the shipped model 'ci' is load_model\('ci'\)"):
        mj.load_model("ci.toml")
    with pytest.raises(FileNotFoundError, match=r"no file 'nope.toml' \(a name ending in .toml is a path; .*\)$"):
        mj.load_model("nope.toml")
    _toml(tmp_path / "ci.toml", num_experts="8")
    assert mj.load_model("ci.toml").num_experts == 8 and mj.load_model("ci").num_experts == 16
    (tmp_path / "broken.toml").write_text("name = \n")
    with pytest.raises(ValueError, match="broken.toml: not valid TOML"):
        mj.load_model("broken.toml")
    with pytest.raises(ValueError, match="unknown model 'cii'; known models: .*ci"):
        mj.load_model("cii")
    with pytest.raises(TypeError, match="load_model takes a model name or a path to a TOML file, got int"):
        mj.load_model(3)

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
    k = mj.KernelConfig(granularity=4096, comm_items_fwd=16)
    assert hash(mj.MoEConfig(kernel=k)) == hash(mj.MoEConfig(kernel=mj.KernelConfig(granularity=4096,
                                                                                     comm_items_fwd=16)))


def test_kernel_config_refuses_the_names_before_issue_35_with_the_new_ones():
    """comm_sms_fwd / comm_sms_bwd became comm_items_fwd / comm_items_bwd (they count communication work items,
    not SMs set aside): the old keywords raise a TypeError naming the new field, in KernelConfig(...), .replace
    and dataclasses.replace alike, rather than "unexpected keyword argument"."""
    fields = {f.name for f in dataclasses.fields(mj.KernelConfig)}
    assert {"comm_items_fwd", "comm_items_bwd"} <= fields and not {"comm_sms_fwd", "comm_sms_bwd"} & fields
    k = mj.KernelConfig(comm_items_fwd=8, comm_items_bwd=4)
    assert (k.comm_items_fwd, k.comm_items_bwd) == (8, 4)
    for old, new in (("comm_sms_fwd", "comm_items_fwd"), ("comm_sms_bwd", "comm_items_bwd")):
        for make in (lambda: mj.KernelConfig(**{old: 8}), lambda: k.replace(**{old: 8}),
                     lambda: dataclasses.replace(k, **{old: 8})):
            with pytest.raises(TypeError, match=rf"^KernelConfig\.{old} is now {new}: .*not SMs set aside"):
                make()
    assert list(inspect.signature(mj.KernelConfig).parameters) == [f.name for f in dataclasses.fields(mj.KernelConfig)]


def test_moe_config_is_pure_static_data():
    """MoEConfig holds no runtime resource (issue 35): its fields are plain values, it compares and hashes by
    value, and the workspace it held until then (now passed beside it) is refused with where it went."""
    assert "workspace" not in {f.name for f in dataclasses.fields(mj.MoEConfig)}
    c = mj.MoEConfig(implementation="mok", ep_axis="ep", kernel=mj.KernelConfig(granularity=1024), keep="ring")
    assert all(isinstance(getattr(c, f.name), (str, bool, type(None), mj.KernelConfig))
               for f in dataclasses.fields(c))
    assert c == copy.deepcopy(c) and hash(c) == hash(dataclasses.replace(c))
    where = r"moe\(\.\.\., workspace=\).*expert_parallel_moe\(\.\.\., workspace=\).*MoELayer\(\.\.\., workspace=\)"
    for make in (lambda: mj.MoEConfig(implementation="mok", workspace=None),
                 lambda: dataclasses.replace(c, workspace=None)):
        with pytest.raises(TypeError, match=rf"^MoEConfig has no workspace: .*{where}"):
            make()
    assert list(inspect.signature(mj.MoEConfig).parameters) == [f.name for f in dataclasses.fields(mj.MoEConfig)]


def test_ci_runs_the_readme_test_command():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    ci = [l for l in (root / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    readme = (root / "README.md").read_text()
    assert len(ci) == 1 and ci[0] in readme, "the README's test command and .ci/run must stay the same"
