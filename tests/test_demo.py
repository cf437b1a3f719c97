"""Tests for the demo (gradclip_jax.demo), run in-process with small settings."""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("dp_accounting")

import dp_accounting
import numpy as np

from gradclip_jax import demo

# the module-scoped demo run (about 10 s) is trained once, on one worker
pytestmark = pytest.mark.xdist_group("demo_run")

# Measured with these settings (300 steps, batch 64 (expected, Poisson, for DP-SGD),
# epsilon 3, seeds 0-2): DP-SGD test accuracy 0.92-0.94 and 0.96-0.97 without DP;
# the thresholds leave a margin.
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
    assert dp.epsilon <= 3.0 + 1e-9
    assert dp.epsilon > 2.9  # calibrated, not over-noised
    assert dp.clip_fraction > 0.1  # with C=1 most early per-example gradients are clipped
    table = demo.format_table(res)
    for name in ("none", "global", "dp-sgd"):
        assert name in table
    assert f"{dp.epsilon:.3f}" in table and f"{dp.test_accuracy:.3f}" in table
    assert "Poisson batches" in table and "PLD accountant after the 300 steps taken" in table


def test_dp_epsilon_is_the_accountants(results):
    # the table's epsilon is read from the run's accountant, which holds exactly
    # the steps taken: 300 Poisson-subsampled Gaussian steps at q = 64 / n_train
    res, _ = results
    dp = res["dp-sgd"]
    acc = dp.accountant
    assert acc is not None and acc.accountant == "pld"
    assert res["none"].accountant is None and res["global"].accountant is None
    n_train = len(demo.load_digits_split(0)[0])
    q = 64 / n_train
    assert acc.steps == 300
    assert len(acc.phases) == 1
    phase = acc.phases[0]
    assert phase.noise_multiplier == dp.noise_multiplier
    assert phase.sample_rate == pytest.approx(q, rel=1e-12)
    assert phase.truncated_batch_size is None  # plain Poisson: an overflow raises instead
    assert dp.epsilon == acc.epsilon(demo.DELTA)
    # the same number from dp-accounting directly
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(dp.noise_multiplier)),
        300,
    )
    # on the accountant's PLD grid (pld_interval: coarser for a wider loss), up to FFT rounding
    from gradclip_jax.dp.accounting import pld_interval
    from gradclip_jax.dp.accounting._composition import loss_std, phases_of

    grid = pld_interval(dp.noise_multiplier, loss_std(phases_of(event)))
    direct = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=grid)
        .compose(event)
        .get_epsilon(demo.DELTA)
    )
    assert dp.epsilon == pytest.approx(direct, rel=1e-6)


def test_dp_run_uses_poisson_batches(results):
    res, _ = results
    n_train = len(demo.load_digits_split(0)[0])
    q = 64 / n_train
    for name in ("none", "global"):  # the non-private runs keep fixed-size shuffled batches
        assert res[name].batch_sizes == [64] * 300 and res[name].padded_batch_size == 64
    dp = res["dp-sgd"]
    sizes = np.asarray(dp.batch_sizes)
    assert sizes.shape == (300,)
    # every batch padded to one size, above the expected 64 so that no step overflows
    assert dp.padded_batch_size > 64 and sizes.max() <= dp.padded_batch_size
    # Binomial(n_train, q) sizes: mean n q = 64 (std. error 0.45 over 300 steps),
    # variance n q (1 - q) = 61 (a fixed-size loader would give 0)
    assert len(np.unique(sizes)) > 10
    assert abs(sizes.mean() - n_train * q) < 3.0
    assert 30 < sizes.var() < 120


def test_accuracy(results):
    res, _ = results
    assert res["none"].test_accuracy >= NON_DP_ACCURACY
    assert res["global"].test_accuracy >= NON_DP_ACCURACY
    assert res["dp-sgd"].test_accuracy >= DP_ACCURACY


def test_global_clipping_acts(results):
    # the demo's global clip norm is set where clipping changes the run, so the
    # plot shows an effect (at 1.0 it clipped <1% of the steps: identical curves)
    res, _ = results
    assert 0.1 < res["global"].clip_fraction < 0.9
    assert res["global"].losses[0] == pytest.approx(res["none"].losses[0])  # same start
    diff = [abs(a - b) for a, b in zip(res["global"].losses, res["none"].losses)]
    assert max(diff) > 0.05


