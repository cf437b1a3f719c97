"""The ghost strategy: one trace and analysis of the loss, one probed forward and
backward pass, norms from activations and cotangents, then the clipped sum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradclip_jax._core.jaxcompat import shape
from gradclip_jax.per_example._batch import (
    Call,
    first_leaf,
    match_batch_sharding,
    one_example_loss,
    vary_like,
)
from gradclip_jax.per_example._chunks import run_chunks
from gradclip_jax.per_example._clip_sum import Weights, clip_flags, drops_examples, weigh
from gradclip_jax.per_example._config import ClipConfig, ClippedGradInfo, GhostSum
from gradclip_jax.per_example._example_norms import clip_budgets, from_leaf_norms
from gradclip_jax.per_example._vmap import run_vmap
from gradclip_jax.per_example.ghost._analysis import (
    Traced,
    check_per_example,
    check_sum_precision,
    sum_mode,
    trace_and_plan,
    use_ghost,
    warn_fallback,
)
from gradclip_jax.per_example.ghost._jaxpr import run_probed, site_eqn
from gradclip_jax.per_example.ghost._measure import (
    LeafNorms,
    Pass,
    acc_dtype_of,
    leaf_norms,
    pin_narrow,
    weighting_excess,
)
from gradclip_jax.per_example.ghost._streamed import streamed_pass, streams
from gradclip_jax.per_example.ghost._sums import (
    backward_sums,
    bookkept_sums,
    clipped_sums,
    costly_to_zero,
)


def _trace(config: ClipConfig, call: Call, batch: Any, check: bool) -> Traced:
    bsize = first_leaf(batch).shape[0]
    return trace_and_plan(
        config.loss_fn,
        config.has_aux,
        config.fn,
        call.params,
        call.pflat,
        batch,
        call.args,
        bsize,
        check=check,
    )


def _forward(call: Call, traced: Traced, batch: Any, backward: bool) -> Pass:
    """One forward pass with a zero probe on every site's output, and the pull-back to the probes.

    For the second backward pass the forward is linearized with respect to the
    parameters too (and pulled back twice); book-keeping holds them fixed.
    """
    closed, plan = traced
    ref = first_leaf(call.batch)
    # One probe per probed equation: the sites of several leaves summed before one use (a
    # BatchNorm's scale and offset) share it, its operands and its cotangent.
    slot: dict[tuple[int | None, int], int] = {}
    owners: list[Any] = []
    for s in plan.sites:
        if (s.scan, s.eqn) not in slot:
            slot[(s.scan, s.eqn)] = len(owners)
            owners.append(s)
    of_site = [slot[(s.scan, s.eqn)] for s in plan.sites]
    outs = [site_eqn(closed.jaxpr, s).outvars[0] for s in owners]
    # a site in a scan's body: its probe (and so its cotangent) stacked over the steps
    probes = [
        vary_like(
            jnp.zeros((s.length, *shape(v)) if s.scan is not None else shape(v), v.aval.dtype), ref
        )
        for s, v in zip(owners, outs, strict=True)
    ]
    at = {s.eqn: j for j, s in enumerate(owners) if s.scan is None}
    inner: dict[int, dict[int, int]] = {}
    for j, s in enumerate(owners):
        if s.scan is not None:
            inner.setdefault(s.scan, {})[s.eqn] = j
    kept: dict[int, tuple[int, ...]] = {}  # the batched operands leave the loop
    for s, j in zip(plan.sites, of_site, strict=True):
        kept[j] = tuple(sorted({*kept.get(j, ()), *s.rows}))

    def probed(p: Any, pr: list) -> tuple:
        res, operands = run_probed(
            closed, jax.tree_util.tree_leaves((p, batch, call.args)), at, pr, inner, kept
        )
        return res[0], operands

    losses: jax.Array
    operands: list[Any]
    if backward:
        losses, pull, operands = jax.vjp(probed, call.params, probes, has_aux=True)
        cts = pull(jnp.ones_like(losses))[1]
    else:
        losses, pull, operands = jax.vjp(lambda pr: probed(call.params, pr), probes, has_aux=True)
        cts = pull(jnp.ones_like(losses))[0]
    return Pass(losses, pull, [operands[i] for i in of_site], [cts[i] for i in of_site])


def _values_and_aux(
    config: ClipConfig, call: Call, batch: Any, losses: jax.Array
) -> tuple[jax.Array, Any]:
    """Per-example losses, and with ``has_aux`` the per-example aux (one forward per example)."""
    if not config.has_aux:
        return losses, None
    scalar_loss = one_example_loss(config.loss_fn, config.has_aux)
    in_axes = (0,) + (None,) * len(call.args)
    return jax.vmap(
        lambda ex, *a: scalar_loss(call.params, ex, *a),
        in_axes=in_axes,  # type: ignore[no-any-return]
        spmd_axis_name=config.spmd_axis_name,
    )(batch, *call.args)


def _chunk(
    config: ClipConfig, call: Call, traced: Traced, clips: Any, batch: Any, valid: jax.Array | None
) -> tuple:
    """``(sums, norms, flags, values, aux)`` of the examples of ``batch`` (the whole batch or a microbatch)."""
    m = first_leaf(batch).shape[0]
    if m != call.bsize:  # a microbatch: the jaxpr and plan at its size
        traced = _trace(config, call, batch, check=False)
    if streams(config, traced, call.pflat):
        return _streamed_chunk(config, call, traced, clips, batch, valid)
    backward = sum_mode(config, traced) is GhostSum.BACKWARD
    fwd = pin_narrow(
        _forward(call, traced, batch, backward), traced.plan.sites, acc_dtype_of(call.pflat)
    )
    measured = leaf_norms(config, call, traced, batch, fwd)
    valid = match_batch_sharding(valid, first_leaf(batch)) if valid is not None else None
    vals, aux = _values_and_aux(config, call, batch, fwd.losses)
    excess = (
        {} if backward else weighting_excess(traced, call.pflat, fwd, measured.rows, measured.acc)
    )
    w, ws = _step_weights(config, call, clips, measured, excess, valid, batch)

    def fast(keep: jax.Array | None) -> list[jax.Array]:
        if backward:
            return backward_sums(config, fwd, ws)
        return bookkept_sums(traced, call.pflat, fwd, measured.rows, ws, keep)

    sums, ns, flags = _sums_and_flags(
        fast,
        config,
        call,
        batch,
        (w, ws),
        valid,
        clips,
        not backward,
        costly_to_zero(traced, call.pflat, fwd),
    )
    return sums, ns, flags, vals, aux


def _sums_and_flags(
    fast: Callable[[jax.Array | None], list[jax.Array]],
    config: ClipConfig,
    call: Call,
    batch: Any,
    weights: tuple[Weights, list[jax.Array]],
    valid: jax.Array | None,
    clips: Any,
    zeroes_dropped: bool,
    costly: bool,
) -> tuple:
    """``(sums, norms, flags)`` of a chunk: the clipped sums by ``fast`` (NaN-safe as
    :func:`~._sums.clipped_sums` makes them) and the clip step's norms and flags."""
    w, ws = weights
    sums = clipped_sums(
        fast,
        config,
        call,
        batch,
        ws,
        w.keep,
        w.finite,
        zeroes_dropped=zeroes_dropped,
        costly=costly,
    )
    flags, ns = clip_flags(w, valid, clips is not None)
    return sums, ns, flags


