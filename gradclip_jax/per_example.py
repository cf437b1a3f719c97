"""Per-example gradient clipping: the building block of DP-SGD.

Two families of functions live here:

* :func:`per_example_global_norm_clip` and :func:`per_example_layer_norm_clip`
  take *materialized* per-example gradients (every leaf carries the batch on axis
  0) and return the sum of the clipped gradients, exactly like their optax
  namesakes, but NaN-free at zero norms, overflow-safe, accumulating 16-bit
  gradients in float32, and working when the batch axis is explicitly sharded.
* :func:`clipped_grad` turns a loss of per-example losses into a function that
  computes the **sum of clipped per-example gradients** directly: per-example
  gradients come from ``jax.vmap(jax.grad(...))``, each is materialized once
  (as one row per example), measured, and the clip and the sum are a single
  ``dot_general`` of the clip factors with the rows; ``microbatch_size`` bounds
  memory without changing the result.

For a batch :math:`\\{x_i\\}` with per-example gradients :math:`g_i` and clip
norm :math:`C`, every function computes

.. math:: \\sum_i g_i \\cdot \\min\\Big(1, \\frac{C}{\\|g_i\\|_2}\\Big)

where :math:`\\|g_i\\|_2` is the global L2 norm over all leaves of example
:math:`i` (measured by :mod:`gradclip_jax.norms`). A zero-norm example is left
unchanged (multiplier 1, never NaN). Every clipped contribution has norm at most
:math:`C` up to float32 rounding, so adding or removing one example moves the
sum by at most :math:`C` (the L2 sensitivity). That holds at the edges of the
float range too: an example whose norm does not fit in the accumulation dtype
(finite elements, norm above ~3.4e38 in float32) is reported with norm ``inf``
and scaled by :math:`C / (\\sqrt{D} \\max_j |g_{ij}|)`, an upper bound of its
norm (:math:`D` elements); when that factor is below the smallest normal float
it flushes to zero and the example contributes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax import norms as _norms
from gradclip_jax.clipping import clip_factor
from gradclip_jax.hyperparams import check_scalar, is_traced, static_value

__all__ = [
    "ClippedGradInfo",
    "ClippedGradFn",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "per_example_norms",
    "clipped_grad",
]

_L2 = _norms.NormSpec(kind="pow", p=2.0, label="2")
_LINF = _norms.NormSpec(kind="max", p=math.inf, label="inf")


# ----------------------------------------------------------------------------
# Helpers shared with gradclip_jax.dp
# ----------------------------------------------------------------------------


def _keystr(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _check_batch_axis(pairs: Sequence[tuple[Any, Any]], fn: str, what: str) -> int | None:
    """The common size of axis 0 of ``(path, leaf)`` pairs; ValueError naming a bad leaf."""
    batch, first = None, None
    for path, x in pairs:
        shape = tuple(np.shape(x))
        if len(shape) == 0:
            raise ValueError(
                f"{fn}: {what} {_keystr(path)} is a scalar (shape ()); every "
                f"{what} must carry the batch on axis 0"
            )
        if batch is None:
            batch, first = shape[0], path
        elif shape[0] != batch:
            raise ValueError(
                f"{fn}: {what} {_keystr(path)} has batch size {shape[0]} on axis 0 "
                f"(shape {shape}), but {what} {_keystr(first)} has batch size {batch}; "
                f"every {what} must carry the same batch on axis 0"
            )
    return batch


def batch_flatten(tree: Any, fn: str, what: str = "leaf") -> tuple[_norms.FlatTree, int | None]:
    """Flattens per-example ``tree`` and checks every leaf carries the batch on axis 0.

    Returns:
      ``(flat, batch_size)``; ``batch_size`` is ``None`` for a tree with no leaf.

    Raises:
      ValueError: naming the leaf, for a scalar leaf or mismatched batch sizes.
      TypeError: for integer or bool leaves (from the norm engine).
    """
    flat = _norms.flatten(tree, fn)
    pairs = [(flat.paths[i], flat.leaves[i]) for i in flat.active]
    return flat, _check_batch_axis(pairs, fn, what)


def batch_size_of(batch: Any, fn: str) -> int:
    """The batch size of a data batch (any dtypes), checking every leaf agrees on axis 0."""
    pairs = jax.tree_util.tree_flatten_with_path(batch)[0]
    size = _check_batch_axis(pairs, fn, "batch leaf")
    if size is None:
        raise ValueError(f"{fn}: `batch` has no array leaf, so it has no batch axis")
    return size


def _example_axes(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _sqrt_safe(s: jax.Array) -> jax.Array:
    """``sqrt(s)`` with a zero (not NaN) derivative at 0: the double-where trick."""
    pos = s > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, s, jnp.ones_like(s))), jnp.zeros_like(s))


def combine_l2(leaf_norms: Sequence[jax.Array]) -> jax.Array:
    """Combines per-leaf L2 norms (each of shape ``(B,)``) into per-example global norms.

    ``sqrt(sum_l n_l**2)``, computed directly when that is exact and otherwise as
    ``s * sqrt(sum_l (n_l / s)**2)`` with ``s = max_l n_l`` (times ``2**-8`` when
    it is above 1, so that ``1 / s`` is never subnormal: XLA turns the division
    into a multiplication by the reciprocal, and CPUs flush subnormals to zero).
    Norms near the overflow or underflow threshold of the dtype stay finite and
    accurate; a norm too large for the dtype is ``inf``; NaN and inf propagate.
    """
    dtype = np.dtype(jnp.result_type(*[n.dtype for n in leaf_norms]))
    n = jnp.stack([x.astype(dtype) for x in leaf_norms])  # (K, B)
    direct = _sqrt_safe(jnp.sum(n * n, axis=0))
    m = jnp.max(n, axis=0)
    ok = jnp.isfinite(m) & (m > 0)
    safe_m = jnp.where(ok, m, jnp.ones_like(m))
    scale = jnp.where(safe_m > 1, safe_m * jnp.asarray(2.0**-8, dtype), safe_m)
    r = n / scale
    scaled = jnp.where(ok, scale * _sqrt_safe(jnp.sum(r * r, axis=0)), m)
    info = jnp.finfo(dtype)
    lo = float(np.sqrt(info.tiny) / info.eps)
    fast = jnp.isfinite(direct) & (m >= lo)
    return jnp.where(fast, direct, scaled)


def leaf_example_norms(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Per-example L2 norm of each leaf: a list of ``(B,)`` arrays (accumulation dtype)."""
    if not arrays:
        return []
    measured = _norms.slice_norms(arrays, [_example_axes(x) for x in arrays], _L2)
    return [jnp.reshape(nrm, (x.shape[0],)) for nrm, x in zip(measured, arrays, strict=True)]


