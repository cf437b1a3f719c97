"""AutoClip, ZClip, AdaGC, quantile clipping and skip_on_spike; and the contract every
stateful clipper (these and the EMA / growth clippers) shares: jit, lax.scan, vmap over
stacked states, inject_hyperparams, checkpointing, dtypes, masking, gradients.

ZClip and AutoClip are checked against direct Python ports of their reference
algorithms (bluorion-com/ZClip ``ZClip.step``; pseeth/autoclip: ``np.percentile`` of
the history including the current norm) on norm sequences with spikes, and against
small sequences computed by hand.
"""

from __future__ import annotations

import itertools
import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import gradclip_jax as gcx
from gradclip_jax.transforms import (
    AdaGCState,
    AutoClipState,
    QuantileClipState,
    SkipOnSpikeState,
    ZClipState,
    adagc,
    autoclip,
    quantile_clip,
    skip_on_spike,
    zclip,
)
from gradclip_jax.transforms.ema import clip_norm_by_ema, clip_value_by_ema, normalize_by_ema
from gradclip_jax.transforms.growth import clip_norm_growth, clip_value_growth


def _vec(norm: float) -> jax.Array:
    """A 2-vector with the given L2 norm (direction (0.6, 0.8))."""
    return jnp.array([0.6 * norm, 0.8 * norm])


def _feed(tx, norms, dtype=jnp.float32, jit=True):
    """Runs ``tx`` on 2-vectors with the given norms; returns (output norms, states)."""
    state = tx.init(jnp.zeros(2, dtype))
    update = jax.jit(tx.update) if jit else tx.update
    outs, states = [], []
    for n in norms:
        out, state = update(_vec(n).astype(dtype), state)
        outs.append(float(jnp.linalg.norm(out)) if np.all(np.isfinite(np.asarray(out))) else math.nan)
        states.append(state)
    return outs, states


# ----------------------------------------------------------------------------
# ZClip
# ----------------------------------------------------------------------------


class RefZClip:
    """The reference algorithm (bluorion-com/ZClip ``zclip.py``), on a scalar norm."""

    def __init__(self, alpha=0.97, z_thresh=2.5, max_grad_norm=None, eps=1e-6, warmup_steps=25,
                 mode="zscore", clip_option="adaptive_scaling", clip_factor=1.0, skip_update_on_spike=False):
        self.__dict__.update(locals())
        self.buffer, self.initialized, self.mean, self.var = [], False, None, None

    def step(self, n):
        """Returns (output norm, effective clip or None during warm-up)."""
        if not self.initialized:
            self.buffer.append(n)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.initialized, self.buffer = True, []
            if self.max_grad_norm is not None:  # torch clip_grad_norm_
                return n * min(1.0, self.max_grad_norm / (n + 1e-6)), None
            return n, None
        std = self.var**0.5
        clip_val = None
        if self.mode == "percentile":
            thr = self.mean + self.z_thresh * std
            if n > thr:
                clip_val = thr
        else:
            z = (n - self.mean) / (std + self.eps)
            if z > self.z_thresh:
                if self.clip_option == "adaptive_scaling":
                    clip_val = (self.mean + self.z_thresh * std / (z / self.z_thresh)) * self.clip_factor
                else:
                    clip_val = self.mean
        eff = clip_val if clip_val is not None else n
        if self.max_grad_norm is not None:
            eff = min(eff, self.max_grad_norm)
        out = n * (eff / (n + 1e-6)) if n > eff else n
        if not (clip_val is not None and self.skip_update_on_spike):
            x = clip_val if clip_val is not None else n
            self.mean = self.alpha * self.mean + (1 - self.alpha) * x
            self.var = self.alpha * self.var + (1 - self.alpha) * (x - self.mean) ** 2
        return out, eff


def _spiky_norms(n=40, seed=0):
    rng = np.random.default_rng(seed)
    norms = 1.0 + 0.1 * rng.standard_normal(n)
    for i, s in ((8, 5.0), (15, 20.0), (16, 3.0), (30, 50.0)):
        if i < n:
            norms[i] *= s
    return [float(v) for v in norms]


ZCLIP_CONFIGS = {
    "default": {},
    "capped": {"max_grad_norm": 1.2},
    "mean": {"clip_option": "mean"},
    "percentile": {"mode": "percentile", "z_thresh": 2.0},
    "aggressive": {"clip_factor": 0.7, "z_thresh": 2.0, "alpha": 0.9},
    "skip_stats": {"skip_update_on_spike": True},
}


