"""gradclip_jax.dp.hardened: OS-seeded keys, the sum-of-normals noise, the discrete Gaussian
sampler (its exact table and its distribution at fixed keys), the integer grid's exact norm bound
and int32 sum, its accounting against dp-accounting's, and every bad input."""

from __future__ import annotations

import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import gradclip_jax as gcx
from gradclip_jax import PoissonSampler, make_private
from gradclip_jax.dp import hardened as h
from gradclip_jax.dp.accounting import PoissonSampledDiscreteGaussianEvent, poisson_subsampled_rdp
from gradclip_jax.dp.hardened import _discrete_gaussian as dg


def _pmf(sigma: float, ks: np.ndarray) -> np.ndarray:
    """The discrete Gaussian's pmf at ``ks`` (float64 is plenty for a goodness-of-fit test)."""
    k = np.arange(-int(14 * sigma) - 3, int(14 * sigma) + 4)
    z = np.exp(-(k.astype(float) ** 2) / (2 * sigma**2)).sum()
    return np.exp(-(ks.astype(float) ** 2) / (2 * sigma**2)) / z


# --- entropy ------------------------------------------------------------------------------------


def test_os_keys_differ_and_a_given_generator_decides_the_key():
    a, b = h.os_key(), h.os_key()
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    c, d = h.os_key(random.Random(7)), h.os_key(random.Random(7))
    np.testing.assert_array_equal(jax.random.key_data(c), jax.random.key_data(d))
    assert h.os_seed() != h.os_seed() and 0 <= h.os_seed(bits=8) < 256
    assert h.os_seed(random.Random(1)) == h.os_seed(random.Random(1))


def _spy_on_entropy(monkeypatch, value):
    """Replaces the OS's generator by one that records the bits asked of it (a list) and answers ``value``."""
    drawn = []

    class Spy:
        def getrandbits(self, k):
            drawn.append(k)
            return value

    monkeypatch.setattr("gradclip_jax.dp.hardened._entropy._SYSTEM", Spy())
    return drawn


def test_os_key_draws_from_secrets_by_default(monkeypatch):
    drawn = _spy_on_entropy(monkeypatch, 12345)
    key = h.os_key()
    assert drawn == [32] * jax.random.key_data(key).size
    assert int(jax.random.key_data(key).ravel()[0]) == 12345


@pytest.mark.parametrize("rng", [0, 42, True, np.int64(3), np.random.default_rng(0), "seed"])
def test_an_integer_or_other_non_generator_is_refused_naming_rng(rng):
    with pytest.raises(TypeError, match="`rng`"):
        h.os_key(rng)
    with pytest.raises(TypeError, match="`rng`"):
        h.os_seed(rng)


# --- the discrete Gaussian -----------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [0.4, 3.0, 1000.5])
def test_table_is_the_exact_cdf_to_96_bits(sigma):
    table = dg.cdf_table(sigma)
    c = np.array([(int(a) << 64) + (int(b) << 32) + int(w) + 1 for a, b, w in table], dtype=object)
    assert c[-1] == 2**96 and all(np.diff(c) >= 0)
    p = np.array([float(v) for v in np.diff(np.concatenate([[0], c]))]) / 2**96
    k = np.arange(len(p))
    exact = _pmf(sigma, k) * np.where(k == 0, 1, 2)
    np.testing.assert_allclose(
        p[:50], exact[:50], rtol=1e-12, atol=2.0**-95
    )  # each entry floored to 2**-96
    assert len(p) >= 13 * sigma  # the tail is cut where exp(-k^2 / 2 sigma^2) < 2**-128
    assert h.sampler_tv_bound(sigma) < 1e-22


@pytest.mark.parametrize("sigma", [0.7, 3.0, 40.0])
def test_draws_fit_the_discrete_gaussian(sigma):
    """Chi-square against the pmf at a fixed key (bins with >= 5 expected), and the moments."""
    n = 200_000
    y = np.asarray(jax.jit(lambda k: h.discrete_gaussian(k, (n,), sigma))(jax.random.key(1)))
    assert y.dtype == np.int32
    ks = np.arange(-int(12 * sigma) - 2, int(12 * sigma) + 3)
    counts = np.histogram(y, bins=np.append(ks, ks[-1] + 1) - 0.5)[0]
    expected = _pmf(sigma, ks) * n
    m = expected >= 5
    chi2 = float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())
    assert stats.chi2.sf(chi2, int(m.sum()) - 1) > 1e-3
    var = float((_pmf(sigma, ks) * ks.astype(float) ** 2).sum())
    assert abs(y.mean()) < 5 * math.sqrt(var / n)
    assert abs(y.var() / var - 1) < 5 * math.sqrt(2 / n)


