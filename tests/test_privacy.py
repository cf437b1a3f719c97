"""Tests for gradclip_jax.privacy: accounting backed by dp-accounting."""

from __future__ import annotations

import builtins
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import privacy

dp_accounting = pytest.importorskip("dp_accounting")


def _direct_rdp(z, q, steps, delta):
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
    )
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(
    "z,q,steps,delta",
    [(1.1, 256 / 60000, 14062, 1e-5), (0.8, 0.01, 1000, 1e-6), (4.0, 1.0, 10, 1e-5), (1.0, 0.1, 1, 1e-3)],
)
def test_epsilon_matches_rdp_accountant(z, q, steps, delta):
    eps = privacy.epsilon(z, q, steps, delta)
    assert isinstance(eps, float)
    assert eps == pytest.approx(_direct_rdp(z, q, steps, delta), rel=1e-12)


def test_epsilon_known_value_and_pld():
    # the JAX DP-SGD example: sigma 1.1, batch 256 of 60000, 60 epochs -> about 2.6-3 at 1e-5
    eps = privacy.epsilon(1.1, 256 / 60000, 60 * 60000 // 256, 1e-5)
    assert 2.0 < eps < 3.5
    pld = privacy.epsilon(1.1, 0.01, 200, 1e-5, accountant="pld")
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(privacy.dp_sgd_event(1.1, 0.01, 200))
    assert pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert pld <= privacy.epsilon(1.1, 0.01, 200, 1e-5) * 1.01  # PLD is at least as tight


def test_epsilon_is_monotone():
    steps = [1, 10, 100, 1000, 5000]
    eps = [privacy.epsilon(1.0, 0.01, t, 1e-5) for t in steps]
    assert all(a < b for a, b in itertools.pairwise(eps))
    zs = [0.6, 0.8, 1.0, 2.0, 5.0]
    eps_z = [privacy.epsilon(z, 0.01, 1000, 1e-5) for z in zs]
    assert all(a > b for a, b in itertools.pairwise(eps_z))
    assert privacy.epsilon(0.0, 0.01, 10, 1e-5) == math.inf
    assert privacy.epsilon(1.0, 0.01, 0, 1e-5) == 0.0


@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_calibrate_inverts_epsilon(target):
    q, steps, delta = 0.01, 2000, 1e-5
    z = privacy.calibrate_noise_multiplier(target, q, steps, delta)
    eps = privacy.epsilon(z, q, steps, delta)
    assert eps <= target
    assert eps == pytest.approx(target, rel=1e-2)
    # and the other way round
    z2 = privacy.calibrate_noise_multiplier(privacy.epsilon(1.3, q, steps, delta), q, steps, delta)
    assert z2 == pytest.approx(1.3, abs=2e-3)


def test_validation():
    with pytest.raises(ValueError, match="sample_rate"):
        privacy.epsilon(1.0, 0.0, 10, 1e-5)
    with pytest.raises(ValueError, match="sample_rate"):
        privacy.epsilon(1.0, 1.5, 10, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        privacy.epsilon(1.0, 0.1, 10, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        privacy.epsilon(-1.0, 0.1, 10, 1e-5)
    with pytest.raises(ValueError, match="steps"):
        privacy.epsilon(1.0, 0.1, 2.5, 1e-5)
    with pytest.raises(ValueError, match="accountant"):
        privacy.epsilon(1.0, 0.1, 10, 1e-5, accountant="moments")
    with pytest.raises(ValueError, match="target_epsilon"):
        privacy.calibrate_noise_multiplier(0.0, 0.1, 10, 1e-5)
    with pytest.raises(ValueError, match="steps"):
        privacy.calibrate_noise_multiplier(1.0, 0.1, 0, 1e-5)


def test_missing_dp_accounting_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "dp_accounting" or name.startswith("dp_accounting."):
            raise ImportError("No module named 'dp_accounting'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r'pip install "gradclip_jax\[dp\]"'):
        privacy.epsilon(1.0, 0.1, 10, 1e-5)
    with pytest.raises(ImportError, match="dp-accounting"):
        privacy.calibrate_noise_multiplier(1.0, 0.1, 10, 1e-5)


def test_add_gaussian_noise():
    tree = {"a": jnp.zeros(50000, jnp.bfloat16), "b": jnp.zeros((100, 100), jnp.float32)}
    out = privacy.add_gaussian_noise(tree, 3.0, jax.random.key(0))
    assert out["a"].dtype == jnp.float32  # noise added in float32 for 16-bit leaves
    assert float(np.std(np.asarray(out["a"]))) == pytest.approx(3.0, rel=0.03)
    assert float(np.std(np.asarray(out["b"]))) == pytest.approx(3.0, rel=0.05)
