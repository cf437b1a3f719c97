""":func:`clip_pytree`: a pytree clipped to a global L2 norm, jax-privacy's scale kept where an
exact check proves that the stored output is within the bound, else lowered just enough."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import clip_factor
from gradclip_jax._core.numerics import (
    bounded_factor,
    divide_or_zero,
    lowest_precision,
    rounding_margin,
)
from gradclip_jax._core.stored import certified_factors, stored_scale
from gradclip_jax._core.validation import check_scalar, static_value
from gradclip_jax.interop.jax_privacy import _version
from gradclip_jax.interop.jax_privacy._clip_norms import (
    PyTree,
    clip_norm_leaves,
    is_per_layer,
    per_group,
)


def _finite_or_zero(x: Any) -> Any:
    return jnp.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _scale_factor(norm: jax.Array, clip_norm: Any, rescale: bool) -> jax.Array:
    """jax-privacy's scale (its edge-case table), before the stored bound is checked."""
    # a negative (traced) clip norm zeroes the output, as in jax-privacy
    c = jnp.maximum(jnp.asarray(clip_norm, norm.dtype), 0.0)
    f = clip_factor(norm, c)  # min(1, c / n), exactly 1 at a zero norm, finite derivatives
    if rescale:  # c = 0: the limit c -> 0, x / |x|
        f = jnp.where(c > 0, f / jnp.where(c > 0, c, 1.0), divide_or_zero(1.0, norm))
    # a NaN or inf norm (nan_safe=False), or a NaN clip norm: scale 0, as jax-privacy
    f = jnp.where(jnp.isfinite(norm), f, 0.0)
    return jnp.nan_to_num(f, nan=0.0, posinf=0.0)


def _stored_factors(
    leaves: list[jax.Array], f: jax.Array, bound: Any, rescale: bool, norm: jax.Array
) -> list[jax.Array]:
    """Each leaf's factor to store with: ``f`` itself where the stored tree provably has norm
    ``<= bound`` (:func:`gradclip_jax._core.stored.certified_factors`, exact arithmetic), else ``f``
    lowered by the measured excess, else by the rounding margin.

    A factor ``f >= 1``, which ``certified_factors`` reads as "not clipped" and leaves
    unchecked, is checked as ``g = f / 2**e < 1`` on the leaves times ``2**e``, which stores the
    same values (a power of two scales exactly, and the scaled leaves, about the bound's size,
    cannot overflow): with ``rescale`` always (the output ``x / C`` of a tree just below ``C``
    lands on the unit bound), without it where the measured norm is within the rounding margin
    of the bound. There a tree left as it is can exceed it: ``[4096, 1, ..., 1]`` (16 ones)
    measures 4096 in float32, its exact norm is 4096.002. Further below, it is stored as it is.

    A tree with a 16-bit leaf takes the margin (:func:`gradclip_jax._core.numerics.bounded_factor`)
    and no exact check: such a tree's norm is commonly measured in 16-bit arithmetic
    (``optax.global_norm``, jax-privacy's own tests), whose rounding (``2**-11`` relative in
    float16) exceeds the few units of float32 the check saves, and the margin keeps that
    measurement within the bound too.
    """
    near = norm > bound * jnp.asarray(
        rounding_margin(lowest_precision(x.dtype for x in leaves), norm.dtype), norm.dtype
    )
    _, exp = jnp.frexp(lax.stop_gradient(f))  # f = m 2**exp, m in [0.5, 1)
    e = jnp.where((f >= 1) & (rescale | near), exp, 0)
    up = jnp.ldexp(jnp.ones((), f.dtype), e)
    g = f / up  # exact: a power of two
    if any(jnp.finfo(x.dtype).bits < 32 for x in leaves):
        return [bounded_factor(g, x.dtype) * up for x in leaves]
    # scaled in the product's dtype, stored in the leaf's
    arrays = [x.astype(jnp.promote_types(x.dtype, f.dtype)) * up for x in leaves]
    factors = certified_factors(
        arrays,
        [g] * len(arrays),
        [tuple(range(x.ndim)) for x in arrays],
        bound,
        combine=True,
        stores=[x.dtype for x in leaves],
    )
    return [fa * up for fa in factors]