def _leaf_example_max(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Per-example ``max |x|`` of each leaf (the engine's ``ord=inf``), ``(B,)`` each."""
    measured = _norms.slice_norms(arrays, [_example_axes(x) for x in arrays], _LINF)
    return [jnp.reshape(m, (x.shape[0],)) for m, x in zip(measured, arrays, strict=True)]


class Measured(NamedTuple):
    """Per-example measurements of per-example gradients (see :func:`measure`).

    Attributes:
      norms: the L2 norms, ``(B,)`` (global) or one ``(B,)`` array per leaf
        (per-layer); ``inf`` where the elements are finite but the norm cannot
        be represented in the accumulation dtype.
      finite: ``(B,)`` bool: every element of the example is finite.
      unmeasured: like ``norms``: bool, the norm could not be represented.
      bound_scale: like ``norms``: ``1 / (max|x| * sqrt(D))`` where unmeasured
        (``max|x| sqrt(D)`` bounds the norm from above), else 0.
    """

    norms: Any
    finite: jax.Array
    unmeasured: Any
    bound_scale: Any


def measure(rows: Sequence[jax.Array], per_leaf: bool = False) -> Measured:
    """Measures per-example gradients (rows ``(B, ...)``) for clipping, with the norm engine.

    Besides the L2 norms this takes each example's ``max |x|`` (the engine's
    ``ord=inf``), which guards the privacy bound at the edge of the float range:
    :math:`\\max|x| \\le \\|x\\|_2 \\le \\sqrt{D} \\max|x|` always holds, so where
    the reported norm is not finite, or is below ``max|x|`` (the true norm does
    not fit in the dtype), the example is marked ``unmeasured`` and clipped with
    the upper bound :math:`\\sqrt{D}\\max|x|` instead: its contribution stays
    within the clip norm.
    """
    leaf_n = leaf_example_norms(rows)
    leaf_m = _leaf_example_max(rows)
    sizes = [math.prod(r.shape[1:]) for r in rows]
    tol = 1.0 - 2.0**-10
    leaf_fin = [jnp.isfinite(m) for m in leaf_m]
    finite = jnp.all(jnp.stack(leaf_fin), axis=0)
    leaf_bad = [
        f & ~(jnp.isfinite(n) & (n >= m * tol))
        for n, m, f in zip(leaf_n, leaf_m, leaf_fin, strict=True)
    ]

    def scale(m: jax.Array, size: int, bad: jax.Array) -> jax.Array:
        safe = jnp.where(bad & (m > 0), m, jnp.ones_like(m))
        return jnp.where(bad, (1.0 / safe) / jnp.asarray(math.sqrt(max(size, 1)), m.dtype), 0.0)

    if per_leaf:
        norms = [jnp.where(b, jnp.inf, n) for n, b in zip(leaf_n, leaf_bad, strict=True)]
        scales = [scale(m, d, b) for m, d, b in zip(leaf_m, sizes, leaf_bad, strict=True)]
        return Measured(norms, finite, leaf_bad, scales)
    n = combine_l2(leaf_n)
    dtype = n.dtype
    m = jnp.max(jnp.stack([v.astype(dtype) for v in leaf_m]), axis=0)
    # A global norm is at least every leaf's: anything else means it was lost.
    consistent = jnp.isfinite(n) & (n >= m * tol)
    bad = jnp.any(jnp.stack(leaf_bad), axis=0) | (finite & ~consistent)
    return Measured(jnp.where(bad, jnp.inf, n), finite, bad, scale(m, sum(sizes), bad))


def guarded_factor(factor: jax.Array, measured_bad: jax.Array, bound_scale: jax.Array, clip: Any) -> jax.Array:
    """``factor``, replaced by ``min(1, C / (sqrt(D) max|x|))`` for unmeasured examples."""
    c = jnp.asarray(clip, factor.dtype)
    return jnp.where(measured_bad, jnp.minimum(1.0, c * bound_scale.astype(factor.dtype)), factor)


def example_norms(arrays: Sequence[jax.Array], batch: int) -> jax.Array:
    """Per-example global L2 norms of per-example leaves, shape ``(B,)`` (inf if unrepresentable)."""
    if not arrays:
        return jnp.zeros((batch,), jnp.float32)
    return measure(arrays).norms


def _explicit_spec(x: Any) -> tuple[Any, ...] | None:
    """The partition spec of ``x`` (padded to its rank) under explicit sharding, else ``None``."""
    try:
        sharding = jax.typeof(x).sharding
        spec = tuple(sharding.spec)
    except Exception:  # not under a mesh
        return None
    spec = spec + (None,) * (np.ndim(x) - len(spec))
    if all(s is None for s in spec):
        return None
    return spec


def batch_axis_sharding(x: Any) -> tuple[Any, int]:
    """``(mesh_axes, num_shards)`` of ``x``'s axis 0 under explicit sharding, else ``(None, 1)``."""
    spec = _explicit_spec(x)
    if spec is None or not spec or spec[0] is None:
        return None, 1
    ax0 = spec[0]
    names = ax0 if isinstance(ax0, tuple) else (ax0,)
    mesh = jax.typeof(x).sharding.mesh
    return ax0, int(math.prod(mesh.shape[a] for a in names))


def match_batch_sharding(v: jax.Array, like: jax.Array) -> jax.Array:
    """``v`` (batch on axis 0) resharded like axis 0 of ``like`` when that is explicitly sharded.

    Explicit sharding requires both sides of a ``select`` to agree; a replicated
    mask or validity vector must follow the (sharded) per-example values.
    """
    ax0, _ = batch_axis_sharding(like)
    if ax0 is None or batch_axis_sharding(v)[0] == ax0:
        return v
    spec = jax.sharding.PartitionSpec(ax0, *([None] * (v.ndim - 1)))
    return jax.sharding.reshard(v, spec)


def as_rows(x: jax.Array) -> jax.Array:
    """``x`` of shape ``(B, ...)`` as one row per example, shape ``(B, D)``.

    Measuring and summing the same 2-D array lets XLA materialize each per-example
    gradient once, in one layout (the N-D form makes it keep two copies). A leaf
    whose non-batch axes are explicitly sharded is returned unchanged.
    """
    spec = _explicit_spec(x)
    if x.ndim == 2 or (spec is not None and any(a is not None for a in spec[1:])):
        return x
    return jnp.reshape(x, (x.shape[0], math.prod(x.shape[1:])))


def _row_dot(w: jax.Array, r: jax.Array, acc: np.dtype) -> jax.Array:
    """``sum_i w_i r_i`` over axis 0 as one ``dot_general`` with full-precision accumulation.

    ``Precision.HIGHEST`` keeps float32 products exact-to-rounding on every
    backend (no bf16/TF32 passes), so the clipping bound holds as computed. When
    the batch axis is explicitly sharded the output sharding is given, which is
    where ``tensordot`` raises ``ShardingTypeError``.
    """
    spec = _explicit_spec(r)
    out_sharding = None
    if spec is not None:
        out_sharding = jax.sharding.PartitionSpec(*spec[1:])
    return lax.dot_general(
        w.astype(acc),
        r.astype(acc),
        (((0,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=acc,
        out_sharding=out_sharding,
    )


def _bcast(v: jax.Array, x: jax.Array) -> jax.Array:
    """``v`` of shape ``(B,)`` reshaped to broadcast against ``x`` of shape ``(B, ...)``."""
    return jnp.reshape(v, v.shape + (1,) * (x.ndim - 1))


def fused_sums(
    rows: Sequence[jax.Array],
    factors: Sequence[jax.Array],
    keep: jax.Array | None = None,
    finite: jax.Array | None = None,
) -> list[jax.Array]:
    """``sum_i factors[l]_i * rows[l]_i`` for every leaf ``l``, in the accumulation dtype.

    Rows where ``keep`` is False contribute exactly zero, even if they hold NaN or
    inf: when every dropped row is finite (``finite``, the common case) their
    weight is simply 0; otherwise one ``lax.cond`` takes a path that also zeroes
    the rows themselves. Each sum is a single ``dot_general`` over the batch axis.

    Returns:
      The sums, each of shape ``row.shape[1:]``.
    """
    accs = [_norms.acc_dtype(r.dtype) for r in rows]
    if keep is None:
        return [_row_dot(f, r, a) for r, f, a in zip(rows, factors, accs, strict=True)]
    keep = match_batch_sharding(keep, rows[0])
    weights = [jnp.where(keep, f, jnp.zeros_like(f)) for f in factors]

    def fast(rs: Sequence[jax.Array]) -> list[jax.Array]:
        return [_row_dot(w, r, a) for r, w, a in zip(rs, weights, accs, strict=True)]

    def safe(rs: Sequence[jax.Array]) -> list[jax.Array]:
        if batch_axis_sharding(rs[0])[0] is not None:
            zeroed = [jnp.where(_bcast(keep, r), r, jnp.zeros((), r.dtype)) for r in rs]
            return fast(zeroed)

        # One example at a time: no second copy of the per-example gradients.
        def body(carry: list, xs: tuple) -> tuple:
            k, ws, rows_i = xs
            new = [
                c + jnp.where(k, w.astype(a) * r.astype(a), jnp.zeros((), a))
                for c, w, r, a in zip(carry, ws, rows_i, accs, strict=True)
            ]
            return new, None

        init = [_vary_like(jnp.zeros(r.shape[1:], a), r) for r, a in zip(rs, accs, strict=True)]
        out, _ = lax.scan(body, init, (keep, list(weights), list(rs)))
        return out

    if finite is None:
        return safe(rows)
    ok = jnp.all(keep | finite)
    return lax.cond(ok, fast, safe, list(rows))


def unrow(sums: Sequence[jax.Array], like: Sequence[jax.Array]) -> list[jax.Array]:
    """Reshapes per-leaf sums of rows back to the per-example shape of each leaf."""
    return [jnp.reshape(s, x.shape[1:]) for s, x in zip(sums, like, strict=True)]


def _check_clip(fn: str, name: str, value: Any) -> None:
    check_scalar(fn, name, value)


# ----------------------------------------------------------------------------
# optax-compatible functions over materialized per-example gradients
# ----------------------------------------------------------------------------


def per_example_global_norm_clip(grads: Any, l2_norm_clip: Any) -> tuple[Any, jax.Array]:
    """Clips each example's gradient to global L2 norm ``l2_norm_clip`` and sums.

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
      l2_norm_clip: :math:`C \\ge 0` (number or array, traced too).

    Returns:
      ``(summed, num_clipped)``: the tree of summed clipped gradients (leaves of
      shape ``leaf.shape[1:]`` in the accumulation dtype: float32 for 16-bit
      leaves) and the int32 number of examples that were scaled down.

    Raises:
      ValueError: for a leaf without a batch axis or with a different batch size
        (the message names the leaf), or a negative / NaN ``l2_norm_clip``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.per_example import per_example_global_norm_clip
      >>> grads = [jnp.array([[0., 0, 0], [0, 3, 4], [4, 0, 3], [3, 4, 0]])]
      >>> per_example_global_norm_clip(grads, 1.25)
      ([Array([1.75, 1.75, 1.75], dtype=float32)], Array(3, dtype=int32))
    """
    fn = "per_example_global_norm_clip"
    _check_clip(fn, "l2_norm_clip", l2_norm_clip)
    flat, _ = batch_flatten(grads, fn)
    arrays = flat.arrays
    if not arrays:
        return grads, jnp.zeros((), jnp.int32)
    rows = [as_rows(x) for x in arrays]
    meas = measure(rows)
    factor = clip_factor(meas.norms, jnp.asarray(l2_norm_clip, meas.norms.dtype))
    factor = guarded_factor(factor, meas.unmeasured, meas.bound_scale, l2_norm_clip)
    summed = fused_sums(rows, [factor] * len(rows))
    num_clipped = jnp.sum(factor < 1).astype(jnp.int32)
    return flat.rebuild(unrow(summed, arrays)), num_clipped


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
      clipped gradients (accumulation dtype) and the per-leaf int32 numbers of
      examples whose leaf was scaled down.

    Raises:
      ValueError: as :func:`per_example_global_norm_clip`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.per_example import per_example_layer_norm_clip
      >>> grads = [jnp.array([[3., 4.], [0., 0.]]), jnp.array([[1.], [2.]])]
      >>> sums, counts = per_example_layer_norm_clip(grads, 2.0)  # C_k = sqrt(2)
      >>> sums
      [Array([0.8485281, 1.1313708], dtype=float32), Array([2.4142137], dtype=float32)]
      >>> counts
      [Array(1, dtype=int32), Array(1, dtype=int32)]
    """
    fn = "per_example_layer_norm_clip"
    _check_clip(fn, "global_l2_norm_clip", global_l2_norm_clip)
    uniform = bool(static_value(fn, "uniform", uniform))
    flat, _ = batch_flatten(grads, fn)
    arrays = flat.arrays
    if not arrays:
        return grads, grads
    budgets = layer_budgets(arrays, global_l2_norm_clip, uniform)
    rows = [as_rows(x) for x in arrays]
    meas = measure(rows, per_leaf=True)
    factors = [
        guarded_factor(clip_factor(n, jnp.asarray(c, n.dtype)), bad, sc, c)
        for n, c, bad, sc in zip(meas.norms, budgets, meas.unmeasured, meas.bound_scale, strict=True)
    ]
    sums = fused_sums(rows, factors)
    counts = [jnp.sum(f < 1).astype(jnp.int32) for f in factors]
    return flat.rebuild(unrow(sums, arrays)), flat.rebuild(counts)


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


def per_example_norms(grads: Any) -> jax.Array:
    """The global L2 norm of each example's gradient, shape ``(B,)``.

    Args:
      grads: per-example gradients (batch on axis 0 of every leaf).

    Returns:
      The norms in the accumulation dtype (float32 for 16-bit leaves), finite
      whenever the gradients are.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.per_example import per_example_norms
      >>> per_example_norms({'a': jnp.array([[3.0], [0.0]]), 'b': jnp.array([[4.0], [1.0]])})
      Array([5., 1.], dtype=float32)
    """
    flat, batch = batch_flatten(grads, "per_example_norms")
    return example_norms(flat.arrays, batch or 0)


# ----------------------------------------------------------------------------
# clipped_grad
# ----------------------------------------------------------------------------


class ClippedGradInfo(NamedTuple):
    """What :func:`clipped_grad`'s function reports besides the gradient sum.

    None of these fields is privatized: they depend on individual examples. Do not
    release them under DP without a mechanism of your own.

    Attributes:
      num_clipped: int32 number of (unmasked) examples whose gradient was scaled
        down (``factor < 1``); with per-layer clipping, a tree of per-leaf counts.
      norms: per-example global L2 norms of the gradients before clipping, shape
        ``(B,)`` (float32 for 16-bit params; 0 for masked examples); with
        per-layer clipping, a tree of per-leaf ``(B,)`` norms.
      values: the per-example losses, shape ``(B,)``.
      aux: with ``has_aux=True``, the auxiliary output of each example, stacked
        over the batch (see :func:`clipped_grad`); otherwise ``None``.
    """

    num_clipped: Any
    norms: Any
    values: jax.Array
    aux: Any = None


_RELATIONS = {
    "add_or_remove": 1.0,
    "add_or_remove_one": 1.0,
    "add_remove": 1.0,
    "replace_special": 1.0,
    "zero_out": 1.0,
    "replace": 2.0,
    "replace_one": 2.0,
    "substitute": 2.0,
}


def sensitivity_factor(relation: Any, fn: str) -> float:
    """1 for add/remove (and zero-out) neighbours, 2 for replace-one neighbours."""
    name = getattr(relation, "name", relation)
    key = str(name).strip().lower()
    if key not in _RELATIONS:
        raise ValueError(
            f"{fn}: unknown neighbouring relation {relation!r}; expected 'add_or_remove', "
            "'replace' or 'zero_out' (or a dp_accounting.NeighboringRelation)"
        )
    return _RELATIONS[key]


class ClippedGradFn:
    """The function :func:`clipped_grad` returns.

    Call it as ``grad_fn(params, batch, *args, mask=None)`` to get
    ``(grads, info)``; ``grad_fn.sensitivity(relation)`` gives the L2 sensitivity
    of ``grads``.
    """

    def __init__(self, impl: Callable[..., Any], sens: Callable[[], Any], doc: str):
        self._impl = impl
        self._sens = sens
        self.__doc__ = doc

    def __call__(self, params: Any, batch: Any, *args: Any, mask: Any = None) -> tuple[Any, ClippedGradInfo]:
        return self._impl(params, batch, *args, mask=mask)

    def sensitivity(self, relation: Any = "add_or_remove") -> Any:
        """The L2 sensitivity of the clipped sum to one example.

        .. math:: \\Delta = \\begin{cases} C & \\text{add or remove one example (also zero-out)} \\\\ 2C & \\text{replace one example} \\end{cases}

        where :math:`C` is the clip norm (:math:`\\sqrt{\\sum_l C_l^2}` with per-layer
        norms :math:`C_l`). Masked (padding) examples contribute nothing, so they
        do not count as neighbours. Gaussian noise of standard deviation
        ``z * grad_fn.sensitivity()`` gives the noise multiplier ``z``.

        Args:
          relation: ``'add_or_remove'`` (default), ``'replace'`` or
            ``'zero_out'``, or a ``dp_accounting.NeighboringRelation``.

        Returns:
          A Python float (a JAX scalar when the clip norm is traced).
        """
        return self._sens() * sensitivity_factor(relation, "sensitivity")


def _tree_is_scalar(x: Any) -> bool:
    if callable(x):
        return False
    leaves = jax.tree_util.tree_leaves(x)
    if len(leaves) != 1 or leaves[0] is not x:
        return False
    return np.ndim(x) == 0 or (hasattr(x, "shape") and math.prod(x.shape) == 1)


def clip_flags(fs: Sequence[jax.Array], ns: Any, valid: jax.Array | None, per_layer: bool) -> tuple[Any, Any]:
    """``(clipped flags, norms)`` of one chunk: padding examples are not clipped and get norm 0.

    Global clipping: one ``(B,)`` factor ``fs[0]`` and norms ``ns``; per-layer:
    one per leaf (lists).
    """
    if not per_layer:
        flags = fs[0] < 1
        if valid is not None:
            flags = flags & valid
            ns = jnp.where(valid, ns, jnp.zeros_like(ns))
        return flags, ns
    flag_list = [f < 1 for f in fs]
    if valid is not None:
        flag_list = [fl & valid for fl in flag_list]
        ns = [jnp.where(valid, v, jnp.zeros_like(v)) for v in ns]
    return flag_list, ns


def run_chunks(
    chunk: Callable[..., tuple], pflat: _norms.FlatTree, batch: Any, valid: jax.Array | None, bsize: int,
    microbatch_size: int | None, per_layer: bool, has_aux: bool,
) -> tuple[Any, ClippedGradInfo]:
    """Runs ``chunk(batch, valid) -> (sums, norms, flags, values, aux)`` over the batch
    (at once, or in microbatches) and builds ``(grads, info)``."""
    mb = microbatch_size
    if mb is None or mb >= bsize:
        sums, ns, flags, vals, aux = chunk(batch, valid)
    else:
        init = [jnp.zeros(x.shape, _norms.acc_dtype(x.dtype)) for x in pflat.arrays]
        sums, ns, flags, vals, aux = _scan_chunks(chunk, init, batch, valid, bsize, mb)
    if per_layer:
        num_clipped: Any = pflat.rebuild([jnp.sum(fl).astype(jnp.int32) for fl in flags], fill=None)
        ns = pflat.rebuild(ns, fill=None)
    else:
        num_clipped = jnp.sum(flags).astype(jnp.int32)
    grads = pflat.rebuild(sums, fill=None)
    return grads, ClippedGradInfo(num_clipped=num_clipped, norms=ns, values=vals, aux=aux if has_aux else None)


def clipped_grad(
    loss_fn: Callable[..., Any],
    l2_clip_norm: Any,
    *,
    has_aux: bool = False,
    microbatch_size: int | None = None,
    method: str = "auto",
    per_layer: bool | str = False,
    normalize: bool = False,
    gamma: float = 0.01,
    nan_safe: bool = True,
    spmd_axis_name: Any = None,
    ghost_sum: str = "auto",
) -> ClippedGradFn:
    """A function computing the sum of clipped per-example gradients of ``loss_fn``.

    ``loss_fn(params, batch, *args)`` must return the per-example losses
    :math:`\\ell_i` of shape ``(B,)`` (or ``(losses, aux)`` with ``has_aux``). The
    returned ``grad_fn(params, batch, *args, mask=None)`` gives ``(grads, info)``:

    .. math:: \\text{grads} = \\sum_{i:\\ \\text{mask}_i} g_i \\cdot f_i, \\qquad
        g_i = \\nabla_{\\theta}\\, \\ell_i(\\theta), \\qquad
        f_i = \\begin{cases} \\min(1, C/\\|g_i\\|_2) & \\text{(clipping, default)} \\\\
        C / (\\|g_i\\|_2 + \\gamma) & \\text{(normalize=True: automatic clipping)} \\end{cases}

    a tree shaped like ``params`` (in the accumulation dtype: float32 for 16-bit
    params), so :math:`\\|g_i f_i\\|_2 \\le C` and ``grad_fn.sensitivity()`` is
    :math:`C` for add/remove neighbours (:math:`2C` for replace-one). Add noise
    of standard deviation ``z * grad_fn.sensitivity()`` and divide by the
    (expected) batch size to get a DP-SGD gradient (see
    :func:`gradclip_jax.dp.dp_noise`).

    How it runs (``method='vmap'``; for ``'ghost'``, see :mod:`gradclip_jax.ghost`): each example
    is passed to ``loss_fn`` as a batch of one (leaves of shape ``(1, ...)``),
    ``jax.vmap(jax.value_and_grad(...))`` materializes the per-example gradients of a
    chunk of examples once, as one row per example, the norm engine measures the
    rows, and the clip and the sum are one ``dot_general`` of the clip factors with
    the rows (no second copy of the per-example gradients; a ``lax.cond`` takes a
    slower, memory-light path only when a dropped example holds NaN or inf).
    With ``microbatch_size=m`` the batch is cut into
    :math:`\\lceil B/m \\rceil` chunks of ``m`` examples run one after another in a
    ``lax.scan`` (the last one padded and masked): peak memory scales with ``m``,
    and the result is the same as without chunks up to float rounding. Chunks
    take every :math:`\\lceil B/m\\rceil`-th example, so a batch sharded over
    devices keeps every device busy in every chunk.

    Args:
      loss_fn: ``loss_fn(params, batch, *args) -> losses`` with ``losses`` of shape
        ``(B,)``, or ``(losses, aux)`` when ``has_aux``. ``batch`` is any pytree
        whose leaves carry the batch on axis 0; ``args`` are shared by all
        examples (they are not split).
      l2_clip_norm: the clip norm :math:`C \\ge 0` (number or array, traced
        too), or a pytree of per-leaf clip norms with the structure of ``params``
        (per-layer clipping: leaf :math:`l` of every example is clipped to
        :math:`C_l` and the sensitivity is :math:`\\sqrt{\\sum_l C_l^2}`).
      has_aux: ``loss_fn`` returns ``(losses, aux)``. ``info.aux`` stacks the aux
        of each example over the batch: a leaf that has a leading axis of size 1
        for a one-example batch (a per-example output) comes back with shape
        ``(B, ...)``, exactly as ``loss_fn`` on the whole batch would return it;
        any other leaf gets a new leading axis of size ``B``.
      microbatch_size: ``None`` (default: one vmap over the whole batch) or a
        positive int, the number of examples per sequential chunk.
      method: ``'vmap'``; ``'ghost'`` (per-example norms from activations and
        output cotangents, then the clipped sum (see ``ghost_sum``); leaves the analysis
        does not recognise fall back to vmap; see :mod:`gradclip_jax.ghost`);
        ``'auto'`` (default): ghost when the ghost-measurable per-example
        gradients would be large (``ghost.AUTO_MIN_ELEMENTS``), else vmap.
        16-bit parameters always use vmap.
      per_layer: ``False`` (default) clips each example's global norm. ``True`` or
        ``'uniform'`` clips each leaf of each example to :math:`C/\\sqrt{K}` (K
        leaves, optax's uniform rule); ``'size'`` to :math:`C\\sqrt{D_l/D}` (by
        parameter count). Either way the sensitivity stays :math:`C`.
      normalize: automatic clipping (Bu et al. 2022, AUTO-S): scale every example
        by :math:`C/(\\|g_i\\|+\\gamma)` instead of clipping. Contributions have
        norm :math:`C\\|g_i\\|/(\\|g_i\\|+\\gamma) < C`.
      gamma: the stability constant :math:`\\gamma \\ge 0` of ``normalize``
        (default 0.01, as fastDP).
      nan_safe: (default ``True``) an example whose gradient has a NaN or inf
        contributes zero, so the sensitivity bound holds whatever the data; its
        ``info.norms`` entry shows the non-finite norm. With ``False`` it
        propagates into the sum.
      spmd_axis_name: passed to ``jax.vmap`` (for ``shard_map``/``pmap`` setups).
      ghost_sum: how the ghost path forms the clipped sum once the norms are
        known. ``'backward'``: a second backward pass on the loss reweighted by
        the clip factors (each layer's output cotangent lives only while it is
        used, as in a non-private step). ``'bookkeeping'``: reuse the stored
        activations and output cotangents, :math:`\\sum_b c_b a_b^\\top g_b`
        per layer (no second backward pass: faster, but every layer's output
        cotangent is held at once). ``'auto'`` (default): book-keeping when
        those cotangents are a small share of the loss's activations
        (``ghost.BOOKKEEPING_MAX_SHARE``; transformers), else the second pass
        (plain MLPs). Per-layer clipping always uses book-keeping. Ignored by
        ``method='vmap'``.

    Returns:
      A :class:`ClippedGradFn`: ``grad_fn(params, batch, *args, mask=None) ->
      (grads, info)`` with ``info`` a :class:`ClippedGradInfo`, and
      ``grad_fn.sensitivity(relation='add_or_remove')``. ``mask`` is an optional
      ``(B,)`` bool array: examples where it is False (padding) contribute
      nothing, are not counted and get norm 0 in ``info``.

    Raises:
      ValueError: at construction for a negative / NaN clip norm, a bad
        ``microbatch_size``, ``gamma`` or ``method``; at call time, naming the leaf
        or argument, for batch leaves without a batch axis or with different
        batch sizes, a loss that is not of shape ``(B,)``, a bad ``mask``, or a
        per-layer clip-norm tree that does not match ``params``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.per_example import clipped_grad
      >>> def loss_fn(w, batch):  # per-example squared errors, shape (B,)
      ...     return 0.5 * jnp.sum((batch['x'] * w - batch['y']) ** 2, axis=-1)
      >>> grad_fn = clipped_grad(loss_fn, 1.0)
      >>> batch = {'x': jnp.ones((3, 1)), 'y': jnp.array([[0.5], [-3.0], [0.0]])}
      >>> grads, info = jax.jit(grad_fn)(jnp.zeros(1), batch)
      >>> grads  # -0.5 + 1 (clipped from 3) + 0
      Array([0.5], dtype=float32)
      >>> info.norms, info.num_clipped, grad_fn.sensitivity('replace')
      (Array([0.5, 3. , 0. ], dtype=float32), Array(1, dtype=int32), 2.0)
    """
    fn = "clipped_grad"
    if not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be callable, got {loss_fn!r}")
    method = static_value(fn, "method", method)
    if method not in ("vmap", "ghost", "auto"):
        raise ValueError(f"{fn}: unknown method {method!r}; expected 'vmap', 'ghost' or 'auto'")
    microbatch_size = static_value(fn, "microbatch_size", microbatch_size)
    if microbatch_size is not None and (
        isinstance(microbatch_size, bool)
        or not isinstance(microbatch_size, (int, np.integer))
        or microbatch_size < 1
    ):
        raise ValueError(
            f"{fn}: microbatch_size must be None or a positive int, got {microbatch_size!r}"
        )
    per_layer = static_value(fn, "per_layer", per_layer)
    if per_layer not in (False, True, "uniform", "size"):
        raise ValueError(
            f"{fn}: per_layer must be False, True, 'uniform' or 'size', got {per_layer!r}"
        )
    normalize = bool(static_value(fn, "normalize", normalize))
    check_scalar(fn, "gamma", gamma)
    has_aux = bool(static_value(fn, "has_aux", has_aux))
    nan_safe = bool(static_value(fn, "nan_safe", nan_safe))
    ghost_sum = static_value(fn, "ghost_sum", ghost_sum)
    if ghost_sum not in ("auto", "backward", "bookkeeping"):
        raise ValueError(f"{fn}: unknown ghost_sum {ghost_sum!r}; expected 'auto', 'backward' or 'bookkeeping'")

    tree_clip = not _tree_is_scalar(l2_clip_norm)
    if tree_clip:
        clip_leaves = jax.tree_util.tree_leaves(l2_clip_norm)
        if not clip_leaves:
            raise ValueError(f"{fn}: l2_clip_norm is an empty tree")
        for path, c in jax.tree_util.tree_flatten_with_path(l2_clip_norm)[0]:
            check_scalar(fn, f"l2_clip_norm{jax.tree_util.keystr(path)}", c)
        layer_mode: Any = "tree"
    else:
        check_scalar(fn, "l2_clip_norm", l2_clip_norm)
        layer_mode = {False: None, True: "uniform", "uniform": "uniform", "size": "size"}[per_layer]

    def sens() -> Any:
        if tree_clip:
            leaves = jax.tree_util.tree_leaves(l2_clip_norm)
            if any(is_traced(c) for c in leaves):
                return jnp.sqrt(sum(jnp.square(jnp.asarray(c, jnp.float32)) for c in leaves))
            return math.sqrt(sum(float(np.asarray(c)) ** 2 for c in leaves))
        if is_traced(l2_clip_norm):
            return jnp.asarray(l2_clip_norm, jnp.float32).reshape(())
        return float(np.asarray(l2_clip_norm).reshape(()))

    def factors(n: jax.Array, c: Any) -> jax.Array:
        c = jnp.asarray(c, n.dtype).reshape(())
        if normalize:
            den = n + jnp.asarray(gamma, n.dtype)
            ok = den > 0
            return jnp.where(ok, c / jnp.where(ok, den, jnp.ones_like(den)), jnp.zeros_like(n))
        return clip_factor(n, c)

    def impl(params: Any, batch: Any, *args: Any, mask: Any = None) -> tuple[Any, ClippedGradInfo]:
        bsize = batch_size_of(batch, fn)
        _check_loss_shape(loss_fn, params, batch, args, bsize, has_aux, fn)
        valid = check_mask(mask, bsize, fn)

        params = _vary_like_batch(params, batch)
        pflat = _norms.flatten(params, fn)
        if layer_mode == "tree":
            budgets_tree = _match_clip_tree(l2_clip_norm, params, fn)
            clip_list: Any = [budgets_tree[i] for i in pflat.active]
        elif layer_mode is not None:
            shapes = [jnp.zeros((1, *x.shape), jnp.float32) for x in pflat.arrays]
            clip_list = layer_budgets(shapes, l2_clip_norm, layer_mode == "uniform") if shapes else []
        else:
            clip_list = None

        def one_example(p: Any, example: Any, *a: Any) -> tuple:
            ex1 = jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), example)

            def scalar_loss(q: Any) -> tuple:
                out = loss_fn(q, ex1, *a)
                loss, aux = out if has_aux else (out, None)
                loss = jnp.reshape(loss, ())
                if has_aux:
                    aux = jax.tree_util.tree_map(_squeeze_example_axis, aux)
                return loss, aux

            (val, aux), g = jax.value_and_grad(scalar_loss, has_aux=True)(p)
            return val, g, aux

        vmapped = jax.vmap(
            one_example,
            in_axes=(None, 0) + (None,) * len(args),
            spmd_axis_name=spmd_axis_name,
        )

        def chunk(chunk_batch: Any, chunk_valid: jax.Array | None) -> tuple:
            vals, g, aux = vmapped(params, chunk_batch, *args)
            gflat = _norms.flatten(g, fn)
            arrays = gflat.arrays
            m = jax.tree_util.tree_leaves(chunk_batch)[0].shape[0]
            if not arrays:  # params without a floating-point leaf: nothing to clip
                if clip_list is None:
                    return [], jnp.zeros((m,), jnp.float32), jnp.zeros((m,), bool), vals, aux
                return [], [], [], vals, aux
            rows = [as_rows(x) for x in arrays]
            if chunk_valid is not None:
                chunk_valid = match_batch_sharding(chunk_valid, rows[0])
            meas = measure(rows, per_leaf=clip_list is not None)
            fin = meas.finite
            if clip_list is None:
                ns: Any = meas.norms
                f0 = guarded_factor(
                    factors(ns, l2_clip_norm), meas.unmeasured, meas.bound_scale, l2_clip_norm
                )
                fs = [f0] * len(rows)
            else:
                ns = meas.norms
                fs = [
                    guarded_factor(factors(n, c), bad, sc, c)
                    for n, c, bad, sc in zip(ns, clip_list, meas.unmeasured, meas.bound_scale, strict=True)
                ]
            keep = chunk_valid
            if nan_safe:
                keep = fin if keep is None else keep & fin
            sums = unrow(fused_sums(rows, fs, keep, fin), arrays)
            flags, ns = clip_flags(fs, ns, chunk_valid, clip_list is not None)
            return sums, ns, flags, vals, aux

        return run_chunks(chunk, pflat, batch, valid, bsize, microbatch_size, clip_list is not None, has_aux)

    if method == "vmap":
        return ClippedGradFn(impl, sens, clipped_grad.__doc__ or "")
    # method 'ghost' / 'auto': norms from activations where the analysis allows it
    # (gradclip_jax.ghost), the vmap path (impl) otherwise.
    from gradclip_jax import ghost as _ghost

    ghost_impl = _ghost.make_ghost_impl(
        loss_fn, l2_clip_norm, method=method, layer_mode=layer_mode, factors=factors, vmap_impl=impl,
        has_aux=has_aux,
        microbatch_size=microbatch_size, nan_safe=nan_safe, spmd_axis_name=spmd_axis_name,
        ghost_sum=ghost_sum,
    )
    return ClippedGradFn(ghost_impl, sens, clipped_grad.__doc__ or "")


def _vma(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    try:
        aval = jax.typeof(x)
    except Exception:  # not an array
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", frozenset()) or frozenset())
    return frozenset(getattr(aval, "vma", frozenset()) or frozenset())


def _vary_like(x: jax.Array, ref: Any) -> jax.Array:
    """``x`` marked as varying over every ``shard_map`` axis ``ref`` varies over."""
    missing = tuple(sorted(_vma(ref) - _vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _vary_like_batch(params: Any, batch: Any) -> Any:
    """Inside ``shard_map``: marks params as varying over the batch's mesh axes.

    Otherwise the gradient with respect to replicated (invariant) params is
    summed over devices by autodiff (the transpose of the implicit ``pcast``), which
    would mix examples of different devices before they are clipped. With this,
    ``grad_fn`` returns the clipped sum of the *local* examples; ``psum`` it.
    """
    axes: frozenset = frozenset()
    for x in jax.tree_util.tree_leaves(batch):
        axes = axes | _vma(x)
    if not axes:
        return params

    def one(p: Any) -> Any:
        if not hasattr(p, "dtype"):
            return p
        missing = tuple(sorted(axes - _vma(p)))
        return lax.pcast(p, missing, to="varying") if missing else p

    return jax.tree_util.tree_map(one, params)


def _squeeze_example_axis(x: Any) -> Any:
    if hasattr(x, "shape") and len(x.shape) >= 1 and x.shape[0] == 1:
        return jnp.squeeze(x, 0)
    return x


def _check_loss_shape(
    loss_fn: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any], bsize: int, has_aux: bool, fn: str
) -> None:
    out = jax.eval_shape(loss_fn, params, batch, *args)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"{fn}: with has_aux=True, loss_fn must return a pair (losses, aux), got {out!r}"
            )
        out = out[0]
    shape = getattr(out, "shape", None)
    if shape is None or tuple(shape) != (bsize,):
        raise ValueError(
            f"{fn}: loss_fn must return per-example losses of shape (B,) = ({bsize},) "
            f"(the batch size of `batch`), got {'shape ' + str(tuple(shape)) if shape is not None else repr(out)}; "
            "return the unreduced per-example losses (no mean or sum over the batch)"
        )


def check_mask(mask: Any, bsize: int, fn: str) -> jax.Array | None:
    if mask is None:
        return None
    m = jnp.asarray(mask)
    if m.shape != (bsize,):
        raise ValueError(
            f"{fn}: `mask` must have shape (B,) = ({bsize},) (the batch size), got {m.shape}"
        )
    if m.dtype != jnp.bool_:
        m = m != 0
    return m


def _match_clip_tree(clip_tree: Any, params: Any, fn: str) -> list[Any]:
    """The per-leaf clip norms of ``clip_tree``, one per leaf of ``params`` (same structure)."""
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    c_leaves, c_def = jax.tree_util.tree_flatten(clip_tree)
    if p_def != c_def:  # type: ignore[operator]
        raise ValueError(
            f"{fn}: the per-layer l2_clip_norm tree must have the structure of params; "
            f"got {c_def} for params {p_def}"
        )
    del p_leaves
    return c_leaves


def _scan_chunks(
    chunk: Callable[..., Any], init: list[jax.Array], batch: Any, valid: Any, bsize: int, mb: int
) -> tuple:
    """Runs ``chunk`` over ``ceil(B/mb)`` chunks of ``mb`` examples in a ``lax.scan``.

    Chunk ``j`` holds examples ``j, j + n, j + 2n, ...`` (``n`` chunks): a batch
    sharded over devices on axis 0 stays evenly spread in every chunk. The last
    examples are padded with copies of the last one and masked out.
    """
    n = -(-bsize // mb)
    total = n * mb
    pad = total - bsize
    leaves_with_path = jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, x in leaves_with_path:
        _, shards = batch_axis_sharding(x)
        if shards > 1 and (pad or mb % shards):
            raise ValueError(
                f"clipped_grad: batch leaf {_keystr(path)} is explicitly sharded over {shards} "
                f"devices on the batch axis; with microbatch_size={mb} the batch size ({bsize}) "
                f"must be a multiple of microbatch_size and microbatch_size a multiple of {shards}"
            )
    if valid is None:
        valid = jnp.ones((bsize,), bool)
    valid = match_batch_sharding(valid, leaves_with_path[0][1])

    def pad_leaf(x: jax.Array) -> jax.Array:
        if pad == 0:
            return x
        return jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)], axis=0)

    def to_chunks(x: jax.Array) -> jax.Array:
        x = pad_leaf(x)
        x = jnp.reshape(x, (mb, n, *x.shape[1:]))
        return jnp.swapaxes(x, 0, 1)  # (n, mb, ...)

    chunked = jax.tree_util.tree_map(to_chunks, batch)
    vpad = jnp.concatenate([valid, jnp.zeros((pad,), bool)]) if pad else valid
    vchunks = jnp.swapaxes(jnp.reshape(vpad, (mb, n)), 0, 1)

    def body(carry: list, xs: tuple) -> tuple:
        b, v = xs
        sums, ns, flags, vals, aux = chunk(b, v)
        return [c + s for c, s in zip(carry, sums, strict=True)], (ns, flags, vals, aux)

    ref = leaves_with_path[0][1]
    init = [_vary_like(z, ref) for z in init]
    outs: Any
    sums, outs = lax.scan(body, init, (chunked, vchunks))

    def unchunk(x: Any) -> Any:
        if x is None:
            return None
        x = jnp.swapaxes(x, 0, 1)  # (mb, n, ...)
        x = jnp.reshape(x, (total, *x.shape[2:]))
        return x[:bsize]

    ns, flags, vals, aux = jax.tree_util.tree_map(unchunk, outs)
    return sums, ns, flags, vals, aux
