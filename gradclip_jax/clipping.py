"""Stateless clipping and normalization transforms.

Each factory returns an :class:`optax.GradientTransformation`. The states are
small ``NamedTuple``s of fixed structure: a step ``count`` (used when a
hyperparameter is a schedule) and, for norm-based transforms, the pre-clip
``norm`` they measured, so ``optax.tree_utils.tree_get(state, 'norm')`` logs it.

House rules shared by every transform here:

* a slice whose norm is ``<= 0`` (or not finite) is left unchanged: no NaN, no
  epsilon; clipping scales by exactly ``max_norm / norm`` when ``norm > max_norm``;
* outputs keep each leaf's dtype; the scale is applied in the leaf's accumulation
  dtype (float32 for 16-bit leaves) and rounded once;
* ``None``, :class:`optax.MaskedNode` and ``float0`` leaves pass through.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax import norms as _norms
from gradclip_jax.hyperparams import (
    Hyperparam,
    as_scalar,
    check_scalar,
    increment,
    mark_static,
    resolve,
    static_value,
)
from gradclip_jax.norms import DimLike, OrdLike

__all__ = [
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipByValueState",
    "ClipByBlockRmsState",
    "NormalizeState",
    "CentralizeState",
    "AdaptiveGradClipState",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip",
    "clip_by_block_rms",
    "normalize",
    "centralize",
    "adaptive_grad_clip",
]


# ----------------------------------------------------------------------------
# States
# ----------------------------------------------------------------------------


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      count: number of updates so far (int32); drives schedules.
      norm: the global norm of the last update before clipping (a scalar in the
        accumulation dtype, 0 before the first update).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: jax.Array


class ClipByNormState(NamedTuple):
    """State of :func:`clip_by_norm`.

    Attributes:
      count: number of updates so far (int32).
      norm: the pre-clip norms of the last update: a tree with one array of
        per-slice norms per leaf (``None`` for leaves left alone), or a scalar when
        ``dim='global'``.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any


class NormalizeState(NamedTuple):
    """State of :func:`normalize` (fields as in :class:`ClipByNormState`)."""

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any


class ClipByValueState(NamedTuple):
    """State of :func:`clip_by_value` / :func:`clip`.

    Attributes:
      count: number of updates so far (int32); drives a scheduled bound.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax


class ClipByBlockRmsState(NamedTuple):
    """State of :func:`clip_by_block_rms`.

    Attributes:
      count: number of updates so far (int32).
      norm: tree of each leaf's root-mean-square before clipping.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any


class CentralizeState(NamedTuple):
    """State of :func:`centralize` (it measures no norm)."""


class AdaptiveGradClipState(NamedTuple):
    """State of :func:`adaptive_grad_clip`.

    Attributes:
      count: number of updates so far (int32).
      norm: tree of per-unit gradient norms before clipping (one per output unit).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any


# ----------------------------------------------------------------------------
# Kernels (shared with the functional API)
# ----------------------------------------------------------------------------


def scale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x * factor`` computed in ``x``'s accumulation dtype, rounded once to x's dtype."""
    acc = _norms.acc_dtype(x.dtype)
    return (x * factor.astype(acc)).astype(x.dtype)


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
    visible instead of being zeroed. An infinite bound never clips. Each branch has
    its own safe operands, so derivatives are finite everywhere, also for norms of
    1e-30 or 1e30 and for infinite bounds.
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
    return factor