def clip_pytree(
    pytree: PyTree,
    clip_norm: float | PyTree,
    rescale_to_unit_norm: bool = False,
    nan_safe: bool | None = None,
    return_zero: bool = False,
) -> tuple[PyTree, Any]:
    """Clips a pytree to global L2 norm ``clip_norm``: ``jax_privacy.clipping.clip_pytree``.

    ``clip_norm`` may also be a pytree that is a prefix of ``pytree`` (per-layer
    clipping, jax-privacy's current source): each subtree that one of its clip norms
    covers is clipped as a whole tree to that norm (rescaled by it), and the norms
    come back as a tree of ``clip_norm``'s structure.

    The norm comes from :func:`gradclip_jax.tree_norm` (float32 accumulation for
    16-bit leaves, no overflow for finite elements). The output's norm, as stored and
    measured exactly, is at most the bound (``clip_norm``, or 1 with
    ``rescale_to_unit_norm``): jax-privacy's scale is kept where the exact check of
    :func:`gradclip_jax._core.stored.certified_factors` proves that, else lowered by the
    measured excess, else by a few units in the last place (always so for a tree
    with 16-bit leaves).

    ======================= ==================== =================================
    Case                    rescale_to_unit_norm Output
    ======================= ==================== =================================
    clip_norm = 0           False                Zero
    clip_norm = 0           True                 Input / norm
    clip_norm = inf         False                Unchanged
    clip_norm = inf         True                 Zero
    clip_norm < 0 (static)  -                    Raises ValueError
    clip_norm < 0 (traced)  -                    Zero
    pytree norm = 0         -                    Unchanged
    ======================= ==================== =================================

    Args:
      pytree: a pytree of floating-point arrays.
      clip_norm: the largest L2 norm of the output (a number or traced scalar), or
        a pytree of them, a prefix of ``pytree`` (per-layer clipping).
      rescale_to_unit_norm: also divide by ``clip_norm`` (output norm at most 1).
        A Python bool.
      nan_safe: set NaN and +-inf elements to 0 first (the bound then holds for any
        input). With False, NaNs stay and infs become NaN, and the norm is not
        finite. A Python bool; None (default): the installed jax-privacy's
        behaviour, True for 2.0.0, False for a later one (which has no such step).
      return_zero: return zeros of the same structure (a bool, traced too), as
        jax-privacy does for padding examples.

    Returns:
      ``(clipped, norm)``: the clipped pytree (same structure and dtypes) and the
      float32 L2 norm of the input (after ``nan_safe``); per-layer, a tree of the
      subtrees' norms.

    Raises:
      ValueError: a negative or NaN static ``clip_norm`` (naming the leaf of a tree),
        a ``clip_norm`` tree that is not a prefix of ``pytree``.
      TypeError: a ``clip_norm`` that is not a number, a traced
        ``rescale_to_unit_norm`` or ``nan_safe``, integer leaves.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.interop.jax_privacy import clip_pytree
      >>> clipped, norm = clip_pytree({'a': jnp.array([3.0]), 'b': jnp.array([4.0])}, 1.0)
      >>> norm
      Array(5., dtype=float32)
      >>> clipped['a'] <= 0.6, clipped['b'] <= 0.8
      (Array([ True], dtype=bool), Array([ True], dtype=bool))
    """
    fn = "clip_pytree"
    if nan_safe is None:
        nan_safe = not _version.AFTER_2_0_0
    if is_per_layer(clip_norm):
        return clip_per_layer(pytree, clip_norm, rescale_to_unit_norm, nan_safe, return_zero)
    check_scalar(fn, "clip_norm", clip_norm)
    rescale = bool(static_value(fn, "rescale_to_unit_norm", rescale_to_unit_norm))
    if static_value(fn, "nan_safe", nan_safe):
        pytree = jax.tree.map(_finite_or_zero, pytree)
    flat = _norms.flatten(pytree, fn)
    leaves = flat.arrays
    norm = _norms.global_norm(leaves, _norms.parse_ord(2))
    f = _scale_factor(norm, clip_norm, rescale)
    bound = 1.0 if rescale else jnp.maximum(jnp.asarray(clip_norm, norm.dtype), 0.0)
    factors = _stored_factors(leaves, f, bound, rescale, norm)
    out = [
        jnp.where(return_zero, jnp.zeros_like(x), stored_scale(x, fx))
        for x, fx in zip(leaves, factors, strict=True)
    ]
    return flat.rebuild(out), norm.astype(jnp.float32)


def clip_per_layer(
    pytree: PyTree,
    clip_norm: PyTree,
    rescale: Any,
    nan_safe: Any,
    return_zero: Any,
    *,
    fn: str = "clip_pytree",
    name: str = "clip_norm",
) -> tuple[PyTree, PyTree]:
    """:func:`clip_pytree` of each subtree of ``pytree`` that a clip norm of the tree ``clip_norm``
    covers; the clipped subtrees and their norms put back in ``clip_norm``'s structure. Errors name
    ``fn`` and the argument ``name``."""
    clip_norm_leaves(fn, name, clip_norm)
    parts = per_group(
        fn,
        name,
        clip_norm,
        pytree,
        lambda sub, c: clip_pytree(sub, c, rescale, nan_safe, return_zero),
    )
    c_def = jax.tree_util.tree_structure(clip_norm)
    # the clip tree with each clip norm replaced by its clipped subtree is pytree's structure again
    clipped = jax.tree_util.tree_unflatten(c_def, [out for out, _ in parts])
    return clipped, jax.tree_util.tree_unflatten(c_def, [norm for _, norm in parts])
