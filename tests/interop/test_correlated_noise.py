"""gradclip_jax.interop.correlated_noise: jax-privacy's BandMF plan with our clipped sums. The noise
is C^{-1} times i.i.d. Gaussians of the scale the accounting assumes, the calibrated epsilon is at
most the target (dp-accounting, rebuilt here), what gets noised is our clipped sum (ghost = vmap =
jax-privacy's), bad arguments are named, and the guide page runs."""

from __future__ import annotations

import functools
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax_privacy")
dp_accounting = pytest.importorskip("dp_accounting")

from jax_privacy import clipping as jp_clipping  # noqa: E402
from jax_privacy.experimental.execution_plan import BandMFExecutionPlanConfig  # noqa: E402
from jax_privacy.matrix_factorization import toeplitz  # noqa: E402

import gradclip_jax as gcx  # noqa: E402
from gradclip_jax.interop import correlated_noise as cn  # noqa: E402
from tests.per_example.models import assert_tree_close, mlp_setup  # noqa: E402

REL = dp_accounting.NeighboringRelation
SMALL = {
    "num_examples": 1000,
    "expected_batch_size": 50,
    "iterations": 12,
    "num_bands": 4,
    "epsilon": 2.0,
    "delta": 1e-5,
    "noise_seed": 0,
    "strategy_optimization_steps": 50,
}


@pytest.fixture(scope="module")
def small_plan():
    return cn.bandmf_plan(**SMALL, l2_clip_norm=0.5)


# Each plan calibrates its noise for about 10 s: the tests that share a plan (a module-scoped
# fixture, or a cached plan) are one xdist group, so that one worker calibrates it once.
SMALL_PLAN = pytest.mark.xdist_group("correlated_noise_small_plan")
ONE_BAND = pytest.mark.xdist_group("correlated_noise_one_band")


@functools.cache
def _one_band_plan():
    """SMALL with one band and 100 iterations: DP-SGD through ``bandmf_plan``."""
    return cn.bandmf_plan(**{**SMALL, "num_bands": 1, "iterations": 100})


def _noise(transform, shape, steps):
    """The noise ``transform`` adds at each of ``steps`` steps to a zero gradient: ``(steps, *shape)``."""
    zero = jnp.zeros(shape, jnp.float32)
    state, out = transform.init(zero), []
    update = jax.jit(transform.update)
    for _ in range(steps):
        noisy, state = update(zero, state)
        out.append(np.asarray(noisy, np.float64))
    return np.stack(out)


@SMALL_PLAN
def test_noise_is_the_strategy_inverse_times_iid_gaussians(small_plan):
    """N = C^{-1} Z: C @ N (C from jax-privacy's own materialize_lower_triangular) is white, of
    standard deviation noise_multiplier * sensitivity * ||coef||; N's covariance is sigma^2 C^{-1} C^{-T}."""
    t, d = SMALL["iterations"], 200_000
    noise = _noise(small_plan.noise_addition_transform, (d,), t)
    c = np.asarray(toeplitz.materialize_lower_triangular(small_plan.strategy, n=t), np.float64)
    sigma = (
        small_plan.noise_multiplier
        * 0.5
        / SMALL["expected_batch_size"]
        * np.linalg.norm(small_plan.strategy)
    )
    z = c @ noise
    np.testing.assert_allclose(np.cov(z), sigma**2 * np.eye(t), atol=0.02 * sigma**2)
    c_inv = np.linalg.inv(c)
    np.testing.assert_allclose(np.cov(noise), sigma**2 * c_inv @ c_inv.T, atol=0.03 * sigma**2)
    # correlated for real: consecutive steps' noise is anti-correlated (not DP-SGD's white noise)
    assert np.corrcoef(noise[0], noise[1])[0, 1] < -0.1


@ONE_BAND
def test_one_band_is_white_noise():
    plan = _one_band_plan()
    np.testing.assert_array_equal(plan.strategy, [1.0])
    noise = _noise(plan.noise_addition_transform, (100_000,), 4)
    sigma = plan.noise_multiplier / SMALL["expected_batch_size"]
    np.testing.assert_allclose(np.cov(noise), sigma**2 * np.eye(4), atol=0.03 * sigma**2)


