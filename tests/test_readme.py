"""The README as a user meets it: its Flax example runs as written, and `pip install .[test]` brings every
third-party module the tests and the package import. (Its links: tests/test_docs_links.py.)"""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import numpy as np

from helpers import TOL_BF16_REORDER, rel_err

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
