"""Tests for gradclip_jax.dp.audit: gradient canaries and the one-run epsilon lower bound.

The slow tests are the audit of the docs' "Auditing epsilon" section: the digits
MLP trained through ``make_private`` with 2000 gradient canaries. Honest runs
stay below the accountant's epsilon; pipelines broken on purpose here (no noise,
noise scaled to the mean) are caught by a lower bound above it; shuffled
fixed-size batches reported as Poisson are beyond the audit's power, and the
test pins that limit down. Run with ``pytest -m slow -s tests/dp/test_audit.py``
to print the table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx
from gradclip_jax.demo import batch_indices, init_mlp, load_digits_split, per_example_loss
from gradclip_jax.dp.audit import GradientCanaries, audit_epsilon, epsilon_lower_bound

pytest.importorskip("dp_accounting")
pytest.importorskip("jax_privacy.auditing")

DELTA = 1e-6
CANARIES = 2000
BATCH = 100
STEPS = 100


def _lin_loss(w, batch):
    return 0.5 * (batch["x"] @ w - batch["y"]) ** 2


def _lin_data(n=6):
    x = np.arange(3 * n, dtype=np.float32).reshape(n, 3) / 10
    return {"x": x, "y": np.ones(n, np.float32)}


# ----------------------------------------------------------------------------
# The pieces (fast)
# ----------------------------------------------------------------------------


def test_perfect_scores_bound_epsilon_far_above_zero_and_blind_scores_bound_nothing():
    included = np.random.default_rng(0).random(1000) < 0.5
    assert epsilon_lower_bound(included * 1.0, included, DELTA) > 4.0
    assert epsilon_lower_bound(np.zeros(1000), included, DELTA) == 0.0
    noise = np.random.default_rng(1).normal(size=1000)
    assert epsilon_lower_bound(noise, included, DELTA) < 0.5


def test_lower_bound_rejects_scores_and_flips_of_other_shapes():
    with pytest.raises(ValueError, match="same 1-D shape"):
        epsilon_lower_bound(np.zeros(4), np.ones(5, bool), DELTA)


def test_draw_flips_a_fair_coin_per_canary_and_needs_two():
    included = GradientCanaries.draw(4000, 1.0, seed=3).included
    assert included.dtype == bool and 0.45 < included.mean() < 0.55
    np.testing.assert_array_equal(included, GradientCanaries.draw(4000, 1.0, seed=3).included)
    with pytest.raises(ValueError, match="num_canaries"):
        GradientCanaries.draw(1, 1.0, seed=0)


def test_data_keeps_its_size_whatever_the_flips_and_marks_in_canaries_by_index():
    can = GradientCanaries(included=np.array([True, False, True]), l2_clip_norm=1.0)
    audited = can.wrap_data(_lin_data(4))
    np.testing.assert_array_equal(audited["canary"], [-2, -2, -2, -2, 0, -1, 2])
    assert audited["data"]["x"].shape == (7, 3)
    np.testing.assert_array_equal(audited["data"]["x"][4:], np.repeat(_lin_data(4)["x"][:1], 3, 0))


def test_clipped_canary_gradient_is_c_times_its_own_coordinate_and_an_out_canary_adds_nothing():
    c = 0.7
    can = GradientCanaries(included=np.array([True, False, True]), l2_clip_norm=c)
    audited = can.wrap_data(_lin_data(4))
    params = can.wrap_params(jnp.ones(3))
    grad_fn = gcx.clipped_grad(can.wrap_loss(_lin_loss), c)
    per_row = [grad_fn(params, jax.tree.map(lambda a, i=i: a[i:i + 1], audited))[0] for i in range(7)]
    for i in range(4):  # real rows: the model's gradient, none on the canaries
        assert float(jnp.abs(per_row[i]["canary"]).max()) == 0.0
        assert float(jnp.linalg.norm(per_row[i]["model"])) > 0.0
    np.testing.assert_allclose(per_row[4]["canary"], [c, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(per_row[6]["canary"], [0, 0, c], rtol=1e-6)
    for i in (4, 5, 6):  # canary rows leave the model alone; the out canary's row is all zero
        assert float(jnp.abs(per_row[i]["model"]).max()) == 0.0
    assert float(jnp.abs(per_row[5]["canary"]).max()) == 0.0


def test_scores_are_how_far_training_moved_each_canary_against_its_gradient():
    can = GradientCanaries(included=np.array([True, False]), l2_clip_norm=1.0)
    before = can.wrap_params(jnp.zeros(3))
    after = {"model": before["model"], "canary": jnp.array([-0.5, 0.25])}
    np.testing.assert_allclose(can.scores(before, after), [0.5, -0.25])


def test_audit_of_a_tiny_honest_run_reports_the_accountants_epsilon_and_a_lower_bound_below_it():
    res = audit_epsilon(
        _lin_loss, jnp.zeros(3), _lin_data(50), num_canaries=100, target_epsilon=2.0, delta=1e-4,
        l2_clip_norm=1.0, expected_batch_size=15, steps=10, process_index=0, process_count=1,
    )
    assert res.claimed_epsilon <= 2.0 + 1e-9 and res.delta == 1e-4
    assert res.scores.shape == res.included.shape == (100,)
    assert 0.0 <= res.epsilon_lower_bound < res.claimed_epsilon and not res.falsified


# ----------------------------------------------------------------------------
# The audit of make_private on the digits MLP (slow)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    x, y, _, _ = load_digits_split()
    return {"x": x, "y": y}, init_mlp(jax.random.key(0), (64, 32, 10))


def _private(canaries, audited, target_epsilon, **kw):
    args = dict(dataset_size=int(audited["canary"].shape[0]), target_epsilon=target_epsilon, delta=DELTA,
                l2_clip_norm=canaries.l2_clip_norm, expected_batch_size=BATCH, steps=STEPS, seed=0,
                process_index=0, process_count=1)
    return gcx.make_private(canaries.wrap_loss(per_example_loss), optax.sgd(0.5), **{**args, **kw})


def _step_with_noise_std(priv, std):
    """The private step with the noise's std set by hand: the pieces make_private is built from."""

    def step(params, opt_state, batch, mask, key):
        summed, _ = priv.clipped_sum(params, batch, mask)
        noised = gcx.privacy.add_gaussian_noise(summed, std, key)
        grads = jax.tree.map(lambda g: g / priv.expected_batch_size, noised)
        updates, opt_state = priv.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step)