@pytest.mark.parametrize("name", list(ZCLIP_CONFIGS))
def test_zclip_matches_reference_port(name):
    cfg = {"warmup_steps": 5, **ZCLIP_CONFIGS[name]}
    norms = _spiky_norms()
    ref = RefZClip(**cfg)
    expected = [ref.step(n) for n in norms]
    ours_cfg = {k: v for k, v in cfg.items() if k != "skip_update_on_spike"}
    tx = zclip(**ours_cfg, skip_stats_on_spike=cfg.get("skip_update_on_spike", False), rel_std_floor=0.0)
    with jax.enable_x64(True):
        outs, states = _feed(tx, norms, jnp.float64)
    n_spikes = 0
    for (want_out, want_eff), got, s in zip(expected, outs, states, strict=True):
        np.testing.assert_allclose(got, want_out, rtol=3e-6)  # the reference adds 1e-6 to the norm
        if want_eff is not None:
            np.testing.assert_allclose(float(s.clip_norm), want_eff, rtol=1e-12)
        n_spikes += bool(s.spike)
    assert n_spikes >= 3  # the spikes were detected (the sequence exercises the rule)
    np.testing.assert_allclose(float(states[-1].mean), ref.mean, rtol=1e-12)
    np.testing.assert_allclose(float(states[-1].var), ref.var, rtol=1e-10)


def test_zclip_first_spike_by_hand():
    """mu = 1, sigma = 0.5, z_thr = 2, n = 3: z = 4, threshold 1 + 2 * 0.5 / (4 / 2) = 1.5."""
    tx = zclip(alpha=0.97, z_thresh=2.0, warmup_steps=2, eps=0.0)
    outs, states = _feed(tx, [0.5, 1.5, 3.0, 1.0])
    np.testing.assert_allclose(outs[:2], [0.5, 1.5], rtol=1e-6)  # warm-up: untouched
    s = states[1]
    np.testing.assert_allclose([float(s.mean), float(s.var)], [1.0, 0.25], rtol=1e-6)  # population var
    s = states[2]
    assert bool(s.spike) and bool(s.clipped)
    np.testing.assert_allclose(outs[2], 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(s.clip_norm), 1.5, rtol=1e-6)
    # the threshold (not the raw norm) is fed back; the variance uses the new mean
    mean = 0.97 * 1.0 + 0.03 * 1.5
    var = 0.97 * 0.25 + 0.03 * (1.5 - mean) ** 2
    np.testing.assert_allclose([float(s.mean), float(s.var)], [mean, var], rtol=1e-6)
    # recovery: a normal norm is left alone and absorbed as is
    s = states[3]
    assert not bool(s.spike) and not bool(s.clipped)
    np.testing.assert_allclose(outs[3], 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(s.mean), 0.97 * mean + 0.03 * 1.0, rtol=1e-6)


def test_zclip_warmup_boundary():
    norms = [1.0, 1.2, 100.0]
    outs, states = _feed(zclip(z_thresh=2.0, warmup_steps=3), norms)
    np.testing.assert_allclose(outs, norms, rtol=1e-6)  # the 3rd call is still warm-up
    assert [int(s.count) for s in states] == [1, 2, 3]
    assert not any(bool(s.spike) for s in states)
    np.testing.assert_allclose(float(states[2].mean), 102.2 / 3, rtol=1e-6)
    # with warmup_steps=2 ZClip is active from call 3 = N + 1, and catches the same norm
    outs, states = _feed(zclip(z_thresh=2.0, warmup_steps=2), norms)
    np.testing.assert_allclose(outs[:2], norms[:2], rtol=1e-6)
    assert bool(states[2].spike) and outs[2] < 2.0


def test_zclip_max_grad_norm_applies_during_warmup_and_after():
    tx = zclip(warmup_steps=2, max_grad_norm=1.0)
    outs, states = _feed(tx, [3.0, 0.5, 0.6])
    np.testing.assert_allclose(outs, [1.0, 0.5, 0.6], rtol=1e-6)
    # the statistics record the raw norms, not the capped ones
    np.testing.assert_allclose(float(states[1].mean), 1.75, rtol=1e-6)
    np.testing.assert_allclose(float(states[0].clip_norm), 1.0)


def test_zclip_zero_std_guard():
    norms = [1.0] * 4 + [1.001]
    # the reference (no floor): sigma = 0, so 0.1% above the mean is a "spike", clipped to the mean
    outs, states = _feed(zclip(warmup_steps=4, rel_std_floor=0.0), norms)
    assert bool(states[-1].spike)
    np.testing.assert_allclose(outs[-1], 1.0, rtol=1e-6)
    # with the default relative floor it is ordinary noise
    outs, states = _feed(zclip(warmup_steps=4), norms)
    assert not bool(states[-1].spike)
    np.testing.assert_allclose(outs[-1], 1.001, rtol=1e-6)
    # a real spike is still caught
    outs, states = _feed(zclip(warmup_steps=4), [1.0] * 4 + [5.0])
    assert bool(states[-1].spike) and outs[-1] < 1.01


