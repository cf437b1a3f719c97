"""Tests for the optax-compatible per-example functions (gradclip_jax.per_example._optax_compat)."""

from __future__ import annotations

import math
import warnings

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradclip_jax import (
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
    per_example_norms,
)
from tests.per_example.models import (
    assert_tree_close,
    random_per_example_grads,
)


def test_per_example_functions_bad_input():
    with pytest.raises(ValueError, match=r"leaf \[1\] is a scalar"):
        per_example_global_norm_clip([jnp.ones((4, 3)), jnp.ones(())], 1.0)
    with pytest.raises(
        ValueError, match=r"leaf \['b'\] has batch size 3.*\['a'\] has batch size 4"
    ):
        per_example_global_norm_clip({"a": jnp.ones((4, 3)), "b": jnp.ones((3, 3))}, 1.0)
    with pytest.raises(ValueError, match=r"leaf \['b'\] has batch size 3"):
        per_example_layer_norm_clip({"a": jnp.ones((4, 3)), "b": jnp.ones((3, 3))}, 1.0)
    with pytest.raises(
        TypeError, match=r"\['k'\]"
    ):  # integers are promoted as in optax; keys are no gradients
        per_example_global_norm_clip({"k": jax.random.split(jax.random.key(0), 4)}, 1.0)
    with pytest.raises(TypeError, match=r"\['b'\] has dtype bool"):
        per_example_layer_norm_clip({"b": jnp.ones((4, 3), bool)}, 1.0)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        per_example_global_norm_clip([jnp.ones((4, 3))], -1.0)
    with pytest.raises(ValueError, match="`l2_clip_norm` must be"):
        per_example_global_norm_clip([jnp.ones((4, 3))], l2_clip_norm=-1.0)
    with pytest.raises(TypeError, match="got both `l2_clip_norm` and `l2_norm_clip`"):
        per_example_global_norm_clip([jnp.ones((4, 3))], 1.0, l2_clip_norm=1.0)


def test_per_example_global_norm_clip_takes_both_spellings_without_a_warning():
    grads = [jnp.array([[0.0, 3.0, 4.0], [1.0, 0.0, 0.0]])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = per_example_global_norm_clip(grads, l2_clip_norm=1.25)
    want = per_example_global_norm_clip(grads, l2_norm_clip=1.25)
    np.testing.assert_array_equal(got[0][0], want[0][0])
    assert int(got[1]) == int(want[1]) == 1


# ----------------------------------------------------------------------------
# optax parity of the per-example functions
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.0, 0.5, 2.0, 1e9, np.inf])
def test_global_norm_clip_matches_optax(clip):
    grads = random_per_example_grads(0, [(3, 4), (5,), ()])
    ours, n_ours = jax.jit(per_example_global_norm_clip)(grads, clip)
    ref, n_ref = optax.per_example_global_norm_clip(grads, clip)
    assert_tree_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert int(n_ours) == int(n_ref)
    assert n_ours.dtype == jnp.int32


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("clip", [0.0, 0.7, 3.0, np.inf])
def test_layer_norm_clip_matches_optax(uniform, clip):
    grads = random_per_example_grads(1, [(3, 4), (5,), (2, 2, 2)])
    ours, counts = per_example_layer_norm_clip(grads, clip, uniform=uniform)
    ref, ref_counts = optax.per_example_layer_norm_clip(grads, clip, uniform=uniform)
    assert_tree_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert [int(c) for c in counts] == [int(c) for c in ref_counts]


def test_per_example_functions_on_dicts_and_empty():
    grads = random_per_example_grads(2, [(3,), (2, 2)])
    tree = {"a": grads[0], "b": {"c": grads[1]}}
    out, n = per_example_global_norm_clip(tree, 1.0)
    ref, n_ref = optax.per_example_global_norm_clip(grads, 1.0)
    assert_tree_close([out["a"], out["b"]["c"]], ref, rtol=1e-6, atol=1e-6)
    assert int(n) == int(n_ref)
    np.testing.assert_allclose(per_example_norms(tree), jax.vmap(optax.tree.norm)(grads), rtol=1e-6)
    empty, n0 = per_example_global_norm_clip([], 1.0)
    assert empty == [] and int(n0) == 0