def _canary_trajectory(step, priv, params, batches):
    """``(steps + 1, m)``: the canary coordinates before training and after each step."""
    opt_state, out = priv.init(params), [np.asarray(params["canary"])]
    for t, (batch, mask) in enumerate(batches):
        params, opt_state = step(params, opt_state, batch, mask, jax.random.fold_in(jax.random.key(1), t))[:2]
        out.append(np.asarray(params["canary"]))
    return np.stack(out)


def _report(case, claimed, bound):
    print(f"\n| {case} | {claimed:.2f} | {bound:.2f} |", end="")


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", [1.0, 4.0, 8.0])
def test_honest_make_private_run_stays_below_the_accountants_epsilon(digits, epsilon):
    data, params = digits
    res = audit_epsilon(
        per_example_loss, params, data, num_canaries=CANARIES, target_epsilon=epsilon, delta=DELTA,
        l2_clip_norm=1.0, expected_batch_size=BATCH, steps=STEPS, optimizer=optax.sgd(0.5),
        process_index=0, process_count=1,
    )
    _report(f"honest, epsilon {epsilon:g}", res.claimed_epsilon, res.epsilon_lower_bound)
    assert res.claimed_epsilon == pytest.approx(epsilon, rel=1e-3)
    assert res.epsilon_lower_bound < res.claimed_epsilon and not res.falsified


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", [1.0, 4.0])
@pytest.mark.parametrize("bug", ["no noise", "noise std z*C/B (the mean's)"])
def test_audit_flags_a_pipeline_with_too_little_noise(digits, bug, epsilon):
    data, params = digits
    canaries = GradientCanaries.draw(CANARIES, 1.0, seed=0)
    audited = canaries.wrap_data(data)
    priv = _private(canaries, audited, epsilon)
    z, c = priv.noise_multiplier, priv.l2_clip_norm
    std = 0.0 if bug == "no noise" else z * c / priv.expected_batch_size  # the accountant assumes z*C
    traj = _canary_trajectory(_step_with_noise_std(priv, std), priv, canaries.wrap_params(params),
                              priv.batches(audited))
    bound = canaries.epsilon_lower_bound(traj[0] - traj[-1], DELTA)
    _report(f"{bug}, epsilon {epsilon:g}", priv.epsilon(), bound)
    assert priv.epsilon() == pytest.approx(epsilon, rel=1e-3)
    assert bound > priv.epsilon()


@pytest.mark.slow
def test_shuffled_batches_reported_as_poisson_are_beyond_the_audits_power(digits):
    """One epoch of batches of 10 at claimed epsilon 8 (small noise, where shuffling is said to
    fall furthest behind Poisson sampling), scored per step: the audit sees no difference."""
    data, params = digits
    canaries = GradientCanaries.draw(CANARIES, 1.0, seed=0)
    audited = canaries.wrap_data(data)
    n, batch = int(audited["canary"].shape[0]), 10
    priv = _private(canaries, audited, 8.0, expected_batch_size=batch, steps=n // batch)

    def shuffled():
        for idx in batch_indices(n, batch, priv.steps, seed=0):
            priv.record_step()  # reported as a Poisson step
            yield jax.tree.map(lambda a: a[idx], audited), np.ones(batch, bool)

    step = _step_with_noise_std(priv, priv.noise_multiplier * priv.l2_clip_norm)
    bounds = {}
    for name, batches in (("Poisson", priv.batches(audited)), ("shuffled", shuffled())):
        priv.accountant.load_state_dict(gcx.privacy.PrivacyAccountant().state_dict())
        traj = _canary_trajectory(step, priv, canaries.wrap_params(params), batches)
        # the strongest score we found: each canary's largest single-step move
        bounds[name] = canaries.epsilon_lower_bound((traj[:-1] - traj[1:]).max(0), DELTA)
        _report(f"{name} batches, per-step scores, epsilon 8", priv.epsilon(), bounds[name])
    assert priv.epsilon() == pytest.approx(8.0, rel=1e-3)
    assert bounds["Poisson"] < 8.0 and bounds["shuffled"] < 8.0
