"""Stateless transforms: optax parity, states, hyperparameters, composition, errors."""

from __future__ import annotations

import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx


def random_tree(seed: int, scale: float = 1.0, dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    return {
        "dense": {
            "kernel": scale * jax.random.normal(k[0], (8, 5), dtype),
            "bias": scale * jax.random.normal(k[1], (5,), dtype),
        },
        "conv": scale * jax.random.normal(k[2], (3, 3, 2, 4), dtype),
        "mha": scale * jax.random.normal(k[3], (4, 2, 3), dtype),
        "scalar": scale * jax.random.normal(k[4], (), dtype),
        "conv3d": scale * jax.random.normal(k[5], (2, 2, 2, 2, 3), dtype),
    }


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        )


# ------------------------------------------------------------------ optax parity


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 5.0, 1e3])
def test_clip_by_global_norm_matches_optax(seed, max_norm):
    g = random_tree(seed, scale=0.5)
    ours = gcx.clip_by_global_norm(max_norm)
    ref = optax.clip_by_global_norm(max_norm)
    out, state = ours.update(g, ours.init(g))
    assert_trees_close(out, ref.update(g, ref.init(g))[0])
    np.testing.assert_allclose(state.norm, optax.tree.norm(g), rtol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("delta", [0.0, 0.3, 2.0])
def test_clip_matches_optax(seed, delta):
    g = random_tree(seed)
    for ours in (gcx.clip(delta), gcx.clip_by_value(delta)):
        out, _ = ours.update(g, ours.init(g))
        assert_trees_close(
            out, optax.clip(delta).update(g, optax.clip(delta).init(g))[0], rtol=0, atol=0
        )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", [0.05, 0.5, 2.0])
def test_clip_by_block_rms_matches_optax(seed, threshold):
    g = random_tree(seed)
    ours = gcx.clip_by_block_rms(threshold)
    ref = optax.clip_by_block_rms(threshold)
    out, state = ours.update(g, ours.init(g))
    assert_trees_close(out, ref.update(g, ref.init(g))[0])
    np.testing.assert_allclose(state.norm["conv"], jnp.sqrt(jnp.mean(g["conv"] ** 2)), rtol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("clipping", [0.01, 0.1, 1.0])
def test_adaptive_grad_clip_matches_optax(seed, clipping):
    g = random_tree(seed, scale=0.3)
    p = random_tree(seed + 100)
    p["dense"]["bias"] = jnp.zeros_like(p["dense"]["bias"])  # exercises the eps floor
    ours = gcx.adaptive_grad_clip(clipping)
    ref = optax.adaptive_grad_clip(clipping)
    out, state = ours.update(g, ours.init(p), p)
    assert_trees_close(out, ref.update(g, ref.init(p), p)[0], rtol=2e-6)
    assert state.norm["dense"]["kernel"].shape == (5,)  # one norm per output unit
    assert state.norm["conv"].shape == (4,)


def test_adaptive_grad_clip_with_axis_matches_optax():
    g = {"w": jax.random.normal(jax.random.PRNGKey(0), (4, 6))}
    p = {"w": jax.random.normal(jax.random.PRNGKey(1), (4, 6))}
    ours, ref = gcx.adaptive_grad_clip(0.05, axis=1), optax.adaptive_grad_clip(0.05, axis=1)
    assert_trees_close(
        ours.update(g, ours.init(p), p)[0], ref.update(g, ref.init(p), p)[0], rtol=2e-6
    )


INT_LEAVES = {
    "i32": jnp.array([[3, 4], [1, -2]], jnp.int32),
    "i8": jnp.array([1, 2], jnp.int8),
    "b": jnp.array([True, False]),
    "f": jnp.array([0.5, -3.0]),
}


@pytest.mark.parametrize(
    "make",
    [
        lambda m: m.clip_by_block_rms(1.5),
        lambda m: m.clip_by_block_rms(0.0),
        lambda m: m.clip_by_block_rms(100.0),
        lambda m: m.adaptive_grad_clip(0.1),
    ],
)
def test_block_rms_and_agc_match_optax_on_integer_and_bool_leaves(make):
    # optax computes integer and bool leaves in the default float dtype; we raised TypeError
    ours, ref = make(gcx), make(optax)
    for params in (INT_LEAVES, jax.tree.map(lambda x: jnp.ones(x.shape), INT_LEAVES)):
        want, _ = ref.update(INT_LEAVES, ref.init(params), params)
        got, state = jax.jit(ours.update)(INT_LEAVES, ours.init(params), params)
        for key in INT_LEAVES:
            assert got[key].dtype == want[key].dtype, key
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-7)
        assert state.norm["i32"].dtype == jnp.float32


def test_adaptive_grad_clip_errors():
    tx = gcx.adaptive_grad_clip(0.1)
    g = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="params"):
        tx.update(g, tx.init(g))
    with pytest.raises(ValueError, match=r"\['w'\]"):
        tx.update(g, tx.init(g), {"w": jnp.ones((2, 3))})
    with pytest.raises(ValueError, match="axis"):
        tx.init({"w": jnp.ones((2, 2, 2, 2, 2, 2))})


