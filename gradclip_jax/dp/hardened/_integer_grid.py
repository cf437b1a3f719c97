"""DP-SGD on an integer grid: each clipped per-example gradient is scaled by a power of two and
truncated toward zero (so its L2 norm stays at most ``grid_scale * l2_clip_norm``, exactly), the
integers are summed exactly in int32, and discrete Gaussian noise is added to the integer sum."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.validation import check_mask, check_number, clip_norm_arg
from gradclip_jax.dp.hardened._discrete_gaussian import check_sigma, discrete_gaussian
from gradclip_jax.dp.noise import check_key_varies, split_stored
from gradclip_jax.per_example.internal import (
    as_rows,
    batch_flatten,
    clip_and_sum,
    sensitivity_factor,
    unrow,
)

# The clipped integer sum of a batch may use at most this much of int32's range; the rest is
# for the noise (at most 13.3 sigma <= 2**20 on a table) with room to spare.
SUM_LIMIT = 1 << 30

# The clip norm and the grid scale of a grid function: finite Python numbers > 0.
_POSITIVE_FINITE = {"low": 0.0, "low_inclusive": False, "allow_inf": False}


def check_grid_scale(fn: str, grid_scale: Any) -> float:
    """``grid_scale`` as a Python float, a power of two (so scaling by it is exact in floating point)."""
    if grid_scale is None:
        raise TypeError(f"{fn}: missing the required argument `grid_scale`")
    g = check_number(fn, "grid_scale", grid_scale, **_POSITIVE_FINITE)
    if math.frexp(g)[0] != 0.5:
        raise ValueError(
            f"{fn}: `grid_scale` must be a power of two (scaling by it is then exact, so the rounded "
            f"vector's norm bound holds exactly), got {g!r}; e.g. {2.0 ** round(math.log2(g))!r}"
        )
    return g


def grid_sensitivity(
    l2_clip_norm: float | None = None,
    grid_scale: float | None = None,
    neighboring: str = "add_remove",
    *,
    l2_norm_clip: float | None = None,
) -> float:
    """The L2 sensitivity of :func:`grid_clipped_sum` on the grid: :math:`\\gamma C` (replace-one: :math:`2\\gamma C`).

    ``neighboring`` is any relation :func:`gradclip_jax.clipped_grad`'s ``sensitivity`` takes
    (``'add_remove'``, ``'replace'``, ...).

    Truncation toward zero never grows a coordinate's magnitude, and scaling by a power of two
    is exact, so each example's integer vector :math:`r_i = \\operatorname{trunc}(\\gamma c_i)`
    has :math:`\\|r_i\\|_2 \\le \\gamma \\|c_i\\|_2 \\le \\gamma C` exactly, with no rounding
    slack: unlike randomized rounding, whose norm bound grows with the dimension :math:`d`
    (any rounding: :math:`\\gamma C + \\sqrt d`; Kairouz et al. 2021, "The Distributed Discrete
    Gaussian Mechanism", conditional randomized rounding: :math:`\\sqrt{\\gamma^2C^2 + d/4 +
    \\sqrt{2\\log(1/\\beta)}(\\gamma C + \\sqrt d/2)}`, retried until it holds). The price is a bias toward zero of less than :math:`1/\\gamma` per coordinate and
    example. ``l2_norm_clip`` (optax's spelling) is accepted for ``l2_clip_norm``.
    """
    fn = "grid_sensitivity"
    c = clip_norm_arg(fn, l2_clip_norm, l2_norm_clip, **_POSITIVE_FINITE)
    g = check_grid_scale(fn, grid_scale)
    return sensitivity_factor(neighboring, fn) * g * c


def grid_noise_multiplier(
    sigma: float,
    l2_clip_norm: float | None = None,
    grid_scale: float | None = None,
    neighboring: str = "add_remove",
    *,
    l2_norm_clip: float | None = None,
) -> float:
    """The noise multiplier the accountant records for discrete noise ``sigma`` on the grid: :math:`\\sigma / \\Delta`,
    :math:`\\Delta` = :func:`grid_sensitivity` (RDP of the discrete Gaussian is at most the Gaussian's at it).
    ``l2_norm_clip`` (optax's spelling) is accepted for ``l2_clip_norm``.

    Example:
      >>> from gradclip_jax.dp.hardened import grid_noise_multiplier
      >>> grid_noise_multiplier(1100.0, 1.0, 1024.0)
      1.07421875
    """
    s = check_sigma("grid_noise_multiplier", sigma)
    c = clip_norm_arg("grid_noise_multiplier", l2_clip_norm, l2_norm_clip, **_POSITIVE_FINITE)
    return s / grid_sensitivity(c, grid_scale, neighboring)


def grid_clipped_sum(
    per_example_grads: Any,
    l2_clip_norm: float | None = None,
    grid_scale: float | None = None,
    *,
    mask: Any = None,
    nan_safe: bool = True,
    with_norms: bool = False,
    l2_norm_clip: float | None = None,
) -> Any:
    """The exact int32 sum of the clipped per-example gradients on the grid of step :math:`1/\\gamma`.

    .. math:: S = \\sum_{i:\\ \\text{mask}_i} \\operatorname{trunc}\\Big(\\gamma\\, g_i
        \\min\\big(1, \\tfrac{C}{\\|g_i\\|_2}\\big)\\Big) \\in \\mathbb{Z}^d

    The clip is the norm engine's (the clipped vector, formed in float32 at least, has norm at
    most :math:`C`, rounding included), :math:`\\gamma` is a power of two, and truncation toward
    zero: :math:`\\|r_i\\|_2 \\le \\gamma C` exactly (:func:`grid_sensitivity`). The sum is in
    int32, exact and independent of the order of summation.

    Args:
      per_example_grads: a pytree of floating-point arrays, the batch on axis 0.
      l2_clip_norm: :math:`C > 0` (a Python number: it sizes the overflow check).
      grid_scale: :math:`\\gamma`, a power of two: the grid's step is :math:`1/\\gamma`.
        :math:`\\gamma C` is each example's largest integer norm; :math:`B \\gamma C \\le 2^{30}`
        is required (no int32 overflow, with room for the noise).
      mask: ``None`` or a bool ``(B,)`` array of the real examples (padding contributes 0).
      nan_safe: an example with a non-finite gradient contributes 0 (default True).
      with_norms: also return the per-example norms before clipping (not private).
      l2_norm_clip: ``l2_clip_norm`` under optax's spelling (give one of the two).

    Returns:
      The int32 tree of sums (each leaf shaped like a leaf without its batch axis); with
      ``with_norms``, ``(sums, norms)`` with the ``(B,)`` norms (0 for masked examples).

    Raises:
      ValueError: naming ``grid_scale`` (not a power of two, or :math:`B\\gamma C > 2^{30}`),
        ``l2_clip_norm`` or ``mask``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.dp.hardened import grid_clipped_sum
      >>> grid_clipped_sum({'w': jnp.array([[3.0, 4.0], [0.3, 0.4]])}, 1.0, 256.0)['w']
      Array([229, 306], dtype=int32)
    """
    fn = "grid_clipped_sum"
    c = clip_norm_arg(fn, l2_clip_norm, l2_norm_clip, **_POSITIVE_FINITE)
    g = check_grid_scale(fn, grid_scale)
    flat, batch = batch_flatten(per_example_grads, fn)
    if batch is None:
        return (per_example_grads, jnp.zeros((0,))) if with_norms else per_example_grads
    if batch * g * c > SUM_LIMIT:
        raise ValueError(
            f"{fn}: `grid_scale`={g:g} is too fine for a batch of {batch} at clip norm {c:g}: the integer "
            f"sum could reach {batch * g * c:.3g} > 2**30 (int32, with room for the noise); use "
            f"grid_scale <= {2.0 ** math.floor(math.log2(SUM_LIMIT / (batch * c)))!r}"
        )
    valid = check_mask(fn, mask, batch)
    rows = [as_rows(x.astype(_norms.sum_dtype(x.dtype))) for x in flat.arrays]
    _, w = clip_and_sum(
        rows, c, valid=valid, nan_safe=nan_safe
    )  # its float sums go unused (dead code)
    keep = jnp.ones((batch,), bool) if w.keep is None else w.keep
    sums = [
        _integer_rows(r, f, keep, g).sum(axis=0, dtype=jnp.int32)
        for r, f in zip(rows, w.factors, strict=True)
    ]
    out = flat.rebuild(unrow(sums, flat.arrays))
    return (out, w.norms) if with_norms else out


def _integer_rows(
    rows: jax.Array, factors: jax.Array, keep: jax.Array, grid_scale: float
) -> jax.Array:
    """``trunc(grid_scale * factor_i * row_i)`` as int32, 0 for a dropped row (a NaN row times 0 is NaN)."""
    clipped = rows * factors[:, None].astype(rows.dtype)
    scaled = clipped * jnp.asarray(grid_scale, rows.dtype)  # a power of two: exact
    return jnp.where(keep[:, None], jnp.trunc(jnp.where(keep[:, None], scaled, 0)), 0).astype(
        jnp.int32
    )


def add_discrete_gaussian_noise(
    tree: Any, sigma: float, key: jax.Array, *, constant_time: bool = False
) -> Any:
    """Adds independent :math:`\\mathcal{N}_{\\mathbb{Z}}(0, \\sigma^2)` draws (:func:`discrete_gaussian`) to an integer tree.

    Leaf ``i`` gets ``discrete_gaussian(k{i+1}, leaf.shape, sigma)`` with
    ``k0, ..., kn = jax.random.split(key, n + 1)``; the sum stays int32 and exact.

    Args:
      tree: a pytree of int32 arrays (e.g. from :func:`grid_clipped_sum`).
      sigma: :math:`\\sigma` on the grid, a Python number in :math:`[0, 2^{16}]`: for noise
        multiplier :math:`z`, ``z * grid_sensitivity(C, grid_scale)``.
      key: a ``jax.random`` key (in a hardened run, from :func:`os_key`).
      constant_time: :func:`discrete_gaussian`'s (the draw's time independent of the values drawn).

    Returns:
      The noised int32 tree.

    Raises:
      TypeError: naming ``tree`` for a leaf that is not int32.
      ValueError: naming ``sigma`` outside :math:`[0, 2^{16}]`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.dp.hardened import add_discrete_gaussian_noise
      >>> add_discrete_gaussian_noise({'w': jnp.zeros(3, jnp.int32)}, 4.0, jax.random.key(0))['w'].dtype
      dtype('int32')
    """
    fn = "add_discrete_gaussian_noise"
    s = check_sigma(fn, sigma)
    leaves, treedef = jax.tree.flatten(tree)
    for x in leaves:
        if jnp.asarray(x).dtype != jnp.int32:
            raise TypeError(
                f"{fn}: every leaf of `tree` must be int32 (an integer sum on the grid), "
                f"got {jnp.asarray(x).dtype}"
            )
    if not leaves:
        return tree
    check_key_varies(fn, leaves, key)
    _, *keys = split_stored(key, len(leaves) + 1)
    noised = [
        x + discrete_gaussian(k, x.shape, s, constant_time=constant_time)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, noised)


def from_grid(tree: Any, grid_scale: float, divisor: Any = 1.0) -> Any:
    """The integer tree back as float32 values: ``x / (grid_scale * divisor)`` (post-processing).

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.dp.hardened import from_grid
      >>> from_grid({'w': jnp.array([256, -128], jnp.int32)}, 256.0)['w']
      Array([ 1. , -0.5], dtype=float32)
    """
    g = check_grid_scale("from_grid", grid_scale)
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) / (jnp.float32(g) * jnp.asarray(divisor, jnp.float32)), tree
    )