def test_discrete_gaussian_same_key_same_draw_and_works_under_vmap_and_blocks(monkeypatch):
    k = jax.random.key(3)
    a, b = h.discrete_gaussian(k, (5, 7), 2.0), h.discrete_gaussian(k, (5, 7), 2.0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, h.discrete_gaussian(jax.random.key(4), (5, 7), 2.0))
    many = jax.vmap(lambda kk: h.discrete_gaussian(kk, (9,), 2.0))(jax.random.split(k, 3))
    assert many.shape == (3, 9) and not np.array_equal(many[0], many[1])
    monkeypatch.setattr(dg, "BLOCK", 64)  # several blocks, the last one partly used
    y = h.discrete_gaussian(k, (1000,), 5.0)
    assert y.shape == (1000,) and 3.5 < float(np.std(np.asarray(y))) < 6.5
    np.testing.assert_array_equal(h.discrete_gaussian(k, (4,), 0.0), np.zeros(4, np.int32))


@pytest.mark.parametrize(
    "sigma,match",
    [(-1.0, "sigma"), (float("nan"), "sigma"), (2.0**17, "grid_scale"), ("1", "sigma")],
)
def test_bad_sigma_names_it(sigma, match):
    with pytest.raises((ValueError, TypeError), match=match):
        h.discrete_gaussian(jax.random.key(0), (3,), sigma)


# --- the integer grid ----------------------------------------------------------------------------


def _exact_sq_norms(r: dict) -> np.ndarray:
    rows = np.concatenate(
        [np.asarray(v, np.int64).reshape(v.shape[0], -1) for v in r.values()], axis=1
    )
    return (rows.astype(object) ** 2).sum(axis=1)


@pytest.mark.parametrize("scale", [1.0, 1.0 + 2**-22, 1.7, 1e3])
def test_each_examples_integer_vector_has_norm_at_most_grid_scale_times_c_exactly(scale):
    """Examples at and just above the clip norm, in many directions: the exact integer norm of
    each rounded example (one example per call, int64 object arithmetic) never exceeds gamma C."""
    rng = np.random.default_rng(0)
    c, gamma = 1.3, 2.0**12
    g = rng.normal(size=(64, 300)).astype(np.float32)
    g = g / np.linalg.norm(g, axis=1, keepdims=True) * c * scale
    for i in range(0, 64, 8):
        r = jax.vmap(lambda x: h.grid_clipped_sum({"w": x[None]}, c, gamma))(
            jnp.asarray(g[i : i + 8])
        )
        sq = _exact_sq_norms(r)
        assert all(s <= (gamma * c) ** 2 for s in sq), sq
        assert all(
            s >= (gamma * c - math.sqrt(300)) ** 2 for s in sq
        )  # truncation loses < 1 per coordinate


def test_grid_sum_is_the_exact_sum_of_the_rounded_examples_and_masks_and_drops_nan():
    rng = np.random.default_rng(1)
    g = {
        "a": rng.normal(size=(6, 4, 3)).astype(np.float32),
        "b": rng.normal(size=(6, 5)).astype(np.float32),
    }
    g["b"][2, 0] = np.nan
    mask = np.array([True, True, True, True, False, True])
    s = h.grid_clipped_sum(g, 1.0, 64.0, mask=mask)
    parts = [
        h.grid_clipped_sum(jax.tree.map(lambda x, i=i: x[i : i + 1], g), 1.0, 64.0)
        for i in range(6)
    ]
    for name in g:
        assert s[name].dtype == jnp.int32
        want = sum(np.asarray(p[name], np.int64) for i, p in enumerate(parts) if mask[i] and i != 2)
        np.testing.assert_array_equal(s[name], want)
    jitted = jax.jit(lambda t: h.grid_clipped_sum(t, 1.0, 64.0, mask=mask))(g)
    np.testing.assert_array_equal(jitted["a"], s["a"])