# ------------------------------------------------------------------ semantics


def test_global_clip_zero_norm_zero_bound_no_nan():
    tx = gcx.clip_by_global_norm(0.0)
    out, state = tx.update([jnp.zeros(3)], tx.init([jnp.zeros(3)]))
    np.testing.assert_array_equal(out[0], np.zeros(3))
    assert float(state.norm) == 0.0
    assert bool(
        jnp.all(jnp.isnan(optax.clip_by_global_norm(0.0).update([jnp.zeros(3)], None)[0][0]))
    )


def test_clip_scales_by_exactly_bound_over_norm():
    tx = gcx.clip_by_global_norm(1.0)
    out, _ = tx.update([jnp.array([3.0, 4.0])], tx.init([jnp.zeros(2)]))
    # bound / norm, lowered by a few float32 units so the stored result's norm is <= the bound
    np.testing.assert_allclose(
        out[0], np.array([3.0, 4.0], np.float32) * np.float32(1.0 / 5.0), rtol=1e-6
    )
    assert np.linalg.norm(np.asarray(out[0], np.float64)) <= 1.0
    out, _ = tx.update([jnp.array([0.6, 0.8])], tx.init([jnp.zeros(2)]))
    np.testing.assert_array_equal(
        out[0], np.array([0.6, 0.8], np.float32)
    )  # at/below the bound: untouched


def test_non_finite_updates_stay_non_finite_and_nothing_is_zeroed():
    tx = gcx.clip_by_global_norm(1.0)
    out, state = tx.update(
        [jnp.array([jnp.inf, 1.0]), jnp.array([2.0])], tx.init([jnp.zeros(2), jnp.zeros(1)])
    )
    assert float(out[0][0]) == math.inf and float(out[0][1]) == 1.0 and float(out[1][0]) == 2.0
    assert float(state.norm) == math.inf
    out, state = tx.update([jnp.array([jnp.nan, 1.0])], tx.init([jnp.zeros(2)]))
    assert math.isnan(float(out[0][0])) and math.isnan(float(state.norm))


def test_clip_by_norm_min_norm_scales_small_slices_up():
    tx = gcx.clip_by_norm(2.0, dim=1, min_norm=1.0)
    out, state = tx.update(
        [jnp.array([[0.3, 0.4], [3.0, 4.0], [0.0, 0.0], [1.2, 0.9]])], tx.init([jnp.zeros((4, 2))])
    )
    np.testing.assert_allclose(out[0], [[0.6, 0.8], [1.2, 1.6], [0.0, 0.0], [1.2, 0.9]], rtol=1e-6)
    np.testing.assert_allclose(state.norm[0], [0.5, 5.0, 0.0, 1.5], rtol=1e-6)
    tx = gcx.clip_by_norm(None, min_norm=1.0)
    np.testing.assert_allclose(
        tx.update([jnp.array([0.3, 0.4])], tx.init([jnp.zeros(2)]))[0][0], [0.6, 0.8], rtol=1e-6
    )


