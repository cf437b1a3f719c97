"""Tests for gradclip_jax.dp: DP aggregation transforms."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from gradclip_jax import (
    DPAggregateState,
    DPQuantileAggregateState,
    clipped_grad,
    dp_aggregate,
    dp_noise,
    dp_quantile_aggregate,
    dpsgd,
    noise_multiplier_for_gradient,
    per_example_global_norm_clip,
)


def _grads(seed=0, batch=8, zero_row=3):
    r = np.random.default_rng(seed)
    scales = r.uniform(0.2, 4.0, size=batch)
    g = {
        "w": r.normal(size=(batch, 4, 3)) * scales[:, None, None],
        "b": r.normal(size=(batch, 3)) * scales[:, None],
    }
    for v in g.values():
        v[zero_row] = 0.0
    return {k: jnp.asarray(v, jnp.float32) for k, v in g.items()}


def _params():
    return {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# optax parity
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("noise_multiplier", [0.0, 1.1])
@pytest.mark.parametrize("clip", [0.5, 3.0])
def test_dp_aggregate_matches_optax(noise_multiplier, clip):
    """Same seed, same key splitting: the same noise draw, step after step."""
    ours = dp_aggregate(clip, noise_multiplier, seed=42)
    ref = optax.contrib.differentially_private_aggregate(
        clip, noise_multiplier, key=jax.random.key(42)
    )
    params = _params()
    s1, s2 = ours.init(params), ref.init(params)
    up1, up2 = jax.jit(ours.update), jax.jit(ref.update)
    for step in range(3):
        g = _grads(step)
        u1, s1 = up1(g, s1, params)
        u2, s2 = up2(g, s2, params)
        _close(u1, u2)
    assert isinstance(s1, DPAggregateState)
    assert int(s1.count) == 3


@pytest.mark.parametrize("momentum,nesterov", [(None, False), (0.9, False), (0.9, True)])
def test_dpsgd_matches_optax(momentum, nesterov):
    ours = dpsgd(0.1, 1.0, 0.8, seed=7, momentum=momentum, nesterov=nesterov)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # optax 0.2.8 passes seed=
        ref = optax.contrib.dpsgd(0.1, 1.0, 0.8, seed=7, momentum=momentum, nesterov=nesterov)
    p1 = p2 = _params()
    s1, s2 = ours.init(p1), ref.init(p2)
    for step in range(3):
        g = _grads(step + 10)
        u1, s1 = ours.update(g, s1, p1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            u2, s2 = ref.update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        _close(p1, p2)


def test_dp_aggregate_noiseless_is_clipped_mean():
    g = _grads(1)
    tx = dp_aggregate(1.0, 0.0, seed=0)
    out, _ = tx.update(g, tx.init(_params()))
    summed, _ = per_example_global_norm_clip(g, 1.0)
    _close(out, jax.tree.map(lambda s: s / 8, summed))
    # a public divisor (e.g. the expected batch size of Poisson sampling)
    tx = dp_aggregate(1.0, 0.0, seed=0, batch_size=32)
    out, _ = tx.update(g, tx.init(_params()))
    _close(out, jax.tree.map(lambda s: s / 32, summed))


# ----------------------------------------------------------------------------
# Noise
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dp_aggregate_noise_statistics(dtype):
    batch, clip, z = 4, 2.0, 1.5
    g = {"w": jnp.zeros((batch, 20000), dtype), "v": jnp.zeros((batch, 10000), dtype)}
    tx = dp_aggregate(clip, z, seed=3)
    out, state = jax.jit(tx.update)(g, tx.init(None))
    assert out["w"].dtype == dtype
    noise = (
        np.concatenate([np.asarray(out["w"], np.float64), np.asarray(out["v"], np.float64)]) * batch
    )
    assert abs(noise.mean()) < 4 * clip * z / math.sqrt(noise.size)
    assert noise.std() == pytest.approx(clip * z, rel=0.03)
    # leaves get independent noise, and the next step fresh noise
    assert (
        abs(
            np.corrcoef(np.asarray(out["w"][:10000], np.float64), np.asarray(out["v"], np.float64))[
                0, 1
            ]
        )
        < 0.05
    )
    out2, _ = jax.jit(tx.update)(g, state)
    assert not np.allclose(np.asarray(out2["w"], np.float32), np.asarray(out["w"], np.float32))


def test_dp_noise_after_clipped_grad():
    def loss(w, b):
        return 0.5 * jnp.sum((b["x"] * w - b["y"]) ** 2, axis=-1)

    r = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(r.normal(size=(16, 5000)), jnp.float32),
        "y": jnp.asarray(r.normal(size=(16, 5000)), jnp.float32),
    }
    grad_fn = clipped_grad(loss, 1.0)
    w = jnp.zeros(5000)
    grads, _ = jax.jit(grad_fn)(w, batch)
    z = 2.0
    tx = dp_noise(z * grad_fn.sensitivity(), seed=0, normalize_by=16)
    noised, _ = jax.jit(tx.update)(grads, tx.init(w))
    resid = np.asarray(noised, np.float64) * 16 - np.asarray(grads, np.float64)
    assert resid.std() == pytest.approx(z * 1.0, rel=0.05)
    tx0 = dp_noise(0.0, seed=0, normalize_by=4)
    out, _ = tx0.update({"w": jnp.array([2.0])}, tx0.init(None))
    np.testing.assert_allclose(out["w"], [0.5])
    with pytest.raises(ValueError, match="normalize_by"):
        dp_noise(1.0, seed=0, normalize_by=0)


# ----------------------------------------------------------------------------
# Masks, NaN, sharding, state rules
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_dp_aggregate_mask_and_nan():
    g = _grads(2)
    mask = jnp.array([True, True, False, True, True, False, True, True])
    garbage = jax.tree.map(lambda x: x.at[2].set(jnp.nan).at[5].set(1e30), g)
    tx = dp_aggregate(1.0, 0.0, seed=0)
    out, _ = jax.jit(tx.update)(garbage, tx.init(_params()), mask=mask)
    kept = jax.tree.map(lambda x: x[np.asarray(mask)], g)
    summed, _ = per_example_global_norm_clip(kept, 1.0)
    _close(out, jax.tree.map(lambda s: s / 8, summed))
    # the mask reaches the transform through optax.chain's extra arguments
    chained = optax.chain(dp_aggregate(1.0, 0.0, seed=0), optax.scale(-1.0))
    out_c, _ = chained.update(garbage, chained.init(_params()), _params(), mask=mask)
    _close(out_c, jax.tree.map(lambda s: -s / 8, summed))
    # nan_safe: a NaN example contributes nothing (within the sensitivity)
    nan_row = jax.tree.map(lambda x: x.at[0].set(jnp.nan), g)
    out, _ = tx.update(nan_row, tx.init(_params()))
    summed, _ = per_example_global_norm_clip(jax.tree.map(lambda x: x[1:], g), 1.0)
    _close(out, jax.tree.map(lambda s: s / 8, summed))
    unsafe = dp_aggregate(1.0, 0.0, seed=0, nan_safe=False)
    out, _ = unsafe.update(nan_row, unsafe.init(_params()))
    assert np.isnan(np.asarray(out["w"])).any()


def test_dp_in_chain_and_scan_state_is_fixed():
    tx = optax.chain(dp_aggregate(1.0, 1.0, seed=0), optax.sgd(0.1))
    params = _params()
    state = tx.init(params)
    gs = jax.tree.map(lambda *x: jnp.stack(x), *[_grads(i) for i in range(4)])

    def step(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (_, state2), _ = jax.lax.scan(step, (params, state), gs)
    assert jax.tree.structure(state2) == jax.tree.structure(state)
    assert int(state2[0].count) == 4
    # the state holds only the key and the step count: nothing about the data
    assert DPAggregateState._fields == ("rng_key", "count")
    assert DPQuantileAggregateState._fields == ("rng_key", "clip_norm", "count")


def test_dp_aggregate_explicit_sharding():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    g = _grads(3, batch=16)
    tx = dp_aggregate(1.0, 1.0, seed=5)
    ref, _ = tx.update(g, tx.init(_params()))
    q = dp_quantile_aggregate(1.0, seed=5, expected_batch_size=16)
    qref, qs_ref = q.update(g, q.init(_params()))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        gs = jax.tree.map(lambda x: jax.sharding.reshard(x, P("x")), g)
        out, _ = jax.jit(tx.update)(gs, tx.init(None))
        qout, qs = jax.jit(q.update)(gs, q.init(_params()), mask=jnp.ones(16, bool))
    _close(out, ref)
    _close(qout, qref)
    np.testing.assert_allclose(qs.clip_norm, qs_ref.clip_norm, rtol=1e-6)


def test_construction_errors():
    with pytest.raises(ValueError, match="l2_norm_clip"):
        dp_aggregate(-1.0, 1.0, seed=0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_aggregate(1.0, float("nan"), seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        dp_aggregate(1.0, 1.0, seed=0, batch_size=0)
    with pytest.raises(TypeError, match="seed"):
        dp_aggregate(1.0, 1.0, seed="zero")
    with pytest.raises(TypeError):
        dp_aggregate(1.0, 1.0)  # the seed is required: no silent default noise
    with pytest.raises(ValueError, match="count_noise_std"):
        dp_quantile_aggregate(1.0, seed=0, count_noise_std=0.4)
    with pytest.raises(ValueError, match="count_noise_std"):
        dp_quantile_aggregate(1.0, seed=0)  # neither expected_batch_size nor count_noise_std
    with pytest.raises(ValueError, match="target_unclipped_quantile"):
        dp_quantile_aggregate(1.0, seed=0, expected_batch_size=100, target_unclipped_quantile=1.5)
    with pytest.raises(ValueError, match="initial_l2_norm_clip"):
        dp_quantile_aggregate(1.0, seed=0, expected_batch_size=100, initial_l2_norm_clip=0.0)
    with pytest.raises(ValueError, match="min_l2_norm_clip"):
        dp_quantile_aggregate(
            1.0, seed=0, expected_batch_size=100, min_l2_norm_clip=2.0, max_l2_norm_clip=1.0
        )
    with pytest.raises(ValueError, match=r"leaf \['b'\] has batch size"):
        tx = dp_aggregate(1.0, 1.0, seed=0)
        tx.update({"w": jnp.ones((4, 2)), "b": jnp.ones((3, 2))}, tx.init(None))


def test_key_and_schedules():
    g = _grads(4)
    a = dp_aggregate(1.0, 1.0, seed=jax.random.key(9))
    b = dp_aggregate(1.0, 1.0, seed=9)
    c = dp_aggregate(1.0, 1.0, seed=jax.random.PRNGKey(9))
    outs = [tx.update(g, tx.init(None))[0] for tx in (a, b, c)]
    _close(outs[0], outs[1])
    _close(outs[0], outs[2])
    # schedules are evaluated at the transform's own step count
    tx = dp_aggregate(lambda t: 1.0 / (t + 1), 0.0, seed=0)
    s = tx.init(None)
    for t in range(3):
        out, s = tx.update(g, s)
        summed, _ = per_example_global_norm_clip(g, 1.0 / (t + 1))
        _close(out, jax.tree.map(lambda x: x / 8, summed))


# ----------------------------------------------------------------------------
# Quantile-adaptive DP clipping (Andrew et al.)
# ----------------------------------------------------------------------------


def _norm_rows(norms):
    """Per-example grads with the given global norms (one leaf, direction e_0 + e_1)."""
    norms = np.asarray(norms, np.float64)
    v = np.zeros((len(norms), 2))
    v[:, 0] = norms / math.sqrt(2)
    v[:, 1] = norms / math.sqrt(2)
    return {"g": jnp.asarray(v, jnp.float32)}


def test_noise_multiplier_split():
    assert noise_multiplier_for_gradient(1.0, 6.4) == pytest.approx((1.0 - 1.0 / 12.8**2) ** -0.5)
    assert noise_multiplier_for_gradient(0.0, 5.0) == 0.0
    with pytest.raises(ValueError):
        noise_multiplier_for_gradient(2.0, 1.0)
    traced = jax.jit(noise_multiplier_for_gradient)(1.0, 6.4)
    assert float(traced) == pytest.approx((1.0 - 1.0 / 12.8**2) ** -0.5, rel=1e-6)


@pytest.mark.parametrize("geometric", [True, False])
def test_quantile_update_noiseless_exact(geometric):
    norms = np.arange(1.0, 11.0)  # 1..10
    g = _norm_rows(norms)
    c0, gamma, eta = 5.5, 0.8, 0.2
    tx = dp_quantile_aggregate(
        0.0,
        seed=0,
        initial_l2_norm_clip=c0,
        target_unclipped_quantile=gamma,
        clip_learning_rate=eta,
        expected_batch_size=10,
        count_noise_std=0.0,
        geometric_update=geometric,
    )
    state = tx.init({"g": jnp.zeros(2)})
    out, state = jax.jit(tx.update)(g, state)
    frac = 5 / 10  # norms 1..5 are <= 5.5
    expected = c0 * math.exp(-eta * (frac - gamma)) if geometric else c0 - eta * (frac - gamma)
    assert float(state.clip_norm) == pytest.approx(expected, rel=1e-6)
    # the gradient is the clipped mean at the clip norm in force (C_0)
    summed, _ = per_example_global_norm_clip(g, c0)
    _close(out, jax.tree.map(lambda s: s / 10, summed))
    # an example exactly at the clip norm counts as unclipped
    tx2 = dp_quantile_aggregate(
        0.0,
        seed=0,
        initial_l2_norm_clip=2.0,
        expected_batch_size=2,
        count_noise_std=0.0,
        target_unclipped_quantile=1.0,
    )
    _, s2 = tx2.update({"g": jnp.array([[2.0, 0.0], [0.0, 0.0]])}, tx2.init(None))
    assert float(s2.clip_norm) == pytest.approx(2.0)


def test_quantile_clamps_and_bounds():
    g = _norm_rows(np.full(10, 100.0))
    tx = dp_quantile_aggregate(
        0.0,
        seed=0,
        initial_l2_norm_clip=1.0,
        expected_batch_size=10,
        count_noise_std=0.0,
        max_l2_norm_clip=1.1,
    )
    _, s = tx.update(g, tx.init(None))
    assert float(s.clip_norm) == pytest.approx(1.1)  # exp(0.1) = 1.105 clamped to 1.1
    # huge count noise: the fraction is clamped to [0, 1], so one step moves C by at most e^(eta/2)
    tx = dp_quantile_aggregate(
        1.0, seed=0, initial_l2_norm_clip=1.0, expected_batch_size=10, count_noise_std=1e6
    )
    state = tx.init(None)
    upd = jax.jit(tx.update)
    for _ in range(20):
        prev = float(state.clip_norm)
        _, state = upd(g, state)
        assert abs(math.log(float(state.clip_norm) / prev)) <= 0.2 * 0.5 + 1e-6


def test_quantile_converges_to_target_quantile():
    r = np.random.default_rng(0)
    m = 256
    tx = dp_quantile_aggregate(
        1.0, seed=0, initial_l2_norm_clip=0.1, expected_batch_size=m, target_unclipped_quantile=0.5
    )
    keys = jax.random.split(jax.random.key(1), 300)

    def step(state, k):
        norms = jnp.exp(jax.random.normal(k, (m,)))  # log-normal, median 1
        g = {"g": jnp.stack([norms, jnp.zeros(m)], axis=1)}
        _, state = tx.update(g, state)
        return state, state.clip_norm

    _, path = jax.lax.scan(step, tx.init(None), keys)
    tail = np.asarray(path[-100:])
    assert float(np.median(tail)) == pytest.approx(1.0, rel=0.15)
    del r


def test_quantile_gradient_noise_uses_split_multiplier():
    z, m, c0 = 1.0, 100, 2.0
    tx = dp_quantile_aggregate(z, seed=0, initial_l2_norm_clip=c0, expected_batch_size=m)
    g = {"g": jnp.zeros((m, 40000))}
    out, _ = jax.jit(tx.update)(g, tx.init(None))
    z_delta = noise_multiplier_for_gradient(z, m / 20)
    std = float(np.std(np.asarray(out["g"], np.float64) * m))
    assert std == pytest.approx(z_delta * c0, rel=0.03)
    assert z_delta > z


def test_quantile_mask_excludes_padding():
    norms = np.array([1.0, 1.0, 1.0, 1.0, 50.0, 50.0])
    g = _norm_rows(norms)
    mask = jnp.array([True, True, True, True, False, False])
    tx = dp_quantile_aggregate(
        0.0,
        seed=0,
        initial_l2_norm_clip=2.0,
        expected_batch_size=4,
        count_noise_std=0.0,
        target_unclipped_quantile=0.5,
    )
    _, s = tx.update(g, tx.init(None), mask=mask)
    # all 4 real examples are unclipped: fraction 1 -> C shrinks by exp(-0.2 * 0.5)
    assert float(s.clip_norm) == pytest.approx(2.0 * math.exp(-0.1), rel=1e-6)


def test_aggregates_refuse_multisteps():
    grads = {"w": jnp.ones((4, 2))}
    for tx in (
        dp_aggregate(1.0, 1.0, seed=0),
        dp_quantile_aggregate(1.0, seed=0, expected_batch_size=4, count_noise_std=1.0),
    ):
        ms = optax.MultiSteps(tx, every_k_schedule=2)
        with pytest.raises(ValueError, match="MultiSteps"):
            ms.update(grads, ms.init({"w": jnp.zeros(2)}))


def test_errors_name_the_called_function_and_spellings():
    with pytest.raises(ValueError, match=r"^dpsgd: "):
        dpsgd(0.1, -1.0, 1.0, seed=0)
    with pytest.raises(ValueError, match=r"^dp_aggregate: "):
        dp_aggregate(-1.0, 1.0, seed=0)
    with pytest.raises(TypeError, match="dpsgd: missing"):
        dpsgd(0.1, noise_multiplier=1.0, seed=0)
    with pytest.raises(ValueError, match=r"^dpsgd: `l2_clip_norm` must be"):
        dpsgd(0.1, l2_clip_norm=-1.0, noise_multiplier=1.0, seed=0)


@pytest.mark.parametrize("factory,extra", [(dp_aggregate, {}), (dpsgd, {"learning_rate": 0.1})])
def test_both_spellings_of_the_clip_norm_are_accepted_without_a_warning(factory, extra):
    g = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])}
    p = {"w": jnp.zeros(2)}
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for clip in ({"l2_clip_norm": 1.0}, {"l2_norm_clip": 1.0}):
            tx = factory(**extra, **clip, noise_multiplier=0.5, seed=0)
            outs.append(tx.update(g, tx.init(p), p)[0]["w"])
    np.testing.assert_array_equal(outs[0], outs[1])
    name = factory.__name__
    with pytest.raises(TypeError, match=rf"^{name}: got both `l2_clip_norm` and `l2_norm_clip`"):
        factory(**extra, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0, l2_clip_norm=1.0)
    with pytest.raises(TypeError, match=rf"^{name}: missing .*`l2_clip_norm`.*`l2_norm_clip`"):
        factory(**extra, noise_multiplier=0.0, seed=0)


# ----------------------------------------------------------------------------
# Invalid hyperparameters known only at run time (optax.inject_hyperparams)
# ----------------------------------------------------------------------------

_INJECTED = {
    "dp_aggregate": (
        dp_aggregate,
        {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "seed": 0, "batch_size": 8.0},
    ),
    "dpsgd": (
        dpsgd,
        {
            "learning_rate": 0.1,
            "l2_norm_clip": 1.0,
            "noise_multiplier": 1.0,
            "seed": 0,
            "momentum": 0.9,
        },
    ),
    "dp_noise": (dp_noise, {"stddev": 1.0, "seed": 0, "normalize_by": 4.0}),
}
_BAD = {
    "l2_norm_clip": (-1.0, math.nan),
    "noise_multiplier": (-1.0, math.nan),
    "stddev": (-1.0, math.nan),
    "batch_size": (-8.0, 0.0, math.nan),
    "normalize_by": (-4.0, 0.0, math.nan),
    "learning_rate": (-0.1, math.nan),
    "momentum": (-1.0, 1.0, math.nan),
}


@pytest.mark.parametrize("name", sorted(_INJECTED))
def test_invalid_traced_noise_clip_and_learning_rate_give_nan(name):
    # A traced noise_multiplier = -1 used to negate the noise and a learning rate of -0.1 to
    # ascend, both with finite updates that apply_if_finite could not catch.
    factory, kwargs = _INJECTED[name]
    tx = optax.inject_hyperparams(factory, static_args=("seed",))(**kwargs)
    params = _params()
    g = _grads(2) if name != "dp_noise" else params
    step = jax.jit(tx.update)
    state = tx.init(params)
    out, _ = step(g, state, params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
    tried = 0
    for hp in state.hyperparams:
        for bad in _BAD[hp]:
            state = tx.init(params)
            state.hyperparams[hp] = jnp.asarray(bad, state.hyperparams[hp].dtype)
            out, _ = step(g, state, params)
            for leaf in jax.tree.leaves(out):
                assert bool(jnp.all(jnp.isnan(leaf))), (hp, bad)
            tried += 1
    assert tried >= 5


def test_dpsgd_rejects_ascent_and_bad_momentum():
    for kwargs, match in (
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"learning_rate": math.nan}, "learning_rate"),
        ({"learning_rate": 0.1, "momentum": -1.0}, "momentum"),
        ({"learning_rate": 0.1, "momentum": 1.0}, "momentum"),
        ({"learning_rate": 0.1, "momentum": math.nan}, "momentum"),
    ):
        with pytest.raises(ValueError, match=rf"^dpsgd: .*{match}"):
            dpsgd(l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, **kwargs)
    # a schedule that turns negative gives a NaN update at the step it does (never ascent)
    tx = dpsgd(lambda t: jnp.where(t >= 1, -0.1, 0.1), 1.0, 0.0, seed=0)
    params = _params()
    step = jax.jit(tx.update)
    upd, state = step(_grads(0), tx.init(params), params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(upd))
    upd, state = step(_grads(1), state, params)
    assert all(bool(jnp.all(jnp.isnan(u))) for u in jax.tree.leaves(upd))


def test_quantile_aggregate_takes_both_spellings_of_its_clip_norms():
    """``initial_l2_clip_norm`` (the DP API's name) and ``initial_l2_norm_clip`` (optax's) are one
    argument, without a warning; so are the clamp's; both spellings at once raise."""
    import warnings

    grads = {"w": jnp.arange(12.0).reshape(4, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = dp_quantile_aggregate(
            0.0,
            0,
            initial_l2_clip_norm=0.5,
            min_l2_clip_norm=0.1,
            max_l2_clip_norm=2.0,
            expected_batch_size=4,
        )
        b = dp_quantile_aggregate(
            0.0,
            0,
            initial_l2_norm_clip=0.5,
            min_l2_norm_clip=0.1,
            max_l2_norm_clip=2.0,
            expected_batch_size=4,
        )
    (ua, sa), (ub, sb) = a.update(grads, a.init(grads)), b.update(grads, b.init(grads))
    assert jnp.array_equal(ua["w"], ub["w"]) and jnp.array_equal(sa.clip_norm, sb.clip_norm)
    for name in ("initial", "min", "max"):
        with pytest.raises(TypeError, match=f"{name}_l2_clip_norm"):
            dp_quantile_aggregate(
                0.0,
                0,
                expected_batch_size=4,
                **{f"{name}_l2_clip_norm": 1.0, f"{name}_l2_norm_clip": 1.0},
            )


def test_an_int_seed_keeps_all_its_bits():
    """Without 64-bit mode jax.random.key keeps a seed's low 32 bits: 12345 and 12345 + 2**32
    drew the same noise, and a 63-bit secret seed had 2**32 values."""
    g = {"w": jnp.zeros((2, 64))}
    noise = []
    for seed in (12345, 12345 + 2**32, 12345 + 2**62):
        tx = dp_aggregate(l2_clip_norm=1.0, noise_multiplier=1.0, seed=seed, batch_size=1.0)
        key = tx.init({"w": jnp.zeros(64)}).rng_key
        assert np.array_equal(jax.random.key_data(key), [seed >> 32, seed & 0xFFFFFFFF])
        noise.append(np.asarray(tx.update(g, tx.init({"w": jnp.zeros(64)}))[0]["w"]))
    assert not np.array_equal(noise[0], noise[1]) and not np.array_equal(noise[0], noise[2])
    with pytest.raises(ValueError, match="seed"):
        dp_aggregate(l2_clip_norm=1.0, noise_multiplier=1.0, seed=2**64)


def test_a_state_restored_as_a_dict_is_named():
    """orbax restores a NamedTuple state as a dict without a target: an AttributeError
    ('dict' object has no attribute 'rng_key') deep inside; now the transform's TypeError."""
    grads = {"w": jnp.ones((4, 3))}
    for tx in (
        dp_aggregate(l2_clip_norm=1.0, noise_multiplier=1.0, seed=0),
        dp_noise(1.0, seed=0),
        dp_quantile_aggregate(
            1.0, seed=0, initial_l2_clip_norm=1.0, expected_batch_size=4.0, count_noise_std=10.0
        ),
    ):
        state = tx.init({"w": jnp.ones(3)})
        with pytest.raises(TypeError, match="restored without a target"):
            tx.update(grads, dict(state._asdict()))
