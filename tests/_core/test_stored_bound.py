"""The norm bound holds as stored: after clipping, the exact (float64) norm of the stored result of every
clipper whose contract is a norm bound is <= the clip norm, rounding included, on mixed-precision trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import gradclip_jax as gcx
from gradclip_jax import clipped_grad, dp_aggregate

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


@st.composite
def mixed_trees(draw, batch=None):
    """A list of 1-4 leaves of random dtypes (fp16/bf16/fp32) and sizes, values of very different scales."""
    n = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    r = np.random.default_rng(seed)
    leaves = []
    for _ in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        # a few sizes (from one element to several vector widths): eager ops compile once per shape
        shape = ((batch,) if batch else ()) + (draw(st.sampled_from([1, 3, 8, 17, 40])),)
        scale = 10.0 ** draw(st.floats(-2, 2))
        leaves.append(jnp.asarray(r.normal(size=shape) * scale, dtype))
    clip = draw(st.floats(0.05, 20.0))
    return leaves, clip


def _norm64(tree) -> float:
    return float(
        np.sqrt(
            sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree_util.tree_leaves(tree))
        )
    )


def test_the_reported_case():
    tree = [
        jnp.full((7,), 0.7, jnp.float16),
        jnp.full((5,), -1.3, jnp.bfloat16),
        jnp.full((3,), 0.9, jnp.float32),
    ]
    out, _ = gcx.clip_by_global_norm(1.0).update(
        tree, None if False else gcx.clip_by_global_norm(1.0).init(tree)
    )
    assert _norm64(out) <= 1.0
    assert _norm64(out) > 1.0 - 2**-7  # and nothing much was lost


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(mixed_trees())
def test_clip_by_global_norm(case):
    tree, clip = case
    tx = gcx.clip_by_global_norm(clip)
    out, _ = tx.update(tree, tx.init(tree))
    assert [x.dtype for x in out] == [x.dtype for x in tree]
    assert _norm64(out) <= clip
    if _norm64(tree) <= clip * (1 - 1e-3):  # below the bound: untouched
        assert all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, tree, strict=True)
        )


@settings(max_examples=25, deadline=None)
@given(mixed_trees())
def test_clip_by_norm_each_leaf(case):
    tree, clip = case
    tx = gcx.clip_by_norm(clip)
    out, _ = tx.update(tree, tx.init(tree))
    for x in out:
        assert _norm64(x) <= clip


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(mixed_trees(batch=3))
def test_per_example_clippers_single_example(case):
    tree, clip = case
    one = [x[:1] for x in tree]
    summed, _ = gcx.per_example_global_norm_clip(one, clip)
    assert _norm64(summed) <= clip
    sums, _ = gcx.per_example_layer_norm_clip(one, clip)
    assert _norm64(sums) <= clip
    tx = dp_aggregate(clip, 0.0, seed=0)
    out, _ = tx.update(one, tx.init([x[0] for x in one]))
    assert [x.dtype for x in out] == [x.dtype for x in tree]
    assert _norm64(out) <= clip


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(mixed_trees(batch=1), st.sampled_from([None, jnp.float32]), st.booleans())
def test_clipped_grad_contribution(case, dtype, unit):
    tree, clip = case
    params = [x[0] for x in tree]  # 16-bit params: the vmap path
    target = [jnp.asarray(x, jnp.float32) for x in tree]

    def loss(p, b):  # gradient of example b w.r.t. leaf l is target_l (up to the param's dtype)
        return sum(jnp.sum(q.astype(jnp.float32) * t, axis=-1) for q, t in zip(p, b, strict=True))

    fn = clipped_grad(loss, clip, dtype=dtype, rescale_to_unit_norm=unit)
    g, _ = fn(params, target)
    assert _norm64(g) <= fn.sensitivity()


def test_optax_chain_stays_bounded():
    tree = [jnp.full((9,), 3.3, jnp.bfloat16), jnp.full((2,), 1.1, jnp.float16)]
    tx = optax.chain(gcx.clip_by_global_norm(0.5), optax.scale(1.0))
    out, _ = tx.update(tree, tx.init(tree))
    assert _norm64(out) <= 0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_unclipped_values_are_exact(dtype):
    x = [jnp.asarray([0.1, -0.2, 0.3], dtype)]
    tx = gcx.clip_by_global_norm(1.0)
    out, _ = tx.update(x, tx.init(x))
    assert np.array_equal(np.asarray(out[0]), np.asarray(x[0]))
