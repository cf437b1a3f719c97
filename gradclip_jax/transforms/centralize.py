"""Gradient centralization: subtract the mean over the chosen axes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import validate_shape_args
from gradclip_jax._core.hyperparam_rules import mark_static
from gradclip_jax._core.norms import DimLike
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_state

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class CentralizeState(NamedTuple):
    """State of :func:`centralize` (it measures no norm)."""


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
        A leaf that lacks some of the axes is centred over those it has; a leaf
        that lacks all of them (and a 0-d leaf) is left unchanged.
      inverse_dims: reduce over every axis not in ``dim`` (``dim=-1,
        inverse_dims=True`` centres each output unit of a dense kernel, as in Yong et
        al. 2020); a leaf left with no axis to reduce is unchanged.
      min_size: slices with fewer elements are left alone (default 2: a single
        number is never centred to 0).

    Returns:
      An :class:`optax.GradientTransformation` (state :class:`CentralizeState`).

    Raises:
      ValueError: at ``update``, when no leaf has any of the axes in ``dim``
        (``dim=5`` on matrices: nothing would be centred); at construction, for
        an invalid ``dim`` or ``min_size``.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.centralize()
      >>> tx.update(jnp.array([1.0, 2.0, 6.0]), tx.init(jnp.zeros(3)))[0]
      Array([-2., -1.,  3.], dtype=float32)
    """
    fn = "centralize"
    _, d, inv, ms = validate_shape_args(fn, 2, dim, inverse_dims, min_size)

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