@pytest.mark.slow  # about 19 s (a whole demo run); CI runs the slow tests and the demo itself
def test_main_cli_default_out_is_a_temp_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = demo.main(["--steps", "5", "--batch-size", "32", "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "dp-sgd" in printed and "epsilon" in printed
    saved = Path(re.search(r"plot saved to (\S+?);", printed).group(1))
    assert saved.is_file() and saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert saved.resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
    assert list(tmp_path.iterdir()) == []  # nothing written to the current folder
    saved.unlink()
    saved.parent.rmdir()


@pytest.fixture
def no_training(monkeypatch):
    """Makes loading the data (the first step of training) fail loudly."""

    def fail(*args, **kwargs):
        raise AssertionError("training started before the output path was checked")

    monkeypatch.setattr(demo.training, "load_digits_split", fail)  # where run() reads it


@pytest.mark.parametrize(
    ("out", "match"),
    [
        ("/nonexistent/x.png", "folder '/nonexistent' does not exist"),
        ("{tmp}", "is a folder"),
        ("{tmp}/a_file.txt/x.png", "does not exist"),
        ("{tmp}/x.notanimage", "unknown image format 'notanimage'"),
    ],
)
def test_bad_out_fails_before_training(tmp_path, no_training, capsys, out, match):
    (tmp_path / "a_file.txt").write_text("")
    out = out.format(tmp=tmp_path)
    with pytest.raises(ValueError, match=re.escape(match)):
        demo.run(steps=5, out=out, progress=False)
    rc = demo.main(["--steps", "5", "--out", out, "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out=") and match in err and "Traceback" not in err


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can write to read-only folders"
)
def test_read_only_out_folder(tmp_path, no_training):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot write"):
            demo.run(steps=5, out=str(ro / "x.png"), progress=False)
    finally:
        ro.chmod(0o700)


def test_out_type():
    with pytest.raises(TypeError, match="out"):
        demo.check_output_path(3)


def test_plot_leaves_pyplot_alone(results, tmp_path):
    import matplotlib

    res, _ = results
    before = matplotlib.get_backend()
    demo.plot_results(res, str(tmp_path / "again.png"))
    assert (tmp_path / "again.png").stat().st_size > 10_000
    assert matplotlib.get_backend() == before


@pytest.mark.slow  # a full (short) ghost run of the demo
def test_bad_method_is_a_clean_error(tmp_path, capsys):
    # 'ghost' either works (then the run succeeds) or fails with a clear message
    rc = demo.main(
        [
            "--steps",
            "5",
            "--batch-size",
            "16",
            "--method",
            "ghost",
            "--out",
            str(tmp_path / "g.png"),
            "--no-progress",
        ]
    )
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


GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "demo.md"


def _without_times(table: str) -> list[list[str]]:
    """The table's rows as words, the ms/step column (machine-dependent) left out."""
    rows = []
    for line in table.strip().splitlines():
        words = line.split()
        if words and words[0] in ("none", "global", "dp-sgd"):
            words = words[:4] + words[5:]
        rows.append(words)
    return rows


@pytest.mark.slow
def test_demo_guide_shows_what_the_demo_prints(tmp_path):
    """docs/guides/demo.md's measured output is the default demo's (`python -m gradclip_jax.demo`)."""
    block = re.search(r"## Measured output\n.*?```text\n(.*?)\n```", GUIDE.read_text(), flags=re.S)
    assert block, "no measured output in the demo guide"
    res = demo.run(out=str(tmp_path / "demo.png"), seed=0, progress=False)
    printed = demo.format_table(res)
    assert _without_times(block.group(1)) == _without_times(printed)


def test_run_accepts_the_old_spelling_of_the_clip_norm_with_a_warning(no_training):
    """``dp_clip_norm`` is the deprecated spelling of ``l2_clip_norm`` (both at once: an error)."""
    with (
        pytest.raises(AssertionError, match="training started"),
        pytest.warns(DeprecationWarning, match="`dp_clip_norm` is deprecated, use `l2_clip_norm`"),
    ):
        demo.run(steps=5, dp_clip_norm=0.5, progress=False)
    with pytest.raises(TypeError, match="got both `l2_clip_norm` and its deprecated spelling"):
        demo.run(steps=5, l2_clip_norm=0.5, dp_clip_norm=0.5, progress=False)
