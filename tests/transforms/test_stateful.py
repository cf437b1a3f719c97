"""The contract every stateful clipper shares (transforms._stateful): jit, lax.scan, vmap over
stacked states, inject_hyperparams, checkpointing, dtypes, masking, gradients, sharding, and
training with gradient spikes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import gradclip_jax as gcx
from gradclip_jax import adagc, autoclip, quantile_clip, skip_on_spike, zclip
from gradclip_jax.transforms.ema import clip_norm_by_ema, clip_value_by_ema, normalize_by_ema
from gradclip_jax.transforms.growth import clip_norm_growth, clip_value_growth
from tests.transforms.feeding import feed as _feed, vec as _vec

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
NORM_BASED = {
    "clip_norm_by_ema",
    "normalize_by_ema",
    "clip_norm_growth",
    "autoclip",
    "zclip",
    "adagc",
    "quantile_clip",
}


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
        _assert_trees(
            jax.tree_util.tree_map(lambda x: jnp.zeros_like(x), state),
            jax.tree_util.tree_map(lambda x: jnp.zeros_like(x), s0),
        )  # fixed structure
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
    update, update_plain = jax.jit(tx.update), jax.jit(plain.update)
    for i in range(6):
        o_p, s_p = update_plain(_at(batch, i), s_p)
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
        return sum(
            jnp.sum(o * c)
            for o, c in zip(
                jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(w), strict=True
            )
        )

    grad = jax.jit(jax.grad(loss))
    update = jax.jit(tx.update)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, w)
    for i in range(len(SCALES)):
        if i in (0, 2, 4, 6):  # fresh, warm-up, spike, after warm-up
            for u in (zeros, _at(batch, i)):
                g = grad(u, state)
                assert all(
                    np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g)
                ), (name, i)
        state = update(_at(batch, i), state)[1]


def _skipped_step(name, bad_leaf):
    """Four steps of ``name``, then step 4 with one leaf replaced by ``bad_leaf``: ``(output of
    that step, its state)``, after checking that the next step from it is the next step from
    the state before it (the bad step is not absorbed)."""
    tx = _make(name)
    batch = _updates()
    update = jax.jit(tx.update)
    state = tx.init(_params())
    for i in range(4):
        _, state = update(_at(batch, i), state)
    bad = dict(_at(batch, 4), **bad_leaf)
    out, skipped = update(bad, state)
    a, s_a = update(_at(batch, 5), skipped)
    b, s_b = update(_at(batch, 5), state)
    _assert_trees(a, b, rtol=0, atol=0)
    _assert_trees(s_a, s_b, rtol=0, atol=0)
    return bad, out, skipped


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_update_is_as_if_it_never_happened(name):
    bad, out, _ = _skipped_step(name, {"b": jnp.array([jnp.nan, 1.0])})
    for k in bad:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(bad[k]))


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
        floats = [
            x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
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
    return [
        {
            "w": jnp.asarray(rng.standard_normal((2 * n, 4)) * s, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(n) * s, jnp.float32),
        }
        for s in (1.0, 1.2, 0.9, 30.0, 1.0)
    ]


@pytest.mark.parametrize("name", ["zclip", "autoclip", "quantile_clip"])
def test_shard_map_axis_name(name):
    """Leaves sharded by hand inside shard_map: axis_name combines the partial norms."""
    if len(jax.devices()) < 2:
        pytest.skip("needs several devices")
    factory, kwargs = FACTORIES[name]
    ref, tx = factory(**kwargs), factory(**kwargs, axis_name="x")
    mesh = _mesh("explicit")
    spec, rep = jax.sharding.NamedSharding(mesh, P("x")), jax.sharding.NamedSharding(mesh, P())
    f = jax.jit(
        jax.shard_map(tx.update, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P()))
    )
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
    tx = optax.chain(
        optax.masked(quantile_clip(initial_norm=1.0), {"a": True, "b": False}), optax.adam(1e-3)
    )
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

    run = jax.jit(
        lambda: [
            train(optax.sgd(0.05)),
            train(optax.chain(zclip(warmup_steps=20), optax.sgd(0.05))),
            train(optax.chain(autoclip(percentile=10.0), optax.sgd(0.05))),
        ]
    )
    plain, with_zclip, with_autoclip = (np.asarray(v) for v in run())
    noise = 0.01
    assert plain[59] < 10 * noise + 0.05  # it was training fine before the spike
    assert not np.all(np.isfinite(plain[60:])) or np.nanmax(plain[60:]) > 1e4  # then blew up
    for losses in (with_zclip, with_autoclip):
        assert np.all(np.isfinite(losses))
        assert losses[60:].max() < 1.0  # the spikes are absorbed
        assert losses[-1] < 0.05 and losses[-1] < 1e-3 * plain[-1]


@pytest.mark.parametrize("name", sorted(NORM_BASED))
def test_norm_past_float32_range_is_clipped_and_not_absorbed(name):
    """Finite elements whose norm does not fit in float32 (reported inf): clipped (to zero, c/inf),
    never passed on unclipped, and the step is not absorbed into the statistics."""
    _, out, skipped = _skipped_step(name, {"w": jnp.full((3, 2), 3e38, jnp.float32)})
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(out))
    np.testing.assert_array_equal(np.asarray(out["w"]), 0.0)
    assert bool(np.any(jax.tree_util.tree_leaves(skipped.clipped)))
