"""Norm clipping and normalization: global (``clip_by_global_norm``) and per slice (``clip_by_norm``, ``normalize``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import (
    clip_factor,
    like_state,
    norm_shape,
    norm_template,
    normalize_factor,
    rescale_tree,
    state_dtype,
    tree_dtype,
    validate_shape_args,
)
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    increment,
    mark_static,
    poison,
)
from gradclip_jax._core.norms import DimLike, OrdLike
from gradclip_jax._core.numerics import count0 as _count0
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_state
from gradclip_jax.transforms._state_checks import check_tree

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
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


@register_state
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


@register_state
class NormalizeState(NamedTuple):
    """State of :func:`normalize` (fields as in :class:`ClipByNormState`)."""

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any


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
    large fp16/fp32 values, supports any ``ord`` and leaves sharded by hand. An
    infinite or NaN element passes through (``optax.apply_if_finite`` sees it);
    finite elements whose norm is past the dtype's range (reported ``inf``) are
    clipped to 0 (``max_norm / inf``), never passed on unclipped.

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
        dtype = tree_dtype(params)
        return ClipByGlobalNormState(
            count=_count0(), norm=jnp.zeros((), dtype), clipped=jnp.zeros((), bool)
        )

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
            bound=hps.exact("max_norm", v),
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
        Negative axes count from each leaf's own last axis. A leaf that lacks
        some of the axes is measured over those it has; a leaf that lacks all
        of them has no axis to reduce and is left unchanged (its entries in the
        state are ``None``).
      inverse_dims: reduce over every axis not in ``dim`` (``dim=0`` with
        ``inverse_dims=True`` clips each row of a matrix); a leaf left with no
        axis to reduce (a vector with ``dim=0``) is unchanged.
      min_size: slices with fewer elements are left unchanged.
      min_norm: optional lower bound: non-zero slices with a smaller norm are
        scaled *up* to it.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByNormState`.

    Raises:
      ValueError: at construction, for a negative or NaN bound, ``min_norm >
        max_norm`` or an unknown ``ord``; at ``update``, when no leaf has any of
        the axes in ``dim`` (``dim=5`` on matrices: nothing would be measured),
        or when the updates are another tree, or would give per-slice norms of
        other shapes, than the parameters ``init`` was given.

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
    spec, d, inv, ms = validate_shape_args(fn, ord, dim, inverse_dims, min_size)
    if max_norm is None and min_norm is None:
        raise ValueError(f"{fn}: give max_norm, min_norm or both")
    hps = Hyperparams(fn)
    hps.add("max_norm", max_norm, allow_none=True)
    hps.add("min_norm", min_norm, allow_none=True)
    hps.order("min_norm", "max_norm")  # a traced pair out of order gives NaN, as any invalid value

    def factor_of(v: dict, invalid: Any) -> Any:
        hi, lo = v["max_norm"], v["min_norm"]
        return lambda n: poison(
            clip_factor(
                n,
                None if hi is None else hi.astype(n.dtype),
                None if lo is None else lo.astype(n.dtype),
            ),
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
        extra = {"clipped": norm_template(params, fn, dim, inv, ms, flags=True)} if flags else {}
        return state_cls(count=_count0(), norm=norm_template(params, fn, dim, inv, ms), **extra)

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, state_cls)
        if dim != "global":
            # per-slice norms: a leaf of another shape would change the state's shapes
            check_tree(
                fn, "norm", state.norm, updates, shape_of=lambda x: norm_shape(x, dim, inv, ms)
            )
        v, invalid = hps.at(state.count, tree_dtype(updates))
        out, nrm, clipped = rescale_tree(
            updates,
            factor_of(v, invalid),
            fn=fn,
            ord=spec,
            dim=dim,
            inverse_dims=inv,
            min_size=ms,
            norm_dtype=state_dtype(state.norm),
            bound=hps.exact("max_norm", v)
            if "max_norm" in v
            else None,  # normalize: no bound, the margin
        )
        # the factors are NaN already; leaves left unchanged (no axis to reduce, min_size) must be too
        out = poison(out, invalid)
        extra = {"clipped": clipped} if flags else {}
        return out, state_cls(
            count=increment(state.count), norm=like_state(nrm, state.norm), **extra
        )

    return optax.GradientTransformation(init_fn, update_fn)


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

    A slice with norm 0 (or a non-finite element) is left unchanged: no NaN, unlike
    ``optax.contrib.normalize`` and torchzero's global ``Normalize``. A slice of
    finite elements whose norm is past the dtype's range (reported ``inf``)
    becomes 0 (``norm_value / inf``), as every norm-based clipper treats it.

    Args:
      norm_value: the target norm (>= 0), number, array or schedule.
      ord, dim, inverse_dims, min_size: as in :func:`clip_by_norm`: a leaf that
        lacks every axis in ``dim`` (or, with ``inverse_dims``, is left with no
        axis to reduce) is left unchanged.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`NormalizeState`.

    Raises:
      ValueError: at construction, for a negative or NaN ``norm_value`` or an
        unknown ``ord``; at ``update``, when no leaf has any of the axes in
        ``dim``, or when the updates are another tree, or would give per-slice
        norms of other shapes, than the parameters ``init`` was given.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.normalize(2.0, dim='global')
      >>> out, _ = tx.update([jnp.array([3.0]), jnp.array([4.0])], tx.init([jnp.zeros(1)] * 2))
      >>> [float(o[0]) for o in out]
      [1.2, 1.6]
    """
    fn = "normalize"
    spec, d, inv, ms = validate_shape_args(fn, ord, dim, inverse_dims, min_size)
    hps = Hyperparams(fn)
    hps.add("norm_value", norm_value)

    def factor_of(v: dict, invalid: Any) -> Any:
        return lambda n: poison(normalize_factor(n, v["norm_value"].astype(n.dtype)), invalid)

    return _slice_transform(fn, NormalizeState, hps, factor_of, spec, d, inv, ms)