@pytest.mark.parametrize("grid_scale", [3.0, 0.0, -2.0, float("inf"), 1000.0])
def test_grid_scale_must_be_a_positive_power_of_two(grid_scale):
    with pytest.raises(ValueError, match="grid_scale"):
        h.grid_clipped_sum({"w": jnp.ones((2, 3))}, 1.0, grid_scale)


def test_grid_too_fine_for_int32_names_grid_scale():
    with pytest.raises(ValueError, match=r"grid_scale.*too fine.*2\*\*30"):
        h.grid_clipped_sum({"w": jnp.ones((1024, 3))}, 1.0, 2.0**21)
    h.grid_clipped_sum({"w": jnp.ones((1024, 3))}, 1.0, 2.0**20)  # at the limit


def test_grid_bad_clip_norm_and_mask_are_named():
    with pytest.raises(ValueError, match="l2_clip_norm"):
        h.grid_clipped_sum({"w": jnp.ones((2, 3))}, -1.0, 4.0)
    with pytest.raises((ValueError, TypeError), match="mask"):
        h.grid_clipped_sum({"w": jnp.ones((2, 3))}, 1.0, 4.0, mask=np.ones(3, bool))


def test_add_discrete_noise_is_integer_per_leaf_and_refuses_float_leaves():
    t = {"a": jnp.zeros((100, 50), jnp.int32), "b": jnp.full((7,), 5, jnp.int32)}
    out = h.add_discrete_gaussian_noise(t, 3.0, jax.random.key(0))
    assert out["a"].dtype == jnp.int32 and 2.5 < float(np.std(np.asarray(out["a"]))) < 3.5
    assert not np.array_equal(out["a"][0], out["a"][1])
    with pytest.raises(TypeError, match="int32"):
        h.add_discrete_gaussian_noise({"w": jnp.zeros(3)}, 1.0, jax.random.key(0))
    with pytest.raises(ValueError, match="sigma"):
        h.add_discrete_gaussian_noise(t, -1.0, jax.random.key(0))


def test_from_grid_and_sensitivity():
    np.testing.assert_array_equal(
        h.from_grid({"w": jnp.array([512, -64], jnp.int32)}, 256.0, 2.0)["w"], [1.0, -0.125]
    )
    assert (
        h.grid_sensitivity(1.5, 1024.0) == 1536.0
        and h.grid_sensitivity(1.5, 1024.0, "replace") == 3072.0
    )
    assert h.grid_noise_multiplier(3072.0, 1.5, 1024.0) == 2.0
    with pytest.raises(ValueError, match="neighbouring relation"):
        h.grid_sensitivity(1.0, 2.0, "swap")


# --- sum of normals ------------------------------------------------------------------------------


def test_sum_of_normals_is_standard_normal_and_keeps_the_signal():
    """KS against N(0, sigma^2) at a fixed key; the signal is added once, not halved."""
    x = {"a": jnp.full((400, 250), 3.0), "b": jnp.ones(7, jnp.bfloat16)}
    out = jax.jit(lambda t, k: h.add_sum_of_normals_noise(t, 2.0, k))(x, jax.random.key(5))
    z = (np.asarray(out["a"]).ravel() - 3.0) / 2.0
    assert stats.kstest(z, "norm").pvalue > 1e-3
    # within five standard errors of the sample mean and variance (n = 10**5)
    assert abs(z.mean()) < 5 / np.sqrt(z.size) and abs(z.var() - 1) < 5 * np.sqrt(2 / z.size)
    assert out["b"].dtype == jnp.float32
    again = h.add_sum_of_normals_noise(x, 2.0, jax.random.key(5))
    np.testing.assert_allclose(again["a"], out["a"], rtol=1e-6)
    other = h.add_sum_of_normals_noise(x, 2.0, h.os_key())
    assert not np.allclose(other["a"], out["a"])


# --- accounting of the discrete mechanism ------------------------------------------------------


def _log_pmf(sigma: float, y: np.ndarray, mu: float = 0.0) -> np.ndarray:
    logw = -((y - mu) ** 2) / (2 * sigma**2)
    return logw - np.logaddexp.reduce(-((y.astype(float)) ** 2) / (2 * sigma**2))