@pytest.mark.parametrize("how", ["traced", "schedule"])
def test_clip_by_norm_min_norm_above_max_norm_at_run_time_gives_nan(how):
    # Python rejects min_norm > max_norm at construction; a traced pair used to scale small slices
    # up to min_norm = 2 > max_norm = 1, a finite update that breaks the bound
    g = {"w": jnp.array([[0.3, 0.4], [3.0, 4.0]]), "b": jnp.array([0.1, 0.0])}
    if how == "traced":
        tx = gcx.inject_hyperparams(gcx.clip_by_norm)(max_norm=1.0, min_norm=0.5, dim=1)
        state = tx.init(g)
        step = jax.jit(tx.update)
        out, state = step(g, state)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
        state.hyperparams["min_norm"] = jnp.asarray(2.0)
    else:
        tx = gcx.clip_by_norm(1.0, dim=1, min_norm=lambda t: jnp.where(t >= 1, 2.0, 0.5))
        step = jax.jit(tx.update)
        out, state = step(g, tx.init(g))
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
    out, _ = step(g, state)
    for leaf in jax.tree.leaves(out):
        assert bool(jnp.all(jnp.isnan(leaf)))
    # equal bounds are fine (every non-zero slice gets that norm)
    tx = gcx.inject_hyperparams(gcx.clip_by_norm)(max_norm=1.0, min_norm=1.0, dim=1)
    out, _ = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_allclose(jnp.linalg.norm(out["w"], axis=1), [1.0, 1.0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"clip_by_norm.*min_norm.*must not exceed.*max_norm"):
        gcx.clip_by_norm(1.0, min_norm=2.0)


def test_clip_by_norm_global_equals_clip_by_global_norm():
    g = random_tree(3)
    a = gcx.clip_by_norm(0.5, dim="global", ord=3)
    b = gcx.clip_by_global_norm(0.5, ord=3)
    oa, sa = a.update(g, a.init(g))
    ob, sb = b.update(g, b.init(g))
    assert_trees_close(oa, ob, rtol=0, atol=0)
    assert float(sa.norm) == float(sb.norm)


def test_clip_by_norm_min_size_and_missing_axes_leave_leaves_alone():
    tx = gcx.clip_by_norm(0.1, dim=1, min_size=3)
    tree = {"v": jnp.ones(4), "m2": jnp.ones((3, 2)), "m4": jnp.ones((2, 4))}
    out, state = tx.update(tree, tx.init(tree))
    np.testing.assert_array_equal(out["v"], tree["v"])
    np.testing.assert_array_equal(out["m2"], tree["m2"])
    np.testing.assert_allclose(jnp.linalg.norm(out["m4"], axis=1), [0.1, 0.1], rtol=1e-6)
    assert state.norm["v"] is None and state.norm["m2"] is None and state.norm["m4"].shape == (2,)


def test_normalize_and_centralize():
    tx = gcx.normalize(2.0, dim=0)
    out, _ = tx.update([jnp.array([[3.0, 0.0], [4.0, 0.0]])], tx.init([jnp.zeros((2, 2))]))
    np.testing.assert_allclose(out[0], [[1.2, 0.0], [1.6, 0.0]], rtol=1e-6)  # zero column untouched
    tx = gcx.centralize(dim="global")
    out, _ = tx.update(
        [jnp.array([1.0, 2.0]), jnp.asarray(3.0)], tx.init([jnp.zeros(2), jnp.zeros(())])
    )
    np.testing.assert_allclose(out[0], [-1.0, 0.0]) and np.testing.assert_allclose(out[1], 1.0)
    tx = gcx.centralize(dim=-1, inverse_dims=True)  # per output unit of a dense kernel
    w = jnp.array([[1.0, 10.0], [3.0, 20.0]])
    np.testing.assert_allclose(tx.update(w, tx.init(w))[0], [[-1.0, -5.0], [1.0, 5.0]])


def test_complex_leaves():
    z = jnp.array([3 + 4j, 6 + 8j], jnp.complex64)
    tx = gcx.clip_by_global_norm(1.0)
    out, _state = tx.update([z], tx.init([z]))
    assert out[0].dtype == jnp.complex64
    np.testing.assert_allclose(float(jnp.linalg.norm(out[0])), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.angle(out[0]), np.angle(z), rtol=1e-6)
    tv = gcx.clip_by_value(5.0)
    out = tv.update([z], tv.init([z]))[0][0]
    np.testing.assert_allclose(np.abs(out), [5.0, 5.0], rtol=1e-6)
    np.testing.assert_allclose(np.angle(out), np.angle(z), rtol=1e-6)


def test_clip_by_value_integers_never_truncate_the_bound_and_nan_stays():
    # an integer bound keeps an int leaf's dtype; a fractional one promotes (as optax.clip), never floor(2.5)
    out = gcx.clip_grad_value(
        {"i": jnp.array([-5, 2, 7], jnp.int32), "f": jnp.array([jnp.nan, 3.0])}, 2.5
    )
    assert out["i"].dtype == jnp.float32
    np.testing.assert_array_equal(out["i"], [-2.5, 2.0, 2.5])
    assert math.isnan(float(out["f"][0])) and float(out["f"][1]) == 2.5
    out = gcx.clip_grad_value({"i": jnp.array([-5, 2, 7], jnp.int32)}, 2)
    assert out["i"].dtype == jnp.int32
    np.testing.assert_array_equal(out["i"], [-2, 2, 2])
    tx = gcx.clip_by_value(1.5)
    out, _ = tx.update({"a": jnp.array([[3, 4], [1, -2]])}, None)
    assert out["a"].dtype == jnp.float32
    np.testing.assert_array_equal(out["a"], [[1.5, 1.5], [1.0, -1.5]])
    with pytest.raises(TypeError, match=r"\['b'\]"):
        gcx.clip_grad_value({"b": jnp.array([True])}, 1.0)
    with pytest.raises(TypeError, match=r"clip_by_value.*\['b'\]"):
        tx.update({"b": jnp.array([True])}, None)
    # an invalid traced bound: NaN, as for every transform
    out = jax.jit(lambda c: gcx.clip_grad_value({"f": jnp.array([1.0, -3.0])}, c))(-1.0)
    assert bool(jnp.all(jnp.isnan(out["f"])))


@pytest.mark.parametrize("bound", [1.5, 2, 0.5, jnp.float32(1.5), jnp.int32(2), np.float32(1.5)])
@pytest.mark.parametrize("key", sorted(INT_LEAVES))
def test_clip_matches_optax_exactly_on_integer_and_bool_leaves(bound, key):
    # optax.clip is jnp.clip with the bound as given: its promotion decides the dtype (clip(1.5) of an
    # int32 leaf is float32 1.5, not a truncated int32 1)
    leaf = {key: INT_LEAVES[key]}
    want, _ = optax.clip(bound).update(leaf, None)
    for run in (
        lambda u: gcx.clip(bound).update(u, None),
        jax.jit(lambda u: gcx.clip(bound).update(u, None)),
    ):
        got, _ = run(leaf)
        assert got[key].dtype == want[key].dtype
        assert got[key].weak_type == want[key].weak_type
        np.testing.assert_array_equal(got[key], want[key])
    if key == "b":
        return  # optax.inject_hyperparams would store the bound as a bool: no bound at all
    # and under optax.inject_hyperparams, which stores the bound in the leaves' dtype
    ours = optax.inject_hyperparams(gcx.clip)(max_delta=1.5)
    ref = optax.inject_hyperparams(optax.clip)(max_delta=1.5)
    got, _ = jax.jit(ours.update)(leaf, ours.init(leaf))
    want, _ = ref.update(leaf, ref.init(leaf))
    assert got[key].dtype == want[key].dtype
    np.testing.assert_array_equal(got[key], want[key])


def test_pass_through_leaves():
    f0 = np.zeros((3,), dtype=jax.dtypes.float0)
    tree = {"a": jnp.array([3.0, 4.0]), "n": None, "m": optax.MaskedNode(), "z": f0}
    for tx in [
        gcx.clip_by_global_norm(1.0),
        gcx.clip_by_norm(1.0),
        gcx.normalize(),
        gcx.clip_by_block_rms(1.0),
        gcx.clip(1.0),
        gcx.centralize(),
    ]:
        out, _ = tx.update(tree, tx.init(tree))
        assert out["n"] is None and isinstance(out["m"], optax.MaskedNode) and out["z"] is f0


def test_optax_masked_norm_over_masked_in_leaves_only():
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([100.0])}
    tx = optax.masked(gcx.clip_by_global_norm(1.0), {"a": True, "b": False})
    out, state = tx.update(tree, tx.init(tree))
    np.testing.assert_allclose(out["a"], [0.6, 0.8], rtol=1e-6)
    assert float(out["b"][0]) == 100.0
    assert float(optax.tree_utils.tree_get(state, "norm")) == 5.0