def normalize_factor(norm: jax.Array, norm_value: Any) -> jax.Array:
    """``norm_value / norm`` for a positive finite norm, else exactly 1."""
    ok = jnp.isfinite(norm) & (norm > 0)
    target = jnp.asarray(norm_value, norm.dtype)
    return jnp.where(ok, _ratio(target, jnp.where(ok, norm, jnp.ones_like(norm))), jnp.ones_like(norm))


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
) -> tuple[Any, Any]:
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

    Returns:
      ``(new_tree, norms)``: ``norms`` is a scalar for ``dim='global'`` and
      otherwise a tree of per-slice norms with the reduced axes removed (``None``
      for leaves left unchanged).
    """
    spec = _norms.parse_ord(ord, fn)
    flat = _norms.flatten(tree, fn)
    _norms.check_complex(flat, spec, fn)
    arrays = flat.arrays
    if dim == "global":
        norm = _norms.global_norm(arrays, spec, axis_name, dtype=norm_dtype)
        out = flat.rebuild([scale_leaf(x, factor_fn(norm)) for x in arrays])
        return out, norm
    todo, axes = [], []
    for pos, x in enumerate(arrays):
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax is not None:
            todo.append(pos)
            axes.append(ax)
    measured = _norms.slice_norms([arrays[p] for p in todo], axes, spec, then=factor_fn)
    new = list(arrays)
    reported: list[Any] = [None] * len(arrays)
    for pos, ax, (n, factor) in zip(todo, axes, measured):
        new[pos] = scale_leaf(arrays[pos], factor)
        nrm = jnp.squeeze(n, axis=ax)
        reported[pos] = nrm if norm_dtype is None else nrm.astype(norm_dtype)
    return flat.rebuild(new), flat.rebuild(reported, fill=None)


def _norm_template(params: Any, fn: str, dim: DimLike, inverse_dims: bool, min_size: int) -> Any:
    """Zeros shaped like the norms :func:`rescale_tree` reports for ``params``."""
    leaves = jax.tree_util.tree_leaves(params)
    dtype = _norms.tree_acc_dtype(leaves)
    if dim == "global":
        return jnp.zeros((), dtype)

    def one(x: Any) -> Any:
        if getattr(x, "dtype", None) == jax.dtypes.float0:
            return None
        x = jnp.asarray(x)
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax is None:
            return None
        shape = tuple(s for i, s in enumerate(x.shape) if i not in ax)
        return jnp.zeros(shape, _norms.acc_dtype(x.dtype) if _is_float(x) else dtype)

    return jax.tree_util.tree_map(one, params)


def _is_float(x: Any) -> bool:
    dtype = np.dtype(x.dtype)
    return bool(np.issubdtype(dtype, np.inexact) or dtype == jnp.bfloat16)


def _count0() -> jax.Array:
    return jnp.zeros([], jnp.int32)


def _validate_shape_args(fn: str, ord: Any, dim: Any, inverse_dims: Any, min_size: Any) -> tuple:  # noqa: A002
    spec = _norms.parse_ord(ord, fn)
    d = _norms.check_dim(dim, bool(static_value(fn, "inverse_dims", inverse_dims)), fn)
    ms = static_value(fn, "min_size", min_size)
    if isinstance(ms, bool) or not isinstance(ms, (int, np.integer)) or ms < 0:
        raise ValueError(f"{fn}: min_size must be a non-negative int, got {min_size!r}")
    return spec, d, bool(inverse_dims), int(ms)


# ----------------------------------------------------------------------------
# Transforms
# ----------------------------------------------------------------------------


@mark_static("ord", "axis_name")
def clip_by_global_norm(
    max_norm: Hyperparam,
    ord: OrdLike = 2,  # noqa: A002
    *,
    axis_name: Any = None,
) -> optax.GradientTransformation:
    """Clips the updates so their global norm is at most ``max_norm``.

    With :math:`n = \\|u\\|_{ord}` over all leaves,

    .. math:: u \\leftarrow u \\cdot \\begin{cases} \\text{max\\_norm} / n & n > \\text{max\\_norm} \\\\ 1 & \\text{otherwise} \\end{cases}

    A drop-in replacement for :func:`optax.clip_by_global_norm` that also records
    ``n`` in its state, never gives NaN at a zero norm (also with
    ``max_norm=0``), accumulates 16-bit norms in float32, does not overflow for
    large fp16/fp32 values, supports any ``ord`` and leaves sharded by hand.

    Args:
      max_norm: the bound (>= 0): a number, an array or a schedule ``step -> value``.
      ord: which norm (default 2); see :func:`gradclip_jax.norms.parse_ord`.
      axis_name: inside ``shard_map``/``pmap`` with leaves sharded by hand over this
        axis: partial norms are combined across it so every device uses the
        global norm. Leave ``None`` with ``jax.sharding`` (jit handles it).

    Returns:
      An :class:`optax.GradientTransformation` with state
      :class:`ClipByGlobalNormState`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import gradclip_jax as gcx
      >>> tx = optax.chain(gcx.clip_by_global_norm(1.0), optax.sgd(0.1))
      >>> params = {'w': jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({'w': jnp.array([3.0, 4.0])}, state, params)
      >>> [round(float(u), 6) for u in updates['w']]
      [-0.06, -0.08]
      >>> float(state[0].norm)
      5.0
    """
    fn = "clip_by_global_norm"
    spec = _norms.parse_ord(ord, fn)
    check_scalar(fn, "max_norm", max_norm)

    def init_fn(params: Any) -> ClipByGlobalNormState:
        dtype = _norms.tree_acc_dtype(jax.tree_util.tree_leaves(params))
        return ClipByGlobalNormState(count=_count0(), norm=jnp.zeros((), dtype))

    def update_fn(updates: Any, state: ClipByGlobalNormState, params: Any = None) -> tuple:
        del params
        bound = resolve(max_norm, state.count)
        out, norm = rescale_tree(
            updates,
            lambda n: clip_factor(n, as_scalar(bound, n.dtype)),
            fn=fn,
            ord=spec,
            dim="global",
            axis_name=axis_name,
            norm_dtype=state.norm.dtype,
        )
        return out, ClipByGlobalNormState(count=increment(state.count), norm=norm)

    return optax.GradientTransformation(init_fn, update_fn)


@mark_static("ord", "dim", "inverse_dims", "min_size")
def clip_by_norm(
    max_norm: Hyperparam | None,
    ord: OrdLike = 2,  # noqa: A002
    dim: DimLike = None,
    inverse_dims: bool = False,
    min_size: int = 1,
    min_norm: Hyperparam | None = None,
) -> optax.GradientTransformation:
    """Clips the norm of each leaf (or each slice of a leaf) to ``max_norm``.

    For each slice :math:`s` (a whole leaf by default) with norm :math:`n_s`:

    .. math:: s \\leftarrow s \\cdot \\begin{cases} \\text{max\\_norm}/n_s & n_s > \\text{max\\_norm} \\\\ \\text{min\\_norm}/n_s & 0 < n_s < \\text{min\\_norm} \\\\ 1 & \\text{otherwise} \\end{cases}

    This is torchzero's ``ClipNorm`` and declearn's ``L2Clipping`` without their
    quirks (``dim=None`` means each leaf's own axes, negative axes count from each
    leaf's end, a zero or tiny slice is left alone).

    Args:
      max_norm: upper bound (>= 0), a number, array or schedule; ``None`` for no
        upper bound (then ``min_norm`` is required).
      ord: which norm (default 2).
      dim: ``None`` (each whole leaf), an int or tuple of axes to reduce over, or
        ``'global'`` (one norm over all leaves, as :func:`clip_by_global_norm`).
      inverse_dims: reduce over every axis not in ``dim`` (``dim=0`` with
        ``inverse_dims=True`` clips each row of a matrix).
      min_size: slices with fewer elements are left unchanged.
      min_norm: optional lower bound: non-zero slices with a smaller norm are
        scaled *up* to it.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByNormState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip_by_norm(1.0, dim=1)  # clip each row of each matrix
      >>> out, state = tx.update({'w': jnp.array([[3.0, 4.0], [0.3, 0.4]])},
      ...                        tx.init({'w': jnp.zeros((2, 2))}))
      >>> out['w']
      Array([[0.6, 0.8],
             [0.3, 0.4]], dtype=float32)
      >>> state.norm['w']
      Array([5. , 0.5], dtype=float32)
    """
    fn = "clip_by_norm"
    spec, d, inv, ms = _validate_shape_args(fn, ord, dim, inverse_dims, min_size)
    if max_norm is None and min_norm is None:
        raise ValueError(f"{fn}: give max_norm, min_norm or both")
    check_scalar(fn, "max_norm", max_norm, allow_none=True)
    check_scalar(fn, "min_norm", min_norm, allow_none=True)
    _check_order(fn, min_norm, max_norm)

    def factor_at(count: jax.Array) -> Any:
        hi, lo = resolve(max_norm, count), resolve(min_norm, count)
        return lambda n: clip_factor(
            n,
            None if hi is None else as_scalar(hi, n.dtype),
            None if lo is None else as_scalar(lo, n.dtype),
        )

    return _slice_transform(fn, ClipByNormState, factor_at, spec, d, inv, ms)


def _slice_transform(
    fn: str, state_cls: Any, factor_at: Any, spec: _norms.NormSpec, dim: DimLike, inv: bool, ms: int
) -> optax.GradientTransformation:
    """A transform that rescales each slice by ``factor_at(count)(norm)``.

    The shared body of :func:`clip_by_norm` and :func:`normalize`: the state is
    ``state_cls(count, norm)`` with the per-slice (or global) norms it measured.
    """

    def init_fn(params: Any) -> Any:
        return state_cls(count=_count0(), norm=_norm_template(params, fn, dim, inv, ms))

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple:
        del params
        out, nrm = rescale_tree(
            updates,
            factor_at(state.count),
            fn=fn,
            ord=spec,
            dim=dim,
            inverse_dims=inv,
            min_size=ms,
            norm_dtype=_state_dtype(state.norm),
        )
        return out, state_cls(count=increment(state.count), norm=_like(nrm, state.norm))

    return optax.GradientTransformation(init_fn, update_fn)


def _check_order(fn: str, lo: Any, hi: Any) -> None:
    known = all(v is not None and not callable(v) and not isinstance(v, jax.core.Tracer) for v in (lo, hi))
    if known and float(np.asarray(lo)) > float(np.asarray(hi)):
        raise ValueError(f"{fn}: min_norm ({lo}) must not exceed max_norm ({hi})")


def _state_dtype(norm_state: Any) -> Any:
    """The dtype of a global (scalar) norm state, or None for per-leaf trees."""
    if isinstance(norm_state, jax.Array) and norm_state.ndim == 0:
        return norm_state.dtype
    return None


def _like(new: Any, template: Any) -> Any:
    """Casts reported norms to the dtypes fixed at ``init`` (scan-safe state)."""
    if isinstance(template, jax.Array) or template is None:
        return new if template is None else new.astype(template.dtype)
    try:
        return jax.tree_util.tree_map(lambda n, t: n.astype(t.dtype), new, template)
    except ValueError:
        return new  # structure differs from init (params and updates disagree)


@mark_static("ord", "dim", "inverse_dims", "min_size")
def normalize(
    norm_value: Hyperparam = 1.0,
    ord: OrdLike = 2,  # noqa: A002
    dim: DimLike = None,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> optax.GradientTransformation:
    """Rescales each leaf (or slice, or the whole tree) to norm ``norm_value``.

    .. math:: s \\leftarrow s \\cdot \\text{norm\\_value} / n_s \\quad (n_s > 0)

    A slice with norm 0 (or a non-finite norm) is left unchanged: no NaN, unlike
    ``optax.contrib.normalize`` and torchzero's global ``Normalize``.

    Args:
      norm_value: the target norm (>= 0), number, array or schedule.
      ord, dim, inverse_dims, min_size: as in :func:`clip_by_norm`.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`NormalizeState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.normalize(2.0, dim='global')
      >>> out, _ = tx.update([jnp.array([3.0]), jnp.array([4.0])], tx.init([jnp.zeros(1)] * 2))
      >>> [float(o[0]) for o in out]
      [1.2, 1.6]
    """
    fn = "normalize"
    spec, d, inv, ms = _validate_shape_args(fn, ord, dim, inverse_dims, min_size)
    check_scalar(fn, "norm_value", norm_value)

    def factor_at(count: jax.Array) -> Any:
        target = resolve(norm_value, count)
        return lambda n: normalize_factor(n, as_scalar(target, n.dtype))

    return _slice_transform(fn, NormalizeState, factor_at, spec, d, inv, ms)


def clip_value_tree(tree: Any, bound: Any, fn: str) -> Any:
    """Clamps every element to ``[-bound, bound]`` (complex: the magnitude).

    Integer leaves are clamped and keep their dtype; bool leaves raise ``TypeError``.
    NaN stays NaN.
    """

    def one(path: Any, x: Any) -> Any:
        if getattr(x, "dtype", None) == jax.dtypes.float0:
            return x
        x = jnp.asarray(x)
        if x.dtype == jnp.bool_:
            raise TypeError(f"{fn}: leaf {jax.tree_util.keystr(path)} is bool; cannot clip it")
        if jnp.iscomplexobj(x):
            acc = _norms.acc_dtype(x.dtype)
            b = jnp.asarray(bound, acc)
            mag = jnp.abs(x).astype(acc)
            factor = jnp.where(mag > b, b / jnp.where(mag > b, mag, 1), 1)
            return (x * factor).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.integer):
            b = jnp.floor(jnp.asarray(bound, jnp.float32))
            return jnp.clip(x.astype(jnp.float32), -b, b).astype(x.dtype)
        acc = _norms.acc_dtype(x.dtype)
        b = jnp.asarray(bound, acc)
        return jnp.clip(x.astype(acc), -b, b).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)


def clip_by_value(max_value: Hyperparam) -> optax.GradientTransformation:
    """Clips every element of the updates to ``[-max_value, max_value]``.

    Complex elements keep their phase and have their magnitude clipped. Integer
    leaves are clamped and keep their dtype. NaN elements stay NaN.

    Args:
      max_value: the bound (>= 0): number, array or schedule.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByValueState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip_by_value(1.0)
      >>> tx.update(jnp.array([-3.0, 0.5, 2.0]), tx.init(jnp.zeros(3)))[0]
      Array([-1. ,  0.5,  1. ], dtype=float32)
    """
    return _clip_value("clip_by_value", "max_value", max_value)


def clip(max_delta: Hyperparam) -> optax.GradientTransformation:
    """Alias of :func:`clip_by_value` with optax's argument name (``optax.clip``).

    Args:
      max_delta: the bound (>= 0): number, array or schedule.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByValueState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip(0.5)
      >>> tx.update(jnp.array([-3.0, 0.25]), tx.init(jnp.zeros(2)))[0]
      Array([-0.5 ,  0.25], dtype=float32)
    """
    return _clip_value("clip", "max_delta", max_delta)


def _clip_value(fn: str, name: str, bound: Hyperparam) -> optax.GradientTransformation:
    check_scalar(fn, name, bound)

    def init_fn(params: Any) -> ClipByValueState:
        del params
        return ClipByValueState(count=_count0())

    def update_fn(updates: Any, state: ClipByValueState, params: Any = None) -> tuple:
        del params
        b = resolve(bound, state.count)
        return clip_value_tree(updates, b, fn), ClipByValueState(count=increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def clip_by_block_rms(threshold: Hyperparam) -> optax.GradientTransformation:
    """Clips each leaf so its root mean square is at most ``threshold``.

    .. math:: u \\leftarrow u / \\max(1, \\mathrm{rms}(u) / \\text{threshold})

    The same result as :func:`optax.clip_by_block_rms`, without its NaN at
    ``threshold=0`` on zero updates, with float32 accumulation for 16-bit leaves,
    and with each leaf's RMS recorded in the state.

    Args:
      threshold: the bound on each leaf's RMS (>= 0): number, array or schedule.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByBlockRmsState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip_by_block_rms(1.0)
      >>> tx.update({'w': jnp.full(4, 2.0)}, tx.init({'w': jnp.zeros(4)}))[0]
      {'w': Array([1., 1., 1., 1.], dtype=float32)}
    """
    fn = "clip_by_block_rms"
    check_scalar(fn, "threshold", threshold)
    rms = _norms.parse_ord("rms", fn)

    def init_fn(params: Any) -> ClipByBlockRmsState:
        return ClipByBlockRmsState(count=_count0(), norm=_norm_template(params, fn, None, False, 1))

    def update_fn(updates: Any, state: ClipByBlockRmsState, params: Any = None) -> tuple:
        del params
        thr = resolve(threshold, state.count)
        out, nrm = rescale_tree(
            updates, lambda n: clip_factor(n, as_scalar(thr, n.dtype)), fn=fn, ord=rms
        )
        return out, ClipByBlockRmsState(count=increment(state.count), norm=_like(nrm, state.norm))

    return optax.GradientTransformation(init_fn, update_fn)


@mark_static("dim", "inverse_dims", "min_size")
def centralize(
    dim: DimLike = None, inverse_dims: bool = False, min_size: int = 2
) -> optax.GradientTransformation:
    """Gradient centralization: subtracts each slice's mean.

    .. math:: s \\leftarrow s - \\operatorname{mean}(s)

    With ``dim=None`` each whole leaf is centred; with ``dim='global'`` the mean of
    all elements of all leaves is subtracted from every leaf. The mean is taken in
    the accumulation dtype (float32 for 16-bit leaves) without overflow.

    Args:
      dim: ``None``, an int / tuple of axes, or ``'global'`` (see :func:`clip_by_norm`).
      inverse_dims: reduce over every axis not in ``dim`` (``dim=-1,
        inverse_dims=True`` centres each output unit of a dense kernel, as in Yong et
        al. 2020).
      min_size: slices with fewer elements are left alone (default 2: a single
        number is never centred to 0).

    Returns:
      An :class:`optax.GradientTransformation` (state :class:`CentralizeState`).

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.centralize()
      >>> tx.update(jnp.array([1.0, 2.0, 6.0]), tx.init(jnp.zeros(3)))[0]
      Array([-2., -1.,  3.], dtype=float32)
    """
    fn = "centralize"
    _, d, inv, ms = _validate_shape_args(fn, 2, dim, inverse_dims, min_size)

    def init_fn(params: Any) -> CentralizeState:
        del params
        return CentralizeState()

    def update_fn(updates: Any, state: CentralizeState, params: Any = None) -> tuple:
        del params
        return centralize_tree(updates, d, inv, ms, fn), state

    return optax.GradientTransformation(init_fn, update_fn)


def centralize_tree(tree: Any, dim: DimLike, inverse_dims: bool, min_size: int, fn: str) -> Any:
    """Subtracts the per-slice (or global) mean, using the engine's signed sums."""
    total = _norms.parse_ord("sum", fn)
    flat = _norms.flatten(tree, fn)
    arrays = flat.arrays
    if dim == "global":
        n = sum(int(np.prod(x.shape)) for x in arrays)
        if n == 0:
            return tree
        mean = _norms.global_norm(arrays, total) / n
        return flat.rebuild([_sub(x, mean) for x in arrays])
    todo, axes = [], []
    for pos, x in enumerate(arrays):
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax is not None:
            todo.append(pos)
            axes.append(ax)
    sums = _norms.slice_norms([arrays[p] for p in todo], axes, total)
    new = list(arrays)
    for pos, ax, s in zip(todo, axes, sums):
        n = int(np.prod([arrays[pos].shape[a] for a in ax]))
        new[pos] = _sub(arrays[pos], s / n)
    return flat.rebuild(new)


def _sub(x: jax.Array, mean: jax.Array) -> jax.Array:
    acc = _norms.acc_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        return (x - mean).astype(x.dtype)
    return (x.astype(acc) - mean.astype(acc)).astype(x.dtype)


def unit_axes(shape: tuple[int, ...], axis: Any, fn: str = "adaptive_grad_clip") -> tuple[int, ...]:
    """The axes one AGC "unit" norm reduces over (optax's ``unitwise_norm`` rules).

    Scalars and vectors (after squeezing): the whole array; rank 2 and 3: axis 0;
    rank 4 (HWIO): axes (0, 1, 2); rank 5 (DHWIO): (0, 1, 2, 3). Other ranks need
    ``axis``.
    """
    ndim = len(shape)
    if axis is not None:
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        return tuple(sorted(a + ndim if a < 0 else a for a in axes))
    if sum(1 for s in shape if s != 1) <= 1:
        return tuple(range(ndim))
    if ndim in (2, 3):
        return (0,)
    if ndim == 4:
        return (0, 1, 2)
    if ndim == 5:
        return (0, 1, 2, 3)
    raise ValueError(
        f"{fn}: cannot infer the unit axes of a parameter of shape {shape}; pass axis="
    )


@mark_static("axis")
def adaptive_grad_clip(
    clipping: Hyperparam, eps: Hyperparam = 1e-3, axis: Any = None
) -> optax.GradientTransformation:
    """Adaptive gradient clipping (AGC, Brock et al. 2021), unit-wise.

    For each unit :math:`i` (an output column of a dense kernel, an output channel
    of a conv kernel, a whole bias vector):

    .. math:: G_i \\leftarrow G_i \\cdot \\min\\Big(1, \\frac{\\lambda \\max(\\|W_i\\|, \\epsilon)}{\\|G_i\\|}\\Big)

    The same result as :func:`optax.adaptive_grad_clip` (same unit axes), without
    its 1e-6 guard, working with explicitly sharded parameters, and recording the
    per-unit gradient norms. Place it first in the chain; use ``optax.masked`` to
    leave the classifier head out, as the NFNets reference does.

    Args:
      clipping: :math:`\\lambda` (>= 0), the allowed ratio of gradient to
        parameter norm; number, array or schedule.
      eps: floor on the parameter norm (>= 0), so zero-initialised parameters can
        still move.
      axis: the axes of one unit's norm, for every leaf; ``None`` infers them from
        each leaf's rank (see :func:`unit_axes`).

    Returns:
      An :class:`optax.GradientTransformation` with state
      :class:`AdaptiveGradClipState`; ``update`` requires ``params``.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.adaptive_grad_clip(0.1)
      >>> params = {'w': jnp.ones((2, 2))}
      >>> out, _ = tx.update({'w': jnp.ones((2, 2))}, tx.init(params), params)
      >>> out['w']
      Array([[0.1, 0.1],
             [0.1, 0.1]], dtype=float32)
    """
    fn = "adaptive_grad_clip"
    check_scalar(fn, "clipping", clipping)
    check_scalar(fn, "eps", eps)
    axis = static_value(fn, "axis", axis)
    l2 = _norms.parse_ord(2, fn)

    def init_fn(params: Any) -> AdaptiveGradClipState:
        def one(x: Any) -> Any:
            x = jnp.asarray(x) if not hasattr(x, "shape") else x
            ax = unit_axes(x.shape, axis)
            shape = tuple(s for i, s in enumerate(x.shape) if i not in ax)
            return jnp.zeros(shape, _norms.acc_dtype(x.dtype) if _is_float(x) else jnp.float32)

        return AdaptiveGradClipState(count=_count0(), norm=jax.tree_util.tree_map(one, params))

    def update_fn(updates: Any, state: AdaptiveGradClipState, params: Any = None) -> tuple:
        if params is None:
            raise ValueError(f"{fn}: update needs params (call tx.update(updates, state, params))")
        lam = resolve(clipping, state.count)
        floor = resolve(eps, state.count)
        gflat = _norms.flatten(updates, fn)
        pflat = _norms.flatten(params, fn)
        if gflat.treedef != pflat.treedef:
            raise ValueError(
                f"{fn}: updates and params have different structures: "
                f"{gflat.treedef} vs {pflat.treedef}"
            )
        garr, parr = gflat.arrays, pflat.arrays
        axes = []
        for path_i, g, p in zip(gflat.active, garr, parr):
            if g.shape != p.shape:
                raise ValueError(
                    f"{fn}: leaf {jax.tree_util.keystr(gflat.paths[path_i])} has update "
                    f"shape {g.shape} but parameter shape {p.shape}"
                )
            axes.append(unit_axes(g.shape, axis))
        gn = _norms.slice_norms(garr, axes, l2)
        pn = _norms.slice_norms(parr, axes, l2)
        new, reported = [], []
        for g, ax, gnorm, pnorm in zip(garr, axes, gn, pn):
            dtype = gnorm.dtype
            bound = as_scalar(lam, dtype) * jnp.maximum(pnorm.astype(dtype), as_scalar(floor, dtype))
            new.append(scale_leaf(g, clip_factor(gnorm, bound)))
            reported.append(jnp.squeeze(gnorm, axis=ax))
        return gflat.rebuild(new), AdaptiveGradClipState(
            count=increment(state.count), norm=_like(gflat.rebuild(reported, fill=None), state.norm)
        )

    return optax.GradientTransformation(init_fn, update_fn)