def test_zclip_all_zero_warmup_does_not_zero_later_updates():
    """All-zero warm-up norms give mu = sigma = 0; the reference then clips every later
    update to 0 and feeds 0 back, for good. A spike needs mu > 0 here."""
    outs, states = _feed(zclip(warmup_steps=3, rel_std_floor=0.0), [0.0, 0.0, 0.0] + [2.0] * 20)
    np.testing.assert_allclose(outs[3], 2.0, rtol=1e-6)
    assert not bool(states[3].spike)
    assert all(o > 0 for o in outs[3:])
    means = [float(s.mean) for s in states[3:]]
    assert all(b > a for a, b in itertools.pairwise(means))  # the statistics keep moving


def test_zclip_nonfinite_is_skipped():
    outs, states = _feed(zclip(warmup_steps=2), [1.0, math.inf, 2.0, math.nan, 1.5])
    assert [int(s.count) for s in states] == [1, 1, 2, 2, 3]
    assert math.isnan(outs[1]) and math.isnan(outs[3])  # inf/NaN pass through, never zeroed
    assert np.isfinite(float(states[-1].mean)) and np.isfinite(float(states[-1].var))
    np.testing.assert_allclose(float(states[2].mean), 1.5, rtol=1e-6)
    assert math.isinf(float(states[1].norm))


def test_zclip_invalid_arguments():
    for kwargs, name in (({"alpha": 1.0}, "alpha"), ({"z_thresh": 0.0}, "z_thresh"),
                         ({"warmup_steps": 0}, "warmup_steps"), ({"mode": "median"}, "mode"),
                         ({"clip_option": "max"}, "clip_option"), ({"max_grad_norm": -1.0}, "max_grad_norm"),
                         ({"clip_factor": 0.0}, "clip_factor"), ({"eps": math.nan}, "eps")):
        with pytest.raises(ValueError, match=name):
            zclip(**kwargs)
    # wrong types are TypeErrors
    for kwargs, name in (({"warmup_steps": 2.5}, "warmup_steps"), ({"alpha": None}, "alpha"),
                         ({"z_thresh": "2.5"}, "z_thresh"), ({"mode": 1}, "mode"),
                         ({"skip_nonfinite": "yes"}, "skip_nonfinite")):
        with pytest.raises(TypeError, match=name):
            zclip(**kwargs)


# ----------------------------------------------------------------------------
# AutoClip
# ----------------------------------------------------------------------------


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


@pytest.mark.parametrize("p,size", [(10.0, 1000), (50.0, 5), (0.0, 3), (90.0, 4), (100.0, 2), (33.3, 7)])
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
    # min_clip_norm floors the threshold
    outs, _ = _feed(autoclip(percentile=0.0, min_clip_norm=1.5), [1.0, 2.0])
    np.testing.assert_allclose(outs, [1.0, 1.5], rtol=1e-6)


def test_autoclip_nonfinite():
    outs, states = _feed(autoclip(), [1.0, math.nan, 2.0])
    assert [int(s.count) for s in states] == [1, 1, 2] and int(states[-1].filled) == 2
    assert math.isnan(outs[1])  # passes through, not zeroed
    np.testing.assert_allclose(outs[2], 1.1, rtol=1e-6)  # 10th percentile of {1, 2}
    _, states = _feed(autoclip(skip_nonfinite=False), [1.0, math.inf, 2.0])
    assert [int(s.count) for s in states] == [1, 2, 3] and int(states[-1].filled) == 2  # never recorded


@pytest.mark.parametrize("hp,bad", [("percentile", 101.0), ("percentile", -1.0), ("percentile", math.nan),
                                    ("min_clip_norm", -1.0), ("min_clip_norm", math.nan)])
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
    for kwargs, name in (({"percentile": 101.0}, "percentile"), ({"percentile": -1.0}, "percentile"),
                         ({"history_size": 0}, "history_size"), ({"min_clip_norm": -1.0}, "min_clip_norm")):
        with pytest.raises(ValueError, match=name):
            autoclip(**kwargs)


# ----------------------------------------------------------------------------
# AdaGC
# ----------------------------------------------------------------------------


