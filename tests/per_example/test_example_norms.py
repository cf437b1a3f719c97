"""combine_l2: per-leaf per-example norms into each example's global norm, across the range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax.per_example._example_norms import combine_l2


def _exact(leaf_norms):
    return np.sqrt(sum(np.asarray(n, np.float64) ** 2 for n in leaf_norms))


def test_ordinary_norms_combine_as_the_direct_formula():
    r = np.random.default_rng(0)
    leaf_norms = [jnp.asarray(r.uniform(0, 10, size=16), jnp.float32) for _ in range(5)]
    direct = jax.jit(lambda ns: jnp.sqrt(jnp.sum(jnp.stack(ns) ** 2, axis=0)))(leaf_norms)
    # scaled by a power of two, which is exact: the direct formula to float32 rounding
    np.testing.assert_allclose(
        np.asarray(jax.jit(combine_l2)(leaf_norms)), np.asarray(direct), rtol=2.5e-7
    )


@pytest.mark.parametrize(
    "columns",
    [
        [(1e38, 2e38), (3e37, 1.0)],  # squares overflow, the norm (2.2e38) does not
        [(1e-30, 3e-31), (2e-35, 0.0)],  # squares underflow
        [(2e-38, 4e-38), (3e-38, 0.0)],  # at the bottom of the normal range
        [(3e38, 3e38), (1.0, 2.0)],  # the norm (4.2e38) does not fit: inf
    ],
)
def test_norms_at_the_edges_of_the_range_are_right_or_inf(columns):
    leaf_norms = [jnp.asarray(c, jnp.float32) for c in zip(*columns, strict=True)]
    got = np.asarray(jax.jit(combine_l2)(leaf_norms), np.float64)
    want = _exact([np.asarray(c, np.float32) for c in zip(*columns, strict=True)])
    fits = want < np.finfo(np.float32).max
    np.testing.assert_allclose(got[fits], want[fits], rtol=2e-6, atol=1e-45)
    assert np.all(got[~fits] == np.inf)


def test_zero_inf_and_nan_pass_through_and_the_derivative_is_n_over_norm():
    leaf_norms = [jnp.array([0.0, jnp.inf, jnp.nan, 3.0]), jnp.array([0.0, 1.0, 1.0, 4.0])]
    got = np.asarray(combine_l2(leaf_norms))
    assert got[0] == 0.0 and got[1] == np.inf and np.isnan(got[2]) and got[3] == 5.0
    grads = jax.grad(lambda ns: jnp.sum(combine_l2(ns)[jnp.array([0, 3])]))(leaf_norms)
    np.testing.assert_allclose([float(g[3]) for g in grads], [0.6, 0.8], rtol=1e-6)
    assert all(np.isfinite(float(g[0])) for g in grads)  # finite at zero
