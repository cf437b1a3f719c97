"""Checks that the state given to ``update`` belongs to the tree it was built for (private).

Every transform calls :func:`gradclip_jax._core.validation.check_state` first, so a
state from another transform (an ``optax.chain``'s tuple, say) raises one clear
``TypeError`` naming the transform instead of an ``AttributeError`` deep inside it;
the per-leaf statistics of stateful transforms go through :func:`check_tree`, so a
state initialised on another tree (other leaves, other shapes) raises a
``ValueError`` naming the transform, the state field and the first leaf that
differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _is_none(x: Any) -> bool:
    return x is None


def check_tree(
    fn: str,
    what: str,
    template: Any,
    updates: Any,
    *,
    shapes: bool = False,
    shape_of: Callable[[Any], tuple[int, ...] | None] | None = None,
) -> None:
    """``ValueError`` unless ``updates`` has the leaves (and shapes) ``template`` was built for.

    Args:
      fn: the public name of the transform.
      what: the state field, for the message (``'exp_avg'``).
      template: the state field: a tree built at ``init`` from the parameters
        with ``None`` at the leaves that are not measured.
      updates: the updates given to ``update``.
      shapes: also compare the shape of every array in ``template`` with the
        update at the same path (for parameter-shaped statistics).
      shape_of: for statistics shaped otherwise (per-slice norms): the shape
        the field has for an update leaf, or ``None`` where the leaf is not
        measured; every entry of ``template`` must have it (implies ``shapes``).
    """
    t_pairs, _ = jax.tree_util.tree_flatten_with_path(template, is_leaf=_is_none)
    u_pairs, _ = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_none)
    t_keys = [jax.tree_util.keystr(p) for p, _ in t_pairs]
    u_keys = [jax.tree_util.keystr(p) for p, _ in u_pairs]
    if t_keys != u_keys:
        t_set, u_set = set(t_keys), set(u_keys)
        extra = [k for k in u_keys if k not in t_set]
        missing = [k for k in t_keys if k not in u_set]
        if extra:
            detail = f"leaf {extra[0] or '<root>'} of the updates is not in the state"
        elif missing:
            detail = f"leaf {missing[0] or '<root>'} of the state is not in the updates"
        else:
            detail = "the leaves are in another order"
        raise ValueError(
            f"{fn}: the state's `{what}` was initialised on another tree than these updates "
            f"({detail}); call init with parameters shaped like the updates"
        )
    if shape_of is not None:
        _check_derived_shapes(fn, what, t_keys, t_pairs, u_pairs, shape_of)
        return
    if not shapes:
        return
    for key, (_, t), (_, u) in zip(t_keys, t_pairs, u_pairs, strict=True):
        t_shape, u_shape = getattr(t, "shape", None), getattr(u, "shape", None)
        if t is None or t_shape is None or u_shape is None:
            continue
        if tuple(t_shape) != tuple(u_shape):
            raise ValueError(
                f"{fn}: leaf {key or '<root>'} has shape {tuple(u_shape)} but the state's "
                f"`{what}` was initialised for shape {tuple(t_shape)}; call init with "
                "parameters shaped like the updates"
            )


def _check_derived_shapes(
    fn: str,
    what: str,
    keys: list[str],
    t_pairs: list,
    u_pairs: list,
    shape_of: Callable[[Any], tuple[int, ...] | None],
) -> None:
    """The ``shape_of`` half of :func:`check_tree`: a state whose shapes would change raises."""
    for key, (_, t), (_, u) in zip(keys, t_pairs, u_pairs, strict=True):
        want = shape_of(u) if u is not None else None
        have = None if t is None else tuple(getattr(t, "shape", ()))
        if want is not None:
            want = tuple(want)
        if want != have:
            u_shape = tuple(getattr(u, "shape", ()))
            given = "no entry" if want is None else f"shape {want}"
            held = "no entry" if have is None else f"shape {have}"
            raise ValueError(
                f"{fn}: leaf {key or '<root>'} has shape {u_shape}, which gives `{what}` {given}, but "
                f"the state's `{what}` was initialised with {held} for it; call init with parameters "
                "shaped like the updates"
            )