def _tree(a, b):
    return {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def test_adagc_by_hand():
    tx = adagc(clip_ratio=2.0, beta=0.5, warmup_steps=2, warmup_max_norm=1.0, min_gamma=0.0)
    state = tx.init(_tree([0.0, 0.0], [0.0]))
    assert isinstance(state, AdaGCState) and math.isinf(float(state.gamma["a"]))
    # step 1 (warm-up): global norm 5 -> factor 0.2; b's zero norm is not recorded
    out, state = tx.update(_tree([3.0, 4.0], [0.0]), state)
    np.testing.assert_allclose(out["a"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(float(state.gamma["a"]), 1.0, rtol=1e-6)
    assert math.isinf(float(state.gamma["b"]))
    # step 2 (warm-up): global norm sqrt(0.25 + 4); gamma = min of post-clip norms
    out, state = tx.update(_tree([0.3, 0.4], [2.0]), state)
    f = 1.0 / math.sqrt(4.25)
    ga, gb = 0.5 * f, 2.0 * f
    np.testing.assert_allclose([float(state.gamma["a"]), float(state.gamma["b"])], [ga, gb], rtol=1e-6)
    assert bool(state.clipped["a"]) and float(state.clip_norm["a"]) == 1.0
    # step 3 (adaptive): a is clipped to 2 * gamma_a; b (1 <= 2 * gamma_b) passes
    out, state = tx.update(_tree([3.0, 4.0], [1.0]), state)
    np.testing.assert_allclose(float(jnp.linalg.norm(out["a"])), 2 * ga, rtol=1e-6)
    np.testing.assert_allclose(out["b"], [1.0])
    np.testing.assert_allclose(float(state.clip_norm["a"]), 2 * ga, rtol=1e-6)
    # the EMA tracks the clipped norm
    np.testing.assert_allclose(float(state.gamma["a"]), 0.5 * ga + 0.5 * 2 * ga, rtol=1e-6)
    np.testing.assert_allclose(float(state.gamma["b"]), 0.5 * gb + 0.5 * 1.0, rtol=1e-6)
    assert bool(state.clipped["a"]) and not bool(state.clipped["b"])
    np.testing.assert_allclose(float(state.norm["a"]), 5.0, rtol=1e-6)


def test_adagc_zero_gradient_in_warmup_does_not_freeze():
    """The reference sets gamma = 0 for a tensor with a zero warm-up gradient, freezing it."""
    tx = adagc(warmup_steps=2)
    state = tx.init(_tree([0.0], [0.0]))
    for b in (0.0, 0.5):
        _, state = tx.update(_tree([0.1], [b]), state)
    np.testing.assert_allclose(float(state.gamma["b"]), 0.5, rtol=1e-6)
    state = tx.init(_tree([0.0], [0.0]))
    for _ in range(2):  # 'b' has no gradient at all during warm-up
        _, state = tx.update(_tree([0.1], [0.0]), state)
    out, state = tx.update(_tree([0.1], [3.0]), state)
    np.testing.assert_allclose(out["b"], [3.0])  # starts from its first norm, not from 0
    np.testing.assert_allclose(float(state.gamma["b"]), 3.0, rtol=1e-6)
    # a zero gradient after warm-up leaves gamma alone
    _, state2 = tx.update(_tree([0.1], [0.0]), state)
    assert float(state2.gamma["b"]) == float(state.gamma["b"])


def test_adagc_no_warmup_and_floor():
    tx = adagc(warmup_steps=0, clip_ratio=1.5, beta=0.9)
    outs = [tx.update(_tree([2.0], [1.0]), tx.init(_tree([0.0], [0.0])))[0]]
    np.testing.assert_allclose(outs[0]["a"], [2.0])  # gamma starts at the current norm
    tx = adagc(warmup_steps=1, warmup_max_norm=None, min_gamma=0.01, clip_ratio=2.0)
    state = tx.init(_tree([0.0], [0.0]))
    _, state = tx.update(_tree([1e-6], [1.0]), state)
    out, state = tx.update(_tree([1.0], [1.0]), state)
    np.testing.assert_allclose(out["a"], [0.02], rtol=1e-6)  # bound 2 * max(1e-6, 0.01)


def test_adagc_invalid_arguments():
    for kwargs, name in (({"clip_ratio": 0.0}, "clip_ratio"), ({"beta": 1.5}, "beta"),
                         ({"warmup_steps": -1}, "warmup_steps"), ({"warmup_max_norm": -2.0}, "warmup_max_norm"),
                         ({"min_gamma": -1.0}, "min_gamma")):
        with pytest.raises(ValueError, match=name):
            adagc(**kwargs)


# ----------------------------------------------------------------------------
# Quantile clipping
# ----------------------------------------------------------------------------


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
    for kwargs, name in (({"target_quantile": 1.5}, "target_quantile"), ({"learning_rate": -0.1}, "learning_rate"),
                         ({"initial_norm": 0.0}, "initial_norm")):
        with pytest.raises(ValueError, match=name):
            quantile_clip(**kwargs)


# ----------------------------------------------------------------------------
# skip_on_spike
# ----------------------------------------------------------------------------


def test_skip_on_spike_zeroes_spikes_only():
    tx = skip_on_spike(zclip(z_thresh=2.0, warmup_steps=3))
    outs, states = _feed(tx, [1.0, 1.1, 0.9, 1.05, 10.0, 1.0])
    assert outs[4] == 0.0 and all(o > 0.5 for i, o in enumerate(outs) if i != 4)
    assert [bool(s.skipped) for s in states] == [False] * 4 + [True, False]
    assert int(states[-1].num_skipped) == 1
    assert isinstance(states[-1], SkipOnSpikeState) and isinstance(states[-1].inner_state, ZClipState)


def test_skip_on_spike_field_and_chain():
    with pytest.raises(ValueError, match="spike"):
        skip_on_spike(autoclip()).init(jnp.zeros(2))
    with pytest.raises(ValueError, match="clipped"):  # two clippers: ambiguous
        skip_on_spike(optax.chain(autoclip(), zclip()), field="clipped").init(jnp.zeros(2))
    tx = skip_on_spike(autoclip(percentile=50.0), field="clipped")
    outs, _ = _feed(tx, [1.0, 2.0, 0.5])
    np.testing.assert_allclose(outs, [1.0, 0.0, 0.5], rtol=1e-6)
    # the whole chain: the parameters do not move on a spike
    tx = skip_on_spike(optax.chain(zclip(warmup_steps=2, z_thresh=2.0), optax.sgd(1.0)))
    outs, _ = _feed(tx, [1.0, 1.2, 50.0, 1.0])
    assert outs[2] == 0.0 and outs[3] > 0


# ----------------------------------------------------------------------------
# The contract shared by every stateful clipper
# ----------------------------------------------------------------------------

FACTORIES = {
    "clip_norm_by_ema": (clip_norm_by_ema, {"beta": 0.5}),
    "normalize_by_ema": (normalize_by_ema, {"beta": 0.5, "tensorwise": False}),
    "clip_value_by_ema": (clip_value_by_ema, {"beta": 0.5}),
    "clip_norm_growth": (clip_norm_growth, {"mul": 1.5}),
    "clip_value_growth": (clip_value_growth, {"mul": 1.5}),
    "autoclip": (autoclip, {"percentile": 50.0, "history_size": 4}),
    "zclip": (zclip, {"z_thresh": 1.0, "warmup_steps": 3}),
    "adagc": (adagc, {"warmup_steps": 2, "warmup_max_norm": 3.0}),
    "quantile_clip": (quantile_clip, {"initial_norm": 1.0}),
}
NAMES = [*FACTORIES, "skip_on_spike"]
NORM_BASED = {"clip_norm_by_ema", "normalize_by_ema", "clip_norm_growth", "autoclip", "zclip", "adagc",
              "quantile_clip"}


def _make(name):
    if name == "skip_on_spike":
        return skip_on_spike(zclip(z_thresh=1.0, warmup_steps=3))
    factory, kwargs = FACTORIES[name]
    return factory(**kwargs)


def _params(dtype=jnp.float32):
    return {"w": jnp.zeros((3, 2), dtype), "b": jnp.zeros(2, dtype), "s": jnp.zeros((), dtype)}


SCALES = [1.0, 1.2, 0.8, 1.1, 20.0, 1.0, 0.1, 1.0]  # _updates() gives 8 steps


def _updates(n=8, dtype=jnp.float32, seed=0):
    """A batch of ``n`` updates (stacked on axis 0) with a spike at step 4."""
    rng = np.random.default_rng(seed)
    scales = np.asarray(SCALES[:n])
    return {
        "w": jnp.asarray(rng.standard_normal((n, 3, 2)) * scales[:, None, None], dtype),
        "b": jnp.asarray(rng.standard_normal((n, 2)) * scales[:, None], dtype),
        "s": jnp.asarray(rng.standard_normal(n) * scales, dtype),
    }


def _at(batch, i):
    return jax.tree_util.tree_map(lambda x: x[i], batch)


def _assert_trees(a, b, rtol=1e-6, atol=1e-7):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype == bool or np.issubdtype(x.dtype, np.integer):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_scan_jit_eager_and_checkpoint(name):
    """lax.scan == jitted loop == eager step; fixed state structure; checkpoint round trip."""
    tx = _make(name)
    batch = _updates()
    s0 = tx.init(_params())
    update = jax.jit(tx.update)
    state, outs = s0, []
    for i in range(len(SCALES)):
        out, state = update(_at(batch, i), state)
        outs.append(out)
        _assert_trees(jax.tree_util.tree_map(lambda x: jnp.zeros_like(x), state),
                      jax.tree_util.tree_map(lambda x: jnp.zeros_like(x), s0))  # fixed structure
        if i == 3:
            mid = state
    eager_out, _ = tx.update(_at(batch, 4), mid)  # eager == jit (the spike step)
    _assert_trees(eager_out, outs[4])

    def body(s, u):
        o, s = tx.update(u, s)
        return s, o

    final, scanned = jax.jit(lambda s, b: lax.scan(body, s, b))(s0, batch)
    _assert_trees(scanned, jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *outs))
    _assert_trees(final, state)

    # checkpoint: a plain pytree of arrays; numpy round trip, then continue
    leaves, treedef = jax.tree_util.tree_flatten(mid)
    restored = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
    restored = jax.tree_util.tree_map(jnp.asarray, restored)
    s_a, s_b = mid, restored
    for i in range(4, len(SCALES)):
        o_a, s_a = update(_at(batch, i), s_a)
        o_b, s_b = update(_at(batch, i), s_b)
        _assert_trees(o_a, o_b, rtol=0, atol=0)
    _assert_trees(s_a, s_b, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_stacked_states(name):
    tx = _make(name)
    batch = _updates()
    update = jax.jit(tx.update)
    states, s = [], tx.init(_params())
    for i in range(6):
        if i in (0, 3, 5):
            states.append(s)
        _, s = update(_at(batch, i), s)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)
    ups = jax.tree_util.tree_map(lambda x: x[jnp.array([4, 5, 6])], batch)
    v_out, v_state = jax.jit(jax.vmap(tx.update))(ups, stacked)
    for k, one in enumerate(states):
        o, s2 = update(_at(ups, k), one)
        _assert_trees(_at(v_out, k), o)
        _assert_trees(_at(v_state, k), s2)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_inject_hyperparams(name):
    factory, kwargs = FACTORIES[name]
    plain = factory(**kwargs)
    tx = gcx.inject_hyperparams(factory)(**kwargs)
    batch = _updates(6)
    s_p, s_i = plain.init(_params()), tx.init(_params())
    assert s_i.hyperparams  # the numeric hyperparameters are exposed
    update = jax.jit(tx.update)
    for i in range(6):
        o_p, s_p = jax.jit(plain.update)(_at(batch, i), s_p)
        o_i, s_i = update(_at(batch, i), s_i)
        _assert_trees(o_i, o_p, rtol=1e-5, atol=1e-6)
    _assert_trees(s_i.inner_state, s_p, rtol=1e-5, atol=1e-6)


def test_inject_hyperparams_changes_behaviour():
    tx = gcx.inject_hyperparams(quantile_clip)(initial_norm=1.0, learning_rate=0.2)
    state = tx.init(jnp.zeros(2))
    state.hyperparams["learning_rate"] = jnp.asarray(0.0)
    for _ in range(3):
        _, state = tx.update(_vec(5.0), state)
    assert float(state.inner_state.estimate) == 1.0  # lr 0: the estimate never moves
    tx = gcx.inject_hyperparams(zclip)(warmup_steps=2, z_thresh=2.0, mode="percentile")
    state = tx.init(jnp.zeros(2))
    for n in (0.5, 1.5):
        _, state = tx.update(_vec(n), state)
    state.hyperparams["z_thresh"] = jnp.asarray(10.0)
    out, state = tx.update(_vec(3.0), state)  # 3 < 1 + 10 * 0.5: no spike
    np.testing.assert_allclose(float(jnp.linalg.norm(out)), 3.0, rtol=1e-6)


def test_schedules_and_traced_hyperparameters():
    sched = optax.linear_schedule(100.0, 0.0, 2)  # percentile 100 -> 50 -> 0
    outs, _ = _feed(autoclip(percentile=sched, history_size=10), [1.0, 3.0, 2.0])
    np.testing.assert_allclose(outs, [1.0, 2.0, 1.0], rtol=1e-6)

    @jax.jit
    def run(lr):  # a transform built inside jit with a traced hyperparameter
        tx = quantile_clip(initial_norm=1.0, learning_rate=lr)
        _, s = tx.update(_vec(5.0), tx.init(jnp.zeros(2)))
        return s.estimate

    np.testing.assert_allclose(float(run(0.4)), math.exp(0.2), rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_monitoring_fields(name):
    tx = _make(name)
    state = tx.update(_at(_updates(1), 0), tx.init(_params()))[1]
    assert int(optax.tree_utils.tree_get(state, "count")) == 1
    if name in NORM_BASED or name == "skip_on_spike":
        assert optax.tree_utils.tree_get(state, "norm") is not None
        assert optax.tree_utils.tree_get(state, "clip_norm") is not None
    assert optax.tree_utils.tree_get(state, "clipped") is not None


@pytest.mark.parametrize("name", NAMES)
def test_finite_gradients_at_zero_and_after_spikes(name):
    tx = _make(name)
    batch = _updates()
    state = tx.init(_params())
    w = jax.tree_util.tree_map(lambda x: jnp.ones_like(x[0]), batch)

    def loss(u, s):
        out, _ = tx.update(u, s)
        return sum(jnp.sum(o * c) for o, c in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(w),
                                                  strict=True))

    grad = jax.jit(jax.grad(loss))
    update = jax.jit(tx.update)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, w)
    for i in range(len(SCALES)):
        if i in (0, 2, 4, 6):  # fresh, warm-up, spike, after warm-up
            for u in (zeros, _at(batch, i)):
                g = grad(u, state)
                assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g)), (name, i)
        state = update(_at(batch, i), state)[1]


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_update_is_as_if_it_never_happened(name):
    tx = _make(name)
    batch = _updates()
    update = jax.jit(tx.update)
    state = tx.init(_params())
    for i in range(4):
        _, state = update(_at(batch, i), state)
    bad = dict(_at(batch, 4), b=jnp.array([jnp.nan, 1.0]))
    out, skipped = update(bad, state)
    for k in bad:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(bad[k]))
    a, s_a = update(_at(batch, 5), skipped)
    b, s_b = update(_at(batch, 5), state)
    _assert_trees(a, b, rtol=0, atol=0)
    _assert_trees(s_a, s_b, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_dtypes_bf16_and_x64(name):
    tx = _make(name)
    p16 = _params(jnp.bfloat16)
    state = tx.init(p16)
    update = jax.jit(tx.update)
    for i in range(5):
        out, state = update(_at(_updates(5, jnp.bfloat16), i), state)
        assert all(o.dtype == jnp.bfloat16 for o in jax.tree_util.tree_leaves(out))
    floats = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)
    with jax.enable_x64(True):
        tx = _make(name)
        state = tx.init(_params(jnp.float64))
        out, state = jax.jit(tx.update)(_at(_updates(2, jnp.float64), 0), state)
        floats = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert all(x.dtype == jnp.float64 for x in floats)
        assert all(o.dtype == jnp.float64 for o in jax.tree_util.tree_leaves(out))


