"""jax-privacy's clip-norm arguments as its current source defines them: ``l2_clip_norm`` a
number or a pytree that is a prefix of the clipped tree (per-layer clipping), ``grid_scale``
(integer-grid outputs), each checked with errors naming the argument, and the sensitivity
they define."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core.validation import check_int, check_scalar, is_traced

PyTree = Any


def is_per_layer(clip_norm: Any) -> bool:
    """A tree of clip norms (per-layer clipping) rather than one number: jax-privacy's
    ``not jnp.isscalar(clip_norm)``, for containers (dicts, lists, tuples, ...)."""
    leaves = jax.tree_util.tree_leaves(clip_norm)
    return clip_norm is not None and not (len(leaves) == 1 and leaves[0] is clip_norm)


def clip_norm_leaves(fn: str, name: str, clip_norm: Any) -> list[Any]:
    """The clip norms of ``clip_norm`` (one for a number), each checked (a number or traced
    scalar, not negative, not NaN); the error names the leaf, e.g. ``l2_clip_norm['w']``."""
    if not is_per_layer(clip_norm):
        check_scalar(fn, name, clip_norm)
        return [clip_norm]
    pairs = jax.tree_util.tree_flatten_with_path(clip_norm)[0]
    if not pairs:
        raise ValueError(
            f"{fn}: `{name}` is an empty tree: give one clip norm per layer (or subtree)"
        )
    for path, c in pairs:
        check_scalar(fn, f"{name}{jax.tree_util.keystr(path)}", c)
    return [c for _, c in pairs]


def _root_sum_squares(values: list[Any]) -> Any:
    if any(is_traced(c) for c in values):
        return jnp.sqrt(sum(jnp.square(jnp.asarray(c, jnp.float32)) for c in values))
    return math.sqrt(sum(float(c) ** 2 for c in values))


def norm_bound(
    fn: str, l2_clip_norm: Any, rescale: bool, normalize_by: Any, grid_scale: Any = None
) -> Any:
    """The add/remove sensitivity jax-privacy defines (its ``l2_norm_bound``), every argument checked.

    ``grid_scale``: the grid scale itself (the integer sum's units). Otherwise, with one clip norm
    ``C``: ``C / normalize_by`` (``1 / normalize_by`` rescaled); with per-layer clip norms ``C_i``:
    ``sqrt(sum_i C_i**2) / normalize_by`` (``sqrt(K) / normalize_by`` rescaled, ``K`` of them).

    Example:
      >>> norm_bound('clipped_fun', {'a': 3.0, 'b': 4.0}, False, 2.0)
      2.5
    """
    check_scalar(fn, "normalize_by", normalize_by, low_inclusive=False)
    leaves = clip_norm_leaves(fn, "l2_clip_norm", l2_clip_norm)
    check_grid_scale(fn, grid_scale, l2_clip_norm, rescale, normalize_by)
    if grid_scale is not None:
        return float(grid_scale)
    if not is_per_layer(l2_clip_norm):  # kept as given (a traced or integer clip norm too)
        return (1.0 if rescale else l2_clip_norm) / normalize_by
    return (math.sqrt(len(leaves)) if rescale else _root_sum_squares(leaves)) / normalize_by


def check_grid_scale(
    fn: str, grid_scale: Any, l2_clip_norm: Any, rescale: bool, normalize_by: Any
) -> None:
    """``grid_scale`` (None, or a positive int) and what it excludes, as jax-privacy: rescaling,
    ``normalize_by != 1``, per-layer clip norms, 32-bit mode; the clip norm must be positive and finite."""
    if grid_scale is None:
        return
    check_int(fn, "grid_scale", grid_scale, 1)
    if rescale:
        raise ValueError(
            f"{fn}: grid_scale={grid_scale} cannot be combined with rescale_to_unit_norm=True "
            "(the grid's unit is l2_clip_norm / grid_scale)"
        )
    if is_traced(normalize_by) or float(normalize_by) != 1.0:
        raise ValueError(
            f"{fn}: grid_scale={grid_scale} needs normalize_by=1 (got {normalize_by!r}): "
            "divide the integer sum after the noise is added"
        )
    if is_per_layer(l2_clip_norm):
        raise ValueError(
            f"{fn}: grid_scale needs one clip norm; `l2_clip_norm` is a per-layer tree"
        )
    check_scalar(fn, "l2_clip_norm", l2_clip_norm, low_inclusive=False, allow_inf=False)
    if not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"{fn}: grid_scale needs 64-bit mode (jax.config.update('jax_enable_x64', True)): "
            "its int64 outputs and sums would otherwise be int32"
        )


def clip_prefix(fn: str, name: str, clip_norm: Any, tree: Any) -> list[Any]:
    """The subtrees of ``tree`` that the clip norms of the tree ``clip_norm`` cover, in its leaf
    order; ValueError naming ``name`` when ``clip_norm`` is not a prefix of ``tree``."""
    c_def = jax.tree_util.tree_structure(clip_norm)
    try:
        return c_def.flatten_up_to(tree)  # type: ignore[attr-defined,no-any-return]
    except (ValueError, TypeError):
        raise ValueError(
            f"{fn}: `{name}` must be a prefix of the clipped tree's structure (one clip norm per "
            f"leaf or subtree); got {c_def} for {jax.tree_util.tree_structure(tree)}"
        ) from None


def per_group(
    fn: str, name: str, clip_norm: Any, tree: Any, apply: Callable[[Any, Any], Any]
) -> list[Any]:
    """``apply(subtree, c)`` for each clip norm ``c`` of the tree ``clip_norm`` and the subtree of
    ``tree`` it covers, in ``clip_norm``'s leaf order."""
    return [
        apply(sub, c)
        for sub, c in zip(
            clip_prefix(fn, name, clip_norm, tree),
            jax.tree_util.tree_leaves(clip_norm),
            strict=True,
        )
    ]