def _exact_subsampled_rdp(q, shift, sigma, orders):
    """Both directions' Renyi divergences of the Poisson-subsampled 1-D discrete Gaussian (integer
    shift), summed exactly over the integers: ``(mixture || base, base || mixture)`` per order."""
    y = np.arange(-int(80 * sigma) - shift, int(80 * sigma) + 2 * shift).astype(float)
    lp0, lp1 = _log_pmf(sigma, y), _log_pmf(sigma, y, shift)
    lm = np.logaddexp(np.log1p(-q) + lp0, np.log(q) + lp1) if q < 1 else lp1
    up = [np.logaddexp.reduce(lp0 + a * (lm - lp0)) / (a - 1) for a in orders]
    down = [np.logaddexp.reduce(a * lp0 + (1 - a) * lm) / (a - 1) for a in orders]
    return np.array(up), np.array(down)


@pytest.mark.parametrize(
    "q,shift,sigma", [(1.0, 4, 5.0), (0.1, 4, 5.0), (0.01, 3, 2.4), (0.3, 1, 0.9)]
)
def test_discrete_mechanisms_renyi_divergences_are_below_dp_accountings_gaussian_rdp(
    q, shift, sigma
):
    """Both directions of the Poisson-subsampled discrete Gaussian's Renyi divergence (1-D,
    integer shift, computed exactly over the integers) stay below dp-accounting's RDP of the
    subsampled Gaussian at noise multiplier sigma / shift in these cases: an observation, not a
    proof (the accountant records the general bound of the test below)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    orders = np.arange(2, 33)
    acc = dp_accounting.rdp.RdpAccountant(orders=list(map(float, orders)))
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma / shift))
    )
    gaussian = np.asarray(acc._rdp)
    up, down = _exact_subsampled_rdp(q, shift, sigma, orders)
    assert np.all(np.maximum(up, down) <= gaussian * (1 + 1e-9) + 1e-12), (up, down, gaussian)


@pytest.mark.parametrize(
    "q,shift,sigma", [(1.0, 4, 5.0), (0.1, 4, 5.0), (0.01, 3, 2.4), (0.3, 1, 0.9)]
)
def test_the_discrete_events_rdp_bounds_both_directions_exactly_computed(q, shift, sigma):
    """What make_private(hardened='discrete') records (Zhu and Wang's general bound on the
    discrete Gaussian's RDP) is above both exact directions, at integer and fractional orders."""
    orders = np.array([1.5, 2.0, 2.5, 3.0, 4.0, 7.5, 8.0, 16.0, 32.0])
    bound = PoissonSampledDiscreteGaussianEvent(q, sigma / shift).rdp(orders)
    up, down = _exact_subsampled_rdp(q, shift, sigma, orders)
    assert np.all(np.maximum(up, down) <= bound * (1 + 1e-9) + 1e-12), (up, down, bound)
    assert np.all(np.diff(bound) >= 0)  # RDP grows with the order


def test_the_general_bound_is_the_base_rdp_unsampled_and_above_the_sampled_gaussians():
    dp_accounting = pytest.importorskip("dp_accounting")
    orders = np.arange(2.0, 65.0)
    np.testing.assert_allclose(
        PoissonSampledDiscreteGaussianEvent(1.0, 2.0).rdp(orders), orders / 8.0
    )
    for q, z in [(0.01, 1.0), (0.1, 0.8), (0.5, 3.0)]:
        acc = dp_accounting.rdp.RdpAccountant(orders=list(orders))
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
        ours = poisson_subsampled_rdp(q, lambda a, z=z: a / (2 * z * z), orders)
        assert np.all(
            ours >= np.asarray(acc._rdp) * (1 - 1e-9)
        )  # the exact Gaussian's is the tighter
        assert np.all(np.isfinite(ours))
    assert np.all(np.isinf(PoissonSampledDiscreteGaussianEvent(0.1, 0.0).rdp(orders)))


def test_hardened_discrete_run_accounts_the_discrete_gaussians_bound():
    dp_accounting = pytest.importorskip("dp_accounting")
    priv = _run("discrete")
    sigma = priv.noise_multiplier * 256.0 * 1.0
    assert priv.accountant.accountant == "rdp"
    assert priv.epsilon() == 0.0 and 3.99 <= priv.planned_epsilon <= 4.0
    assert priv.plan()["mechanism"] == "discrete_gaussian"
    # calibrated on the discrete mechanism's bound: more noise than the Gaussian run's
    assert priv.noise_multiplier > _run(False, accountant="rdp").noise_multiplier
    params, state = jnp.zeros(3), priv.init(jnp.zeros(3))
    batches = priv.batches(_data())
    for _ in range(3):
        batch, mask = next(batches)
        params, state, _ = priv.step(params, state, batch, mask, priv.noise_key())
    orders = np.asarray(dp_accounting.rdp.RdpAccountant().orders)
    rdp = 3 * PoissonSampledDiscreteGaussianEvent(0.1, priv.noise_multiplier).rdp(orders)
    expected = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(orders, rdp, 1e-4)[0]
    assert priv.epsilon() == pytest.approx(expected, rel=1e-12)
    resumed = _run("discrete", resume_from=priv.state_dict())  # the saved phases name the mechanism
    assert resumed.accountant.steps == 3 and resumed.epsilon() == pytest.approx(expected, rel=1e-12)
    pld = gcx.PrivacyAccountant("pld")
    pld.step(priv.noise_multiplier, sampler=priv.sampler)
    with pytest.raises(
        ValueError, match="has no privacy loss distribution here: use the 'rdp' accountant"
    ):
        pld.epsilon(1e-4)
    assert priv.plan()["grid_scale"] == 256.0 and priv.plan()["hardened"] == "discrete"
    with pytest.raises(ValueError, match="grid_scale"):  # resumed on another grid
        _run("discrete", grid_scale=512.0, resume_from=priv.state_dict())
    np.testing.assert_allclose(h.grid_noise_multiplier(sigma, 1.0, 256.0), priv.noise_multiplier)


# --- make_private(hardened=...) ------------------------------------------------------------------


def _loss(w, batch):
    return 0.5 * (batch["x"] @ w - batch["y"]) ** 2


def _data(n=200):
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}


