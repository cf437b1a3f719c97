"""Tests for the demo (gradclip_jax.demo), run in-process with small settings."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("dp_accounting")

from gradclip_jax import demo, privacy

# Measured with these settings (300 steps, batch 64, epsilon 3, seeds 0-2): DP-SGD
# test accuracy 0.92-0.94 and 0.98 without DP; the thresholds leave a margin.
DP_ACCURACY = 0.85
NON_DP_ACCURACY = 0.95


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo.png"
    res = demo.run(steps=300, batch_size=64, epsilon=3.0, out=str(out), seed=0, progress=False)
    return res, out


def test_runs_and_plot(results):
    res, out = results
    assert list(res) == ["none", "global", "dp-sgd"]
    assert out.exists() and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_values(results):
    res, _ = results
    for r in res.values():
        assert len(r.losses) == len(r.clip_fractions) == 300
        assert all(math.isfinite(v) for v in r.losses)
        assert 0.0 <= r.clip_fraction <= 1.0
        assert 0.0 < r.sec_per_step < 1.0
    assert res["none"].clip_fraction == 0.0
    assert math.isinf(res["none"].epsilon) and math.isinf(res["global"].epsilon)
    dp = res["dp-sgd"]
    assert dp.noise_multiplier > 0
    # the reported epsilon is what the accountant gives for the calibrated noise
    q = 64 / len(demo.load_digits_split(0)[0])
    assert dp.epsilon == pytest.approx(privacy.epsilon(dp.noise_multiplier, q, 300, demo.DELTA))
    assert dp.epsilon <= 3.0 + 1e-9
    assert dp.epsilon > 2.9  # calibrated, not over-noised
    assert dp.clip_fraction > 0.1  # with C=1 most early per-example gradients are clipped
    table = demo.format_table(res)
    for name in ("none", "global", "dp-sgd"):
        assert name in table
    assert f"{dp.epsilon:.3f}" in table and f"{dp.test_accuracy:.3f}" in table


def test_accuracy(results):
    res, _ = results
    assert res["none"].test_accuracy >= NON_DP_ACCURACY
    assert res["global"].test_accuracy >= NON_DP_ACCURACY
    assert res["dp-sgd"].test_accuracy >= DP_ACCURACY


def test_main_cli(tmp_path, capsys):
    out = tmp_path / "cli.png"
    rc = demo.main(["--steps", "20", "--batch-size", "32", "--out", str(out), "--no-progress"])
    assert rc == 0
    assert out.exists()
    printed = capsys.readouterr().out
    assert "dp-sgd" in printed and "epsilon" in printed


def test_bad_method_is_a_clean_error(tmp_path, capsys):
    # 'ghost' either works (then the run succeeds) or fails with a clear message
    rc = demo.main(["--steps", "5", "--batch-size", "16", "--method", "ghost",
                    "--out", str(tmp_path / "g.png"), "--no-progress"])
    err = capsys.readouterr().err
    if rc != 0:
        assert rc == 2
        assert "ghost" in err and "--method vmap" in err
        assert "Traceback" not in err


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        demo.run(steps=1, out=None, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        demo.run(steps=5, batch_size=0, out=None, progress=False)
    with pytest.raises(ValueError, match="unknown run"):
        demo.run(steps=5, out=None, progress=False, methods=("sgd",))