@pytest.mark.parametrize(
    ("bands", "target", "relation"),
    [
        *[(b, 1.0, r) for b in (1, 4) for r in ("add_or_remove", "zero_out")],
        # a large target is the same code path at 3x the calibration time: slow, and once (the
        # relation only changes which dp-accounting PLD is calibrated, as at target 1 above)
        pytest.param(4, 8.0, "add_or_remove", marks=pytest.mark.slow),
    ],
)
def test_epsilon_at_most_target_by_dp_accounting(bands, target, relation):
    """The run's event, rebuilt from the public description (ceil(T/b) Poisson-sampled Gaussians of
    rate q = B b / n) and composed by dp-accounting's PLD and RDP accountants: epsilon <= target."""
    n, batch, steps, delta = 1347, 64, 100, 1e-5
    plan = cn.bandmf_plan(
        num_examples=n,
        expected_batch_size=batch,
        iterations=steps,
        num_bands=bands,
        epsilon=target,
        delta=delta,
        neighboring_relation=relation,
        strategy_optimization_steps=20,
    )
    rel = {"add_or_remove": REL.ADD_OR_REMOVE_ONE, "zero_out": REL.REPLACE_SPECIAL}[relation]
    assert plan.neighboring_relation == rel and plan.sampling_prob == pytest.approx(
        batch * bands / n
    )
    gauss = dp_accounting.GaussianDpEvent(plan.noise_multiplier)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(batch * bands / n, gauss), math.ceil(steps / bands)
    )
    pld = dp_accounting.pld.PLDAccountant(rel).compose(event).get_epsilon(delta)
    assert pld <= target and pld == pytest.approx(plan.epsilon, rel=1e-9)
    assert pld > 0.97 * target  # calibrated, not merely safe
    if relation == "add_or_remove":  # RDP is an upper bound on the same mechanism
        assert dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta) >= 0.97 * target


@ONE_BAND
def test_one_band_calibrates_like_make_private():
    """num_bands=1 is DP-SGD: jax-privacy's calibration gives gradclip_jax.dp's noise multiplier."""
    from gradclip_jax.dp.accounting import calibrate_noise_multiplier

    plan = _one_band_plan()
    ours = calibrate_noise_multiplier(SMALL["epsilon"], 50 / 1000, 100, SMALL["delta"], "pld")
    assert plan.noise_multiplier == pytest.approx(ours, rel=1e-3)


@SMALL_PLAN
def test_batches_follow_the_bands(small_plan):
    """Each example is only ever in steps of one residue mod num_bands; batches average B."""
    batches = list(small_plan.batch_selection_strategy.batch_iterator(1000, rng=0))
    assert len(batches) == SMALL["iterations"]
    residue: dict[int, int] = {}
    for t, idx in enumerate(batches):
        for i in idx.tolist():
            assert residue.setdefault(i, t % 4) == t % 4
    assert 40 < np.mean([len(b) for b in batches]) < 60


def _mean_loss(loss):
    return lambda p, b: jnp.mean(loss(p, b))


@functools.cache
def _plan_of_ten(method):
    """The SMALL plan with an expected batch of 10, for ``method``: each calibrated once (about
    10 s), shared by the slow tests below (one xdist group, so one worker calibrates them)."""
    return cn.bandmf_plan(**{**SMALL, "expected_batch_size": 10}, method=method)