def _run(hardened=True, **kw):
    args = dict(
        dataset_size=200,
        expected_batch_size=20,
        steps=5,
        target_epsilon=4.0,
        delta=1e-4,
        l2_clip_norm=1.0,
        process_index=0,
        process_count=1,
        hardened=hardened,
    )
    if hardened == "discrete":
        args.update(grid_scale=256.0, accountant="rdp")
    return make_private(_loss, optax.sgd(0.1), **{**args, **kw})


def test_hardened_runs_seed_their_sampler_from_the_os_and_differ():
    a, b = _run(), _run()
    assert a.plan()["seed"] != b.plan()["seed"]
    assert (
        max(a.plan()["seed"], b.plan()["seed"]) >= 2**64
    )  # 128-bit seeds (both below: probability 2**-128)
    assert a.plan()["hardened"] == "sum_of_normals" and "hardened" not in _run(False).plan()
    ia, ib = a.sampler.batch(0).indices, b.sampler.batch(0).indices
    assert not np.array_equal(ia, ib)
    assert not np.array_equal(
        jax.random.key_data(a.noise_key()), jax.random.key_data(a.noise_key())
    )


def test_hardened_run_draws_its_seed_from_secrets_never_a_user_int(monkeypatch):
    drawn = _spy_on_entropy(monkeypatch, 987654321)
    priv = _run()
    assert drawn == [128] and priv.plan()["seed"] == 987654321
    priv.noise_key()
    assert drawn[1:] == [32] * jax.random.key_data(jax.random.key(0)).size


def test_a_hardened_run_takes_no_caller_chosen_noise_key():
    # batches(noise_key=) and step_key derive each step's key from the caller's key: in a
    # hardened run that would bring back the user-chosen seed the OS keys replace
    priv = _run()
    with pytest.raises(
        ValueError, match=r"priv\.noise_key\(\) for each step instead of passing `noise_key`"
    ):
        next(priv.batches(_data(), noise_key=jax.random.key(0)))
    assert priv.accountant.steps == 0  # refused before a step was recorded
    with pytest.raises(ValueError, match="`noise_key`"):
        priv.step_key(jax.random.key(0), 0)


