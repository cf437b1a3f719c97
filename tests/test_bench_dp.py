"""The DP benchmark's drop-in rows (``benchmarks/bench_dp.py``): gradclip_jax.interop.jax_privacy's
``clipped_grad`` against jax-privacy's own, on the CPU models of the benchmarks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax_privacy")
from benchmarks import bench_dp as bd
from benchmarks.models import transformer


def _tiny_mlp(seed: int, batch: int):
    r = np.random.default_rng(seed)
    params = {"w": jnp.asarray(r.normal(size=(6, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    data = {
        "x": jnp.asarray(r.normal(size=(batch, 6)), jnp.float32),
        "y": jnp.asarray(r.integers(0, 3, batch)),
    }

    def losses(p, b):
        logp = jax.nn.log_softmax(b["x"] @ p["w"] + p["b"])
        return -jnp.take_along_axis(logp, b["y"][:, None], axis=1)[:, 0]

    return losses, params, data


def test_dropin_row_times_both_calls_and_reports_their_ratio_and_agreement():
    ms, diff = bd.dropin_ms(*_tiny_mlp(0, 8), reps=2, max_s=5.0)
    assert set(ms) == {"jax_privacy", "dropin"} and all(
        v > 0 and math.isfinite(v) for v in ms.values()
    )
    assert diff < 1e-5  # the two sums agree
    row = bd.dropin_row("tiny B=8", ms, diff, "cpu")
    assert row["group"] == "dp" and row["ratio"] == ms["dropin"] / ms["jax_privacy"]
    assert (
        row["name"]
        == "tiny B=8 interop.jax_privacy.clipped_grad (drop-in) vs jax_privacy.clipped_grad"
    )
    assert f"{diff:.1e}" in row["note"]


def test_first_call_row_times_a_fresh_compile_of_each():
    secs = bd.first_call_s(*_tiny_mlp(0, 8), rounds=1)
    assert set(secs) == {"jax_privacy", "dropin"} and all(
        v > 0 and math.isfinite(v) for v in secs.values()
    )
    row = bd.first_call_row("tiny B=8", secs, "cpu")
    assert row["ratio"] == secs["dropin"] / secs["jax_privacy"]
    assert row["name"].endswith("(drop-in) first call vs jax_privacy.clipped_grad's")


@pytest.mark.slow
def test_dropin_rows_cover_both_cpu_models_of_the_benchmarks(monkeypatch):
    """run() asks for the drop-in rows on the MLP (each batch size) and on bench_ghost's transformer."""
    asked = []

    def fake_ms(losses, params, data, reps=3, max_s=10.0):
        asked.append(jax.tree.leaves(data)[0].shape)
        return {"jax_privacy": 2.0, "dropin": 1.0}, 0.0

    monkeypatch.setattr(bd, "dropin_ms", fake_ms)
    monkeypatch.setattr(bd, "first_call_s", lambda *a: {"jax_privacy": 2.0, "dropin": 1.0})
    monkeypatch.setattr(bd, "interleaved_ms", lambda fns, *a, **k: {name: 1.0 for name in fns})
    monkeypatch.setattr(bd, "compiled_mb", lambda *a, **k: (1.0, 1.0))
    rows = [r for r in bd.run(quick=True) if "(drop-in)" in r["name"]]
    names = [r["name"].split(" interop")[0] for r in rows]
    assert names == [
        "mlp 784-512-512-10 B=32",
        "mlp 784-512-512-10 B=128",
        "transformer 2x128 T=64 B=32",
        "mlp 784-512-512-10 B=32",
        "transformer 2x128 T=64 B=32",
    ]
    assert all(r["ratio"] == 0.5 for r in rows)
    _, _, data = transformer(0, 32)
    assert asked[-1] == jax.tree.leaves(data)[0].shape