def _streamed_chunk(
    config: ClipConfig, call: Call, traced: Traced, clips: Any, batch: Any, valid: jax.Array | None
) -> tuple:
    """:func:`_chunk` on the streamed path (:mod:`._streamed`): one forward pass, pulled back for
    the norms and again, with the clip weights, for the sums, each site's inside the pull that
    holds its operands."""
    # NaN-safe sums (or a microbatch's padding) drop examples by weight 0: each site's sum then
    # zeroes their values, and adds exactly what was measured, with no conditional and no
    # second forward pass (one over a patched batch would hold a second copy of the sums)
    zero_dropped = drops_examples(valid, config.nan_safe)  # the rule weigh() keeps examples by
    losses, measured, streamed_sums = streamed_pass(call, traced, batch, zero_dropped)
    valid = match_batch_sharding(valid, first_leaf(batch)) if valid is not None else None
    vals, aux = _values_and_aux(config, call, batch, losses)
    w, ws = _step_weights(config, call, clips, measured, {}, valid, batch)

    def fast(keep: jax.Array | None) -> list[jax.Array]:  # the pass zeroes what keep drops
        return streamed_sums(ws)

    sums, ns, flags = _sums_and_flags(
        fast, config, call, batch, (w, ws), valid, clips, True, costly=False
    )
    return sums, ns, flags, vals, aux