def test_a_given_generator_makes_a_hardened_run_reproducible():
    a, b = _run(rng=random.Random(3)), _run(rng=random.Random(3))
    assert a.plan()["seed"] == b.plan()["seed"]
    np.testing.assert_array_equal(
        jax.random.key_data(a.noise_key()), jax.random.key_data(b.noise_key())
    )


@pytest.mark.parametrize("mode", [True, "discrete"])
def test_hardened_step_trains_and_its_noise_has_the_calibrated_scale(mode):
    priv = _run(mode)
    params = jnp.zeros(3)
    state = priv.init(params)
    step = jax.jit(priv.step)
    for batch, mask in priv.batches(_data()):
        params, state, metrics = step(params, state, batch, mask, priv.noise_key())
    assert np.all(np.isfinite(np.asarray(params))) and int(metrics.num_clipped) >= 0
    # the noise alone: zero sum, sgd(0.1) -> update = -0.1 * noise / expected batch size
    zero = jnp.zeros(4000, jnp.int32) if mode == "discrete" else jnp.zeros(4000)
    p0 = jnp.zeros(4000)
    new, _, _ = jax.jit(priv.noisy_update)(p0, priv.optimizer.init(p0), zero, priv.noise_key())
    noise = -np.asarray(new) / 0.1 * priv.expected_batch_size
    assert abs(noise.std() / priv.noise_multiplier - 1.0) < 0.06
    if mode == "discrete":  # on the grid: multiples of 1/256
        np.testing.assert_allclose(noise * 256.0, np.round(noise * 256.0), atol=1e-3)


def test_hardened_resume_keeps_the_os_drawn_seed():
    priv = _run()
    it = priv.batches()
    next(it)
    state = priv.state_dict()
    resumed = _run(resume_from=state)
    assert resumed.plan()["seed"] == priv.plan()["seed"]
    np.testing.assert_array_equal(next(resumed.batches()).indices, priv.sampler.batch(1).indices)


def test_a_hardened_state_does_not_resume_as_a_default_run():
    """The saved plan's ``hardened`` is checked even where the resuming call has no such field:
    resumed without it, the run would take caller-chosen noise keys and the plain draw."""
    priv = _run()
    next(priv.batches())
    state = priv.state_dict()
    with pytest.raises(
        ValueError, match=r"hardened='sum_of_normals' there, and this call has no 'hardened'"
    ):
        _run(hardened=False, resume_from=state, seed=state["plan"]["seed"])


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(seed=0), ValueError, "`seed`"),
        (dict(seed=7), ValueError, "`seed`"),
        (dict(rng=0), TypeError, "`rng`"),
        (dict(rng=np.random.default_rng(0)), TypeError, "`rng`"),
        (dict(hardened="yes"), ValueError, "`hardened`"),
        (dict(hardened=1), ValueError, "`hardened`"),
        (dict(hardened=False, rng=random.Random(0)), ValueError, "`rng`"),
        (dict(hardened=False, grid_scale=4.0), ValueError, "`grid_scale`"),
        (dict(grid_scale=4.0), ValueError, "`grid_scale`"),
        (dict(hardened="discrete", grid_scale=None), ValueError, "`grid_scale`"),
        (dict(hardened="discrete", accountant="pld"), ValueError, "accountant"),
        (dict(hardened="discrete", grid_scale=3.0, accountant="rdp"), ValueError, "grid_scale"),
        (dict(hardened="discrete", grid_scale=2.0**20, accountant="rdp"), ValueError, "grid_scale"),
        (
            dict(hardened="discrete", grid_scale=4.0, accountant="rdp", physical_batch_size=4),
            ValueError,
            "physical_batch_size",
        ),
        (
            dict(hardened="discrete", grid_scale=4.0, accountant="rdp", method="ghost"),
            ValueError,
            "`method`",
        ),
    ],
)
def test_bad_hardened_arguments_are_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        _run(**kw)


def test_hardened_refuses_a_given_sampler():
    sampler = PoissonSampler(
        200, steps=5, expected_batch_size=20, seed=1, process_index=0, process_count=1
    )
    with pytest.raises(ValueError, match="`sampler`"):
        _run(
            sampler=sampler,
            dataset_size=None,
            expected_batch_size=None,
            process_index=None,
            process_count=None,
        )


