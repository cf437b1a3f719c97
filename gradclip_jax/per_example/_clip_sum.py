"""Clip and sum, written once: factors from measured norms, the guard for
unmeasurable norms, which examples are kept, and the weighted sums."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax._core.control import cond
from gradclip_jax.per_example._batch import (
    along_axis,
    explicit_spec,
    match_batch_sharding,
    zeroed,
)
from gradclip_jax.per_example._config import clip_factors
from gradclip_jax.per_example._example_norms import (
    LeafGroups,
    Measured,
    combine_l2,
    measure,
)
from gradclip_jax.per_example._products import product_precision

FactorFn = Callable[[jax.Array, Any], jax.Array]


def _row_dot(w: jax.Array, r: jax.Array, acc: np.dtype) -> jax.Array:
    """``sum_i w_i r_i`` over axis 0 as one ``dot_general`` with full-precision accumulation.

    The products run at :func:`product_precision` (``Precision.HIGHEST`` unless
    ``PRODUCT_PRECISION`` says otherwise: no bf16/TF32 passes), so the clipping
    bound holds as computed. When the batch axis is explicitly sharded the output
    sharding is given, which is where ``tensordot`` raises ``ShardingTypeError``.
    """
    spec = explicit_spec(r)
    out_sharding = None if spec is None else jc.on_mesh_of(r, jax.sharding.PartitionSpec(*spec[1:]))
    return lax.dot_general(
        w.astype(acc),
        r.astype(acc),
        (((0,), (0,)), ((), ())),
        precision=product_precision(acc, acc),
        preferred_element_type=acc,
        out_sharding=out_sharding,
    )


def scan_weighted_sum(
    init: list[jax.Array],
    keep: jax.Array,
    weights: Sequence[jax.Array],
    xs: Any,
    rows_of: Callable[[Any], Sequence[jax.Array]],
    lanes: int = 1,
) -> list[jax.Array]:
    """``sum_b [keep_b] w_{l,b} rows_of(x_b)[l]`` ``lanes`` examples at a time in a ``lax.scan``.

    A dropped example contributes exactly zero even when its rows hold NaN or
    inf, and no second copy of the per-example rows is formed. The batch is cut
    into ``lanes`` contiguous blocks and step ``i`` takes example ``i`` of every
    block (``lanes`` must divide the batch): with the batch sharded over devices
    in as many blocks as ``lanes`` (or a divisor of it), each step reads one
    example on each device, where slicing the sharded batch axis one example at
    a time makes the SPMD partitioner gather the whole batch onto every device.
    """
    accs = [c.dtype for c in init]
    steps = keep.shape[0] // lanes

    def split(x: jax.Array) -> jax.Array:  # (B, ...) -> (steps, lanes, ...): step i, block a
        return jnp.swapaxes(jnp.reshape(x, (lanes, steps, *x.shape[1:])), 0, 1)

    def body(carry: list, step: tuple) -> tuple:
        k, ws, x = step
        if lanes == 1:  # (one device: no batched gradient of one example)
            rows = [r[None] for r in rows_of(jax.tree_util.tree_map(lambda v: v[0], x))]
        else:
            rows = list(jax.vmap(rows_of)(x))
        new = []
        for c, w, r, a in zip(carry, ws, rows, accs, strict=True):
            w_r = along_axis(w.astype(a), r.ndim) * r.astype(a)
            kept = jnp.where(along_axis(k, r.ndim), w_r, jnp.zeros((), a))
            new.append(c + jnp.sum(kept, axis=0))
        return new, None

    xs = jax.tree_util.tree_map(split, xs)
    out, _ = lax.scan(body, init, (split(keep), [split(w) for w in weights], xs))
    return out  # type: ignore[no-any-return]


# Elements of the per-example gradients zeroed at a time when a dropped example is not finite
# (:func:`_zero_dropped`): a step's block, besides the rows themselves.
SAFE_BLOCK_ELEMENTS = 1 << 14


def _zero_dropped(rows: Sequence[jax.Array], keep: jax.Array, ok: jax.Array) -> list[jax.Array]:
    """``rows`` (each ``(B, D)``), their dropped examples (``keep`` False) set to exactly zero
    unless ``ok``: in place, a block of columns at a time.

    One loop, run for no step when ``ok``: each step selects zeros into the dropped examples of
    a block of columns of every leaf and writes the block back where it was read. The rows are
    the loop's state, so XLA updates them in place (no copy), and the sums formed from the
    loop's rows afterwards are the fast path's own products (one kernel for both): this rarely
    run path adds one kernel per distinct leaf shape, the block's select and write, and no
    conditional. The blocks are sliced on the feature axis, which a sharded batch leaves whole
    on each device (slicing the batch axis, as a loop over examples does, makes the SPMD
    partitioner gather the rows across devices). The blocks of one step hold
    :data:`SAFE_BLOCK_ELEMENTS` elements, or a 64th of one example's gradient where that is
    more (at most ``64 B`` steps). A leaf's last partial block is taken overlapping the one
    before, and a leaf with fewer blocks than steps repeats its last one: zeroing is idempotent.
    """
    batch, total = rows[0].shape[0], sum(r.shape[0] * r.shape[1] for r in rows)
    steps = max(1, min(-(-total // SAFE_BLOCK_ELEMENTS), 64 * batch, max(r.shape[1] for r in rows)))
    widths = [-(-r.shape[1] // steps) for r in rows]

    def body(k: jax.Array, rs: list[jax.Array]) -> list[jax.Array]:
        new = []
        for r, width in zip(rs, widths, strict=True):
            start = jnp.minimum(k * width, r.shape[1] - width)
            block = zeroed(keep, lax.dynamic_slice_in_dim(r, start, width, axis=1))
            new.append(lax.dynamic_update_slice_in_dim(r, block, start, axis=1))
        return new

    return lax.fori_loop(0, jnp.where(ok, 0, steps), body, list(rows))  # type: ignore[no-any-return]


def _kept_rows(rows: Sequence[jax.Array], keep: jax.Array, ok: jax.Array) -> list[jax.Array]:
    """``rows`` with the dropped examples zeroed unless ``ok`` (some dropped row holds NaN or
    inf, which a weight of 0 leaves in the sum).

    Rows explicitly sharded are zeroed by a select under a conditional (a loop cannot slice
    them); the others in place, a block of columns at a time (:func:`_zero_dropped`), in one
    loop for all of them.
    """
    out = list(rows)
    plain: list[int] = []  # the rows a loop can slice: 2-D, not empty, not explicitly sharded
    others: list[int] = []
    for i, r in enumerate(rows):
        sliceable = r.ndim == 2 and r.size > 0 and explicit_spec(r) is None
        (plain if sliceable else others).append(i)
    if others:
        fixed = cond(
            ok,
            lambda: [rows[i] for i in others],
            lambda: [zeroed(keep, rows[i]) for i in others],
        )
        for i, r in zip(others, fixed, strict=True):
            out[i] = r
    if plain:
        for i, r in zip(plain, _zero_dropped([rows[i] for i in plain], keep, ok), strict=True):
            out[i] = r
    return out


def fused_sums(
    rows: Sequence[jax.Array],
    factors: Sequence[jax.Array],
    keep: jax.Array | None = None,
    finite: jax.Array | None = None,
) -> list[jax.Array]:
    """``sum_i factors[l]_i * rows[l]_i`` for every leaf ``l``, in the accumulation dtype.

    Rows where ``keep`` is False contribute exactly zero, even if they hold NaN or
    inf. Without ``finite`` (small rows: the leaves ghost clipping forms) the rows
    are zeroed by an elementwise select the sum reads, with no loop and no
    conditional (on a GPU a conditional costs a round trip to the host). With
    ``finite`` (every example's gradient formed: a zeroed copy would double them)
    their weight is simply 0, which is exact when every dropped row is finite, the
    common case; otherwise a loop that runs for no step in the common case first
    zeroes the dropped rows in place, a block of columns at a time (:func:`_kept_rows`;
    on a GPU its trip count, like a conditional's predicate, is read on the host
    once): no copy of the rows, no second set of products, and under a sharded batch
    nothing gathered across devices. Each sum is a single ``dot_general`` over the
    batch axis.

    Returns:
      The sums, each of shape ``row.shape[1:]``.
    """
    accs = [_norms.sum_dtype(r.dtype) for r in rows]
    if keep is None:
        return [_row_dot(f, r, a) for r, f, a in zip(rows, factors, accs, strict=True)]
    keep = match_batch_sharding(keep, rows[0])
    once: dict[int, jax.Array] = {}  # one weight vector for the leaves sharing a factor
    weights = [once.setdefault(id(f), jnp.where(keep, f, jnp.zeros_like(f))) for f in factors]
    if finite is None:  # small rows: zeroed by a select that the sum reads
        return [
            _row_dot(w, zeroed(keep, r), a) for r, w, a in zip(rows, weights, accs, strict=True)
        ]
    ok = jnp.all(keep | finite)
    if isinstance(ok, jax.core.Tracer) or not bool(ok):  # traced, or a dropped row not finite
        # Also read from the weights (finite, for the kept examples' clip factors; else the rows
        # are zeroed, which is right anyway): the zeroing, in place, then comes after the norms
        # that read the rows, and XLA need not copy them for a reader it could run after it.
        ok = ok & jnp.all(jnp.isfinite(jnp.stack(list(once.values()))))
        rows = _kept_rows(rows, keep, ok)
    return [_row_dot(w, r, a) for r, w, a in zip(rows, weights, accs, strict=True)]


def drops_examples(valid: jax.Array | None, nan_safe: bool) -> bool:
    """Whether :func:`weigh` may drop examples (its ``keep`` is not ``None``): padding rows
    (``valid``), or with ``nan_safe`` the examples whose norm is not finite. Known at trace time,
    so a path that must zero the dropped examples' values can decide before it computes them."""
    return valid is not None or nan_safe


class Weights(NamedTuple):
    """The clip step of one batch: per-leaf ``(B,)`` factors, the kept examples, the norms.

    ``factors`` holds one entry per leaf (the same array for every leaf under
    global clipping); ``keep`` is ``None`` when every example is kept. With clip
    norms for groups of leaves (:class:`LeafGroups`), ``norms`` and ``group_factors``
    hold one entry per group.
    """

    factors: list[jax.Array]
    keep: jax.Array | None
    norms: Any
    finite: jax.Array
    group_factors: list[jax.Array] | None = None


def guard_nonfinite(factor: jax.Array, norm: jax.Array) -> jax.Array:
    """``factor``, 0 where ``norm`` is ``+inf`` (``c / inf``) and NaN where it is NaN.

    A clip factor is 1 for a non-finite norm (:func:`~gradclip_jax._core.factors.clip_factor`:
    NaN and inf stay visible). For a per-example norm that would let a gradient whose elements
    are finite, but whose norm does not fit in the dtype, into the sum unclipped: above the
    clip norm by up to 38 orders of magnitude in float32, a silent break of the sensitivity
    bound. A norm too large for the dtype is ``inf``, and with a factor of 0 its example adds
    exactly zero, as in optax's and jax-privacy's clipping (``c / inf``); an example holding
    inf or NaN still makes the sum NaN where it is kept (``0 * inf``). A NaN norm (a NaN
    element, or a ghost norm whose inner products overflowed, ``inf - inf``) gives a NaN
    factor: the example, kept, makes the sum NaN whatever its values. The one guard of every
    path's norms that cannot be measured.
    """
    bad = jnp.where(norm == jnp.inf, jnp.zeros_like(factor), jnp.full_like(factor, jnp.nan))
    return jnp.where(jnp.isnan(norm) | (norm == jnp.inf), bad, factor)


def weigh(
    meas: Measured,
    clips: Any,
    n_leaves: int,
    *,
    factor_fn: FactorFn = clip_factors,
    valid: jax.Array | None = None,
    nan_safe: bool = False,
) -> Weights:
    """Factors from measured norms (:func:`guard_nonfinite`: 0 for a norm that does not fit,
    NaN for a NaN one) and kept examples.

    ``clips`` is the clip norm (global clipping: ``meas.norms`` of shape ``(B,)``)
    or a list of per-leaf clip norms (``meas.norms`` a list). ``valid`` marks real
    examples (sharded like the norms); with ``nan_safe`` non-finite examples
    are dropped too.
    """
    if isinstance(clips, LeafGroups):
        return _weigh_groups(
            meas, clips, n_leaves, factor_fn=factor_fn, valid=valid, nan_safe=nan_safe
        )
    per_leaf = isinstance(clips, list)
    norms = meas.norms if per_leaf else [meas.norms]
    cs = clips if per_leaf else [clips]
    fs = [guard_nonfinite(factor_fn(n, c), n) for n, c in zip(norms, cs, strict=True)]
    keep = valid
    if nan_safe:
        keep = meas.finite if keep is None else keep & meas.finite
    if not per_leaf:
        # One factor and mask for every leaf, stored once: XLA would otherwise repeat their
        # computation (the norms' combination) in each leaf's kernels, which compiles slowly.
        f, keep = lax.optimization_barrier((fs[0], keep))
        fs = [f] * n_leaves
    return Weights(fs, keep, meas.norms, meas.finite)


def _weigh_groups(
    meas: Measured,
    groups: LeafGroups,
    n_leaves: int,
    *,
    factor_fn: FactorFn,
    valid: jax.Array | None,
    nan_safe: bool,
) -> Weights:
    """:func:`weigh` for clip norms of groups of leaves: each group's norm is its leaves' norms
    combined, its factor scales each of its leaves (so each group's contribution is within its
    clip norm)."""
    leaf_norms = list(meas.norms)  # (a norm that does not fit: inf, and so is its group's)
    zero = jnp.zeros_like(leaf_norms[0])
    norms = [combine_l2([leaf_norms[j] for j in m]) if m else zero for m in groups.members]
    per_group = weigh(
        Measured(norms, meas.finite),
        list(groups.budgets),
        len(norms),
        factor_fn=factor_fn,
        valid=valid,
        nan_safe=nan_safe,
    )
    factors: list[Any] = [None] * n_leaves
    for k, m in enumerate(groups.members):
        for j in m:
            factors[j] = per_group.factors[k]
    return per_group._replace(factors=factors, group_factors=per_group.factors)


def clip_and_sum(
    rows: Sequence[jax.Array],
    clips: Any,
    *,
    factor_fn: FactorFn = clip_factors,
    valid: jax.Array | None = None,
    nan_safe: bool = False,
    settle: Callable[[list[jax.Array]], list[jax.Array]] | None = None,
) -> tuple[list[jax.Array], Weights]:
    """Measure, factor, guard, keep, sum: the clipped sum of per-example rows ``(B, D)``.

    ``settle`` maps the per-leaf factors to the ones the sum is formed with (the
    exact stored-bound check of the optax-named functions); ``weights`` keeps them.

    Returns:
      ``(sums, weights)``: the per-leaf sums (accumulation dtype, shape
      ``row.shape[1:]``) and the :class:`Weights` they were formed with.
    """
    meas = measure(rows, per_leaf=isinstance(clips, (list, LeafGroups)))
    if valid is not None:
        valid = match_batch_sharding(valid, rows[0])
    w = weigh(meas, clips, len(rows), factor_fn=factor_fn, valid=valid, nan_safe=nan_safe)
    if settle is not None:
        w = w._replace(factors=settle(w.factors))
    keep = w.keep
    finite = meas.finite if keep is not None else None
    return fused_sums(rows, w.factors, keep, finite), w


def clip_flags(w: Weights, valid: jax.Array | None, per_layer: bool) -> tuple[Any, Any]:
    """``(clipped flags, norms)`` of one chunk: padding examples are not clipped and get norm 0.

    Global clipping: one ``(B,)`` flag array and norms; per-layer: one per leaf (lists).
    """
    if not per_layer:
        flags, ns = w.factors[0] < 1, w.norms
        if valid is not None:
            flags, ns = flags & valid, jnp.where(valid, ns, jnp.zeros_like(ns))
        return flags, ns
    units = w.factors if w.group_factors is None else w.group_factors
    flag_list, ns = [f < 1 for f in units], w.norms
    if valid is not None:
        flag_list = [fl & valid for fl in flag_list]
        ns = [jnp.where(valid, v, jnp.zeros_like(v)) for v in ns]
    return flag_list, ns
