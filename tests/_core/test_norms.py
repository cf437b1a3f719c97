"""The norm engine: every ord, axes rules, leaf handling, precision, errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx
from tests import oracle

ORDS = [
    1,
    2,
    3,
    1.5,
    0.5,
    -1,
    -2.5,
    0,
    math.inf,
    -math.inf,
    "l0",
    "l1",
    "l2",
    "l3",
    "l4",
    "linf",
    "mad",
    "rms",
    "std",
    "var",
    "sum",
]


def _tree(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(3, 4)).astype(dtype),
        "b": rng.normal(size=(4,)).astype(dtype),
        "s": np.asarray(rng.normal(), dtype),
        "k": rng.normal(size=(2, 3, 2)).astype(dtype),
    }


def _concat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


@pytest.mark.parametrize("ord_", ORDS, ids=str)
def test_global_norm_equals_norm_of_concatenation(ord_):
    with jax.enable_x64(True):
        tree = _tree()
        got = float(gcx.tree_norm(jax.tree_util.tree_map(jnp.asarray, tree), ord=ord_))
        want = float(oracle.norm(_concat(tree), ord_).reshape(()))
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("ord_", ORDS, ids=str)
@pytest.mark.parametrize(
    "dim,inverse", [(None, False), (0, False), (-1, False), ((0, 1), False), (0, True), (-1, True)]
)
def test_leaf_norms_match_numpy(ord_, dim, inverse):
    tree = _tree(1, np.float32)
    got = gcx.leaf_norms(tree, ord=ord_, dim=dim, inverse_dims=inverse)
    for key, x in tree.items():
        axes = oracle.axes_for(x.ndim, dim, inverse)
        if x.ndim == 0 and dim is None:
            axes = ()
        if axes is None:
            assert got[key] is None
            continue
        want = np.squeeze(oracle.norm(x.astype(np.float64), ord_, axes), axis=axes)
        np.testing.assert_allclose(np.asarray(got[key]), want, rtol=3e-5, atol=1e-6)


def test_leaf_norms_keepdims_broadcasts():
    x = jnp.arange(12.0).reshape(3, 4)
    n = gcx.leaf_norms([x], dim=1, keepdims=True)[0]
    assert n.shape == (3, 1)
    np.testing.assert_allclose(
        n[:, 0], np.linalg.norm(np.arange(12.0).reshape(3, 4), axis=1), rtol=1e-6
    )


def test_axes_a_leaf_lacks_are_ignored():
    tree = {"v": jnp.array([3.0, 4.0]), "m": jnp.ones((2, 3))}
    n = gcx.leaf_norms(tree, dim=1)
    assert n["v"] is None  # a vector has no axis 1: left alone
    np.testing.assert_allclose(n["m"], [math.sqrt(3)] * 2, rtol=1e-6)


def test_negative_axes_count_from_each_leaf():
    tree = {"v": jnp.array([3.0, 4.0]), "m": jnp.array([[3.0, 4.0], [6.0, 8.0]])}
    n = gcx.leaf_norms(tree, dim=-1)
    np.testing.assert_allclose(n["v"], 5.0)
    np.testing.assert_allclose(n["m"], [5.0, 10.0])


def test_scalar_leaf_is_its_own_slice():
    assert float(gcx.leaf_norms([jnp.asarray(-3.0)])[0]) == 3.0


@pytest.mark.parametrize("ord_", ORDS, ids=str)
def test_empty_tree_and_empty_leaves_have_norm_zero(ord_):
    assert float(gcx.tree_norm({}, ord=ord_)) == 0.0
    assert float(gcx.tree_norm([jnp.zeros((0, 3))], ord=ord_)) == 0.0


def test_none_masked_and_float0_leaves_count_for_nothing():
    f0 = np.zeros((2,), dtype=jax.dtypes.float0)
    tree = {"a": jnp.array([3.0, 4.0]), "n": None, "m": optax.MaskedNode(), "z": f0}
    assert float(gcx.tree_norm(tree)) == 5.0
    norms = gcx.leaf_norms(tree)
    assert norms["n"] is None and norms["z"] is None and float(norms["a"]) == 5.0


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_, jnp.uint8])
def test_integer_leaf_raises_type_error_naming_its_path(dtype):
    tree = {"layer": {"kernel": jnp.ones((2,)), "steps": jnp.ones((2,), dtype)}}
    with pytest.raises(TypeError, match=r"\['layer'\]\['steps'\]"):
        gcx.tree_norm(tree)
    with pytest.raises(TypeError, match=r"\['layer'\]\['steps'\]"):
        gcx.leaf_norms(tree)


def test_python_int_leaf_is_rejected_but_float_accepted():
    with pytest.raises(TypeError, match=r"\[1\]"):
        gcx.tree_norm([1.0, 3])
    assert float(gcx.tree_norm([3.0, 4.0])) == 5.0


@pytest.mark.parametrize("bad", ["l5", "fro", "nuc", "", "nan"])
def test_unknown_ord_raises_value_error(bad):
    with pytest.raises(ValueError, match="ord"):
        gcx.tree_norm([jnp.ones(2)], ord=bad)
    with pytest.raises(ValueError, match="ord"):
        gcx.clip_by_norm(1.0, ord=bad)


def test_nan_ord_and_bool_ord_are_rejected():
    with pytest.raises(ValueError):
        gcx.parse_ord(float("nan"))
    with pytest.raises(TypeError):
        gcx.parse_ord(True)


def test_ord_string_aliases():
    x = [jnp.array([1.0, -2.0, 0.0, 4.0])]
    for alias, num in [
        ("l1", 1),
        ("l2", 2),
        ("linf", math.inf),
        ("l0", 0),
        ("inf", math.inf),
        ("-inf", -math.inf),
        ("L2", 2),
    ]:
        assert float(gcx.tree_norm(x, ord=alias)) == float(gcx.tree_norm(x, ord=num))


def test_complex_leaves_use_modulus():
    z = jnp.array([3 + 4j, 0 + 0j], jnp.complex64)
    assert float(gcx.tree_norm([z])) == pytest.approx(5.0)
    assert float(gcx.tree_norm([z], ord=1)) == pytest.approx(5.0)
    assert float(gcx.tree_norm([z], ord=3)) == pytest.approx(5.0, rel=1e-6)
    assert gcx.tree_norm([z]).dtype == jnp.float32
    with pytest.raises(TypeError, match="complex"):
        gcx.tree_norm([z], ord="sum")


def test_std_of_one_element_is_zero_not_nan():
    assert float(gcx.tree_norm([jnp.array([5.0])], ord="std")) == 0.0
    assert float(gcx.leaf_norms([jnp.array([[5.0], [2.0]])], ord="var", dim=1)[0][1]) == 0.0


# ---------------------------------------------------------------- precision


def test_fp16_values_of_300_do_not_overflow():
    g = [jnp.full((4,), 300.0, jnp.float16)]
    n = gcx.tree_norm(g)
    assert n.dtype == jnp.float32 and float(n) == 600.0
    assert float(optax.tree.norm(g)) == math.inf  # what optax does


def test_fp16_many_tens_do_not_overflow():
    assert float(gcx.tree_norm([jnp.full((10000,), 10.0, jnp.float16)])) == pytest.approx(1000.0)


@pytest.mark.parametrize("ord_", [2, 3, 4, 1.5, "rms", "std", "var", "mad", "sum", 1])
def test_huge_float32_values_give_a_finite_right_norm(ord_):
    x = np.array([1e30, -2e30, 3e30], np.float64)
    got = float(gcx.tree_norm([jnp.asarray(x, jnp.float32)], ord=ord_))
    want = float(oracle.norm(x, ord_).reshape(()))
    if ord_ == "var":  # the variance itself (~4e60) exceeds float32: inf is the right answer
        assert got == math.inf
        return
    assert math.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("ord_", [2, 3, "rms", "std"])
def test_tiny_values_do_not_underflow_to_zero(ord_):
    x = np.array([1e-30, 2e-30, -3e-30], np.float64)
    got = float(gcx.tree_norm([jnp.asarray(x, jnp.float32)], ord=ord_))
    np.testing.assert_allclose(got, float(oracle.norm(x, ord_).reshape(())), rtol=1e-5)


def test_negative_p_with_a_zero_element_is_zero_and_robust():
    assert float(gcx.tree_norm([jnp.array([0.0, 1.0])], ord=-1)) == 0.0
    x = np.array([1e-30, 2e-30])
    np.testing.assert_allclose(
        float(gcx.tree_norm([jnp.asarray(x, jnp.float32)], ord=-2)),
        float(oracle.norm(x, -2).reshape(())),
        rtol=1e-5,
    )


def test_bf16_thousand_leaves_accumulate_in_float32():
    tree = [jnp.ones((4,), jnp.bfloat16) for _ in range(1000)]
    n = float(gcx.tree_norm(tree))
    assert abs(n - math.sqrt(4000)) / math.sqrt(4000) < 0.01
    assert abs(float(optax.tree.norm(tree)) - math.sqrt(4000)) / math.sqrt(4000) > 0.4  # optax: 32


def test_float64_leaves_accumulate_in_float64():
    with jax.enable_x64(True):
        n = gcx.tree_norm([jnp.ones(3, jnp.float64), jnp.ones(2, jnp.float32)])
        assert n.dtype == jnp.float64
        assert gcx.tree_norm([jnp.ones(3, jnp.float32)]).dtype == jnp.float32


def test_non_finite_inputs_give_non_finite_norms():
    assert math.isnan(float(gcx.tree_norm([jnp.array([jnp.nan, 1.0])])))
    assert float(gcx.tree_norm([jnp.array([jnp.inf, 1.0])])) == math.inf
    assert float(gcx.tree_norm([jnp.array([jnp.inf, 1.0])], ord=3)) == math.inf
    assert math.isnan(float(gcx.tree_norm([jnp.array([jnp.nan, 0.0]), jnp.ones(2)], ord=1)))


@pytest.mark.parametrize("ord_", [2, 1, 3, 0.5, "rms", "std", "mad", math.inf, "var"])
def test_gradient_of_norm_is_finite_at_zero(ord_):
    g = jax.grad(lambda t: gcx.tree_norm(t, ord=ord_))([jnp.zeros(3), jnp.zeros((2, 2))])
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)


def test_norm_under_jit_and_vmap():
    x = jnp.arange(6.0).reshape(2, 3)
    f = jax.jit(lambda t: gcx.tree_norm([t]))
    np.testing.assert_allclose(f(x), np.linalg.norm(np.arange(6.0)), rtol=1e-6)
    per_row = jax.vmap(lambda r: gcx.tree_norm({"r": r}))(x)
    np.testing.assert_allclose(
        per_row, np.linalg.norm(np.arange(6.0).reshape(2, 3), axis=1), rtol=1e-6
    )
    # vmap with a batched fallback predicate (one row huge, one normal)
    big = jnp.array([[1e30, 1e30], [3.0, 4.0]], jnp.float32)
    np.testing.assert_allclose(
        jax.vmap(lambda r: gcx.tree_norm([r]))(big), [math.sqrt(2) * 1e30, 5.0], rtol=1e-6
    )


@pytest.mark.parametrize("big", [1e38, 3e38, 3.4e38])
def test_per_slice_norm_near_float32_max(big):
    """Regression: dividing by max|x| ~ 1e38 flushed its reciprocal to zero."""
    n = gcx.leaf_norms(
        {"w": jnp.array([big, 0.0], jnp.float32), "m": jnp.array([[big, big]], jnp.float32)},
        dim=None,
    )
    np.testing.assert_allclose(float(n["w"]), big, rtol=1e-6)
    assert (
        float(n["m"]) == math.inf
        or abs(float(n["m"]) - big * math.sqrt(2)) / (big * math.sqrt(2)) < 1e-6
    )
    tx = gcx.clip_by_norm(1.0)
    out, state = tx.update([jnp.array([big, 0.0], jnp.float32)], tx.init([jnp.zeros(2)]))
    np.testing.assert_allclose(float(state.norm[0]), big, rtol=1e-6)
    # Known limit: a factor max_norm/norm below float32's smallest normal (1.2e-38) is
    # flushed to zero by the CPU, so only the bound is guaranteed there.
    assert float(jnp.linalg.norm(out[0])) <= 1.0 + 1e-6
    out, _ = tx.update([jnp.array([big / 10, 0.0], jnp.float32)], tx.init([jnp.zeros(2)]))
    np.testing.assert_allclose(np.asarray(out[0]), [1.0, 0.0], rtol=1e-6)


def test_stateful_finiteness_and_change_checks():
    from gradclip_jax.transforms import _stateful as st

    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        assert not bool(st.all_finite([jnp.array([1.0, bad])]))
        assert not bool(jax.jit(st.all_finite)([jnp.array([[0.0], [bad]], jnp.bfloat16)]))
        assert not bool(st.all_finite([jnp.array([1.0, complex(bad, 0)], jnp.complex64)]))
    assert bool(
        st.all_finite([jnp.array([3e38, -3e38, 1e-45])])
    )  # huge and subnormal values are finite
    assert bool(st.any_exceeds(jnp.array([0.5, -2.0]), jnp.array([1.0, 1.5])))
    assert not bool(st.any_exceeds(jnp.array([0.5, -1.5]), jnp.array([1.0, 1.5])))
    assert bool(st.any_exceeds(jnp.array([1j]), jnp.array([0.5])))
    assert not bool(st.any_exceeds(jnp.array([jnp.nan]), jnp.array([0.5])))
    assert bool(st.any_changed(jnp.array([1.0, 1e-30]), jnp.array([1.0, 0.0])))
    assert not bool(st.any_changed(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0])))
    assert bool(st.any_changed(jnp.array([1.0, -2.0]), jnp.array([1.0, 2.0])))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_guard_power_of_two_from_exponent_bits(dtype):
    # 2**e with m = f * 2**e, f in [0.5, 1) (frexp), clamped so 1/p is normal; 0, inf, NaN pass
    from gradclip_jax._core.norms._reduce import power_of_two

    info = jnp.finfo(dtype)
    r = np.random.default_rng(0)
    vals = np.concatenate(
        [
            [
                0.0,
                np.inf,
                np.nan,
                float(info.tiny),
                float(info.smallest_subnormal),
                float(info.max),
                1.0,
                2.0,
                3.0,
                0.75,
            ],
            np.abs(r.standard_normal(500)) * 10.0 ** r.integers(-45, 45, 500),
        ]
    )
    with np.errstate(over="ignore"):
        m = jnp.asarray(vals.astype(np.float64).clip(0, float(info.max)), dtype)

    # the reference in float64 numpy (every value of these dtypes is exact there), not jnp.frexp,
    # whose handling of subnormals differs between JAX releases and backends
    mf = np.asarray(m, np.float64)
    _, e = np.frexp(mf)
    e = np.clip(e, int(info.minexp) + 1, int(info.maxexp) - 2)
    want = np.where(np.isfinite(mf) & (mf > 0), np.ldexp(1.0, e), mf)
    sub = (mf > 0) & (mf < float(info.tiny))
    # eager and jitted: exact on every normal or special value; a subnormal (exponent bits 0, like
    # zero) gives the smallest power of two allowed, or passes through (as itself, or as zero where
    # the backend flushes subnormals)
    for run in (power_of_two, jax.jit(power_of_two)):
        out = run(m)
        assert out.dtype == m.dtype
        got = np.asarray(out, np.float64)
        np.testing.assert_array_equal(got[~sub], want[~sub])
        ok = (got[sub] == 2.0 ** (int(info.minexp) + 1)) | (got[sub] == 0) | (got[sub] == mf[sub])
        assert np.all(ok) and sub.any()


def test_slice_norms_of_stacked_equal_arrays_match_separate_ones():
    """Small arrays of one shape reduced over the same axes are measured as one stacked job
    (one reduction, one overflow check); each result is what measuring it alone gives."""
    from gradclip_jax._core.norms import NormSpec, slice_norms

    r = np.random.default_rng(0)
    arrays = [
        jnp.asarray(r.standard_normal((4, 6)) * s, jnp.float32) for s in (1.0, 1e30, 1e-30, 0.0)
    ]
    arrays += [
        jnp.asarray(r.standard_normal((4, 6)), jnp.bfloat16),
        jnp.asarray(r.standard_normal((5, 6))),
    ]
    axes = [(1,), (-1,), (1,), (1,), (1,), (1,)]
    jaxpr = jax.make_jaxpr(lambda *xs: slice_norms(list(xs), axes, NormSpec("pow", p=2.0)))(*arrays)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1  # one overflow check for all of them
    for spec in (NormSpec("pow", p=2.0), NormSpec("max"), NormSpec("std")):
        together = slice_norms(arrays, axes, spec)
        for x, ax, got in zip(arrays, axes, together, strict=True):
            alone = slice_norms([x], [ax], spec)[0]
            assert got.shape == alone.shape == (x.shape[0], 1)
            np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=1e-6)
    n = slice_norms(arrays[1:2], [(1,)], NormSpec("pow", p=2.0))[0]
    assert np.all(np.isfinite(np.asarray(n)))  # the overflow fallback still applies per stacked job


def test_global_std_of_complex_leaves_is_that_of_the_concatenated_leaves():
    """The global mean of complex leaves was summed in the real dtype (its imaginary part
    dropped): [1j, 1j] had a global std of 1.414 and a per-leaf one of 0."""
    x = np.array([3 + 4j, 1j, -2 - 2j], np.complex64)
    want = np.sqrt(np.sum(np.abs(x - x.mean()) ** 2) / 2)
    for tree in ({"a": jnp.asarray(x)}, {"a": jnp.asarray(x[:2]), "b": jnp.asarray(x[2:])}):
        np.testing.assert_allclose(float(gcx.tree_norm(tree, ord="std")), want, rtol=1e-6)
    const = {"a": jnp.array([1j, 1j], jnp.complex64)}
    assert float(gcx.tree_norm(const, ord="std")) == 0.0
    out, _ = gcx.clip_by_global_norm(0.5, ord="std").update(const, None)
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(const["a"]))


@pytest.mark.parametrize(
    ("values", "norm", "overflowed"),
    [
        ([3e38, 3e38], math.inf, True),  # finite elements, the norm (4.2e38) does not fit
        ([1e38, 2e38], 2.236068e38, False),  # squares overflow, the norm fits
        ([math.inf, 1.0], math.inf, False),  # an infinite element
        ([math.nan, 3e38], math.nan, False),
        ([3.0, 4.0], 5.0, False),
    ],
)
def test_global_norm_and_overflow_tells_an_overflowed_norm_from_an_infinite_element(
    values, norm, overflowed
):
    from gradclip_jax._core import norms

    x = [jnp.array(values, jnp.float32), jnp.ones(3, jnp.bfloat16)]
    spec = norms.parse_ord(2)
    n, over = jax.jit(lambda xs: norms.global_norm_and_overflow(xs, spec))(x)
    np.testing.assert_allclose(float(n), math.sqrt(norm**2 + 3), rtol=1e-6)
    assert bool(over) is overflowed
    pairs = norms.slice_norms(x, [(0,), (0,)], spec, then=lambda n, over: over)
    assert [bool(o) for _, o in pairs] == [overflowed, False]
