"""The public functions: ``tree_norm`` and ``leaf_norms``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core.norms._axes import check_axes_exist, check_dim, reduction_axes
from gradclip_jax._core.norms._engine import check_complex, global_norm, slice_norms
from gradclip_jax._core.norms._spec import DimLike, OrdLike, parse_ord
from gradclip_jax._core.norms._trees import flatten


def tree_norm(tree: Any, ord: OrdLike = 2, *, axis_name: Any = None) -> jax.Array:  # noqa: A002
    """The global norm of a pytree: the norm of all its leaves concatenated.

    .. math:: \\|g\\|_p = \\Big(\\sum_{\\text{leaves } i} \\sum_j |g_{ij}|^p\\Big)^{1/p}

    and the corresponding definition for the other ``ord`` values (see
    :func:`parse_ord`). 16-bit leaves accumulate in float32; the result is finite
    whenever every element is finite; an empty tree has norm 0.

    Args:
      tree: a pytree of floating-point or complex arrays (``None``,
        :class:`optax.MaskedNode` and ``float0`` leaves count for nothing).
      ord: which norm (default 2, the Euclidean norm).
      axis_name: inside ``shard_map`` / ``pmap``, the axis over which the leaves are
        sharded by hand; partial norms are combined across it.

    Returns:
      A scalar in the accumulation dtype (float32, or float64 for float64 leaves).

    Raises:
      TypeError: for an integer or bool leaf (the message names its path).
      ValueError: for an unknown ``ord``.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> float(gcx.tree_norm({'a': jnp.array([3.0]), 'b': jnp.array([4.0])}))
      5.0
      >>> float(gcx.tree_norm([jnp.full(4, 300.0, jnp.float16)]))  # no fp16 overflow
      600.0
    """
    spec = parse_ord(ord, "tree_norm")
    flat = flatten(tree, "tree_norm")
    check_complex("tree_norm", flat, spec)
    return global_norm(flat.arrays, spec, axis_name)


def leaf_norms(
    tree: Any,
    ord: OrdLike = 2,  # noqa: A002
    dim: DimLike = None,
    inverse_dims: bool = False,
    *,
    keepdims: bool = False,
) -> Any:
    """Per-leaf (or per-slice) norms, as a tree of the same structure.

    Args:
      tree: a pytree of floating-point or complex arrays.
      ord: which norm (see :func:`parse_ord`).
      dim: ``None`` for one norm per leaf, or an int / tuple of axes to reduce
        over (negative axes count from each leaf's last axis). A leaf that lacks
        some of the axes is measured over those it has; a leaf that has none of
        them gets ``None``; when no leaf has any of them, ``ValueError``.
      inverse_dims: reduce over every axis *not* in ``dim``.
      keepdims: keep the reduced axes with size 1 (so the result broadcasts
        against the leaf).

    Returns:
      A tree whose leaves are the norms (shape of the leaf with the reduced axes
      removed, or kept with size 1), in the accumulation dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> gcx.leaf_norms({'w': jnp.array([[3.0, 0.0], [4.0, 1.0]])}, dim=0)
      {'w': Array([5., 1.], dtype=float32)}
    """
    spec = parse_ord(ord, "leaf_norms")
    d = check_dim("leaf_norms", dim, inverse_dims, allow_global=False)
    flat = flatten(tree, "leaf_norms")
    check_complex("leaf_norms", flat, spec)
    check_axes_exist("leaf_norms", [x.shape for x in flat.arrays], d)
    arrays, axes, where = [], [], []
    for pos, x in enumerate(flat.arrays):
        ax = reduction_axes(x.shape, d, inverse_dims)
        if ax is not None:
            arrays.append(x)
            axes.append(ax)
            where.append(pos)
    norms = slice_norms(arrays, axes, spec)
    out: list[Any] = [None] * len(flat.active)
    for pos, ax, nrm in zip(where, axes, norms):
        out[pos] = nrm if keepdims else jnp.squeeze(nrm, axis=ax)
    return flat.rebuild(out, fill=None)
