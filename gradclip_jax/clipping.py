"""Stateless clipping and normalization transforms.

Each factory returns an :class:`optax.GradientTransformation`. The states are
small ``NamedTuple``s of fixed structure: a step ``count`` (used when a
hyperparameter is a schedule) and, for norm-based transforms, the pre-clip
``norm`` they measured (log it with :func:`gradclip_jax.norms_from_state`) and,
for the clippers, whether they ``clipped`` (what :func:`gradclip_jax.skip_on_spike`
reads). Like optax's stateless transforms, ``update`` accepts ``state=None``
("no state yet") and returns a proper state.

House rules shared by every transform here:

* a slice whose norm is ``<= 0`` (or not finite) is left unchanged: no NaN, no
  epsilon; clipping scales by ``max_norm / norm`` when ``norm > max_norm``, lowered
  by a few units in the last place of the leaf's dtype so the stored result's norm
  is at most ``max_norm``, rounding included (an unclipped leaf is returned exactly);
* outputs keep each leaf's dtype; the scale is applied in the leaf's accumulation
  dtype (float32 for 16-bit leaves) and rounded once;
* ``None``, :class:`optax.MaskedNode` and ``float0`` leaves pass through;
* a hyperparameter that is invalid only at run time (a traced or scheduled
  ``max_norm`` that is negative or NaN, ...) makes the whole update NaN, so
  :func:`optax.apply_if_finite` skips the step: never a sign flip, never
  clipping switched off.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax import norms as _norms
from gradclip_jax._numerics import bounded_factor
from gradclip_jax._numerics import count0 as _count0
from gradclip_jax._states import check_state, check_tree
from gradclip_jax.hyperparams import (
    Hyperparam,
    Hyperparams,
    increment,
    mark_static,
    poison,
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
      clipped: whether the last update was scaled down (what
        :func:`gradclip_jax.skip_on_spike` reads with ``field='clipped'``).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: jax.Array
    clipped: jax.Array


class ClipByNormState(NamedTuple):
    """State of :func:`clip_by_norm`.

    Attributes:
      count: number of updates so far (int32).
      norm: the pre-clip norms of the last update: a tree with one array of
        per-slice norms per leaf (``None`` for leaves left alone), or a scalar when
        ``dim='global'``.
      clipped: whether the last update was scaled down: one bool per leaf (any
        of its slices; ``None`` for leaves left alone), or a scalar when
        ``dim='global'``.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any
    clipped: Any


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
      clipped: tree of bools, whether each leaf was scaled down.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any
    clipped: Any


class CentralizeState(NamedTuple):
    """State of :func:`centralize` (it measures no norm)."""