# ------------------------------------------------------------------ hyperparameters


@pytest.mark.parametrize(
    "factory,arg",
    [
        (gcx.clip_by_global_norm, "max_norm"),
        (gcx.clip_by_norm, "max_norm"),
        (gcx.clip_by_value, "max_value"),
        (gcx.clip, "max_delta"),
        (gcx.clip_by_block_rms, "threshold"),
        (gcx.normalize, "norm_value"),
        (gcx.adaptive_grad_clip, "clipping"),
    ],
)
@pytest.mark.parametrize("bad", [-1.0, float("nan"), np.array([1.0, 2.0]), "1.0", True])
def test_invalid_hyperparameters_raise_at_construction(factory, arg, bad):
    with pytest.raises((ValueError, TypeError), match=arg):
        factory(bad)


@pytest.mark.parametrize(
    "kwargs,match,err",
    [
        ({"ord": "frobenius"}, "ord", ValueError),
        ({"dim": "rows"}, "dim", ValueError),
        ({"dim": 1.5}, "dim", TypeError),
        ({"inverse_dims": True}, "inverse_dims", ValueError),
        ({"inverse_dims": "yes"}, "inverse_dims", TypeError),
        ({"min_size": -1}, "min_size", ValueError),
        ({"min_size": 1.5}, "min_size", TypeError),
        ({"min_norm": 2.0}, "min_norm", ValueError),
        ({"min_norm": -1.0}, "min_norm", ValueError),
        ({"min_norm": "0.5"}, "min_norm", TypeError),
    ],
)
def test_invalid_structural_arguments_raise(kwargs, match, err):
    with pytest.raises(err, match=match):
        gcx.clip_by_norm(1.0, **kwargs)


