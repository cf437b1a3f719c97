"""Clip and normalization factors from norms, and their application to leaves and trees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.norms import DimLike, OrdLike
from gradclip_jax._core.numerics import bounded_factor, bounded_factors
from gradclip_jax._core.stored import certified_factors, stored_scale
from gradclip_jax._core.validation import is_int, static_value


def scale_leaf(x: jax.Array, factor: jax.Array, settled: jax.Array | None = None) -> jax.Array:
    """``x * factor`` computed in ``x``'s accumulation dtype, rounded once to x's dtype.

    A factor below 1 is first lowered by the rounding margin of x's dtype
    (:func:`gradclip_jax._core.numerics.bounded_factor`), so the stored result never
    exceeds the bound because of rounding; ``settled`` (from
    :func:`gradclip_jax._core.stored.certified_factors`, which lowers only where the
    stored result would exceed the bound) replaces that lowered factor.
    """
    f = factor.astype(_norms.acc_dtype(x.dtype))
    return stored_scale(
        x, bounded_factor(f, x.dtype) if settled is None else settled.astype(f.dtype)
    )


def scale_leaves(
    arrays: Sequence[jax.Array],
    factors: Sequence[jax.Array],
    settled: Sequence[jax.Array | None] | None = None,
) -> list[jax.Array]:
    """:func:`scale_leaf` of each array by its factor; a factor several arrays share (a global
    clip's) is lowered by the margin once per dtype, not once per array (see
    :func:`~gradclip_jax._core.numerics.bounded_factors`)."""
    settled = [None] * len(arrays) if settled is None else settled
    todo = [i for i, s in enumerate(settled) if s is None]
    accs = [factors[i].astype(_norms.acc_dtype(arrays[i].dtype)) for i in todo]
    given = dict(zip(todo, bounded_factors(accs, [arrays[i].dtype for i in todo]), strict=True))
    return [
        scale_leaf(x, f, given.get(i, s))
        for i, (x, f, s) in enumerate(zip(arrays, factors, settled, strict=True))
    ]


def _settled(
    arrays: Sequence[jax.Array],
    factors: Sequence[jax.Array],
    axes: Sequence[tuple[int, ...]],
    bound: Any,
    spec: _norms.NormSpec,
    combine: bool,
    axis_name: Any,
) -> list[Any]:
    """The exactly checked factors of :func:`rescale_tree` (``None`` each: the margin).

    Checked for a 2-norm or rms bound whose leaves are all here (not split across devices)."""
    sumsq = spec.kind == "rms" or (spec.kind == "pow" and spec.p == 2.0)
    if bound is None or not sumsq or axis_name is not None:
        return [None] * len(arrays)
    accs = [f.astype(_norms.acc_dtype(x.dtype)) for x, f in zip(arrays, factors, strict=True)]
    return certified_factors(arrays, accs, axes, bound, combine=combine, rms=spec.kind == "rms")


@jax.custom_jvp
def _ratio(b: jax.Array, n: jax.Array) -> jax.Array:
    """``b / n`` whose derivative stays finite for tiny (or huge) ``n``.

    The tangent is written as ``(t_b - f * t_n) / n`` with ``f = b / n``: linear in
    the tangents, so reverse mode transposes it to *divide the cotangent by n
    first*. The textbook ``-b t_n / n**2`` would square a 1e-30 norm to 0 (or a
    1e20 norm to inf) in float32 and turn a finite gradient into NaN.
    """
    return b / n


@_ratio.defjvp
def _ratio_jvp(primals: tuple, tangents: tuple) -> tuple:
    b, n = primals
    tb, tn = tangents
    f = b / n
    return f, tb / n - (f * tn) / n


def clip_factor(norm: jax.Array, max_norm: Any = None, min_norm: Any = None) -> jax.Array:
    """The factor that brings ``norm`` into ``[min_norm, max_norm]``.

    ``max_norm / norm`` when ``norm > max_norm``, ``min_norm / norm`` when
    ``0 < norm < min_norm``, else exactly 1. A zero, negative or non-finite norm
    gives 1: there is nothing meaningful to rescale, and non-finite inputs stay
    visible instead of being zeroed (for a norm of finite elements that
    overflowed, callers use :func:`overflow_safe`). An infinite bound never clips; a NaN or
    negative bound gives a NaN factor (never a sign flip, never "no clipping").
    Each branch has its own safe operands, so derivatives are finite everywhere,
    also for norms of 1e-30 or 1e30 and for infinite bounds.
    """
    ok = jnp.isfinite(norm) & (norm > 0)
    factor = jnp.ones_like(norm)
    one = jnp.ones_like(norm)
    for bound, pick in ((max_norm, lambda b: norm > b), (min_norm, lambda b: norm < b)):
        if bound is None:
            continue
        b = jnp.asarray(bound, norm.dtype)
        # an infinite or NaN bound never selects; both operands get the safe value
        # outside the selected branch so its derivative cannot be inf * 0
        sel = ok & jnp.isfinite(b) & pick(b)
        factor = jnp.where(sel, _ratio(jnp.where(sel, b, one), jnp.where(sel, norm, one)), factor)
        factor = jnp.where(jnp.isnan(b) | (b < 0), jnp.full_like(factor, jnp.nan), factor)
    return factor


def overflow_safe(factor_fn: Any, norm: jax.Array, overflowed: jax.Array) -> jax.Array:
    """``factor_fn(norm)``, and 0 where the norm ``overflowed`` (finite elements, a norm past
    the dtype's range, reported ``inf``) and would be scaled down: ``c / inf``.

    A non-finite norm gets a factor of 1 (:func:`clip_factor`), so that an infinite
    or NaN element stays visible; a norm that overflowed would then pass finite
    elements up to 38 orders of magnitude above the bound, unclipped. Its factor is
    what ``factor_fn`` gives the largest finite norm: 0 where that is below 1
    (``c / inf``, as optax's and torch's clipping give, and as XLA already gives a
    norm above about ``8.5e37 * c`` by flushing its subnormal factor ``c / norm``
    to 0), else that factor (1 for an infinite bound, NaN for an invalid one).

    Example:
      >>> import functools, jax.numpy as jnp
      >>> f = functools.partial(clip_factor, max_norm=1.0)
      >>> overflow_safe(f, jnp.array([jnp.inf, jnp.inf]), jnp.array([True, False]))
      Array([0., 1.], dtype=float32)
    """
    big = jnp.asarray(jnp.finfo(norm.dtype).max, norm.dtype)
    factor = factor_fn(jnp.where(overflowed, big, norm))
    return jnp.where(overflowed & (factor < 1), jnp.zeros_like(factor), factor)


def normalize_factor(norm: jax.Array, norm_value: Any) -> jax.Array:
    """``norm_value / norm`` for a positive finite norm, else exactly 1 (NaN for a NaN or negative target)."""
    ok = jnp.isfinite(norm) & (norm > 0)
    target = jnp.asarray(norm_value, norm.dtype)
    f = jnp.where(ok, _ratio(target, jnp.where(ok, norm, jnp.ones_like(norm))), jnp.ones_like(norm))
    return jnp.where(jnp.isnan(target) | (target < 0), jnp.full_like(f, jnp.nan), f)


def rescale_tree(
    tree: Any,
    factor_fn: Any,
    *,
    fn: str,
    ord: OrdLike | _norms.NormSpec = 2,  # noqa: A002
    dim: DimLike = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    axis_name: Any = None,
    norm_dtype: Any = None,
    bound: Any = None,
) -> tuple[Any, Any, Any]:
    """Measures ``tree`` with the norm engine and rescales each slice.

    Args:
      tree: the updates.
      factor_fn: ``norm -> factor`` (broadcasting), e.g. a partial of
        :func:`clip_factor`.
      fn: the public name, for error messages.
      ord, dim, inverse_dims, min_size: as in :func:`clip_by_norm` (already
        validated).
      axis_name: for ``dim='global'`` under ``shard_map``/``pmap``.
      norm_dtype: dtype of the reported norms (the state's), if fixed.
      bound: the norm the result must not exceed (the clip norm), if any. For
        2-norms and ``'rms'`` a factor below 1 is then kept as it is wherever the
        values it stores provably satisfy the bound (:func:`gradclip_jax._core.stored.certified_factors`,
        exact arithmetic), and lowered by the rounding margin only where they do
        not; without a bound (or for other norms) it is always lowered.

    Returns:
      ``(new_tree, norms, clipped)``: ``norms`` is a scalar for ``dim='global'``
      and otherwise a tree of per-slice norms with the reduced axes removed
      (``None`` for leaves left unchanged); ``clipped`` says whether some factor
      was below 1 (a scalar, or one bool per leaf).
    """
    spec = _norms.parse_ord(ord, fn)
    flat = _norms.flatten(tree, fn)
    _norms.check_complex(fn, flat, spec)
    arrays = flat.arrays
    if dim == "global":
        norm, overflowed = _norms.global_norm_and_overflow(arrays, spec, axis_name, norm_dtype)
        factor = overflow_safe(factor_fn, norm, overflowed)
        settled = _settled(
            arrays,
            [factor] * len(arrays),
            [tuple(range(x.ndim)) for x in arrays],
            bound,
            spec,
            True,
            axis_name,
        )
        out = flat.rebuild(scale_leaves(arrays, [factor] * len(arrays), settled))
        return out, norm, factor < 1
    _norms.check_axes_exist(fn, [x.shape for x in arrays], dim)
    todo, axes = [], []
    for pos, x in enumerate(arrays):
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax is not None:
            todo.append(pos)
            axes.append(ax)
    measured = _norms.slice_norms(
        [arrays[p] for p in todo],
        axes,
        spec,
        then=lambda n, overflowed: overflow_safe(factor_fn, n, overflowed),
    )
    oks = _settled(
        [arrays[p] for p in todo], [f for _, f in measured], axes, bound, spec, False, axis_name
    )
    new = list(arrays)
    reported: list[Any] = [None] * len(arrays)
    clipped: list[Any] = [None] * len(arrays)
    for pos, ax, (n, factor), ok in zip(todo, axes, measured, oks):
        new[pos] = scale_leaf(arrays[pos], factor, ok)
        nrm = jnp.squeeze(n, axis=ax)
        reported[pos] = nrm if norm_dtype is None else nrm.astype(norm_dtype)
        clipped[pos] = jnp.any(factor < 1)
    return flat.rebuild(new), flat.rebuild(reported, fill=None), flat.rebuild(clipped, fill=None)


def norm_template(
    params: Any, fn: str, dim: DimLike, inverse_dims: bool, min_size: int, flags: bool = False
) -> Any:
    """Zeros shaped like the norms :func:`rescale_tree` reports for ``params``.

    With ``flags``: ``False`` in place of each norm array (the ``clipped`` field).
    """
    leaves = jax.tree_util.tree_leaves(params)
    dtype = _norms.tree_acc_dtype(leaves)
    if dim == "global":
        return jnp.zeros((), bool) if flags else jnp.zeros((), dtype)

    def one(x: Any) -> Any:
        shape = norm_shape(x, dim, inverse_dims, min_size)
        if shape is None:
            return None
        if flags:
            return jnp.zeros((), bool)
        x = jnp.asarray(x)
        return jnp.zeros(shape, _norms.acc_dtype(x.dtype) if is_float(x) else dtype)

    return jax.tree_util.tree_map(one, params)


def norm_shape(x: Any, dim: DimLike, inverse_dims: bool, min_size: int) -> tuple[int, ...] | None:
    """The shape of the per-slice norms :func:`rescale_tree` reports for leaf ``x`` (``None``: not measured)."""
    if getattr(x, "dtype", None) == jax.dtypes.float0:
        return None
    shape = tuple(np.shape(x))
    ax = _norms.reduction_axes(shape, dim, inverse_dims, min_size)
    if ax is None:
        return None
    return tuple(s for i, s in enumerate(shape) if i not in ax)


def is_float(x: Any) -> bool:
    dtype = np.dtype(x.dtype)
    return bool(np.issubdtype(dtype, np.inexact) or dtype == jnp.bfloat16)


def validate_shape_args(fn: str, ord: Any, dim: Any, inverse_dims: Any, min_size: Any) -> tuple:  # noqa: A002
    spec = _norms.parse_ord(ord, fn)
    inv = static_value(fn, "inverse_dims", inverse_dims)
    if not isinstance(inv, (bool, np.bool_)):
        raise TypeError(f"{fn}: `inverse_dims` must be a bool, got {type(inv).__name__} {inv!r}")
    d = _norms.check_dim(fn, dim, bool(inv))
    ms = static_value(fn, "min_size", min_size)
    if not is_int(ms):
        raise TypeError(
            f"{fn}: `min_size` must be a non-negative int, got {type(ms).__name__} {ms!r}"
        )
    if ms < 0:
        raise ValueError(f"{fn}: `min_size` must be a non-negative int, got {ms!r}")
    return spec, d, bool(inv), int(ms)


def tree_dtype(tree: Any) -> np.dtype:
    """The accumulation dtype of a tree's floating-point leaves (hyperparameters resolve in it)."""
    return _norms.tree_acc_dtype(jax.tree_util.tree_leaves(tree))


def state_dtype(norm_state: Any) -> Any:
    """The dtype of a global (scalar) norm state, or None for per-leaf trees."""
    if isinstance(norm_state, jax.Array) and norm_state.ndim == 0:
        return norm_state.dtype
    return None


def like_state(new: Any, template: Any) -> Any:
    """Casts reported norms to the dtypes fixed at ``init`` (scan-safe state)."""
    if isinstance(template, jax.Array) or template is None:
        return new if template is None else new.astype(template.dtype)
    return jax.tree_util.tree_map(lambda n, t: n.astype(t.dtype), new, template)
