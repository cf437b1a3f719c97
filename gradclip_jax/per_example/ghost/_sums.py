"""Clipped sums on the ghost path, once the clip weights are known: a second
backward pass, book-keeping, and the NaN-safe path both fall back to."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax._core.control import cond
from gradclip_jax.per_example._batch import (
    Call,
    along_axis,
    batch_axis_sharding,
    first_leaf,
    gathered_over_batch,
    one_example_loss,
    vary_like,
    zeroed,
)
from gradclip_jax.per_example._clip_sum import fused_sums, scan_weighted_sum
from gradclip_jax.per_example._config import ClipConfig
from gradclip_jax.per_example._example_norms import as_rows, unrow
from gradclip_jax.per_example._products import (
    as_measured,
    rounds_to_tf32,
    tf32_passes,
    tf32_weighted,
    tf32_weighted_once,
)
from gradclip_jax.per_example.ghost._analysis import Traced
from gradclip_jax.per_example.ghost._jaxpr import widen
from gradclip_jax.per_example.ghost._measure import Pass, apply_site, each_step, sums_once
from gradclip_jax.per_example.ghost.rules import Site


def backward_sums(config: ClipConfig, fwd: Pass, ws: Sequence[jax.Array]) -> list[jax.Array]:
    """:math:`\\nabla_\\theta \\sum_b c_b \\ell_b`: the pull-back of the weights through the loss."""
    g = _norms.flatten(fwd.pull(ws[0].astype(fwd.losses.dtype))[0], config.fn).arrays
    return [x.astype(_norms.sum_dtype(x.dtype)) for x in g]


def _per_row(x: jax.Array, rows: int) -> jax.Array:
    """Each example's value repeated for each of its ``rows`` rows (a broadcast then a merge of
    the example-major axes: unlike ``jnp.repeat``, this keeps a sharded batch axis sharded)."""
    return jnp.reshape(jnp.broadcast_to(x[:, None], (x.shape[0], rows)), (-1,))


def site_sum(
    closed: Any,
    site: Site,
    param: jax.Array,
    invals: Sequence[Any],
    g: jax.Array,
    w: jax.Array,
    keep: jax.Array | None = None,
) -> jax.Array:
    """``sum_b w_b G_b`` for one use of a leaf: the pull-back of ``w_b g_b`` through its one operation.

    The operation is evaluated in the leaf's accumulation dtype: with 16-bit
    operands and cotangents, :math:`a^\\top \\mathrm{diag}(w)\\, g` is formed from
    both widened to float32 at full precision, so each example's contribution is
    :math:`w_b a_b^\\top g_b` to float32 rounding, as measured (a 16-bit
    :math:`w_b g_b` would round it up to ``2**-9`` above). With ``keep``, the
    dropped examples' operand rows and cotangents are zeroed first: their
    contribution is exactly 0 even when those hold NaN or inf. At ``PRODUCT_PRECISION``
    ``"tf32"`` or ``"tf32x2"`` the operands are the TF32 values the norms measured, weighted
    in one or two TF32 passes (:func:`_tf32_site_sum`); a
    convolution at ``"tf32x3"`` runs as three TF32 passes
    (:func:`~gradclip_jax.per_example._products.tf32_passes`). A site in a
    scan's body gives each step's block of the stacked leaf.
    """
    if site.scan is not None:
        return each_step(
            lambda c, s, p, v, gl: site_sum(c, s, p, v, gl, w, keep), closed, site, param, invals, g
        )
    acc = _norms.acc_dtype(param.dtype)
    ct_dtype = widen(g.dtype, acc)
    if site.merged > 1:  # a merged batch: each example's weight on each of its rows
        w = _per_row(w, site.merged)
        keep = None if keep is None else _per_row(keep, site.merged)
    vals = list(invals)
    p0 = param.astype(widen(param.dtype, acc))
    if rounds_to_tf32(ct_dtype):  # "tf32", "tf32x2": TF32 passes on the operands the norms measured
        return _tf32_site_sum(
            closed, site, vals, p0, acc, g.astype(ct_dtype), w.astype(ct_dtype), keep
        )
    ct = g.astype(ct_dtype) * along_axis(w.astype(ct_dtype), g.ndim, site.out_axis)
    if keep is not None:
        ct = zeroed(keep, ct, site.out_axis)
        for r in site.rows:
            vals[r] = zeroed(keep, vals[r], site.axis)
    passes = (
        tf32_passes(vals[site.rows[0]], ct) if site.kind == "conv" and len(site.rows) == 1 else None
    )
    if passes is None:
        out, pull = jax.vjp(lambda p: apply_site(closed, site, vals, p, acc), p0)
        return pull(jc.sharded_like(ct, out))[0]  # type: ignore[no-any-return]
    # A convolution takes no dot algorithm: at "tf32x3" its three passes are written out.
    row = site.rows[0]
    total = None
    for x, c in passes:
        v = [*vals[:row], x, *vals[row + 1 :]]
        part = _pulled(closed, site, v, p0, acc, [c])
        total = part if total is None else total + part
    return total  # type: ignore[return-value]


def _weights_operand(site: Site, vals: Sequence[Any], g: jax.Array) -> bool:
    """Whether the clip weights go into the site's batched operand rather than its cotangent: for
    a dense or convolution use whose one batched operand is the smaller of the two (a language
    model's head: activations of width d against a cotangent of the vocabulary's width). The
    weighting, the TF32 split and the zeroing of dropped examples then run over the smaller array,
    and the large one is only rounded, once for both passes."""
    if site.kind not in ("dense", "conv") or len(site.rows) != 1:
        return False
    x = vals[site.rows[0]]
    return bool(jnp.issubdtype(x.dtype, jnp.floating)) and x.size < g.size


def _tf32_site_sum(
    closed: Any,
    site: Site,
    vals: list[Any],
    p0: jax.Array,
    acc: Any,
    g: jax.Array,
    w: jax.Array,
    keep: jax.Array | None,
) -> jax.Array:
    """``sum_b w_b G_b`` at ``PRODUCT_PRECISION`` ``"tf32"`` or ``"tf32x2"``: one or two TF32 passes.

    The weights multiply the smaller of the batched operand and the cotangent, both the TF32
    values the norms measured; the other is rounded to TF32. In two exact passes
    (:func:`~gradclip_jax.per_example._products.tf32_weighted`: the weight truncated to TF32
    times the rounded values is exact in float32, and splits into two TF32 parts) an
    example's contribution is ``trunc(w_b)`` times the gradient whose norm was measured. A
    dense use at ``"tf32"`` runs one pass on the weighted values rounded once to TF32
    (:func:`~gradclip_jax.per_example._products.tf32_weighted_once`): its contribution is
    within ``2**-11 trunc(w_b)`` times the spread of that gradient, which its clip factor
    allowed for (:func:`~gradclip_jax.per_example.ghost._measure.weighting_excess`).
    """
    on_operand = _weights_operand(site, vals, g)
    side, axis = (site.rows[0], site.axis) if on_operand else (None, site.out_axis)
    target = vals[side] if side is not None else g
    w_along = along_axis(w, target.ndim, axis)
    if sums_once(site, g, p0):  # one pass; the clip factor allowed for its rounding
        parts: list[jax.Array] | None = [tf32_weighted_once(target.astype(g.dtype), w_along)]
    else:
        parts = tf32_weighted(target.astype(g.dtype), w_along)
    assert parts is not None  # the caller checked rounds_to_tf32
    # with keep: NaN or inf in a dropped example's values would survive a weight of 0
    if keep is not None:
        parts = [zeroed(keep, x, axis) for x in parts]
    for r in site.rows:
        if r != side:
            vals[r] = (
                as_measured(vals[r])
                if keep is None
                else zeroed(keep, as_measured(vals[r]), site.axis)
            )
    if not on_operand:
        return _pulled(closed, site, vals, p0, acc, parts)
    ct = as_measured(g) if keep is None else zeroed(keep, as_measured(g), site.out_axis)
    row = site.rows[0]
    total = None
    for part in parts:
        pulled = _pulled(closed, site, [*vals[:row], part, *vals[row + 1 :]], p0, acc, [ct])
        total = pulled if total is None else total + pulled
    return total  # type: ignore[return-value]


def _pulled(
    closed: Any, site: Site, vals: Sequence[Any], p0: jax.Array, acc: Any, cts: Sequence[jax.Array]
) -> jax.Array:
    """The sum of the pull-backs of ``cts`` through the site's operation on ``vals``, its products
    at ``Precision.DEFAULT`` (each pass exact on TF32 operands; TF32 tensor cores on NVIDIA GPUs)."""
    out, pull = jax.vjp(lambda p: apply_site(closed, site, vals, p, acc, lax.Precision.DEFAULT), p0)
    cts = [jc.sharded_like(c, out) for c in cts]
    total = pull(cts[0])[0]
    for c in cts[1:]:
        total = total + pull(c)[0]
    return total  # type: ignore[no-any-return]


# Site kinds whose dropped-example zeroing costs a pass over large activations the
# sum cannot fuse (a convolution's input): a model with one keeps the NaN-safe
# book-kept sums in a conditional, for the rare step that needs them (see
# :func:`costly_to_zero`).
COSTLY_TO_ZERO = frozenset({"conv"})


def costly_to_zero(traced: Traced, pflat: _norms.FlatTree, fwd: Pass) -> bool:
    """Whether zeroing the dropped examples' values in the book-kept sums costs a pass of its own:
    at a :data:`COSTLY_TO_ZERO` site whose sum reads its operands in place. Where the sum runs on
    TF32-rounded operands (``PRODUCT_PRECISION`` ``"tf32"``, ``"tf32x2"``: GPUs' default) it reads a
    rounded copy of the input, which a convolution cannot fuse, and the zeroing joins the pass
    that makes the copy: then the sums zero the dropped examples on every step, with no
    conditional (on a GPU a conditional stops the host until its predicate is copied back)."""
    for s, g in zip(traced.plan.sites, fwd.cts, strict=True):
        acc = _norms.acc_dtype(pflat.leaves[s.leaf].dtype)
        if s.kind in COSTLY_TO_ZERO and not rounds_to_tf32(widen(g.dtype, acc)):
            return True
    return False


def bookkept_sums(
    traced: Traced,
    pflat: _norms.FlatTree,
    fwd: Pass,
    rows: dict[int, jax.Array],
    weights: Sequence[jax.Array],
    keep: jax.Array | None = None,
) -> list[jax.Array]:
    """The clipped sum of every active leaf, :math:`\\sum_b c_{b,l} G_{b,l}`, by book-keeping.

    Nothing is differentiated a second time: a dense or embedding leaf's sum is
    the pull-back of the reweighted cotangent through its one operation at the
    whole batch (for a dense layer, :math:`a^\\top \\mathrm{diag}(c)\\, g`),
    summed over its uses for a tied leaf; a leaf whose per-example gradients were
    formed anyway (``rows``) is their weighted row sum. Everything is formed in
    the leaves' accumulation dtype (float32 for 16-bit leaves and activations).
    ``weights`` holds one ``(B,)`` vector per active leaf, already 0 for dropped
    examples. ``keep`` (the NaN-safe form) marks the kept examples when a dropped
    one may hold NaN or inf: the dropped examples' operands, cotangents and rows
    are then zeroed, not only weighted by 0.
    """
    w_of = dict(zip(pflat.active, weights, strict=True))
    row_ids = [i for i in pflat.active if i in rows]
    totals: dict[int, jax.Array] = {}
    if row_ids:
        totals.update(
            zip(
                row_ids,
                fused_sums([rows[i] for i in row_ids], [w_of[i] for i in row_ids], keep),
                strict=True,
            )
        )
    for s, o, g in zip(
        traced.plan.sites, fwd.operands, fwd.cts, strict=True
    ):  # every use of the other leaves
        i = s.leaf
        if i in rows or i not in w_of:
            continue
        total = site_sum(traced.closed, s, pflat.leaves[i], o, g, w_of[i], keep)
        total = total.astype(_norms.sum_dtype(pflat.leaves[i].dtype))
        totals[i] = total if i not in totals else totals[i] + total
    out = []
    for i in pflat.active:
        leaf = pflat.leaves[i]
        acc = _norms.sum_dtype(leaf.dtype)
        t = totals.get(i)
        total = jnp.zeros(leaf.shape, acc) if t is None else t  # None: an unused leaf
        out.append(jnp.reshape(total, leaf.shape).astype(acc))
    return out


def _lanes(ref: jax.Array) -> int:
    """Examples per step of the loop over a batch led by ``ref`` (:func:`scan_weighted_sum`): one
    per device the batch can be sharded over, ``gcd(B, devices)`` (nothing at trace time says
    how it is sharded; a batch sharded over ``D`` devices, ``D`` dividing both, is read locally),
    and one inside ``shard_map`` (``ref`` is then this device's own examples)."""
    if jc.varying_axes(ref):
        return 1
    return math.gcd(ref.shape[0], jax.device_count())


def clipped_sums(
    fast: Callable[[jax.Array | None], list[jax.Array]],
    config: ClipConfig,
    call: Call,
    batch: Any,
    ws: Sequence[jax.Array],
    keep: jax.Array | None,
    finite: jax.Array,
    zeroes_dropped: bool,
    costly: bool = True,
) -> list[jax.Array]:
    """The clipped sums: ``fast(None)`` (second backward pass or book-keeping), made NaN-safe.

    A weight of 0 removes an example's contribution exactly when its values are
    finite; a dropped example with a non-finite norm could leak NaN through
    ``0 * inf`` in the shared computation.

    * Book-keeping (``zeroes_dropped``) zeroes the dropped examples' values
      (``fast(keep)``) and adds exactly what was measured. Where no site is
      costly to zero (``costly`` False: no :data:`COSTLY_TO_ZERO` kind) it always does,
      with no conditional (which also spares the program a second copy of the
      sums, and a GPU a round trip to the host); else the fast sums zero
      nothing and, in a ``lax.cond``, the rare step that needs it forms them all
      again zeroed.
    * The second backward pass is replaced on such a step (``lax.cond``) by a
      path that forms each kept example's gradient in turn.
    """
    if keep is None:
        return fast(None)
    if zeroes_dropped and not costly:
        return fast(keep)
    pflat = call.pflat
    scalar_loss = one_example_loss(config.loss_fn, config.has_aux)

    params = gathered_over_batch(call.params, batch)  # unmapped in the vmap below

    def grad_of(example: Any) -> Any:
        return jax.grad(lambda p: scalar_loss(p, example, *call.args)[0])(params)

    def safe(_: Any) -> list[jax.Array]:  # the fast sums may hold NaN: not used
        if zeroes_dropped:
            return fast(keep)
        if batch_axis_sharding(first_leaf(batch))[0] is not None:
            # a scan cannot run over a sharded axis: form the per-example gradients
            arrays = _norms.flatten(jax.vmap(grad_of)(batch), config.fn).arrays
            sums = fused_sums([as_rows(x) for x in arrays], list(ws), keep, jnp.zeros_like(keep))
            return unrow(sums, arrays)
        ref = first_leaf(batch)
        init = [vary_like(jnp.zeros(x.shape, _norms.sum_dtype(x.dtype)), ref) for x in pflat.arrays]
        return scan_weighted_sum(
            init,
            keep,
            ws,
            batch,
            lambda ex: _norms.flatten(grad_of(ex), config.fn).arrays,
            lanes=_lanes(ref),
        )

    risky = jnp.any(~keep & ~finite)
    # The fast sums are computed outside the conditional, which only picks between
    # results: XLA's CPU backend runs convolutions inside a branch without its fast
    # kernels (a conv kernel's book-kept or second-pass sum took 15x longer there).
    sums = fast(None)

    def safe_typed(s: list[jax.Array]) -> list[jax.Array]:  # both branches of one type
        return [jc.sharded_like(x, y) for x, y in zip(safe(s), s, strict=True)]

    return cond(risky, safe_typed, lambda s: s, sums)  # type: ignore[no-any-return]