@pytest.mark.parametrize("name", NAMES)
def test_none_masked_and_empty_trees(name):
    tx = _make(name)
    u = _at(_updates(1), 0)
    # None leaves pass through and count for nothing
    params = {**_params(), "frozen": None}
    out, state = tx.update({**u, "frozen": None}, tx.init(params))
    assert out["frozen"] is None
    ref, _ = tx.update(u, tx.init(_params()))
    _assert_trees({k: out[k] for k in u}, ref)
    # optax.masked leaves 'b' alone
    masked = optax.masked(tx, {"w": True, "b": False, "s": True})
    out, _ = masked.update(u, masked.init(_params()))
    np.testing.assert_array_equal(out["b"], u["b"])
    # an empty tree
    out, _ = tx.update({}, tx.init({}))
    assert out == {}
    # an integer leaf names its path (at init for per-leaf state, else at update)
    with pytest.raises(TypeError, match="step"):
        state = tx.init({**_params(), "step": jnp.zeros((), jnp.int32)})
        tx.update({**u, "step": jnp.zeros((), jnp.int32)}, state)


def _mesh(kind):
    axis_type = jax.sharding.AxisType.Explicit if kind == "explicit" else jax.sharding.AxisType.Auto
    return jax.make_mesh((len(jax.devices()),), ("x",), axis_types=(axis_type,))