def test_clip_by_norm_needs_a_bound():
    with pytest.raises(ValueError, match="max_norm"):
        gcx.clip_by_norm(None)


def test_schedule_hyperparameter():
    tx = gcx.clip_by_global_norm(optax.linear_schedule(1.0, 3.0, 2))
    g = [jnp.array([30.0, 40.0])]
    state = tx.init(g)
    norms = []
    for _ in range(3):
        out, state = tx.update(g, state)
        norms.append(float(jnp.linalg.norm(out[0])))
    np.testing.assert_allclose(norms, [1.0, 2.0, 3.0], rtol=1e-6)
    assert int(state.count) == 3


def test_traced_hyperparameter_under_jit():
    g = [jnp.array([3.0, 4.0])]

    @jax.jit
    def f(mx):
        tx = gcx.clip_by_global_norm(mx)
        return tx.update(g, tx.init(g))[0][0]

    np.testing.assert_allclose(f(jnp.float32(2.5)), [1.5, 2.0], rtol=1e-6)


def test_strongly_typed_float32_bound_with_bf16_updates():
    g = [jnp.array([3.0, 4.0], jnp.bfloat16)]
    for mx in (np.float32(1.0), jnp.array(1.0, jnp.float32)):
        tx = gcx.clip_by_global_norm(mx)
        out, _ = tx.update(g, tx.init(g))
        assert out[0].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "make",
    [
        lambda: gcx.inject_hyperparams(gcx.clip_by_global_norm)(max_norm=1.0),
        lambda: gcx.inject_hyperparams(gcx.clip_by_norm)(max_norm=1.0, ord=2, dim=0, min_size=1),
        lambda: gcx.inject_hyperparams(gcx.normalize)(norm_value=1.0, ord="l1"),
        lambda: optax.inject_hyperparams(gcx.clip_by_global_norm, static_args=("ord",))(
            max_norm=1.0
        ),
        lambda: optax.inject_hyperparams(gcx.clip_by_value)(max_value=1.0),
        lambda: optax.inject_hyperparams(gcx.clip_by_block_rms)(threshold=1.0),
        lambda: gcx.inject_hyperparams(gcx.adaptive_grad_clip)(clipping=1.0),
    ],
)
def test_inject_hyperparams_under_jit(make):
    tx = make()
    g = {"w": jnp.full((3, 2), 2.0)}
    state = tx.init(g)
    key = next(
        k
        for k in ("max_norm", "max_value", "threshold", "norm_value", "clipping")
        if k in state.hyperparams
    )
    state.hyperparams[key] = jnp.asarray(0.5)
    out, state = jax.jit(tx.update)(g, state, g)
    assert bool(jnp.all(jnp.isfinite(out["w"])))
    assert float(jnp.max(jnp.abs(out["w"]))) < 2.0  # the injected 0.5 was used


