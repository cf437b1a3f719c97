"""Per-example norms: measuring rows with the norm engine, combining per-leaf
norms, and the per-leaf clip budgets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.control import cond
from gradclip_jax._core.numerics import sqrt_safe
from gradclip_jax.per_example._batch import explicit_spec
from gradclip_jax.per_example._config import ClipConfig, LayerMode

_L2 = _norms.NormSpec(kind="pow", p=2.0, label="2")


def as_rows(x: jax.Array) -> jax.Array:
    """``x`` of shape ``(B, ...)`` as one row per example, shape ``(B, D)``.

    Measuring and summing the same 2-D array lets XLA materialize each per-example
    gradient once, in one layout (the N-D form makes it keep two copies). A leaf
    whose non-batch axes are explicitly sharded is returned unchanged.
    """
    spec = explicit_spec(x)
    if x.ndim == 2 or (spec is not None and any(a is not None for a in spec[1:])):
        return x
    return jnp.reshape(x, (x.shape[0], math.prod(x.shape[1:])))


def unrow(sums: Sequence[jax.Array], like: Sequence[jax.Array]) -> list[jax.Array]:
    """Reshapes per-leaf sums of rows back to the per-example shape of each leaf."""
    return [jnp.reshape(s, x.shape[1:]) for s, x in zip(sums, like, strict=True)]


def combine_l2(leaf_norms: Sequence[jax.Array]) -> jax.Array:
    """Combines per-leaf L2 norms (each of shape ``(B,)``) into per-example global norms.

    ``p * sqrt(sum_l (n_l / p)**2)`` with ``p`` the power of two just above ``max_l n_l``
    (clamped so that ``1 / p`` is normal: XLA turns the division into a multiplication by the
    reciprocal, and CPUs flush subnormals to zero). Dividing by a power of two is exact, so
    where ``sqrt(sum_l n_l**2)`` is exact this is its value up to the order of the additions;
    norms near the overflow or underflow threshold of the dtype stay finite and accurate; a
    norm too large for the dtype is ``inf``; NaN and inf propagate.
    """
    dtype = np.dtype(jnp.result_type(*[n.dtype for n in leaf_norms]))
    # stored once: each reduction over the stack would otherwise fuse in the whole stack (K
    # operands per kernel, several kernels), which compiles slowly for many leaves
    return combine_l2_stacked(
        lax.optimization_barrier(jnp.stack([x.astype(dtype) for x in leaf_norms]))
    )


def combine_l2_stacked(n: jax.Array) -> jax.Array:
    """:func:`combine_l2` of the ``K`` rows of ``n``, ``(K, B)`` (norms already stacked)."""
    m = jnp.max(n, axis=0)
    ok = jnp.isfinite(m) & (m > 0)
    p = jnp.where(ok, lax.stop_gradient(_norms.power_of_two(m)), jnp.ones_like(m))
    r = n / p
    return jnp.where(ok, p * sqrt_safe(jnp.sum(r * r, axis=0)), m)


def leaf_example_norms(arrays: Sequence[jax.Array], branch_free: bool = False) -> list[jax.Array]:
    """Per-example L2 norm of each leaf: a list of ``(B,)`` arrays (accumulation dtype).

    One plain sum of squares per leaf and example, and one conditional for all of them that
    measures again, by Blue's algorithm, the sums that over- or underflowed
    (:func:`~gradclip_jax._core.norms.careful_row_norms`). ``branch_free``: Blue's algorithm
    alone, no conditional, for norms taken inside a loop body.
    """
    if not arrays:
        return []
    if branch_free:  # (equal small leaves stacked into one reduction: fewer GPU kernels)
        measured = _norms.slice_norms(
            arrays, [tuple(range(1, x.ndim)) for x in arrays], _L2, branch_free=True
        )
        return [jnp.reshape(n, (x.shape[0],)) for n, x in zip(measured, arrays, strict=True)]
    # arrays of one leading size measured together (a request's blocks may have another)
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(x.shape[0], []).append(i)
    members = [[arrays[i] for i in idx] for idx in groups.values()]
    sums = [_norms.row_sums_of_squares(xs) for xs in members]
    plain = [sqrt_safe(sq) for sq, _ in sums]
    stacks = cond(
        jnp.all(jnp.stack([jnp.all(exact) for _, exact in sums])),
        lambda: plain,
        lambda: [
            jnp.where(exact, p, _norms.careful_row_norms(xs)[0])
            for xs, (_, exact), p in zip(members, sums, plain, strict=True)
        ],
    )
    out: list[Any] = [None] * len(arrays)
    for idx, stack in zip(groups.values(), stacks, strict=True):
        for row, i in enumerate(idx):
            out[i] = stack[row]
    return out


class Measured(NamedTuple):
    """Per-example measurements of per-example gradients (see :func:`measure`).

    Attributes:
      norms: the L2 norms, ``(B,)`` (global) or one ``(B,)`` array per leaf
        (per-layer); ``inf`` where the elements are finite but the norm cannot
        be represented in the accumulation dtype (its clip factor is then 0:
        :func:`~gradclip_jax.per_example._clip_sum.guard_nonfinite`).
      finite: ``(B,)`` bool: every element of the example is finite.
    """

    norms: Any
    finite: jax.Array


def measure(rows: Sequence[jax.Array], per_leaf: bool = False) -> Measured:
    """Measures per-example gradients (rows ``(B, ...)``) for clipping, with the norm engine.

    One plain sum of squares per leaf and example
    (:func:`~gradclip_jax._core.norms.row_sums_of_squares`) gives the norms whenever every sum
    is exact, as it is in training. Otherwise one conditional for the whole batch measures
    again with care (:func:`_measure_with_care`) the examples whose sums were not exact. One
    fallback for all leaves, not one per leaf: the program compiles faster, and the common
    path reads the rows once, as a hand-written clip does.
    """
    sq, exact = _norms.row_sums_of_squares(rows)
    if per_leaf:
        plain, ok = sqrt_safe(sq), exact
    else:
        total = jnp.sum(sq, axis=0)
        plain, ok = sqrt_safe(total), jnp.all(exact, axis=0) & jnp.isfinite(total)
    return cond(
        jnp.all(ok),
        lambda: _plain(plain, per_leaf),
        lambda: _measure_with_care(rows, plain, ok, per_leaf),
    )


def _plain(norms: jax.Array, per_leaf: bool) -> Measured:
    """:class:`Measured` of exact norms: ``(B,)``, or ``(K, B)`` per leaf."""
    # (shaped like the norms, not a new constant: under shard_map it varies as the norms do)
    yes = jnp.ones_like(norms, bool)
    return Measured(list(norms), yes[0]) if per_leaf else Measured(norms, yes)


def _measure_with_care(
    rows: Sequence[jax.Array], plain: jax.Array, ok: jax.Array, per_leaf: bool
) -> Measured:
    """:func:`measure` where some sum of squares over- or underflowed, or an element is not
    finite: those norms (``~ok``) by Blue's algorithm, exact across the float range, and
    where each example is finite (:func:`~gradclip_jax._core.norms.careful_row_norms`: one
    reduction per leaf). The other norms are the ``plain`` ones, so an example's result
    does not depend on what the others hold (a NaN in a padding row changes no other row's
    bits). A norm too large for the dtype is ``inf``: its example, finite, adds nothing
    (a clip factor of ``c / inf``).
    """
    leaf_n, joint, leaf_fin = _norms.careful_row_norms(rows)
    finite = jnp.all(leaf_fin, axis=0)
    if per_leaf:
        return Measured(list(jnp.where(ok, plain, leaf_n)), finite)
    return Measured(jnp.where(ok, plain, joint), finite)


def from_leaf_norms(leaf_norms: Sequence[jax.Array], per_leaf: bool) -> Measured:
    """:class:`Measured` of per-leaf norms computed elsewhere (ghost): a non-finite norm is non-finite."""
    if per_leaf:
        return Measured(
            list(leaf_norms), jnp.all(jnp.stack([jnp.isfinite(n) for n in leaf_norms]), axis=0)
        )
    n = combine_l2(leaf_norms)
    return Measured(n, jnp.isfinite(n))


def example_norms(arrays: Sequence[jax.Array], batch: int) -> jax.Array:
    """Per-example global L2 norms of per-example leaves, shape ``(B,)`` (inf if unrepresentable)."""
    if not arrays:
        return jnp.zeros((batch,), jnp.float32)
    return measure(arrays).norms  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------
# Per-leaf clip budgets
# ----------------------------------------------------------------------------


def layer_budgets(arrays: Sequence[Any], clip: Any, uniform: bool) -> list[Any]:
    """Per-leaf clip norms summing (in squares) to ``clip**2``: ``C/sqrt(K)`` or ``C*sqrt(D_k/D)``.

    ``arrays`` are per-example leaves (batch on axis 0).
    """
    k = len(arrays)
    if uniform:
        return [clip * (1.0 / k) ** 0.5 for _ in arrays]
    sizes = [math.prod(x.shape[1:]) for x in arrays]
    total = sum(sizes)
    return [clip * (d / total) ** 0.5 if total else clip * 0.0 for d in sizes]


class LeafGroups(NamedTuple):
    """Per-layer clip norms given as a prefix of the params tree (jax-privacy's layout): each
    clip norm covers a subtree, whose leaves are clipped jointly (one factor per example and group).

    Attributes:
      budgets: the clip norm of each group, in the clip tree's leaf order.
      members: for each group, the positions (among the active leaves) of its leaves.
      treedef: the clip tree's structure (the per-group norms and counts are returned in it).
    """

    budgets: list[Any]
    members: list[list[int]]
    treedef: Any


def _clip_groups(clip_tree: Any, params: Any, fn: str) -> tuple[list[Any], list[int], Any]:
    """``(clip norms, group of each leaf of params, clip treedef)``: ``clip_tree`` must be a prefix
    of ``params`` (the same structure: one clip norm per leaf)."""
    c_leaves, c_def = jax.tree_util.tree_flatten(clip_tree)
    try:
        subtrees = c_def.flatten_up_to(params)  # type: ignore[attr-defined]
    except (ValueError, TypeError):
        raise ValueError(
            f"{fn}: the per-layer l2_clip_norm tree must be a prefix of the structure of params "
            f"(one clip norm per leaf or per subtree); got {c_def} for params "
            f"{jax.tree_util.tree_structure(params)}"
        ) from None
    return (
        c_leaves,
        [k for k, sub in enumerate(subtrees) for _ in jax.tree_util.tree_leaves(sub)],
        c_def,
    )


def clip_budgets(
    config: ClipConfig, params: Any, pflat: _norms.FlatTree
) -> list[Any] | LeafGroups | None:
    """The clip norm of each active leaf (per-layer clipping), ``None`` for global clipping, or the
    :class:`LeafGroups` of a clip tree that is a strict prefix of ``params``."""
    if config.layer_mode is LayerMode.GLOBAL:
        return None
    if config.layer_mode is LayerMode.TREE:
        budgets, group_of, c_def = _clip_groups(config.l2_clip_norm, params, config.fn)
        active = [group_of[i] for i in pflat.active]
        if c_def == pflat.treedef:  # one clip norm per leaf
            return [budgets[g] for g in active]
        members = [[j for j, g in enumerate(active) if g == k] for k in range(len(budgets))]
        return LeafGroups(budgets, members, c_def)
    shapes = [jnp.zeros((1, *x.shape), jnp.float32) for x in pflat.arrays]
    if not shapes:
        return []
    return layer_budgets(shapes, config.l2_clip_norm, config.layer_mode is LayerMode.UNIFORM)


def per_layer_tree(config: ClipConfig, pflat: _norms.FlatTree, values: list[Any]) -> Any:
    """Per-layer results (norms, counts) as a tree: params' structure, or the clip tree's when the
    clip norms are a strict prefix of params (one value per group)."""
    if config.layer_mode is LayerMode.TREE:
        c_def = jax.tree_util.tree_structure(config.l2_clip_norm)
        if c_def != pflat.treedef:
            return jax.tree_util.tree_unflatten(c_def, values)
    return pflat.rebuild(values, fill=None)