def _sharded_updates():
    rng = np.random.default_rng(3)
    n = len(jax.devices())
    return [{"w": jnp.asarray(rng.standard_normal((2 * n, 4)) * s, jnp.float32),
             "b": jnp.asarray(rng.standard_normal(n) * s, jnp.float32)} for s in (1.0, 1.2, 0.9, 30.0, 1.0)]


@pytest.mark.parametrize("name", ["zclip", "autoclip", "quantile_clip"])
def test_shard_map_axis_name(name):
    """Leaves sharded by hand inside shard_map: axis_name combines the partial norms."""
    if len(jax.devices()) < 2:
        pytest.skip("needs several devices")
    factory, kwargs = FACTORIES[name]
    ref, tx = factory(**kwargs), factory(**kwargs, axis_name="x")
    mesh = _mesh("explicit")
    spec, rep = jax.sharding.NamedSharding(mesh, P("x")), jax.sharding.NamedSharding(mesh, P())
    f = jax.jit(jax.shard_map(tx.update, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P())))
    ups = _sharded_updates()
    s_ref, s = ref.init(ups[0]), tx.init(ups[0])
    for u in ups:
        o_ref, s_ref = jax.jit(ref.update)(u, s_ref)
        o, s = f(jax.device_put(u, spec), jax.device_put(s, rep))
        _assert_trees(o, o_ref, rtol=1e-6)
    _assert_trees(s, s_ref, rtol=1e-6)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("name", ["zclip", "adagc", "clip_norm_by_ema"])
