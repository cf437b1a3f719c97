"""ZClip (transforms.zclip): against a direct Python port of the reference algorithm
(bluorion-com/ZClip ``ZClip.step``) on norm sequences with spikes, and small sequences by hand."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import zclip
from tests.transforms.feeding import feed as _feed, spiky_norms as _spiky_norms


class RefZClip:
    """The reference algorithm (bluorion-com/ZClip ``zclip.py``), on a scalar norm."""

    def __init__(
        self,
        alpha=0.97,
        z_thresh=2.5,
        max_grad_norm=None,
        eps=1e-6,
        warmup_steps=25,
        mode="zscore",
        clip_option="adaptive_scaling",
        clip_factor=1.0,
        skip_update_on_spike=False,
    ):
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
                    clip_val = (
                        self.mean + self.z_thresh * std / (z / self.z_thresh)
                    ) * self.clip_factor
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
    tx = zclip(
        **ours_cfg, skip_stats_on_spike=cfg.get("skip_update_on_spike", False), rel_std_floor=0.0
    )
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
    np.testing.assert_allclose(
        [float(s.mean), float(s.var)], [1.0, 0.25], rtol=1e-6
    )  # population var
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
    for kwargs, name in (
        ({"alpha": 1.0}, "alpha"),
        ({"z_thresh": 0.0}, "z_thresh"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"mode": "median"}, "mode"),
        ({"clip_option": "max"}, "clip_option"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"clip_factor": 0.0}, "clip_factor"),
        ({"eps": math.nan}, "eps"),
    ):
        with pytest.raises(ValueError, match=name):
            zclip(**kwargs)
    # wrong types are TypeErrors
    for kwargs, name in (
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"alpha": None}, "alpha"),
        ({"z_thresh": "2.5"}, "z_thresh"),
        ({"mode": 1}, "mode"),
        ({"skip_nonfinite": "yes"}, "skip_nonfinite"),
    ):
        with pytest.raises(TypeError, match=name):
            zclip(**kwargs)


def test_gradients_through_updates_are_finite():
    """The running std's square root had an infinite derivative at a zero variance: jax.grad
    through two updates of the same gradient was NaN."""

    def loss(u, steps):
        tx = zclip(warmup_steps=2)
        state = tx.init(u)
        for _ in range(steps):
            out, state = tx.update(u, state)
        return jnp.sum(jnp.sin(out["w"]))

    u = {"w": jnp.array([3.0, 4.0])}
    for steps in (1, 2, 3):
        assert np.all(np.isfinite(np.asarray(jax.grad(loss)(u, steps)["w"])))
