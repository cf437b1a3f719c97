"""The exact arithmetic behind the stored-bound check (gradclip_jax/_core/stored.py): the split
and Dekker's product are error-free across magnitudes, in float32 by a bit mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax._core import stored as _stored


# products of 1e-18 and up: their rounding errors stay normal numbers (below, _sumsq counts the
# elements as tiny instead, since XLA flushes subnormals)
@pytest.mark.parametrize("scale", [1e-9, 1e-3, 1.0, 1e3, 1e15])
def test_split_and_product_are_exact_in_float32(scale):
    r = np.random.default_rng(0)
    a = jnp.asarray(r.normal(size=20000) * scale, jnp.float32)
    b = jnp.asarray(r.normal(size=20000) * scale, jnp.float32)
    hi, lo = _stored._split(a)
    np.testing.assert_array_equal(np.asarray(hi) + np.asarray(lo), np.asarray(a))
    assert not np.any(np.asarray(hi).view(np.uint32) & 0xFFF)  # 12 significant bits at most
    p, e = jax.jit(_stored._two_prod)(a, b)
    exact = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.asarray(p, np.float64) + np.asarray(e, np.float64), exact)


def test_stored_scale_keeps_complex_values_complex():
    z = jnp.array([3 + 4j, 6 + 8j], jnp.complex64)
    out = _stored.stored_scale(z, jnp.float32(0.5))
    assert out.dtype == jnp.complex64
    np.testing.assert_array_equal(np.asarray(out), np.asarray(z) * 0.5)
    half = _stored.stored_scale(jnp.ones(3, jnp.bfloat16), jnp.float32(1 / 3))
    assert half.dtype == jnp.bfloat16  # computed in float32, rounded once to the leaf's dtype
    np.testing.assert_array_equal(
        np.asarray(half, np.float32), np.float32(jnp.bfloat16(np.float32(1 / 3)))
    )


def test_one_factor_shared_by_many_leaves_is_lowered_once_per_dtype():
    # past the exact check every factor takes its store's margin; a global clip passes the same
    # factor for each leaf, and an eager call dispatches every op, so the margin's ops must not
    # be repeated per leaf (50 leaves cost 150 dispatches, a third of an eager update)
    from gradclip_jax._core.numerics import bounded_factor

    def run(n):
        arrays = [jnp.ones((70, 70), jnp.bfloat16 if i % 2 else jnp.float32) for i in range(n)]
        f = jnp.float32(0.3)

        def margins(f):
            axes = [(0, 1)] * n
            return _stored.certified_factors(arrays, [f] * n, axes, 1.0, combine=True)

        scalar_ops = [
            e
            for e in jax.make_jaxpr(margins)(f).jaxpr.eqns
            if all(v.aval.ndim == 0 for v in e.outvars)
        ]
        return margins(f), len(scalar_ops), arrays, f

    out, ops, arrays, f = run(30)
    assert ops == run(2)[1]
    for got, x in zip(out, arrays, strict=True):
        assert float(got) == float(bounded_factor(f, x.dtype)) < float(f)
    assert float(out[0]) != float(out[1])  # each dtype its own margin
