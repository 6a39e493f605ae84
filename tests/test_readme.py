"""The README as a user meets it: its Flax example and its API section's emulation calls run as written, and
`pip install .[test]` brings every third-party module the tests and the package import. (Its links:
tests/test_docs_links.py.)"""

import ast
import importlib
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import numpy as np
import pytest

from helpers import GRAD_NAMES, TOL_BF16_REORDER, gpu_skip_reason, readme_api_calls, readme_api_names, rel_err
from mok_jax._native import NativeLibraryUnavailable
from mok_jax.reference import experts_backward_ep_reference, experts_backward_reference
from mok_jax.workspace import CommConfig, Workspace

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# What the example's trailer hands back (the example's own names: x, y, aux_loss, losses, layer, forward, shape),
# with y recomputed on the trained layer and the single-device reference of the same weights and routing.
TRAILER = """
import os as _os
import numpy as _np
from mok_jax.reference import moe as _reference_moe

_y_now, _ = forward(layer, x)
_tokens = x.reshape(-1, shape.hidden_size).astype(layer.dtype)
_idx, _w, _ = layer.route(_tokens)
_f32 = lambda a: None if a is None else _np.asarray(a, _np.float32)
_weights = type(layer.weights())(*(_f32(a) for a in layer.weights()))
_y_ref = _reference_moe(_f32(_tokens), _np.asarray(_idx), _np.asarray(_w), _weights)
_y_ref = _np.asarray(_y_ref).reshape(x.shape)
_np.savez(_os.environ["MOK_README_OUT"], x_shape=_np.asarray(x.shape), y=_f32(y), y_dtype=str(y.dtype),
          aux_loss=_f32(aux_loss), losses=_np.asarray(losses), y_now=_f32(_y_now), y_ref=_f32(_y_ref),
          model=shape.name, devices=len(jax.devices()))
"""


def _section(text: str, title: str) -> str:
    """The body of the '## title' section of a markdown text."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, flags=re.S | re.M)


def test_flax_example_runs_as_written(tmp_path):
    """The example's code blocks, in a fresh CPU-only process with the README's XLA_FLAGS line: the output has the
    input's shape, is finite, and equals the single-device reference; the training step lowers the loss."""
    section = _section(README.read_text(), "Using it from Flax")
    code = "\n".join(_blocks(section, "python"))
    assert "import mok_jax" in code
    flags = re.findall(r"XLA_FLAGS=(\S+)", "\n".join(_blocks(section, "bash")))
    assert flags == ["--xla_force_host_platform_device_count=8"], "the README must say how to get 8 CPU devices"
    out = tmp_path / "example.npz"
    env = {**os.environ, "XLA_FLAGS": flags[0], "JAX_PLATFORMS": "cpu", "MOK_README_OUT": str(out)}
    done = subprocess.run([sys.executable, "-c", code + TRAILER], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    r = np.load(out)
    assert str(r["model"]) == "ci" and int(r["devices"]) == 8
    x_shape = tuple(r["x_shape"])
    assert r["y"].shape == x_shape and str(r["y_dtype"]) == "bfloat16"
    assert np.isfinite(r["y"]).all() and np.abs(r["y"]).max() > 0
    assert r["aux_loss"].shape == () and np.isfinite(r["aux_loss"]) and r["aux_loss"] > 0
    losses = r["losses"]
    assert len(losses) == 5 and np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert rel_err(r["y_now"], r["y"]) > TOL_BF16_REORDER  # the steps changed the layer
    # the sharded bf16 layer against the f32 reference on the same (bf16) tokens, weights and routing
    assert rel_err(r["y_now"], r["y_ref"]) < TOL_BF16_REORDER


# ------------------------------------------------------------------------------------------------ API calls


def test_api_emulation_calls_reach_the_kernels_as_written():
    """Each mok_jax.emulation call of the API section, evaluated as written on a machine without the kernels, gets
    as far as them and says so, naming the call (emulated_moe_backward raised an AttributeError of its own: the
    module it read a setting from was shadowed by the function mok_jax.moe)."""
    if gpu_skip_reason() is None:
        pytest.skip("the kernels are here: tests/test_moe_gpu.py runs these calls on them")
    calls = readme_api_calls("mok_jax.emulation.")
    names = [c.split("(")[0] for c in calls]
    assert names == ["mok_jax.emulation.emulated_moe", "mok_jax.emulation.emulated_moe_backward"], calls
    for call, name in zip(calls, names):
        needs = f"{re.escape(name)} needs (the mok CUDA kernels|a CUDA GPU)"
        with pytest.raises(NativeLibraryUnavailable, match=needs):
            eval(call, readme_api_names())


def test_api_emulated_backward_runs_as_written_with_stand_ins(monkeypatch):
    """The API section's emulated_moe_backward call as written, with the fused op's reference in the kernel's place
    and a stand-in for the emulated workspace this machine cannot make: the gradients of the collectives path
    (fused=False with the EP-1 op's reference), bit for bit."""
    emu = importlib.import_module("mok_jax.emulation")
    names = readme_api_names(ep=4)
    ws = Workspace(ws_id=11, config=CommConfig(ep=4, max_tokens=8, hidden_size=64, top_k=4, num_experts=16),
                   mesh=None, axis_name=None, local=[], emulated=True)
    monkeypatch.setattr(emu, "require_native", lambda what: None)
    monkeypatch.setattr(emu.ops, "experts_backward_ep", experts_backward_ep_reference)
    monkeypatch.setattr(emu, "_emulated_workspace", lambda workspace, device, ep, *a: ws)
    [call] = [c for c in readme_api_calls("mok_jax.emulation.") if "emulated_moe_backward(" in c]
    got = eval(call, names)
    args = [names[n] for n in ("x", "topk_idx", "topk_weight", "weights", "dy")]
    want = emu.emulated_moe_backward(*args, ep=4, fused=False, experts_fn=experts_backward_reference)
    assert len(jax.tree.leaves(got)) == len(GRAD_NAMES)
    for name, a, b in zip(GRAD_NAMES, jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)

# ------------------------------------------------------------------------------------------------ packaging


def _requirement_name(req: str) -> str:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503 normalised


def _imported_top_level_modules(paths) -> dict[str, set[str]]:
    """{top-level module: files} of every absolute import (at any depth: lazy imports count) in ``paths``."""
    found: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_test_extra_covers_third_party_imports():
    """Each third-party module imported by tests/*.py or mok_jax/**/*.py comes from a distribution that is in
    the dependencies or the test extra; so does the pytest-timeout plugin that [tool.pytest] configures."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {_requirement_name(r) for r in project["project"]["dependencies"]}
    declared |= {_requirement_name(r) for r in project["project"]["optional-dependencies"]["test"]}
    local = {"mok_jax"} | {p.stem for p in (ROOT / "tests").glob("*.py")}  # tests import their siblings
    files = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "mok_jax").rglob("*.py"))
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for module, where in sorted(_imported_top_level_modules(files).items()):
        if module in sys.stdlib_module_names or module in local:
            continue
        dists = {_requirement_name(d) for d in distributions.get(module, ())}
        assert dists, f"{module} (imported by {sorted(where)[0]}) is not installed: cannot tell its distribution"
        if not dists & declared:
            missing[module] = (sorted(dists), sorted(where))
    assert not missing, f"imported but not in dependencies or the test extra: {missing}"
    assert "timeout" in project["tool"]["pytest"]["ini_options"] and "pytest-timeout" in declared
