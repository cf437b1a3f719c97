"""optax-compatible per-example functions over *materialized* per-example gradients."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core.norms import promote_ints
from gradclip_jax._core.numerics import count0
from gradclip_jax._core.stored import certified_factors
from gradclip_jax._core.validation import check_scalar, clip_norm_arg, static_value
from gradclip_jax.per_example._batch import along_axis, batch_flatten
from gradclip_jax.per_example._clip_sum import clip_and_sum
from gradclip_jax.per_example._config import plain_clip_factors
from gradclip_jax.per_example._example_norms import as_rows, example_norms, layer_budgets, unrow

__all__ = ["per_example_global_norm_clip", "per_example_layer_norm_clip", "per_example_norms"]


def per_example_global_norm_clip(
    grads: Any, l2_norm_clip: Any = None, *, l2_clip_norm: Any = None
) -> tuple[Any, jax.Array]:
    """Clips each example's gradient to global L2 norm :math:`C` and sums.

    With :math:`g_i` the gradient of example :math:`i` (row :math:`i` of every leaf)
    and :math:`n_i = \\|g_i\\|_2` its global norm over all leaves:

    .. math::
        m_i = \\begin{cases} C / n_i & n_i > C \\\\ 1 & \\text{otherwise} \\end{cases},
        \\qquad \\text{summed} = \\sum_i m_i\\, g_i, \\qquad
        \\text{num\\_clipped} = \\#\\{i : m_i < 1\\}

    The same result as :func:`optax.per_example_global_norm_clip` (Abadi et al.
    2016), with these differences: norms are measured by the overflow-safe norm
    engine in float32 for 16-bit leaves; the sum is one ``dot_general`` per leaf
    in the accumulation dtype at full precision, with an explicit output sharding,
    so it also works when the batch axis is explicitly sharded (optax's
    ``tensordot`` raises ``ShardingTypeError`` there); a zero-norm
    example gets multiplier 1 (no NaN, also for ``C=0``); an empty tree gives
    ``([], 0)``. A non-finite example gets multiplier 1 and its NaN/inf
    propagates into the sum (it is never silently dropped).

    Args:
      grads: a pytree (a list, as in optax, or any tree) of per-example gradients,
        every floating-point leaf with the batch on axis 0.
      l2_norm_clip: :math:`C \\ge 0` (number or array, traced too), optax's
        name and position.
      l2_clip_norm: the same argument under its canonical spelling (as the
        rest of the DP API), accepted without a warning: give one of the two.

    Returns:
      ``(summed, num_clipped)``: the tree of summed clipped gradients (leaves of
      shape ``leaf.shape[1:]``, summed in float32 or wider and returned, as optax
      does, in the promoted dtype of all leaves: bfloat16 for an all-bfloat16
      tree, float32 for a mixed one; integer leaves count as float32) and the
      int32 number of examples that were scaled down. A single example's
      clipped gradient, as returned, has norm at most :math:`C`, rounding included.

    Raises:
      ValueError: for a leaf without a batch axis or with a different batch size
        (the message names the leaf), or a negative / NaN clip norm.
      TypeError: for both spellings of the clip norm, or neither.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import per_example_global_norm_clip
      >>> grads = [jnp.array([[0., 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])]
      >>> per_example_global_norm_clip(grads, 1.25)
      ([Array([1.75, 1.75, 1.75], dtype=float32)], Array(3, dtype=int32))
    """
    fn = "per_example_global_norm_clip"
    name = "l2_norm_clip" if l2_clip_norm is None else "l2_clip_norm"
    l2_norm_clip = clip_norm_arg(fn, l2_clip_norm, l2_norm_clip)
    check_scalar(fn, name, l2_norm_clip)
    flat, _ = batch_flatten(promote_ints(grads), fn)
    arrays = flat.arrays
    if not arrays:
        return grads, count0()
    out = np.dtype(
        jnp.result_type(*[x.dtype for x in arrays])
    )  # optax's: the tree's promoted dtype
    rows = [as_rows(x) for x in arrays]
    summed, w = clip_and_sum(
        rows,
        l2_norm_clip,
        factor_fn=plain_clip_factors,
        settle=lambda fs: _settle(rows, fs, l2_norm_clip, out, combine=True),
    )
    num_clipped = jnp.sum(w.factors[0] < 1).astype(jnp.int32)
    return flat.rebuild([s.astype(out) for s in unrow(summed, arrays)]), num_clipped


def per_example_layer_norm_clip(
    grads: Any, global_l2_norm_clip: Any, uniform: bool = True
) -> tuple[Any, Any]:
    """Clips each leaf of each example's gradient to its own budget and sums.

    With :math:`K` leaves, leaf :math:`k` of every example is clipped to

    .. math:: C_k = \\begin{cases} C/\\sqrt{K} & \\text{uniform} \\\\ C\\sqrt{D_k / D} & \\text{otherwise} \\end{cases}

    (:math:`D_k` the number of parameters of leaf :math:`k` per example, :math:`D`
    their total), so :math:`\\sum_k C_k^2 = C^2` and each example's whole gradient
    still has norm at most :math:`C`. The same result as
    :func:`optax.per_example_layer_norm_clip` (McMahan et al. 2017), NaN-free at
    zero norms, overflow-safe and shardable as :func:`per_example_global_norm_clip`.

    Args:
      grads: a pytree of per-example gradients (batch on axis 0 of every leaf).
      global_l2_norm_clip: :math:`C \\ge 0`.
      uniform: the budget rule above (default ``True``: equal budgets).

    Returns:
      ``(sums, counts)``: two trees shaped like ``grads``: the per-leaf sums of
      clipped gradients (summed in float32 or wider, returned in each leaf's
      dtype as optax does; integer leaves as float32) and the per-leaf int32 numbers of
      examples whose leaf was scaled down.

    Raises:
      ValueError: as :func:`per_example_global_norm_clip`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import per_example_layer_norm_clip
      >>> grads = [jnp.array([[3., 4.], [0., 0.]]), jnp.array([[1.], [2.]])]
      >>> sums, counts = per_example_layer_norm_clip(grads, 2.0)  # C_k = sqrt(2)
      >>> [s.round(5) for s in sums]  # clipped rows sit a few ulp inside C_k
      [Array([0.84853, 1.13137], dtype=float32), Array([2.41421], dtype=float32)]
      >>> counts
      [Array(1, dtype=int32), Array(1, dtype=int32)]
    """
    fn = "per_example_layer_norm_clip"
    check_scalar(fn, "global_l2_norm_clip", global_l2_norm_clip)
    uniform = bool(static_value(fn, "uniform", uniform))
    flat, _ = batch_flatten(promote_ints(grads), fn)
    arrays = flat.arrays
    if not arrays:
        return grads, grads
    budgets = layer_budgets(arrays, global_l2_norm_clip, uniform)
    sums: list[Any] = [None] * len(arrays)
    counts: list[Any] = [None] * len(arrays)
    for dtype in {
        np.dtype(x.dtype) for x in arrays
    }:  # leaves clip independently: one margin per dtype
        idx = [i for i, x in enumerate(arrays) if np.dtype(x.dtype) == dtype]
        part = [arrays[i] for i in idx]
        rows = [as_rows(x) for x in part]
        cs = [budgets[i] for i in idx]
        settle = functools.partial(_settle_each, rows, clips=cs, store=dtype)
        got, w = clip_and_sum(rows, cs, factor_fn=plain_clip_factors, settle=settle)
        for i, g, x, f in zip(idx, unrow(got, part), part, w.factors, strict=True):
            sums[i] = g.astype(x.dtype)  # optax: each leaf's dtype
            counts[i] = jnp.sum(f < 1).astype(jnp.int32)
    return flat.rebuild(sums), flat.rebuild(counts)


def _settle(
    rows: list[jax.Array], factors: list[jax.Array], clip: Any, store: Any, *, combine: bool
) -> list:
    """Per-example factors that lower the plain ones only where an example's clipped
    gradient, stored in ``store``, would exceed ``clip`` (one norm over ``rows`` with ``combine``)."""
    axes = [tuple(range(1, r.ndim)) for r in rows]
    keep = [along_axis(f, r.ndim) for f, r in zip(factors, rows, strict=True)]
    got = certified_factors(rows, keep, axes, clip, combine=combine, stores=[store] * len(rows))
    return [jnp.reshape(g, f.shape) for g, f in zip(got, factors, strict=True)]


def _settle_each(
    rows: list[jax.Array], factors: list[jax.Array], *, clips: list[Any], store: Any
) -> list:
    """:func:`_settle` leaf by leaf, each against its own budget."""
    return [
        _settle([r], [f], c, store, combine=False)[0]
        for r, f, c in zip(rows, factors, clips, strict=True)
    ]


def per_example_norms(grads: Any) -> jax.Array:
    """The global L2 norm of each example's gradient, shape ``(B,)``.

    Args:
      grads: per-example gradients (batch on axis 0 of every leaf).

    Returns:
      The norms in the accumulation dtype (float32 for 16-bit leaves), finite
      whenever the gradients are.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import per_example_norms
      >>> per_example_norms({'a': jnp.array([[3.0], [0.0]]), 'b': jnp.array([[4.0], [1.0]])})
      Array([5., 1.], dtype=float32)
    """
    flat, batch = batch_flatten(grads, "per_example_norms")
    return example_norms(flat.arrays, batch or 0)
