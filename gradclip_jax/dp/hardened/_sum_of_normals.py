"""Gaussian noise as the sum of four normals over two (Holohan and Braghin 2021), the construction
of Opacus' ``secure_mode``: the same variance, so the same accounting, without one floating-point
sample's gaps and low bits exposed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax.dp.noise import add_gaussian_noise

# Normals summed per element; their sum over sqrt(SUMMANDS) = 2 is again N(0, 1).
SUMMANDS = 4


def add_sum_of_normals_noise(tree: Any, stddev: Any, key: jax.Array) -> Any:
    """Adds :math:`\\sigma (Z_1 + Z_2 + Z_3 + Z_4) / 2`, :math:`Z_j \\sim \\mathcal{N}(0, 1)` i.i.d., to every element.

    In exact arithmetic :math:`(Z_1 + \\dots + Z_4)/2 \\sim \\mathcal{N}(0, 1)`: the mechanism,
    and so its accounting, is the Gaussian one. In floating point a single sample of a normal
    sampler takes only some values, with gaps that depend on the sample's size, and the noised
    output :math:`x + \\sigma Z` then tells which :math:`x` it came from (Mironov 2012 for the
    Laplace; Jin et al. 2022, "Are We There Yet? Timing and Floating-Point Attacks on
    Differential Privacy Systems", for the Gaussian samplers of DP libraries and DP-SGD). The sum
    of several samples fills those gaps (Holohan and Braghin 2021, "Secure Random Sampling in
    Differential Privacy"; Opacus' ``secure_mode``): a mitigation of these attacks, not a proof
    that no floating-point leak is left (the integer path, :func:`discrete_gaussian`, is the one
    whose output is exact).

    Each normal is one :func:`gradclip_jax.dp.noise.add_gaussian_noise` draw (the backend's
    strategy, its dtype rules and its stored leaves), from ``jax.random.split(key, 4)``.

    Args:
      tree: a pytree of floating-point arrays (a clipped sum).
      stddev: :math:`\\sigma \\ge 0`.
      key: a ``jax.random`` key; in a hardened run, from :func:`os_key`.

    Returns:
      The noised tree (float32 at least, as :func:`~gradclip_jax.dp.noise.add_gaussian_noise`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.dp.hardened import add_sum_of_normals_noise, os_key
      >>> add_sum_of_normals_noise({'w': jnp.zeros(3)}, 1.0, os_key())['w'].shape
      (3,)
    """
    zero = jax.tree.map(jnp.zeros_like, tree)
    noises = [add_gaussian_noise(zero, stddev, k) for k in jax.random.split(key, SUMMANDS)]
    return jax.tree.map(_plus_half_sum, tree, *noises)


def _plus_half_sum(x: jax.Array, *noises: jax.Array) -> jax.Array:
    """``x + (n1 + n2 + n3 + n4) / 2`` in the noise's dtype (halving is exact in binary)."""
    n1, n2, n3, n4 = noises
    return x.astype(n1.dtype) + ((n1 + n2) + (n3 + n4)) * jnp.asarray(0.5, n1.dtype)
