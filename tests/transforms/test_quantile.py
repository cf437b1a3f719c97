"""Quantile clipping (transforms.quantile): by hand and tracking its target quantile."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import QuantileClipState, quantile_clip
from tests.transforms.feeding import feed as _feed, vec as _vec


def test_quantile_clip_by_hand():
    tx = quantile_clip(target_quantile=0.5, learning_rate=0.2, initial_norm=1.0)
    state = tx.init(jnp.zeros(2))
    assert isinstance(state, QuantileClipState) and float(state.clip_norm) == 1.0
    outs, states = _feed(tx, [5.0, 0.5, 1.0])
    np.testing.assert_allclose(outs, [1.0, 0.5, 1.0], rtol=1e-6)
    c = [1.0, math.exp(0.1), 1.0]  # clipped: C grows; unclipped: C shrinks
    np.testing.assert_allclose([float(s.clip_norm) for s in states], c, rtol=1e-6)
    # n == C counts as unclipped (inclusive): C shrinks
    np.testing.assert_allclose(float(states[2].estimate), math.exp(-0.1), rtol=1e-5)
    assert [bool(s.clipped) for s in states] == [True, False, False]


def test_quantile_clip_tracks_the_target_quantile():
    rng = np.random.default_rng(0)
    norms = jnp.asarray(np.exp(rng.standard_normal(3000)), jnp.float32)  # median 1
    tx = quantile_clip(target_quantile=0.8, learning_rate=0.05, initial_norm=0.1)

    def step(state, n):
        _, state = tx.update(_vec(n), state)
        return state, (state.clip_norm, n <= state.clip_norm)

    _, (c, under) = jax.jit(lambda s: lax.scan(step, s, norms))(tx.init(jnp.zeros(2)))
    frac = float(jnp.mean(under[1000:]))
    assert abs(frac - 0.8) < 0.04, frac
    q80 = math.exp(0.8416)  # the 0.8 quantile of a standard log-normal
    assert abs(float(jnp.median(c[1000:])) / q80 - 1) < 0.15


def test_quantile_clip_invalid_arguments():
    for kwargs, name in (
        ({"target_quantile": 1.5}, "target_quantile"),
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"initial_norm": 0.0}, "initial_norm"),
    ):
        with pytest.raises(ValueError, match=name):
            quantile_clip(**kwargs)


def test_a_run_time_initial_norm_of_zero_gives_nan():
    """A Python 0 is refused; a traced one clipped every update to zero, for good."""

    @jax.jit
    def run(c0):
        tx = quantile_clip(initial_norm=c0)
        state = tx.init({"w": jnp.zeros(2)})
        out, state = tx.update({"w": jnp.array([3.0, 4.0])}, state)
        return out["w"], state.estimate

    for bad in (0.0, -1.0, jnp.nan):
        out, est = run(bad)
        assert np.all(np.isnan(np.asarray(out))) and np.isnan(float(est))
    assert np.all(np.isfinite(np.asarray(run(0.1)[0])))