@pytest.mark.slow
@pytest.mark.xdist_group("correlated_noise_plans")
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_noised_sum_is_our_clipped_sum(method):
    """noisy(g) - noisy(0) (same noise state) is gradclip_jax's clipped sum / B, and jax-privacy's."""
    loss, params, data = mlp_setup()
    rows = jax.tree.leaves(data)[0].shape[0]
    padding = jnp.arange(rows) >= rows - 2
    plan = _plan_of_ten(method)
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    grads = jax.jit(plan.clipped_grad(_mean_loss(loss), batch_argnums=1))(
        params, data, is_padding_example=padding
    )
    state = plan.noise_addition_transform.init(params)
    noisy, _ = plan.noise_addition_transform.update(grads, state)
    noise, _ = plan.noise_addition_transform.update(jax.tree.map(jnp.zeros_like, grads), state)
    core, _ = jax.jit(gcx.clipped_grad(loss, 1.0, method=method))(params, data, mask=~padding)
    theirs = jax.jit(
        jp_clipping.clipped_grad(
            _mean_loss(loss), l2_clip_norm=1.0, batch_argnums=1, normalize_by=10.0
        )
    )
    assert_tree_close(
        jax.tree.map(jnp.subtract, noisy, noise),
        jax.tree.map(lambda g: g / 10, core),
        rtol=1e-4,
        atol=1e-6,
    )
    assert_tree_close(grads, theirs(params, data, is_padding_example=padding), rtol=2e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.xdist_group("correlated_noise_plans")
def test_ghost_and_vmap_plans_give_the_same_noisy_gradient():
    loss, params, data = mlp_setup()
    out = {}
    for method in ("ghost", "vmap"):
        plan = _plan_of_ten(method)
        state = plan.noise_addition_transform.init(params)
        grad_fn = jax.jit(plan.clipped_grad(_mean_loss(loss), batch_argnums=1))
        for _ in range(3):  # the third step's noise mixes three draws
            noisy, state = plan.noise_addition_transform.update(grad_fn(params, data), state)
        out[method] = noisy
    assert_tree_close(out["ghost"], out["vmap"], rtol=1e-5, atol=1e-7)


def test_with_gradclip_keeps_jax_privacys_plan():
    config = BandMFExecutionPlanConfig(
        strategy=np.array([0.8, 0.6]),
        iterations=6,
        noise_multiplier=1.5,
        epsilon=None,
        delta=None,
        sampling_prob=0.5,
        noise_seed=3,
        l2_clip_norm=2.0,
        normalize_by=4.0,
        rescale_to_unit_norm=False,
    )
    theirs, ours = config.plan, cn.with_gradclip(config, method="vmap")
    assert (
        ours.dp_event == theirs.dp_event
        and ours.batch_selection_strategy == theirs.batch_selection_strategy
    )
    loss, params, data = mlp_setup()
    g_ours = ours.clipped_grad(_mean_loss(loss), batch_argnums=1)
    g_theirs = theirs.clipped_grad(_mean_loss(loss), batch_argnums=1)
    assert g_ours.sensitivity() == g_theirs.sensitivity() == 0.5
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    assert_tree_close(
        jax.jit(g_ours)(params, data), jax.jit(g_theirs)(params, data), rtol=2e-5, atol=1e-6
    )
    n_ours = _noise(ours.noise_addition_transform, (5,), 3)
    np.testing.assert_array_equal(n_ours, _noise(theirs.noise_addition_transform, (5,), 3))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_bands": 0}, "num_bands"),
        ({"num_bands": 13}, "num_bands"),
        ({"num_bands": 2.0}, "num_bands"),
        ({"iterations": -1}, "iterations"),
        ({"expected_batch_size": 300}, "expected_batch_size"),
        ({"num_examples": True}, "num_examples"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": math.inf}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"delta": "1e-5"}, "delta"),
        ({"l2_clip_norm": -1.0}, "l2_clip_norm"),
        ({"method": "fast"}, "method"),
        ({"neighboring_relation": "replace"}, "neighboring_relation"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        cn.bandmf_plan(**{**SMALL, **kwargs})


def test_with_gradclip_bad_arguments():
    config = BandMFExecutionPlanConfig(
        strategy=[1.0], iterations=2, noise_multiplier=1.0, epsilon=None, delta=None
    )
    with pytest.raises(ValueError, match="`method`"):
        cn.with_gradclip(config, method="ghosts")
    with pytest.raises(TypeError, match="`config`"):
        cn.with_gradclip(config.plan)
    with pytest.raises(
        TypeError, match="l2_clip_norm"
    ):  # the plan's clip norm is the one the noise fits
        cn.with_gradclip(config).clipped_grad(lambda p, x: p * x, l2_clip_norm=3.0)


@pytest.mark.slow
@pytest.mark.heavy
def test_guide_runs():
    """docs/guides/correlated-noise.md: its python blocks, run in order, train at the target epsilon."""
    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "correlated-noise.md"
    ns: dict = {"__name__": "correlated_noise_guide"}
    for code in re.findall(r"^```python\n(.*?)^```", guide.read_text(), flags=re.S | re.M):
        exec(compile(code, guide.name, "exec"), ns)
    assert ns["plan"].epsilon <= 4.0
    assert ns["test_accuracy"] > 0.5
    assert ns["blt"].epsilon <= 4.0 and ns["blt"].sampling_prob == 1.0
    assert ns["blt_accuracy"] > 0.5


@pytest.mark.slow
@pytest.mark.heavy
def test_digits_comparison():
    """tools/mf_digits.py at one epsilon and seed: every row at most its target epsilon, all learn."""
    from tools import mf_digits

    rows = mf_digits.compare(epsilons=(4.0,), seeds=(0,), bands=(1, 4))
    assert {r["run"] for r in rows} >= {
        "DP-SGD (make_private)",
        "DP-SGD (plan, 1 band)",
        "BandMF (4 bands)",
    }
    for r in rows:
        assert r["epsilon"] <= 4.0 and r["accuracy"] > 0.6, r


# ----------------------------------------------------------------------------
# BLT (buffered linear Toeplitz) noise
# ----------------------------------------------------------------------------

BLT = {
    "num_examples": 600,
    "expected_batch_size": 100,
    "iterations": 15,
    "epsilon": 4.0,
    "delta": 1e-5,
    "noise_seed": 0,
}


@pytest.fixture(scope="module")
def blt_small():
    return cn.blt_plan(**BLT, l2_clip_norm=0.5)


BLT_PLAN = pytest.mark.xdist_group("correlated_noise_blt_plan")  # one worker calibrates blt_small


def _blt_sensitivity_by_brute_force(coefs, t, cycle):
    """max ||C 1_P|| over the participation patterns the cyclic batches produce: {j, j + b, ...}."""
    c = np.asarray(toeplitz.materialize_lower_triangular(coefs, n=t), np.float64)
    return max(np.linalg.norm(c[:, j::cycle].sum(axis=1)) for j in range(cycle))


@BLT_PLAN
def test_blt_noise_is_the_strategy_inverse_times_iid_gaussians_at_the_min_sep_sensitivity(
    blt_small,
):
    """N = C^{-1} Z with C the plan's strategy: C @ N is white, of standard deviation
    noise_multiplier * (C_clip / B) * Delta, Delta = max over the cyclic participation patterns (6
    steps apart, 3 each in 15 steps) of ||C 1_P||, computed here by brute force; and the noise is
    correlated for real (not white)."""
    t, d, cycle = BLT["iterations"], 200_000, 6
    delta_sens = _blt_sensitivity_by_brute_force(blt_small.strategy, t, cycle)
    assert delta_sens > 1.1 * np.linalg.norm(
        blt_small.strategy
    )  # three participations cost more than one
    noise = _noise(blt_small.noise_addition_transform, (d,), t)
    c = np.asarray(toeplitz.materialize_lower_triangular(blt_small.strategy, n=t), np.float64)
    sigma = blt_small.noise_multiplier * 0.5 / BLT["expected_batch_size"] * delta_sens
    np.testing.assert_allclose(np.cov(c @ noise), sigma**2 * np.eye(t), atol=0.02 * sigma**2)
    assert np.corrcoef(noise[0], noise[1])[0, 1] < -0.1


@BLT_PLAN
def test_blt_strategy_is_a_decaying_toeplitz_and_its_epsilon_is_one_gaussian_mechanism(blt_small):
    """C's coefficients start at 1, are positive and non-increasing (where the min-sep sensitivity is
    exact); the run's event is one Gaussian mechanism, calibrated to the target by dp-accounting."""
    coefs = blt_small.strategy
    assert coefs.shape == (BLT["iterations"],) and coefs[0] == pytest.approx(1.0)
    assert np.all(coefs > 0) and np.all(np.diff(coefs) <= 0)
    assert (
        blt_small.sampling_prob == 1.0 and blt_small.neighboring_relation == REL.ADD_OR_REMOVE_ONE
    )
    pld = (
        dp_accounting.pld.PLDAccountant(REL.ADD_OR_REMOVE_ONE)
        .compose(dp_accounting.GaussianDpEvent(blt_small.noise_multiplier))
        .get_epsilon(BLT["delta"])
    )
    assert (
        pld <= BLT["epsilon"]
        and pld > 0.97 * BLT["epsilon"]
        and pld == pytest.approx(blt_small.epsilon)
    )
    assert blt_small.dp_event == dp_accounting.GaussianDpEvent(blt_small.noise_multiplier)


@BLT_PLAN
def test_blt_batches_take_each_example_every_cycle_length_steps(blt_small):
    """600 examples in batches of about 100: cycle length 6, each example in steps j, j + 6, j + 12."""
    batches = list(blt_small.batch_selection_strategy.batch_iterator(BLT["num_examples"], rng=0))
    assert len(batches) == BLT["iterations"]
    steps: dict[int, list[int]] = {}
    for t, idx in enumerate(batches):
        for i in idx.tolist():
            steps.setdefault(i, []).append(t)
    assert all(np.all(np.diff(s) == 6) and len(s) <= 3 for s in steps.values())
    assert len(steps) == BLT["num_examples"]  # everyone takes part (probability 1)


def test_blt_noised_sum_is_our_clipped_sum():
    loss, params, data = mlp_setup()
    plan = cn.blt_plan(**{**BLT, "expected_batch_size": 10}, method="ghost")
    grads = jax.jit(plan.clipped_grad(_mean_loss(loss), batch_argnums=1))(
        params, data
    )  # eager: op by op
    state = plan.noise_addition_transform.init(params)
    noisy, _ = plan.noise_addition_transform.update(grads, state)
    noise, _ = plan.noise_addition_transform.update(jax.tree.map(jnp.zeros_like, grads), state)
    core, _ = jax.jit(gcx.clipped_grad(loss, 1.0, method="vmap"))(params, data)
    assert_tree_close(
        jax.tree.map(jnp.subtract, noisy, noise),
        jax.tree.map(lambda g: g / 10, core),
        rtol=1e-4,
        atol=1e-6,
    )


def test_blt_more_buffers_or_zero_out_still_calibrate_and_bad_buffers_are_named():
    plan = cn.blt_plan(**BLT, num_buffers=5, neighboring_relation="zero_out")
    assert plan.neighboring_relation == REL.REPLACE_SPECIAL and plan.epsilon <= BLT["epsilon"]
    for bad in (0, 11, 2.5, True):
        with pytest.raises(ValueError, match="num_buffers"):
            cn.blt_plan(**BLT, num_buffers=bad)
    with pytest.raises(ValueError, match="expected_batch_size"):
        cn.blt_plan(**{**BLT, "expected_batch_size": 601})


@pytest.mark.slow
def test_blt_optimized_strategy_is_calibrated_alike_and_no_worse_than_the_rational_one():
    """optimize=True (jax-privacy's buffered_toeplitz.optimize for this participation): the same one
    Gaussian mechanism (z depends on epsilon only), its noise white at the brute-force sensitivity
    under C, and its max prefix-sum error times sensitivity squared at most the rational strategy's."""
    opt = cn.blt_plan(**BLT, optimize=True, num_buffers=2)
    rat = cn.blt_plan(**BLT, num_buffers=2)
    assert (
        opt.noise_multiplier == pytest.approx(rat.noise_multiplier)
        and opt.epsilon <= BLT["epsilon"]
    )
    assert np.all(np.diff(opt.strategy) <= 0) and not np.allclose(opt.strategy, rat.strategy)
    t, cycle = BLT["iterations"], 6

    def loss(plan):
        inv = toeplitz.inverse_coef(jnp.asarray(plan.strategy, jnp.float32))
        err = float(jnp.max(toeplitz.per_query_error(noising_coef=inv)))
        return err * _blt_sensitivity_by_brute_force(plan.strategy, t, cycle) ** 2

    assert loss(opt) <= 1.01 * loss(rat)
    noise = _noise(opt.noise_addition_transform, (100_000,), t)
    c = np.asarray(toeplitz.materialize_lower_triangular(opt.strategy, n=t), np.float64)
    sigma = (
        opt.noise_multiplier
        / BLT["expected_batch_size"]
        * _blt_sensitivity_by_brute_force(opt.strategy, t, cycle)
    )
    np.testing.assert_allclose(np.cov(c @ noise), sigma**2 * np.eye(t), atol=0.03 * sigma**2)


def _past_the_plan_is_nan(plan, iterations):
    noise = _noise(plan.noise_addition_transform, (3,), iterations + 2)
    assert np.all(np.isfinite(noise[:iterations])) and np.all(np.isnan(noise[iterations:]))
    state = plan.noise_addition_transform.init(jnp.zeros(3))
    assert isinstance(state, cn.PlanNoiseState) and int(state.steps) == 0


@SMALL_PLAN
def test_bandmf_noise_past_the_planned_steps_is_nan(small_plan):
    """The plan's epsilon is for ``iterations`` steps: a step beyond them (a second pass of
    ``batch_iterator``) gives a NaN update, which ``optax.apply_if_finite`` catches, not noise
    the accounting never saw."""
    _past_the_plan_is_nan(small_plan, SMALL["iterations"])


@BLT_PLAN
def test_blt_noise_past_the_planned_steps_is_nan(blt_small):
    _past_the_plan_is_nan(blt_small, BLT["iterations"])
