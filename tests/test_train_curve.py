"""The training-curve tool (mok_jax.bench.train_curve) on the CPU: a few optax steps of the xla layer."""

import json

import numpy as np

from mok_jax.bench import train_curve


def test_train_curve_runs_and_learns(tmp_path, capsys):
    out = tmp_path / "curve.json"
    assert train_curve.main(["--steps", "6", "--layers", "2", "--tokens", "256", "--vocab", "64", "--lr", "3e-3",
                             "--impl", "xla", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    loss = np.asarray(data["curves"]["xla"])
    assert loss.shape == (6,) and np.all(np.isfinite(loss))
    assert loss[-1] < loss[0], loss  # it trains: the permutation task's loss falls within a few steps
    assert "max gap to xla" in capsys.readouterr().out
    png = tmp_path / "curve.png"
    assert train_curve.main(["--replot", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
