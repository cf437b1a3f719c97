"""Adaptive gradient clipping (AGC): unit-wise norms of the update against those of the parameters."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import (
    clip_factor,
    is_float,
    like_state,
    overflow_safe,
    scale_leaf,
    tree_dtype,
)
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    increment,
    mark_static,
    poison,
)
from gradclip_jax._core.numerics import count0 as _count0
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_state, static_value
from gradclip_jax.transforms._state_checks import check_tree

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
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


def _paired_leaves(
    fn: str, updates: Any, params: Any, axis: Any
) -> tuple[_norms.FlatTree, list[jax.Array], list]:
    """``(updates flattened, the parameter arrays beside them, each leaf's unit axes)``.

    Raises:
      ValueError: when the updates and the parameters differ in structure or in a leaf's shape.
    """
    gflat = _norms.flatten(updates, fn)
    pflat = _norms.flatten(params, fn)
    if gflat.treedef != pflat.treedef:
        raise ValueError(
            f"{fn}: updates and params have different structures: "
            f"{gflat.treedef} vs {pflat.treedef}"
        )
    axes = []
    for path_i, g, p in zip(gflat.active, gflat.arrays, pflat.arrays):
        if g.shape != p.shape:
            raise ValueError(
                f"{fn}: leaf {jax.tree_util.keystr(gflat.paths[path_i])} has update "
                f"shape {g.shape} but parameter shape {p.shape}"
            )
        axes.append(unit_axes(g.shape, axis))
    return gflat, pflat.arrays, axes


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
    per-unit gradient norms. Integer and bool updates or parameters are accepted,
    as optax accepts them, and computed in the default float dtype (float32;
    float64 under x64). Place it first in the chain; use ``optax.masked`` to
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

    def norm_shape(x: Any) -> tuple[int, ...] | None:
        """The shape of leaf ``x``'s per-unit norms (``None``: not measured)."""
        x = jnp.asarray(x) if not hasattr(x, "shape") else x
        if not is_float(x):
            return None  # float0 (the update raises for other non-float leaves)
        ax = unit_axes(x.shape, axis)
        return tuple(s for i, s in enumerate(x.shape) if i not in ax)

    def init_fn(params: Any) -> AdaptiveGradClipState:
        params = _norms.promote_ints(params, bools=True)  # optax accepts integer and bool leaves

        def one(x: Any) -> Any:
            shape = norm_shape(x)
            return None if shape is None else jnp.zeros(shape, _norms.acc_dtype(jnp.result_type(x)))

        def flag(x: Any) -> Any:
            return None if norm_shape(x) is None else jnp.zeros((), bool)

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
        # optax parity: integer and bool leaves are computed in the default float dtype
        updates = _norms.promote_ints(updates, bools=True)
        params = _norms.promote_ints(params, bools=True)
        # per-unit norms: a leaf of another shape would change the state's shapes
        check_tree(fn, "norm", state.norm, updates, shape_of=norm_shape)
        v, invalid = hps.at(state.count, tree_dtype(updates))
        lam, floor = v["clipping"], v["eps"]
        gflat, parr, axes = _paired_leaves(fn, updates, params, axis)
        garr = gflat.arrays
        gn = _norms.slice_norms(garr, axes, l2, then=lambda n, over: over)
        pn = _norms.slice_norms(parr, axes, l2)
        new, reported, clipped = [], [], []
        for g, ax, (gnorm, over), pnorm in zip(garr, axes, gn, pn):
            dtype = gnorm.dtype
            bound = lam.astype(dtype) * jnp.maximum(pnorm.astype(dtype), floor.astype(dtype))
            factor = poison(
                overflow_safe(lambda n, b=bound: clip_factor(n, b), gnorm, over), invalid
            )
            new.append(scale_leaf(g, factor))
            reported.append(jnp.squeeze(gnorm, axis=ax))
            clipped.append(jnp.any(factor < 1))
        return gflat.rebuild(new), AdaptiveGradClipState(
            count=increment(state.count),
            norm=like_state(gflat.rebuild(reported, fill=None), state.norm),
            clipped=like_state(gflat.rebuild(clipped, fill=None), state.clipped),
        )

    return optax.GradientTransformation(init_fn, update_fn)