def test_jax_sharding_inputs(name, kind):
    if len(jax.devices()) < 2:
        pytest.skip("needs several devices")
    tx = _make(name)
    sharding = jax.sharding.NamedSharding(_mesh(kind), P("x"))
    update = jax.jit(tx.update)
    ups = _sharded_updates()
    s_ref = s = tx.init(ups[0])
    for u in ups:
        o_ref, s_ref = update(u, s_ref)
        o, s = update(jax.device_put(u, sharding), s)
        _assert_trees(o, o_ref, rtol=1e-6)
    assert o["w"].sharding.spec[0] == "x"


def test_composes_with_optax_wrappers():
    ups = [_vec(n) for n in (1.0, 1.1, 0.9, 1.0, 40.0, 1.0)]
    # apply_if_finite skips the step; the clipper's state is untouched by the bad update
    tx = optax.apply_if_finite(zclip(warmup_steps=2), max_consecutive_errors=3)
    state = tx.init(jnp.zeros(2))
    out, state = tx.update(jnp.array([jnp.nan, 1.0]), state)
    assert int(state.notfinite_count) == 1 and int(state.inner_state.count) == 0
    np.testing.assert_array_equal(out, [0.0, 0.0])  # apply_if_finite zeroes the step
    # MultiSteps: the clipper sees the averaged gradient every 2 micro-steps
    tx = optax.MultiSteps(autoclip(percentile=50.0), every_k_schedule=2)
    state, update = tx.init(jnp.zeros(2)), jax.jit(tx.update)
    for u in ups:
        _, state = update(u, state)
    assert int(state.inner_opt_state.count) == 3
    # chained with an optimizer and masked
    tx = optax.chain(optax.masked(quantile_clip(initial_norm=1.0), {"a": True, "b": False}), optax.adam(1e-3))
    state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})
    _, state = tx.update({"a": _vec(5.0), "b": _vec(5.0)}, state)
    assert float(optax.tree_utils.tree_get(state, "norm")) == pytest.approx(5.0)