def _step_weights(
    config: ClipConfig,
    call: Call,
    clips: Any,
    measured: LeafNorms,
    excess: dict[int, jax.Array],
    valid: jax.Array | None,
    batch: Any,
) -> tuple[Weights, list[jax.Array]]:
    """The clip step and each leaf's weights for the sums: the factors (no gradient), 0 for a
    dropped example (enough when its values are finite or zeroed: see ``site_sum``). With an
    ``excess`` (one-pass sums), a factor other than 1 (exact) comes from the widened norms."""
    ref = first_leaf(batch)
    w = _weights(config, call, clips, measured, {}, valid, ref.shape[0], ref)
    if excess:
        wide = _weights(config, call, clips, measured, excess, valid, ref.shape[0], ref)
        w = w._replace(
            factors=[
                jnp.where(f == 1, f, fw) for f, fw in zip(w.factors, wide.factors, strict=True)
            ]
        )
    ws = [lax.stop_gradient(f) for f in w.factors]
    if w.keep is not None:
        ws = [jnp.where(w.keep, x, jnp.zeros_like(x)) for x in ws]
    return w, ws


def _weights(
    config: ClipConfig,
    call: Call,
    clips: Any,
    measured: LeafNorms,
    excess: dict[int, jax.Array],
    valid: jax.Array | None,
    m: int,
    ref: jax.Array,
) -> Weights:
    """The clip step from the leaves' norms, each raised by its ``excess`` (none: the norms)."""
    acc = measured.acc

    def norm(i: int) -> jax.Array:
        n = measured.norms.get(i, jnp.zeros((m,), acc)).astype(acc)
        return n + excess[i] if i in excess else n

    if clips is None:  # global clipping: the leaves' norms combined (an unused leaf adds nothing)
        parts = [norm(i) for i in call.pflat.active if i in measured.norms] + list(measured.joint)
        acc_norms = [match_batch_sharding(n.astype(acc), ref) for n in parts] or [
            jnp.zeros((m,), acc)
        ]
    else:
        acc_norms = [match_batch_sharding(norm(i), ref) for i in call.pflat.active]
    return weigh(
        from_leaf_norms(acc_norms, clips is not None),
        config.l2_clip_norm if clips is None else clips,
        len(call.pflat.active),
        factor_fn=config.factors,
        valid=valid,
        nan_safe=config.nan_safe,
    )


def run_ghost(config: ClipConfig, call: Call) -> tuple[Any, ClippedGradInfo]:
    """``(grads, info)`` by ghost clipping, or by the vmap strategy when no leaf can be measured
    without materializing (or ``method='auto'`` finds ghost clipping not worth it)."""
    traced = _trace(config, call, call.batch, check=True)
    check_per_example(config.fn, traced.plan.crossing)
    check_sum_precision(config, traced.plan, call.pflat)
    warn_fallback(traced.plan, call.pflat, call.bsize, config.method, config.fn, config.origin)
    if not use_ghost(
        traced, call.pflat, call.bsize, config.method, streams(config, traced, call.pflat)
    ):
        return run_vmap(config, call, checked=True)
    clips = clip_budgets(config, call.params, call.pflat)

    def chunk(batch: Any, valid: jax.Array | None) -> tuple:
        return _chunk(config, call, traced, clips, batch, valid)

    return run_chunks(chunk, config, call)
