"""Hypothesis properties of every clipper, and mixed-precision behaviour."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import gradclip_jax as gcx

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5)
leaf = hnp.arrays(np.float32, shapes, elements=finite)
trees = st.lists(leaf, min_size=1, max_size=4)
bounds = st.floats(0.0, 100.0, allow_nan=False, width=32)
ords = st.sampled_from([1, 2, 3, 1.5, math.inf, "rms", "mad"])


def _jnp(tree):
    return [jnp.asarray(x) for x in tree]


@given(trees, bounds, ords)
def test_global_clip_bounds_norm_keeps_direction_and_identity_below(tree, bound, ord_):
    g = _jnp(tree)
    tx = gcx.clip_by_global_norm(bound, ord=ord_)
    out, state = tx.update(g, tx.init(g))
    before = float(gcx.tree_norm(g, ord=ord_))
    after = float(gcx.tree_norm(out, ord=ord_))
    assert after <= bound * (1 + 1e-5) + 1e-30
    if before <= bound:
        for o, x in zip(out, g):
            np.testing.assert_array_equal(o, x)
    else:  # same direction: a non-negative multiple of the input
        flat_in = np.concatenate([np.ravel(x) for x in tree]).astype(np.float64)
        flat_out = np.concatenate([np.ravel(o) for o in out]).astype(np.float64)
        k = bound / before
        np.testing.assert_allclose(flat_out, flat_in * k, rtol=1e-5, atol=1e-30 + 1e-6 * bound)
    np.testing.assert_allclose(float(state.norm), before, rtol=1e-6)


@pytest.mark.slow
@given(trees, bounds, st.sampled_from([None, 0, -1, (0, 1)]), ords)
def test_per_slice_clip_bounds_every_slice(tree, bound, dim, ord_):
    g = _jnp(tree)
    tx = gcx.clip_by_norm(bound, ord=ord_, dim=dim)
    if dim is not None and g and all(x.ndim == 0 for x in g):  # no leaf has the axes
        with pytest.raises(ValueError, match="dim"):
            tx.update(g, tx.init(g))
        return
    out, _ = tx.update(g, tx.init(g))
    for o, x in zip(gcx.leaf_norms(out, ord=ord_, dim=dim), gcx.leaf_norms(g, ord=ord_, dim=dim)):
        if o is None:
            continue
        assert bool(jnp.all(o <= bound * (1 + 1e-5) + 1e-30))
        below = x <= bound
        np.testing.assert_allclose(np.where(below, o, 0), np.where(below, x, 0), rtol=1e-6)


@given(trees, st.floats(0.125, 10.0, width=32))
def test_normalize_gives_target_norm(tree, target):
    g = _jnp(tree)
    tx = gcx.normalize(target)
    out, _ = tx.update(g, tx.init(g))
    for o, x in zip(out, g):
        n = float(np.linalg.norm(np.asarray(x, np.float64).ravel()))
        if n > 0:
            np.testing.assert_allclose(
                np.linalg.norm(np.asarray(o, np.float64).ravel()), target, rtol=1e-4
            )
        else:
            np.testing.assert_array_equal(o, x)


ALL = [
    lambda: gcx.clip_by_global_norm(1.0),
    lambda: gcx.clip_by_global_norm(0.0),
    lambda: gcx.clip_by_global_norm(1.0, ord=3),
    lambda: gcx.clip_by_norm(0.5, dim=0),
    lambda: gcx.clip_by_norm(0.5, ord="std", min_norm=0.1),
    lambda: gcx.normalize(1.0),
    lambda: gcx.normalize(1.0, ord="mad", dim="global"),
    lambda: gcx.clip_by_block_rms(0.0),
    lambda: gcx.clip_by_value(0.0),
    lambda: gcx.centralize(),
    lambda: gcx.adaptive_grad_clip(0.01),
]


@pytest.mark.parametrize("make", ALL)
def test_no_nan_and_finite_gradients_for_zero_tiny_and_large_inputs(make):
    tx = make()
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}

    def loss(g):
        u, _ = tx.update(g, tx.init(params), params)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree_util.tree_leaves(u))

    # The update runs eagerly (the library's Python-side fallbacks); the gradient is traced
    # either way, so one jitted program serves every scale (op by op it compiled ~100).
    grad = jax.jit(jax.grad(loss))
    for scale in (0.0, 1e-30, 1e-20, 1e-10, 1.0, 1e20):
        g = {"w": jnp.full((3, 2), scale, jnp.float32), "b": jnp.array([scale, 0.0], jnp.float32)}
        out, _ = tx.update(g, tx.init(params), params)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(out)), scale
        dg = grad(g)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(dg)), scale


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("make", ALL)
def test_dtype_is_kept(make, dtype):
    tx = make()
    g = {"w": jnp.full((3, 2), 2.0, dtype), "b": jnp.array([1.0, -3.0], dtype)}
    out, _ = tx.update(g, tx.init(g), g)
    assert jax.tree_util.tree_map(lambda x: x.dtype, out) == {"w": dtype, "b": dtype}


@pytest.mark.slow
@given(trees, bounds)
def test_jit_equals_eager(tree, bound):
    g = _jnp(tree)
    tx = gcx.clip_by_global_norm(bound)
    eager = tx.update(g, tx.init(g))[0]
    jitted = jax.jit(tx.update)(g, tx.init(g))[0]
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ mixed precision


def test_fp16_overflow_does_not_zero_the_update():
    g = [jnp.full((4,), 300.0, jnp.float16)]
    tx = gcx.clip_by_global_norm(1.0)
    out, state = tx.update(g, tx.init(g))
    np.testing.assert_allclose(np.asarray(out[0], np.float32), [0.5] * 4, rtol=1e-3)
    assert float(state.norm) == 600.0
    np.testing.assert_array_equal(
        optax.clip_by_global_norm(1.0).update(g, None)[0][0], [0, 0, 0, 0]
    )  # optax


def test_huge_float32_clip_is_right():
    g = [jnp.array([1e30, 1e30], jnp.float32)]
    tx = gcx.clip_by_global_norm(1.0)
    np.testing.assert_allclose(tx.update(g, tx.init(g))[0][0], [math.sqrt(0.5)] * 2, rtol=1e-6)


def test_bf16_clipped_norm_within_bf16_rounding():
    key = jax.random.PRNGKey(0)
    g = [jax.random.normal(k, (64, 64), jnp.bfloat16) for k in jax.random.split(key, 50)]
    tx = gcx.clip_by_global_norm(1.0)
    out, state = tx.update(g, tx.init(g))
    exact = (
        math.sqrt(sum(float(jnp.sum(x.astype(jnp.float64) ** 2)) for x in g))
        if jax.config.jax_enable_x64
        else None
    )
    n = float(gcx.tree_norm(out))
    assert abs(n - 1.0) < 2**-8  # one bf16 rounding per element
    true = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in g))
    assert abs(float(state.norm) - true) / true < 1e-5
    del exact
