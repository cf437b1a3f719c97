"""Gaussian noise for DP-SGD: the one place noise is drawn and added."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax import norms as _norms

__all__ = ["add_gaussian_noise", "noised_leaves"]


def add_gaussian_noise(tree: Any, stddev: Any, key: jax.Array) -> Any:
    """Adds independent :math:`\\mathcal{N}(0, \\sigma^2)` noise to every element.

    Noise is drawn and added in float32 at least (the accumulation dtype of each
    leaf), and the result keeps that dtype: round it yourself after dividing by
    the batch size. One key per leaf is split from ``key``.

    Args:
      tree: a pytree of floating-point arrays (e.g. the sum from ``clipped_grad``).
      stddev: :math:`\\sigma \\ge 0`.
      key: a ``jax.random`` key.

    Returns:
      The noised tree.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.privacy import add_gaussian_noise
      >>> noisy = add_gaussian_noise({'w': jnp.zeros(3)}, 1.0, jax.random.key(0))
      >>> noisy['w'].shape
      (3,)
    """
    flat = _norms.flatten(tree, "add_gaussian_noise")
    arrays = flat.arrays
    if not arrays:
        return tree
    keys = jax.random.split(key, len(arrays))
    return flat.rebuild(noised_leaves([x.astype(_norms.acc_dtype(x.dtype)) for x in arrays], list(keys), stddev))


def noised_leaves(
    arrays: Sequence[jax.Array], keys: Sequence[jax.Array], stddev: Any, divisor: Any = None
) -> list[jax.Array]:
    """``(x + stddev * N(0, 1)) / divisor`` per leaf, one key per leaf, drawn and added in ``x``'s dtype.

    The one place noise is drawn: callers cast each leaf to the dtype the noise
    should have (the accumulation dtype) first. ``divisor=None`` keeps the sum.
    """
    out = []
    for x, k in zip(arrays, keys, strict=True):
        noised = x + jnp.asarray(stddev, x.dtype) * jax.random.normal(k, x.shape, x.dtype)
        out.append(noised if divisor is None else noised / jnp.asarray(divisor, x.dtype))
    return out