def test_plain_optax_inject_with_default_ord_works():
    tx = optax.inject_hyperparams(gcx.clip_by_global_norm)(max_norm=1.0)
    g = [jnp.array([3.0, 4.0])]
    state = tx.init(g)
    assert set(state.hyperparams) == {"max_norm"}  # ord stayed static
    out, state = jax.jit(tx.update)(g, state)
    np.testing.assert_allclose(out[0], [0.6, 0.8], rtol=1e-6)


def test_plain_optax_inject_with_a_passed_ord_names_every_structural_arg():
    tx = optax.inject_hyperparams(gcx.clip_by_norm)(max_norm=1.0, ord=1)
    g = [jnp.ones(2)]
    state = tx.init(g)
    with pytest.raises(TypeError, match="static_args") as err:
        jax.jit(tx.update)(g, state)
    for name in ("'ord'", "'dim'", "'inverse_dims'", "'min_size'"):
        assert name in str(err.value)


# ------------------------------------------------------------------ composition


def test_chain_with_adam_and_state_logging():
    tx = optax.chain(gcx.clip_by_global_norm(1.0), optax.adam(1e-2))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    g = {"w": jnp.array([3.0, 4.0, 12.0])}
    _, state = jax.jit(tx.update)(g, state, params)
    assert float(optax.tree_utils.tree_get(state, "norm")) == pytest.approx(13.0)


def test_multisteps_and_apply_if_finite():
    params = {"w": jnp.ones(2)}
    tx = optax.MultiSteps(
        optax.chain(gcx.clip_by_global_norm(1.0), optax.sgd(1.0)), every_k_schedule=2
    )
    state = tx.init(params)
    g = {"w": jnp.array([3.0, 4.0])}
    u, state = tx.update(g, state, params)
    np.testing.assert_array_equal(u["w"], [0.0, 0.0])
    u, state = tx.update(g, state, params)
    np.testing.assert_allclose(u["w"], [-0.6, -0.8], rtol=1e-6)
    tx = optax.apply_if_finite(gcx.clip_by_global_norm(1.0), max_consecutive_errors=3)
    state = tx.init(params)
    u, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert int(state.notfinite_count) == 1


TRANSFORMS = {
    "global": lambda: gcx.clip_by_global_norm(1.0),
    "global_l1": lambda: gcx.clip_by_global_norm(1.0, ord=1),
    "norm_rows": lambda: gcx.clip_by_norm(0.5, dim=-1),
    "normalize": lambda: gcx.normalize(1.0),
    "block_rms": lambda: gcx.clip_by_block_rms(0.2),
    "value": lambda: gcx.clip_by_value(0.3),
    "centralize": lambda: gcx.centralize(),
    "agc": lambda: gcx.adaptive_grad_clip(0.05),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_jit_equals_eager_and_scan_and_vmap_over_states(name):
    tx = TRANSFORMS[name]()
    params = random_tree(7)
    grads = [random_tree(s, scale=2.0) for s in range(3)]
    state = tx.init(params)
    eager = []
    s = state
    for g in grads:
        u, s = tx.update(g, s, params)
        eager.append(u)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *grads)
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x] * 3), state)

    def body(s, g):
        u, s = tx.update(g, s, params)
        return s, u

    # the three traced forms in one compiled program, not three; the vmap is jitted: eagerly it
    # dispatches (and compiles) every batched op on its own
    @jax.jit
    def traced(g0, state, stacked, states):
        return (
            tx.update(g0, state, params)[0],
            jax.lax.scan(body, state, stacked),
            jax.vmap(lambda g, s: tx.update(g, s, params))(stacked, states)[0],
        )

    jitted, (final, scanned), vout = traced(grads[0], state, stacked, states)
    assert_trees_close(jitted, eager[0], rtol=1e-6)
    for i, e in enumerate(eager):
        assert_trees_close(jax.tree_util.tree_map(lambda x: x[i], scanned), e, rtol=1e-6)
    assert jax.tree_util.tree_structure(final) == jax.tree_util.tree_structure(state)
    for i, e in enumerate(eager):
        assert_trees_close(jax.tree_util.tree_map(lambda x: x[i], vout), e, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_state_is_a_plain_picklable_pytree(name):
    tx = TRANSFORMS[name]()
    params = random_tree(1)
    state = tx.update(random_tree(2), tx.init(params), params)[1]
    leaves, treedef = jax.tree_util.tree_flatten(state)
    restored = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) for x in leaves])
    again = pickle.loads(pickle.dumps(restored))
    out1 = tx.update(random_tree(3), state, params)[0]
    out2 = tx.update(random_tree(3), jax.tree_util.tree_map(jnp.asarray, again), params)[0]
    assert_trees_close(out1, out2, rtol=0, atol=0)