@pytest.mark.slow
def test_per_example_clip_is_differentiable_at_zero():
    grads = [jnp.zeros((3, 4)), jnp.zeros((3,))]

    def f(g):
        s, _ = per_example_global_norm_clip(g, 1.0)
        return sum(jnp.sum(x) for x in s)

    d = jax.grad(f)(grads)
    assert all(np.all(np.isfinite(x)) for x in d)
    # vmap over stacked batches
    stacked = [jnp.ones((2, 3, 4)), jnp.ones((2, 3))]
    out, n = jax.vmap(lambda g: per_example_global_norm_clip(g, 1.0))(stacked)
    assert out[0].shape == (2, 4) and n.shape == (2,)


# ----------------------------------------------------------------------------
# Hypothesis: contributions never exceed C, zero examples never give NaN
# ----------------------------------------------------------------------------

_clip_one = jax.jit(per_example_global_norm_clip)
_layer_one = jax.jit(per_example_layer_norm_clip)


@hypothesis.given(
    seed=st.integers(0, 2**31 - 1),
    exponent=st.integers(-30, 38),
    clip=st.floats(1e-4, 1e4),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    zero=st.booleans(),
)
def test_contribution_never_exceeds_clip(seed, exponent, clip, dtype, zero):
    r = np.random.default_rng(seed)
    leaves = [np.clip(r.normal(size=s), -3, 3) for s in ((1, 3, 5), (1, 7), (1,))]
    leaves[r.integers(3)] *= 10.0 ** -r.integers(0, 5)  # leaves of different magnitudes
    scale = 0.0 if zero else 10.0**exponent
    grads = [jnp.asarray(x * scale, dtype) for x in leaves]
    for fn in (_clip_one, _layer_one):
        out, _ = fn(grads, clip)
        out64 = [np.asarray(x, np.float64) for x in out]
        assert all(np.all(np.isfinite(x)) for x in out64)
        norm = math.sqrt(sum(float(np.sum(x**2)) for x in out64))
        assert norm <= clip * (1 + 1e-5)
        if zero:
            assert norm == 0.0
    assert all(x.dtype == jnp.dtype(dtype) for x in out)  # the input dtype, as optax returns it


@pytest.mark.parametrize(
    "dtypes",
    [
        ("int32", "int32"),
        ("int8", "float32"),
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("float16", "float16"),
    ],
)
def test_integer_and_16_bit_gradients_return_what_optax_returns(dtypes):
    r = np.random.default_rng(0)
    grads = [
        jnp.asarray(r.integers(-5, 6, size=(6, 3)), dtypes[0]),
        jnp.asarray(r.integers(-5, 6, size=(6, 2)), dtypes[1]),
    ]
    for ours, theirs in [
        (per_example_global_norm_clip, optax.per_example_global_norm_clip),
        (per_example_layer_norm_clip, optax.per_example_layer_norm_clip),
    ]:
        got, n = ours(grads, 2.0)
        want, m = theirs(grads, 2.0)
        assert [x.dtype for x in got] == [x.dtype for x in want]
        assert jax.tree_util.tree_map(lambda x: x.dtype, n) == jax.tree_util.tree_map(
            lambda x: x.dtype, m
        )
        # each example's factor is lowered by a few ulps so the stored bound holds: a sum of 6 may differ
        # from optax's by ~10 ulps
        tol = max(3 * float(jnp.finfo(want[0].dtype).eps), 16 * float(jnp.finfo(jnp.float32).eps))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
            )


def _complex_grads():
    r = np.random.default_rng(0)
    z = r.standard_normal((6, 5)) + 1j * r.standard_normal((6, 5))
    return [jnp.asarray(z, jnp.complex64), jnp.asarray(r.standard_normal((6, 2)), jnp.float32)]


@pytest.mark.parametrize("clip", [0.5, 100.0])
def test_complex_per_example_gradients_keep_their_imaginary_part(clip):
    """Clipped sums of complex per-example gradients are complex and equal optax's (norms use |x|)."""
    g = _complex_grads()
    ours, n = per_example_global_norm_clip(g, clip)
    ref, n_ref = optax.per_example_global_norm_clip(g, clip)
    assert ours[0].dtype == jnp.complex64 and int(n) == int(n_ref)
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)
    ours_l, _ = per_example_layer_norm_clip(g, clip)
    ref_l, _ = optax.per_example_layer_norm_clip(g, clip)
    for a, b in zip(ours_l, ref_l, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)
