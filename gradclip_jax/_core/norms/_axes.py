"""Which axes a norm reduces over: ``dim`` / ``inverse_dims`` checked and resolved per leaf."""

from __future__ import annotations

from collections.abc import Sequence

from gradclip_jax._core.norms._spec import Axes, DimLike
from gradclip_jax._core.validation import is_int, static_value


def check_dim(fn: str, dim: DimLike, inverse_dims: bool, allow_global: bool = True) -> DimLike:
    """Validates ``dim`` / ``inverse_dims`` at construction and normalises ``dim``."""
    dim = static_value(fn, "dim", dim)
    if isinstance(dim, str):
        if dim != "global" or not allow_global:
            allowed = (
                "None, an int, a tuple of ints or 'global'"
                if allow_global
                else ("None, an int or a tuple of ints")
            )
            raise ValueError(f"{fn}: dim must be {allowed}, got {dim!r}")
        return dim
    if dim is None:
        if inverse_dims:
            raise ValueError(
                f"{fn}: inverse_dims=True needs dim (the axes to keep); with dim=None "
                "there would be no axis left to reduce"
            )
        return None
    if is_int(dim):
        return (int(dim),)
    try:
        dims = tuple(static_value(fn, "dim", d) for d in dim)  # type: ignore[union-attr]
    except TypeError as err:
        raise TypeError(f"{fn}: dim must be None, an int or a tuple of ints, got {dim!r}") from err
    if not all(is_int(d) for d in dims):
        raise TypeError(f"{fn}: dim must be None, an int or a tuple of ints, got {dim!r}")
    return tuple(int(d) for d in dims)


def check_axes_exist(fn: str, shapes: Sequence[Sequence[int]], dim: DimLike) -> None:
    """``ValueError`` naming ``dim`` when no leaf has any of its axes.

    A leaf that lacks some of the axes is measured over those it has; one that
    lacks all of them is left unchanged. When *no* leaf has any of them, the
    ``dim`` is a mistake (``dim=5`` on matrices), not a choice.
    """
    if dim is None or isinstance(dim, str) or not shapes:
        return
    for shape in shapes:
        nd = len(shape)
        if any(-nd <= d < nd for d in dim):  # type: ignore[union-attr]
            return
    most = max(len(s) for s in shapes)
    raise ValueError(
        f"{fn}: no leaf has any of the axes dim={tuple(dim)} (the leaves have at most "  # type: ignore[arg-type]
        f"{most} axes), so nothing would be measured; pick axes the leaves have"
    )


def reduction_axes(
    shape: Sequence[int], dim: DimLike, inverse_dims: bool = False, min_size: int = 1
) -> Axes:
    """The axes of a leaf of ``shape`` that one norm reduces over.

    Args:
      shape: the leaf's shape.
      dim: ``None`` (the whole leaf), or a tuple of axes (negative axes count from
        this leaf's last axis; axes the leaf lacks are ignored).
      inverse_dims: reduce over every axis not in ``dim``.
      min_size: slices with fewer elements are left alone.

    Returns:
      A sorted tuple of axes, or ``None`` when the leaf is left unchanged (no axis to
      reduce, or slices smaller than ``min_size``).
    """
    ndim = len(shape)
    if dim is None:
        axes: tuple[int, ...] = tuple(range(ndim))
    else:
        assert not isinstance(dim, str)
        picked = set()
        for d in dim:  # type: ignore[union-attr]
            d = d + ndim if d < 0 else d
            if 0 <= d < ndim:
                picked.add(d)
        if inverse_dims:
            picked = set(range(ndim)) - picked
        axes = tuple(sorted(picked))
        if not axes:
            return None
    size = 1
    for a in axes:
        size *= shape[a]
    if size < min_size:
        return None
    return axes


def reduced_size(shape: Sequence[int], axes: Axes) -> int:
    n = 1
    for a in range(len(shape)) if axes is None else axes:
        n *= shape[a]
    return n