class AdaptiveGradClipState(NamedTuple):
    """State of :func:`adaptive_grad_clip`.

    Attributes:
      count: number of updates so far (int32).
      norm: tree of per-unit gradient norms before clipping (one per output unit).
      clipped: tree of bools, whether any unit of each leaf was scaled down.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any
    clipped: Any


# ----------------------------------------------------------------------------
# Kernels (shared with the functional API)
# ----------------------------------------------------------------------------


def scale_leaf(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x * factor`` computed in ``x``'s accumulation dtype, rounded once to x's dtype.

    A factor below 1 is first lowered by the rounding margin of x's dtype
    (:func:`gradclip_jax._numerics.bounded_factor`), so the stored result never
    exceeds the bound because of rounding.
    """
    acc = _norms.acc_dtype(x.dtype)
    return (x * bounded_factor(factor.astype(acc), x.dtype)).astype(x.dtype)


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
    visible instead of being zeroed. An infinite bound never clips; a NaN or
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

    Returns:
      ``(new_tree, norms, clipped)``: ``norms`` is a scalar for ``dim='global'``
      and otherwise a tree of per-slice norms with the reduced axes removed
      (``None`` for leaves left unchanged); ``clipped`` says whether some factor
      was below 1 (a scalar, or one bool per leaf).
    """
    spec = _norms.parse_ord(ord, fn)
    flat = _norms.flatten(tree, fn)
    _norms.check_complex(flat, spec, fn)
    arrays = flat.arrays
    if dim == "global":
        norm = _norms.global_norm(arrays, spec, axis_name, dtype=norm_dtype)
        factor = factor_fn(norm)
        out = flat.rebuild([scale_leaf(x, factor) for x in arrays])
        return out, norm, factor < 1
    _norms.check_axes_exist(fn, [x.shape for x in arrays], dim)
    todo, axes = [], []
    for pos, x in enumerate(arrays):
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax is not None:
            todo.append(pos)
            axes.append(ax)
    measured = _norms.slice_norms([arrays[p] for p in todo], axes, spec, then=factor_fn)
    new = list(arrays)
    reported: list[Any] = [None] * len(arrays)
    clipped: list[Any] = [None] * len(arrays)
    for pos, ax, (n, factor) in zip(todo, axes, measured):
        new[pos] = scale_leaf(arrays[pos], factor)
        nrm = jnp.squeeze(n, axis=ax)
        reported[pos] = nrm if norm_dtype is None else nrm.astype(norm_dtype)
        clipped[pos] = jnp.any(factor < 1)
    return flat.rebuild(new), flat.rebuild(reported, fill=None), flat.rebuild(clipped, fill=None)


def _norm_template(
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
        if getattr(x, "dtype", None) == jax.dtypes.float0:
            return None
        x = jnp.asarray(x)
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax is None:
            return None
        if flags:
            return jnp.zeros((), bool)
        shape = tuple(s for i, s in enumerate(x.shape) if i not in ax)
        return jnp.zeros(shape, _norms.acc_dtype(x.dtype) if _is_float(x) else dtype)

    return jax.tree_util.tree_map(one, params)


def _is_float(x: Any) -> bool:
    dtype = np.dtype(x.dtype)
    return bool(np.issubdtype(dtype, np.inexact) or dtype == jnp.bfloat16)


def _validate_shape_args(fn: str, ord: Any, dim: Any, inverse_dims: Any, min_size: Any) -> tuple:  # noqa: A002
    spec = _norms.parse_ord(ord, fn)
    inv = static_value(fn, "inverse_dims", inverse_dims)
    if not isinstance(inv, (bool, np.bool_)):
        raise TypeError(f"{fn}: `inverse_dims` must be a bool, got {type(inv).__name__} {inv!r}")
    d = _norms.check_dim(dim, bool(inv), fn)
    ms = static_value(fn, "min_size", min_size)
    if isinstance(ms, bool) or not isinstance(ms, (int, np.integer)):
        raise TypeError(f"{fn}: `min_size` must be a non-negative int, got {type(ms).__name__} {ms!r}")
    if ms < 0:
        raise ValueError(f"{fn}: `min_size` must be a non-negative int, got {ms!r}")
    return spec, d, bool(inv), int(ms)


def _tree_dtype(tree: Any) -> np.dtype:
    """The accumulation dtype of a tree's floating-point leaves (hyperparameters resolve in it)."""
    return _norms.tree_acc_dtype(jax.tree_util.tree_leaves(tree))


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
    hps = Hyperparams(fn)
    hps.add("max_norm", max_norm)

    def init_fn(params: Any) -> ClipByGlobalNormState:
        dtype = _tree_dtype(params)
        return ClipByGlobalNormState(count=_count0(), norm=jnp.zeros((), dtype), clipped=jnp.zeros((), bool))

    def update_fn(updates: Any, state: ClipByGlobalNormState | None, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, ClipByGlobalNormState)
        v, invalid = hps.at(state.count, state.norm.dtype)
        out, norm, clipped = rescale_tree(
            updates,
            lambda n: poison(clip_factor(n, v["max_norm"].astype(n.dtype)), invalid),
            fn=fn,
            ord=spec,
            dim="global",
            axis_name=axis_name,
            norm_dtype=state.norm.dtype,
        )
        return out, ClipByGlobalNormState(count=increment(state.count), norm=norm, clipped=clipped)

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
      >>> out['w'].round(6)  # clipped rows sit a few ulp inside the bound
      Array([[0.6, 0.8],
             [0.3, 0.4]], dtype=float32)
      >>> state.norm['w']
      Array([5. , 0.5], dtype=float32)
    """
    fn = "clip_by_norm"
    spec, d, inv, ms = _validate_shape_args(fn, ord, dim, inverse_dims, min_size)
    if max_norm is None and min_norm is None:
        raise ValueError(f"{fn}: give max_norm, min_norm or both")
    hps = Hyperparams(fn)
    hps.add("max_norm", max_norm, allow_none=True)
    hps.add("min_norm", min_norm, allow_none=True)
    _check_order(fn, min_norm, max_norm)

    def factor_of(v: dict, invalid: Any) -> Any:
        hi, lo = v["max_norm"], v["min_norm"]
        return lambda n: poison(
            clip_factor(n, None if hi is None else hi.astype(n.dtype), None if lo is None else lo.astype(n.dtype)),
            invalid,
        )

    return _slice_transform(fn, ClipByNormState, hps, factor_of, spec, d, inv, ms)


def _slice_transform(
    fn: str,
    state_cls: Any,
    hps: Hyperparams,
    factor_of: Any,
    spec: _norms.NormSpec,
    dim: DimLike,
    inv: bool,
    ms: int,
) -> optax.GradientTransformation:
    """A transform that rescales each slice by ``factor_of(values, invalid)(norm)``.

    The shared body of :func:`clip_by_norm` and :func:`normalize`: the state is
    ``state_cls(count, norm[, clipped])`` with the per-slice (or global) norms it
    measured (and, for a clipper, whether each leaf was scaled down).
    """
    flags = "clipped" in state_cls._fields

    def init_fn(params: Any) -> Any:
        extra = {"clipped": _norm_template(params, fn, dim, inv, ms, flags=True)} if flags else {}
        return state_cls(count=_count0(), norm=_norm_template(params, fn, dim, inv, ms), **extra)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, state_cls)
        if dim != "global":
            check_tree(fn, "norm", state.norm, updates)
        v, invalid = hps.at(state.count, _tree_dtype(updates))
        out, nrm, clipped = rescale_tree(
            updates,
            factor_of(v, invalid),
            fn=fn,
            ord=spec,
            dim=dim,
            inverse_dims=inv,
            min_size=ms,
            norm_dtype=_state_dtype(state.norm),
        )
        extra = {"clipped": clipped} if flags else {}
        return out, state_cls(count=increment(state.count), norm=_like(nrm, state.norm), **extra)

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
    return jax.tree_util.tree_map(lambda n, t: n.astype(t.dtype), new, template)


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
    hps = Hyperparams(fn)
    hps.add("norm_value", norm_value)

    def factor_of(v: dict, invalid: Any) -> Any:
        return lambda n: poison(normalize_factor(n, v["norm_value"].astype(n.dtype)), invalid)

    return _slice_transform(fn, NormalizeState, hps, factor_of, spec, d, inv, ms)


def clip_value_tree(tree: Any, bound: Any, fn: str, invalid: Any = None) -> Any:
    """Clamps every element to ``[-bound, bound]`` (complex: the magnitude).

    Integer leaves are clamped and keep their dtype; bool leaves raise ``TypeError``.
    NaN stays NaN. A NaN or negative bound (or ``invalid`` true) makes every
    floating-point element NaN (integer leaves cannot hold NaN and become 0).
    """
    bad = jnp.isnan(jnp.asarray(bound)) | (jnp.asarray(bound) < 0)
    if invalid is not None:
        bad = bad | invalid

    def one(path: Any, x: Any) -> Any:
        if getattr(x, "dtype", None) == jax.dtypes.float0:
            return x
        y = _clip_one(path, x)
        if jnp.issubdtype(y.dtype, jnp.inexact):
            return jnp.where(bad, jnp.full_like(y, jnp.nan), y)
        return jnp.where(bad, jnp.zeros_like(y), y)

    def _clip_one(path: Any, x: Any) -> Any:
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
    hps = Hyperparams(fn)
    hps.add(name, bound)

    def init_fn(params: Any) -> ClipByValueState:
        del params
        return ClipByValueState(count=_count0())

    def update_fn(updates: Any, state: ClipByValueState | None, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, ClipByValueState)
        v, invalid = hps.at(state.count, _tree_dtype(updates))
        return clip_value_tree(updates, v[name], fn, invalid), ClipByValueState(count=increment(state.count))

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
    hps = Hyperparams(fn)
    hps.add("threshold", threshold)
    rms = _norms.parse_ord("rms", fn)

    def init_fn(params: Any) -> ClipByBlockRmsState:
        return ClipByBlockRmsState(
            count=_count0(),
            norm=_norm_template(params, fn, None, False, 1),
            clipped=_norm_template(params, fn, None, False, 1, flags=True),
        )

    def update_fn(updates: Any, state: ClipByBlockRmsState | None, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, ClipByBlockRmsState)
        check_tree(fn, "norm", state.norm, updates)
        v, invalid = hps.at(state.count, _tree_dtype(updates))
        out, nrm, clipped = rescale_tree(
            updates, lambda n: poison(clip_factor(n, v["threshold"].astype(n.dtype)), invalid), fn=fn, ord=rms
        )
        return out, ClipByBlockRmsState(count=increment(state.count), norm=_like(nrm, state.norm), clipped=clipped)

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

    def update_fn(updates: Any, state: CentralizeState | None, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, CentralizeState)
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
    _norms.check_axes_exist(fn, [x.shape for x in arrays], dim)
    todo, axes = [], []
    for pos, x in enumerate(arrays):
        ax = _norms.reduction_axes(x.shape, dim, inverse_dims, min_size)
        if ax:  # a 0-d leaf (ax == ()) has no axis to centre over: unchanged
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
    hps = Hyperparams(fn)
    hps.add("clipping", clipping)
    hps.add("eps", eps)
    axis = static_value(fn, "axis", axis)
    l2 = _norms.parse_ord(2, fn)

    def init_fn(params: Any) -> AdaptiveGradClipState:
        def one(x: Any) -> Any:
            x = jnp.asarray(x) if not hasattr(x, "shape") else x
            if not _is_float(x):
                return None  # not measured (update raises for it)
            ax = unit_axes(x.shape, axis)
            shape = tuple(s for i, s in enumerate(x.shape) if i not in ax)
            return jnp.zeros(shape, _norms.acc_dtype(x.dtype))

        def flag(x: Any) -> Any:
            return jnp.zeros((), bool) if _is_float(jnp.asarray(x) if not hasattr(x, "dtype") else x) else None

        return AdaptiveGradClipState(
            count=_count0(),
            norm=jax.tree_util.tree_map(one, params),
            clipped=jax.tree_util.tree_map(flag, params),
        )

    def update_fn(updates: Any, state: AdaptiveGradClipState | None, params: Any = None) -> tuple:
        if params is None:
            raise ValueError(f"{fn}: update needs params (call tx.update(updates, state, params))")
        state = init_fn(params) if state is None else state
        check_state(fn, state, AdaptiveGradClipState)
        check_tree(fn, "norm", state.norm, updates)
        v, invalid = hps.at(state.count, _tree_dtype(updates))
        lam, floor = v["clipping"], v["eps"]
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
        new, reported, clipped = [], [], []
        for g, ax, gnorm, pnorm in zip(garr, axes, gn, pn):
            dtype = gnorm.dtype
            bound = lam.astype(dtype) * jnp.maximum(pnorm.astype(dtype), floor.astype(dtype))
            factor = poison(clip_factor(gnorm, bound), invalid)
            new.append(scale_leaf(g, factor))
            reported.append(jnp.squeeze(gnorm, axis=ax))
            clipped.append(jnp.any(factor < 1))
        return gflat.rebuild(new), AdaptiveGradClipState(
            count=increment(state.count),
            norm=_like(gflat.rebuild(reported, fill=None), state.norm),
            clipped=_like(gflat.rebuild(clipped, fill=None), state.clipped),
        )

    return optax.GradientTransformation(init_fn, update_fn)
