"""AutoClip (transforms.autoclip): against the reference rule (pseeth/autoclip: ``np.percentile``
of the history including the current norm) and small sequences by hand."""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradclip_jax as gcx
from gradclip_jax import AutoClipState, autoclip
from tests.transforms.feeding import feed as _feed, spiky_norms as _spiky_norms, vec as _vec


def _autoclip_reference(norms, p, size):
    """Paper/reference rule with our recording rule: finite positive norms only, last ``size``."""
    hist, outs, thrs = [], [], []
    for n in norms:
        if math.isfinite(n) and n > 0:
            hist = ([*hist, n])[-size:]
        thr = float(np.percentile(hist, p)) if hist else math.inf
        thrs.append(thr)
        outs.append(n if not (math.isfinite(n) and n > thr) else thr)
    return outs, thrs


@pytest.mark.parametrize(
    "p,size", [(10.0, 1000), (50.0, 5), (0.0, 3), (90.0, 4), (100.0, 2), (33.3, 7)]
)
def test_autoclip_matches_numpy_percentile(p, size):
    norms = _spiky_norms(30, seed=1)
    norms[3], norms[11] = 0.0, math.nan
    want_out, want_thr = _autoclip_reference(norms, p, size)
    with jax.enable_x64(True):
        outs, states = _feed(autoclip(percentile=p, history_size=size), norms, jnp.float64)
    for got, want, s, thr in zip(outs, want_out, states, want_thr, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)
        if math.isfinite(got):
            np.testing.assert_allclose(float(s.clip_norm), thr, rtol=1e-12)
    assert int(states[-1].filled) == min(size, 28)


_AUTOCLIPS: dict = {}


@hypothesis.given(
    p=st.sampled_from([0.0, 10.0, 37.5, 50.0, 100.0]),
    norms=st.lists(st.one_of(st.floats(1e-3, 1e3), st.just(0.0)), min_size=1, max_size=12),
)
def test_autoclip_property(p, norms):
    """Output norm = min(n, linear percentile of the last 5 recorded norms) for any sequence."""
    if p not in _AUTOCLIPS:  # one jitted update per percentile (compiled once)
        tx = autoclip(percentile=p, history_size=5)
        _AUTOCLIPS[p] = (tx, jax.jit(tx.update))
    tx, update = _AUTOCLIPS[p]
    want_out, want_thr = _autoclip_reference(norms, p, 5)
    with jax.enable_x64(True):
        state = tx.init(jnp.zeros(2, jnp.float64))
        for n, w_out, w_thr in zip(norms, want_out, want_thr, strict=True):
            out, state = update(_vec(n).astype(jnp.float64), state)
            np.testing.assert_allclose(float(jnp.linalg.norm(out)), w_out, rtol=1e-12, atol=1e-300)
            assert float(state.clip_norm) == pytest.approx(w_thr, rel=1e-12) or math.isinf(w_thr)


def test_autoclip_by_hand():
    tx = autoclip(percentile=50.0, history_size=3)
    outs, states = _feed(tx, [2.0, 4.0, 10.0, 1.0, 100.0])
    # history includes the current norm: thresholds 2, 3, 4, 3 (of 4,10,1), 10 (of 10,1,100)
    np.testing.assert_allclose([float(s.clip_norm) for s in states], [2, 3, 4, 4, 10], rtol=1e-6)
    np.testing.assert_allclose(outs, [2.0, 3.0, 4.0, 1.0, 10.0], rtol=1e-6)
    assert not bool(states[0].clipped) and bool(states[1].clipped)
    assert isinstance(states[0], AutoClipState)


def test_autoclip_zero_norms_never_zero_later_updates():
    outs, states = _feed(autoclip(percentile=0.0), [0.0, 0.0, 1.0, 2.0])
    np.testing.assert_allclose(outs, [0.0, 0.0, 1.0, 1.0], rtol=1e-6)
    assert int(states[1].filled) == 0 and math.isinf(float(states[1].clip_norm))
    # min_norm floors the threshold
    outs, _ = _feed(autoclip(percentile=0.0, min_norm=1.5), [1.0, 2.0])
    np.testing.assert_allclose(outs, [1.0, 1.5], rtol=1e-6)


def test_autoclip_nonfinite():
    outs, states = _feed(autoclip(), [1.0, math.nan, 2.0])
    assert [int(s.count) for s in states] == [1, 1, 2] and int(states[-1].filled) == 2
    assert math.isnan(outs[1])  # passes through, not zeroed
    np.testing.assert_allclose(outs[2], 1.1, rtol=1e-6)  # 10th percentile of {1, 2}
    _, states = _feed(autoclip(skip_nonfinite=False), [1.0, math.inf, 2.0])
    assert [int(s.count) for s in states] == [1, 2, 3] and int(
        states[-1].filled
    ) == 2  # never recorded


@pytest.mark.parametrize(
    "hp,bad",
    [
        ("percentile", 101.0),
        ("percentile", -1.0),
        ("percentile", math.nan),
        ("min_norm", -1.0),
        ("min_norm", math.nan),
    ],
)
def test_autoclip_invalid_traced_hyperparameter_leaves_the_history_untouched(hp, bad):
    # as zclip, adagc, quantile_clip and the EMA clippers: NaN update, statistics as they were
    tx = gcx.inject_hyperparams(autoclip)(percentile=50.0, history_size=4)
    g = jnp.array([3.0, 4.0])
    step = jax.jit(tx.update)
    state = tx.init(g)
    _, state = step(g, state)
    before = state.inner_state
    state.hyperparams[hp] = jnp.asarray(bad, state.hyperparams[hp].dtype)
    out, state = step(2.0 * g, state)
    assert bool(jnp.all(jnp.isnan(out)))
    after = state.inner_state
    for field in ("history", "head", "filled", "count", "clip_norm"):
        np.testing.assert_array_equal(getattr(after, field), getattr(before, field), err_msg=field)
    assert not bool(after.clipped)


def test_autoclip_invalid_arguments():
    for kwargs, name in (
        ({"percentile": 101.0}, "percentile"),
        ({"percentile": -1.0}, "percentile"),
        ({"history_size": 0}, "history_size"),
        ({"min_norm": -1.0}, "min_norm"),
    ):
        with pytest.raises(ValueError, match=name):
            autoclip(**kwargs)
