"""The training-curve tool (mok_jax.bench.train_curve) on the CPU: a few optax steps of the xla layer, its
--impl names (mok-fp8: the FP8 layer) and what it says where the mok layers cannot run."""

import json

import numpy as np
import pytest
from flax import nnx

from mok_jax.bench import train_curve
from mok_jax.flax import MoELayer


def test_train_curve_runs_and_learns(tmp_path, capsys):
    out = tmp_path / "curve.json"
    assert train_curve.main(["--steps", "6", "--layers", "2", "--tokens", "256", "--vocab", "64", "--lr", "3e-3",
                             "--impl", "xla", "--tolerance", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    loss = np.asarray(data["curves"]["xla"])
    assert loss.shape == (6,) and np.all(np.isfinite(loss))
    assert loss[-1] < loss[0], loss  # it trains: the permutation task's loss falls within a few steps
    assert data["summary"]["xla"]["within_tolerance"] is True  # its gap to itself is 0
    table = capsys.readouterr().out
    assert "max gap to xla" in table and "within 0" in table
    png = tmp_path / "curve.png"
    assert train_curve.main(["--replot", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_impls():
    assert train_curve.parse_impls("mok,mok-fp8") == ["mok", "mok-fp8"]
    assert train_curve.parse_impls(" xla, mok ,xla,") == ["xla", "mok"]  # the first is the reference; no repeats
    with pytest.raises(ValueError, match=r"--impl: 'fp8', 'bf16' is not one of xla, mok, mok-fp8"):
        train_curve.parse_impls("mok,fp8,bf16")
    with pytest.raises(ValueError, match="--impl: give at least one"):
        train_curve.parse_impls(",")


def test_bad_impl_and_tolerance_exit_2(capsys):
    for argv, msg in ((["--impl", "mok-bf16"], "--impl: 'mok-bf16' is not one of"),
                      (["--impl", "xla", "--tolerance", "-1"], "--tolerance must be >= 0")):
        with pytest.raises(SystemExit) as e:
            train_curve.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_mok_fp8_is_the_fp8_layer_on_the_same_shape():
    """mok-fp8 trains MoELayer(implementation="mok", precision="fp8") on SHAPE, whose H and I FP8 allows."""
    assert train_curve.IMPLEMENTATIONS["mok-fp8"] == {"implementation": "mok", "precision": "fp8"}
    assert train_curve.SHAPE.hidden_size % 128 == 0 and train_curve.SHAPE.intermediate_size % 128 == 0
    layer = MoELayer(train_curve.SHAPE, **train_curve.IMPLEMENTATIONS["mok-fp8"], rngs=nnx.Rngs(0))
    assert (layer.config.implementation, layer.config.precision, layer.config.keep) == ("mok", "fp8", "nothing")


def test_mok_fp8_without_a_gpu_says_so_and_trains_nothing(tmp_path, capsys):
    from mok_jax._native import NativeLibraryUnavailable, require_native

    try:
        require_native("the test")
        pytest.skip("the mok kernels can run here: nothing to report")
    except NativeLibraryUnavailable:
        pass
    assert set(train_curve.unavailable(["xla", "mok", "mok-fp8"])) == {"mok", "mok-fp8"}
    out = tmp_path / "curve.json"
    assert train_curve.main(["--steps", "2", "--impl", "xla,mok-fp8", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert not out.exists() and "step 0" not in captured.out  # nothing trained, not even xla
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m mok_jax.bench.train_curve: error: --impl mok-fp8 needs ")


def test_summarize_gaps_against_the_first():
    curves = {"mok": [3.0, 2.0, 1.0], "mok-fp8": [3.0, 2.5, 1.1], "xla": [3.0, 2.0, 0.8]}
    s = train_curve.summarize(curves, tolerance=0.3)
    assert [s[i]["max_abs_gap_to_mok"] for i in curves] == pytest.approx([0.0, 0.5, 0.2])
    assert [s[i]["within_tolerance"] for i in curves] == [True, False, True]
    assert (s["mok-fp8"]["first_loss"], s["mok-fp8"]["final_loss"]) == (3.0, 1.1)
    assert "within_tolerance" not in train_curve.summarize(curves)["mok"]