def test_many_small_leaves_per_leaf_norms_use_the_packed_path():
    tree = {f"b{i}": jnp.full((3,), float(i + 1)) for i in range(50)}
    tree["big"] = jnp.ones((300, 300))
    n = gcx.leaf_norms(tree)
    for i in range(50):
        np.testing.assert_allclose(n[f"b{i}"], math.sqrt(3) * (i + 1), rtol=1e-6)
    tx = gcx.clip_by_norm(1.0)
    out, _ = tx.update(tree, tx.init(tree))
    for v in out.values():
        assert float(jnp.linalg.norm(v)) <= 1.0 + 1e-6


def test_clip_grad_norm_leaves_a_non_positive_signed_sum_unchanged():
    """ord='sum' of a negative sum gave a negative coefficient: every sign flipped (and a sum of
    -0.3 under max_norm 1 scaled the gradient up 3.3x). A norm <= 0 leaves the tree as it is; a
    NaN norm still makes it NaN, as torch does."""
    for x in ([-3.0, -4.0, 1.0], [-0.5, 0.2], [0.0, 0.0]):
        out, _ = gcx.clip_grad_norm({"w": jnp.asarray(x)}, 1.0, ord="sum")
        np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(x, np.float32))
    out, _ = gcx.clip_grad_norm({"w": jnp.array([jnp.nan, 4.0])}, 1.0)
    assert np.all(np.isnan(np.asarray(out["w"])))


@pytest.mark.parametrize(
    ("make", "big"),
    [
        (lambda: gcx.clip_by_global_norm(1.0), 3e38),
        (lambda: gcx.clip_by_norm(1.0), 3e38),
        (lambda: gcx.clip_by_norm(1.0, dim=1), 3e38),
        (lambda: gcx.clip_by_norm(1.0, ord="var"), 1e25),  # a variance of 1e50
        (lambda: gcx.normalize(1.0), 3e38),
        (lambda: gcx.adaptive_grad_clip(0.01), 3e38),
    ],
    ids=["global", "per_leaf", "per_row", "var", "normalize", "agc"],
)
def test_norm_past_float32_range_is_clipped_not_passed(make, big):
    """Elements that are all finite but whose norm does not fit in float32 (reported inf) are
    clipped (c / inf = 0, as optax), not passed on unclipped as an infinite element's are."""
    tx = make()
    params = {"w": jnp.ones((2, 4)), "b": jnp.ones(3)}
    huge = {"w": jnp.tile(jnp.array([big, -big], jnp.float32), (2, 2)), "b": jnp.full(3, 0.5)}
    out, state = jax.jit(tx.update)(huge, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(out["w"]), 0.0)
    assert np.all(np.asarray(jax.tree_util.tree_leaves(state.norm)[-1]) == np.inf)
    if hasattr(state, "clipped"):
        assert bool(np.all(jax.tree_util.tree_leaves(state.clipped)[-1]))
    # an infinite element still stays visible, and its finite neighbours are kept
    inf = {"w": huge["w"].at[0, 0].set(jnp.inf), "b": huge["b"]}
    out, _ = jax.jit(tx.update)(inf, tx.init(params), params)
    assert float(out["w"][0, 0]) == math.inf


def test_norm_past_float32_range_with_an_infinite_bound_is_not_clipped():
    tx = gcx.clip_by_global_norm(jnp.inf)
    huge = [jnp.full(4, 3e38, jnp.float32)]
    out, state = tx.update(huge, tx.init(huge))
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(huge[0]))
    assert not bool(state.clipped)
    tx = gcx.inject_hyperparams(gcx.clip_by_global_norm)(max_norm=1.0)
    state = tx.init(huge)
    state.hyperparams["max_norm"] = jnp.asarray(jnp.nan)
    out, _ = jax.jit(tx.update)(huge, state)
    assert bool(jnp.all(jnp.isnan(out[0])))  # an invalid bound still poisons the update
