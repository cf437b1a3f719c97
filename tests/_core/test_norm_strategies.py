"""Every per-backend sum-of-squares strategy of the norm engine keeps the same guarantees.

``norms.SUMSQ_STRATEGY`` picks, per backend, how 2-norms and 'rms' avoid overflow
and underflow (a ``lax.cond`` fallback, or Blue's branch-free three sums). The
GPU may use a different one than the CPU, so each is run here on the CPU, under
jit, against float64 numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradclip_jax as gcx
from gradclip_jax._core import norms

STRATEGIES = ("cond", "blue", "blue-sums")


def _set(monkeypatch, name, pack=False):
    backend = jax.default_backend()
    monkeypatch.setitem(norms.SUMSQ_STRATEGY, backend, name)
    monkeypatch.setitem(norms.GLOBAL_PACK_MAX_SIZE, backend, norms.PACK_MAX_SIZE if pack else 0)
    return name


@pytest.fixture(params=STRATEGIES)
def strategy(request, monkeypatch):
    return _set(monkeypatch, request.param)


@pytest.fixture(
    params=[(s, p) for s in STRATEGIES for p in (False, True)],
    ids=lambda sp: f"{sp[0]}-pack{sp[1]}",
)
def packed_strategy(request, monkeypatch):
    return _set(monkeypatch, *request.param)


def fresh_jit(f):
    """``jax.jit`` of a new function: the strategy is read when tracing, and jit caches traces per function."""
    return jax.jit(lambda *a: f(*a))


def _exact(leaves):
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in leaves)))


# leaves whose squares overflow, underflow, or mix ranges in float32
CASES = {
    "huge": [jnp.full((4,), 1e30, jnp.float32), jnp.ones((3,), jnp.float32)],
    "tiny": [jnp.full((5,), 1e-30, jnp.float32), jnp.full((2,), 3e-31, jnp.float32)],
    "huge+many-medium": [jnp.full((4,), 1e20, jnp.float32), jnp.full((10_000,), 1e15, jnp.float32)],
    "tiny+medium": [jnp.full((1000,), 1e-25, jnp.float32), jnp.array([1e-10], jnp.float32)],
    "bf16-huge": [jnp.full((8,), 1e30, jnp.bfloat16), jnp.full((3,), 2.0, jnp.bfloat16)],
    "fp16-300": [jnp.full((4,), 300.0, jnp.float16), jnp.full((1000,), 10.0, jnp.float16)],
    "ordinary": [
        jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4),
        jnp.array([-2.5, 7.0], jnp.float32),
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_global_norm_is_exact_and_finite_for_every_range(packed_strategy, case):
    leaves = CASES[case]
    got = float(fresh_jit(gcx.tree_norm)(leaves))
    np.testing.assert_allclose(got, _exact(leaves), rtol=2e-6)


@pytest.mark.parametrize("case", ["huge", "tiny", "ordinary"])
def test_gradient_is_x_over_norm_without_overflow(strategy, case):
    leaves = CASES[case]
    grads = fresh_jit(jax.grad(gcx.tree_norm))(leaves)
    n = _exact(leaves)
    for g, x in zip(grads, leaves):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(
            np.asarray(g, np.float64), np.asarray(x, np.float64) / n, rtol=1e-5, atol=1e-30
        )


def test_gradient_at_zero_is_zero(strategy):
    g = fresh_jit(jax.grad(gcx.tree_norm))([jnp.zeros(3), jnp.zeros((2, 2))])
    assert all(np.all(np.asarray(x) == 0) for x in g)


def test_second_derivative_matches_the_closed_form(strategy):
    x = jnp.array([3.0, 4.0])
    h = fresh_jit(jax.hessian(lambda v: gcx.tree_norm([v])))(x)
    n = 5.0
    want = (np.eye(2) - np.outer(np.asarray(x), np.asarray(x)) / n**2) / n
    np.testing.assert_allclose(np.asarray(h), want, rtol=1e-5, atol=1e-7)


def test_nan_and_inf_propagate(strategy):
    f = fresh_jit(gcx.tree_norm)
    assert np.isnan(float(f([jnp.full(4, 1e30), jnp.array([jnp.nan])])))
    assert np.isnan(float(f([jnp.full(4, 1e-30), jnp.array([jnp.nan])])))
    assert float(f([jnp.ones(4), jnp.array([jnp.inf])])) == np.inf
    assert float(f([jnp.full(4, 3e38, jnp.float32)])) == np.inf  # the true norm exceeds float32


def test_per_slice_norms_and_rms_match_numpy(strategy):
    w = np.array([[3e30, 0.0, 1e-30], [4e30, 1.0, 1e-30]], np.float32)
    got = fresh_jit(lambda t: gcx.leaf_norms(t, dim=0))({"w": jnp.asarray(w)})["w"]
    np.testing.assert_allclose(
        np.asarray(got), np.sqrt(np.sum(np.square(w.astype(np.float64)), 0)), rtol=1e-6
    )
    x = jnp.array([3.0, 4.0, 0.0, 12.0])
    rms = float(fresh_jit(lambda t: gcx.tree_norm(t, ord="rms"))([x]))
    np.testing.assert_allclose(
        rms, np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))), rtol=1e-6
    )


def test_empty_tree_and_vmap(strategy):
    assert float(fresh_jit(gcx.tree_norm)([])) == 0.0
    xs = jnp.array([[3.0, 4.0], [1e30, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(
        np.asarray(fresh_jit(jax.vmap(lambda v: gcx.tree_norm([v])))(xs)), [5.0, 1e30, 0.0]
    )


def test_clip_by_global_norm_clips_huge_updates_to_the_bound(packed_strategy):
    tx = gcx.clip_by_global_norm(1.0)
    u = {"a": jnp.full((4,), 1e30, jnp.float32), "b": jnp.full((3,), 2e29, jnp.float32)}
    out, state = fresh_jit(tx.update)(u, tx.init(u))
    np.testing.assert_allclose(float(gcx.tree_norm(out)), 1.0, rtol=1e-5)
    np.testing.assert_allclose(float(state.norm), _exact(list(u.values())), rtol=1e-6)


@pytest.mark.cpu_only(
    reason="reads XLA:CPU's optimized program; other compilers may turn a conditional into selects"
)
def test_branch_free_strategies_compile_without_a_conditional(strategy):
    txt = fresh_jit(gcx.tree_norm).lower([jnp.ones(3), jnp.ones((2, 2))]).compile().as_text()
    assert ("conditional(" in txt) == (strategy == "cond")


def test_unknown_strategy_is_a_value_error_naming_the_setting(monkeypatch):
    monkeypatch.setitem(norms.SUMSQ_STRATEGY, jax.default_backend(), "fast")
    with pytest.raises(ValueError, match="SUMSQ_STRATEGY"):
        gcx.tree_norm([jnp.ones(3)])


# ----------------------------------------------------------------------------
# joint_row_norms: each example's slices of several arrays, one norm (Blue's sums added, one finish)
# ----------------------------------------------------------------------------


def _rows(arrays):
    return [np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in arrays]


def _exact_rows(arrays):
    return np.sqrt(sum(np.sum(np.square(r), axis=1) for r in _rows(arrays)))


def _row_case(scale_a, scale_b, dtype=jnp.float32):
    r = np.random.default_rng(0)
    a = r.normal(size=(5, 3, 4)) * np.array([scale_a, 1.0, scale_b, 1e-3, 0.0])[:, None, None]
    b = r.normal(size=(5, 7)) * np.array([1.0, scale_b, scale_a, 2.0, 0.0])[:, None]
    return [jnp.asarray(a, dtype), jnp.asarray(b, dtype)]


@pytest.mark.parametrize(
    ("scale_a", "scale_b"), [(1.0, 1.0), (1e25, 1e-25), (1e-30, 1e20), (3e18, 3e18)]
)
def test_joint_row_norms_are_each_examples_norm_for_every_range(scale_a, scale_b):
    arrays = _row_case(scale_a, scale_b)
    got = np.asarray(jax.jit(norms.joint_row_norms)(arrays), np.float64)
    np.testing.assert_allclose(got, _exact_rows(arrays), rtol=2e-6)
    assert got[-1] == 0.0  # an example of zeros


def test_joint_row_norms_take_16_bit_rows_in_float32_without_a_conditional():
    arrays = [x.astype(jnp.bfloat16) for x in _row_case(1e30, 1.0)] + [
        jnp.full((5, 3), 300.0, jnp.float16)
    ]
    f = jax.jit(norms.joint_row_norms)
    got = f(arrays)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float64), _exact_rows(arrays), rtol=2e-6)
    assert " conditional(" not in f.lower(arrays).compile().as_text()


def test_joint_row_norms_propagate_nan_and_inf_per_example():
    a, b = _row_case(1.0, 1.0)
    got = np.asarray(norms.joint_row_norms([a.at[1, 0, 0].set(jnp.nan), b.at[2, 3].set(jnp.inf)]))
    assert np.isnan(got[1]) and got[2] == np.inf
    np.testing.assert_allclose(got[[0, 3]], _exact_rows([a, b])[[0, 3]], rtol=2e-6)


@pytest.mark.parametrize(("scale_a", "scale_b"), [(1.0, 1.0), (1e25, 1e-25)])
def test_joint_row_norms_derivative_is_x_over_norm(scale_a, scale_b):
    arrays = _row_case(scale_a, scale_b)
    w = jnp.asarray(np.random.default_rng(1).normal(size=5), jnp.float32)
    grads = jax.jit(jax.grad(lambda xs: jnp.sum(w * norms.joint_row_norms(xs))))(arrays)
    n = _exact_rows(arrays)
    for g, x in zip(grads, arrays, strict=True):
        want = np.asarray(w, np.float64).reshape((-1,) + (1,) * (x.ndim - 1)) * np.asarray(
            x, np.float64
        )
        want = np.where(
            n.reshape(want.shape[:1] + (1,) * (x.ndim - 1)) > 0,
            want / np.maximum(n, 1e-300).reshape((-1,) + (1,) * (x.ndim - 1)),
            0.0,
        )
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-5, atol=1e-30)


# ----------------------------------------------------------------------------
# The per-example path's norms: a plain sum of squares, and its careful fallback
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scale_a", "scale_b"), [(1.0, 1.0), (1e25, 1.0), (1.0, 1e-25), (3e18, 3e-9)]
)
def test_row_sums_of_squares_say_where_they_are_exact(scale_a, scale_b):
    a, b = _row_case(scale_a, scale_b)
    sums, ok = jax.jit(norms.row_sums_of_squares)([a, b])
    assert sums.shape == ok.shape == (2, 5)
    rows = _rows([a, b])
    want = np.stack([np.sum(np.square(r), axis=1) for r in rows])
    info = np.finfo(np.float32)
    # exact: within float32's range, and above where underflow could cost an ulp (zeros are not)
    least = np.array([[r.shape[1] * float(info.tiny) / float(info.eps)] for r in rows])
    np.testing.assert_array_equal(np.asarray(ok), (want <= float(info.max)) & (want >= least))
    assert not np.asarray(ok)[:, 4].any()  # the example of zeros
    np.testing.assert_allclose(np.asarray(sums, np.float64)[ok], want[ok], rtol=2e-6)


def test_row_sums_of_squares_of_float16_fail_only_where_an_element_is_not_finite():
    x = jnp.full((3, 1000), 300.0, jnp.float16).at[1].set(1e-7).at[2, 5].set(jnp.inf)
    sums, ok = norms.row_sums_of_squares([x])
    assert sums.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ok), [[True, True, False]])


@pytest.mark.parametrize(
    ("scale_a", "scale_b"), [(1.0, 1.0), (1e25, 1e-25), (1e-30, 1e20), (3e18, 3e18)]
)
def test_careful_row_norms_are_each_leafs_and_each_examples_norm(scale_a, scale_b):
    arrays = _row_case(scale_a, scale_b)
    leaf, joint, finite = jax.jit(norms.careful_row_norms)(arrays)
    rows = _rows(arrays)
    want = np.stack([np.sqrt(np.sum(np.square(r), axis=1)) for r in rows])
    np.testing.assert_allclose(np.asarray(leaf, np.float64), want, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(joint, np.float64), _exact_rows(arrays), rtol=2e-6)
    assert finite.dtype == bool and np.all(finite)


def test_careful_row_norms_take_16_bit_rows_and_flag_what_is_not_finite():
    a, b = _row_case(1e30, 1.0)
    arrays = [a.astype(jnp.bfloat16).at[1, 0, 0].set(jnp.nan), b.at[2, 3].set(-jnp.inf)]
    arrays.append(jnp.full((5, 3), 300.0, jnp.float16))
    leaf, joint, finite = norms.careful_row_norms(arrays)
    assert leaf.dtype == joint.dtype == jnp.float32
    assert np.isnan(joint[1]) and joint[2] == np.inf
    want = np.ones((3, 5), bool)
    want[0, 1] = want[1, 2] = False
    np.testing.assert_array_equal(finite, want)
    ok = np.array([0, 3, 4])
    np.testing.assert_allclose(
        np.asarray(joint, np.float64)[ok], _exact_rows(arrays)[ok], rtol=2e-6
    )
    # finite rows whose norm (4.2e38) does not fit: inf, and finite
    leaf, joint, finite = norms.careful_row_norms([jnp.full((2, 2), 3e38, jnp.float32)])
    assert np.all(leaf == np.inf) and np.all(joint == np.inf) and np.all(finite)


@pytest.mark.parametrize(("scale_a", "scale_b"), [(1.0, 1.0), (1e25, 1e-25)])
def test_careful_row_norms_derivatives_are_x_over_norm(scale_a, scale_b):
    arrays = _row_case(scale_a, scale_b)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5)), jnp.float32)

    def f(xs):
        leaf, joint, _ = norms.careful_row_norms(xs)
        return jnp.sum(w[:2] * leaf) + jnp.sum(w[2] * joint)

    grads = jax.jit(jax.grad(f))(arrays)
    joint = _exact_rows(arrays)
    for k, (g, x) in enumerate(zip(grads, arrays, strict=True)):
        r = _rows([x])[0]
        own = np.sqrt(np.sum(np.square(r), axis=1))
        scale = np.asarray(w[k], np.float64) / np.where(own > 0, own, np.inf) + np.asarray(
            w[2], np.float64
        ) / np.where(joint > 0, joint, np.inf)
        want = (scale[:, None] * r).reshape(x.shape)
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-5, atol=1e-30)