@pytest.mark.parametrize("sigma", [0.3, 2.0, 50.0, 1024.0])
def test_guided_search_is_the_full_inversion_on_every_boundary(sigma):
    """Uniforms at each table row and one above it: the guided search returns the smallest k with
    u <= row k, as a plain search of the whole table (numpy, exact integers) does."""
    table = dg.cdf_table(sigma)
    rows = table[:: max(1, len(table) // 300)]
    t = np.array([(int(a) << 64) + (int(b) << 32) + int(c) for a, b, c in table], dtype=object)
    us = sorted(
        {
            int(v) + d
            for a, b, c in rows
            for v in [(int(a) << 64) + (int(b) << 32) + int(c)]
            for d in (0, 1)
            if int(v) + d < 2**96
        }
        | {0, 2**96 - 1}
    )
    words = np.array([[(u >> s) & 0xFFFFFFFF for u in us] for s in (64, 32, 0)], np.uint32)
    lo_b, hi_b = dg._guide(sigma)
    got = np.asarray(
        dg._magnitudes(
            jnp.asarray(table), (jnp.asarray(lo_b), jnp.asarray(hi_b)), jnp.asarray(words)
        )
    )
    want = [int(np.argmax(t >= u)) for u in us]
    np.testing.assert_array_equal(got, want)


# --- the guide -----------------------------------------------------------------------------------


def test_the_guides_code_runs_as_written(capsys):
    """docs/guides/hardened-noise.md's python blocks, in order in one namespace: both hardened runs
    train (the discrete one to the right weights within its noise) and spend at most their target."""
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "hardened-noise.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    assert len(blocks) == 3
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(guide), "exec"), ns)  # the guide's own code
    out = capsys.readouterr().out
    assert "sum_of_normals epsilon" in out
    assert ns["priv"].epsilon() <= 2.0 and ns["priv"].accountant.accountant == "rdp"
    np.testing.assert_allclose(np.asarray(ns["w"]), [1.0, -2.0, 0.5], atol=0.2)
    assert ns["ints"]["w"].dtype == jnp.int32 and ns["update"]["w"].dtype == jnp.float32


# --- the audit -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw", [dict(hardened=True), dict(hardened="discrete", grid_scale=256.0, accountant="rdp")]
)
def test_audit_of_a_hardened_run_stays_below_its_epsilon(kw):
    """The one-run canary audit (gradclip_jax.dp.audit) of a hardened run: its empirical lower
    bound is below the accountant's epsilon (a small run: the audit's power is low here; the
    docs' slow audit is the default run's)."""
    pytest.importorskip("jax_privacy.auditing")
    from gradclip_jax.dp.audit import audit_epsilon

    x = np.arange(150, dtype=np.float32).reshape(50, 3) / 100
    res = audit_epsilon(
        _loss,
        jnp.zeros(3),
        {"x": x, "y": np.ones(50, np.float32)},
        num_canaries=200,
        target_epsilon=2.0,
        delta=1e-4,
        l2_clip_norm=1.0,
        expected_batch_size=25,
        steps=10,
        process_index=0,
        process_count=1,
        **kw,
    )
    assert res.claimed_epsilon <= 2.0 + 1e-9
    assert 0.0 <= res.epsilon_lower_bound < res.claimed_epsilon and not res.falsified


def test_constant_time_search_gives_the_same_draws_in_a_fixed_number_of_steps():
    k = jax.random.key(9)
    fast = h.discrete_gaussian(k, (5000,), 700.0)
    fixed = h.discrete_gaussian(k, (5000,), 700.0, constant_time=True)
    np.testing.assert_array_equal(fast, fixed)

    def jaxpr(ct):
        return str(
            jax.make_jaxpr(lambda kk: h.discrete_gaussian(kk, (100,), 700.0, constant_time=ct))(k)
        )

    assert "while[" in jaxpr(False) and "while[" not in jaxpr(
        True
    )  # a fixed trip count: no data-dependent loop
    zero = {"w": jnp.zeros(5000, jnp.int32)}
    noised = h.add_discrete_gaussian_noise(zero, 700.0, k, constant_time=True)
    np.testing.assert_array_equal(noised["w"], h.add_discrete_gaussian_noise(zero, 700.0, k)["w"])