# ----------------------------------------------------------------------------
# Training with gradient spikes
# ----------------------------------------------------------------------------


def test_training_with_spikes_stays_stable():
    """Linear regression by SGD with injected gradient spikes: plain SGD blows up at the
    spikes; zclip and autoclip clip them and keep the loss finite and low."""
    rng = np.random.default_rng(0)
    n, d, steps = 512, 8, 150
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w_true = jnp.asarray(rng.standard_normal(d), jnp.float32)
    y = x @ w_true + 0.1 * jnp.asarray(rng.standard_normal(n), jnp.float32)
    idx = jnp.asarray(rng.integers(0, n, (steps, 32)))
    spike = jnp.zeros(steps).at[jnp.array([60, 90, 120])].set(1.0)

    def loss(w, xb, yb):
        return jnp.mean((xb @ w - yb) ** 2)

    def train(tx):
        def step(carry, inp):
            w, s = carry
            ib, sp = inp
            g = jax.grad(loss)(w, x[ib], y[ib])
            g = g * jnp.where(sp > 0, 1e4, 1.0)  # a corrupted batch
            u, s = tx.update(g, s, w)
            w = optax.apply_updates(w, u)
            return (w, s), loss(w, x, y)

        w0 = jnp.zeros(d)
        _, losses = lax.scan(step, (w0, tx.init(w0)), (idx, spike))
        return losses

    run = jax.jit(lambda: [train(optax.sgd(0.05)),
                           train(optax.chain(zclip(warmup_steps=20), optax.sgd(0.05))),
                           train(optax.chain(autoclip(percentile=10.0), optax.sgd(0.05)))])
    plain, with_zclip, with_autoclip = (np.asarray(v) for v in run())
    noise = 0.01
    assert plain[59] < 10 * noise + 0.05  # it was training fine before the spike
    assert not np.all(np.isfinite(plain[60:])) or np.nanmax(plain[60:]) > 1e4  # then blew up
    for losses in (with_zclip, with_autoclip):
        assert np.all(np.isfinite(losses))
        assert losses[60:].max() < 1.0  # the spikes are absorbed
        assert losses[-1] < 0.05 and losses[-1] < 1e-3 * plain[-1]
