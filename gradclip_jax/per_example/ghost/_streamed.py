"""The streamed ghost path: per-example norms and clipped sums taken inside the backward pass.

The probed pass (:mod:`._strategy`) keeps every site's operands and output cotangent
until the norms are taken: a scan over checkpointed layers (``nnx.remat`` in
``nnx.scan``) then stores every layer's activations, which the non-private step
recomputes. Here each site runs as a ``jax.custom_vjp`` whose backward rule holds
the site's operands and output cotangent at once, as ordinary autodiff does:

one forward pass, pulled back twice (:func:`streamed_pass`):

* each site takes two zero inputs, ``z`` ``(B,)`` and a "sink" shaped like its leaf, and gives
  an extra zero output ``E`` ``(B,)`` (inside a scan, all three stacked over the steps), whose
  cotangent carries the leaf's per-example weights into the backward pass;
* the norms' pull (ones on the losses, zeros on every ``E``): each site's rule returns, as
  ``z``'s cotangent, its per-example norm (:meth:`Rule.norm`), combined over the layers;
* the sums' pull, once the clip weights are known (ones on the losses, the weights on each
  ``E``): each site returns, as its sink's cotangent, its book-kept weighted sum
  :math:`\\sum_b w_b G_b` (:func:`~._sums.site_sum`, formed in float32 at full precision).

What each pull leaves unused (the sums in the first, the norms in the second) XLA removes: with
checkpointed layers the step is 1 forward + 2 x (recomputed forward + backward), 7 units against
the non-private step's 4 (a forward pass of its own for the sums: 8).

NaN-safe sums (an example whose gradient is not finite dropped, adding exactly zero): in the
sums' pull, each site zeroes the operand rows and cotangent of the examples weighted 0 before
its book-kept sum, as book-keeping does (:func:`~._sums.bookkept_sums`); a dropped example's
NaN stays in its own rows (the per-example contract) and adds exactly 0.

Scans over stacked layers stay loops, and run each step under the checkpoint their
body had (:attr:`Plan.remat`), so each pass recomputes what the non-private step
recomputes. Taken only where it is exact: every active leaf measured by its sites
alone (used once, or once per layer), no site formed or factored, global clipping or
per-leaf weights alike; and only for checkpointed or stacked layers (:func:`streams`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax._core.jaxcompat import open_jaxpr
from gradclip_jax.per_example._batch import Call, first_leaf, match_batch_sharding, vary_like
from gradclip_jax.per_example._config import ClipConfig, GhostSum
from gradclip_jax.per_example._example_norms import (
    as_rows,
    combine_l2,
    combine_l2_stacked,
    leaf_example_norms,
)
from gradclip_jax.per_example.ghost._analysis import Traced, own_uses
from gradclip_jax.per_example.ghost._jaxpr import evaluate, site_eqn
from gradclip_jax.per_example.ghost._measure import (
    LeafNorms,
    acc_dtype_of,
    apply_site,
    local_grads,
    sums_once,
)
from gradclip_jax.per_example.ghost._sums import site_sum
from gradclip_jax.per_example.ghost.rules import RowNorms, Site

# A site's hook: ``(closed, site, leaf value, operands, z, sink) -> (output, E)``: ``z`` the
# site's zero norm sink, ``sink`` its zero leaf-shaped sum sink, ``E`` its zero weight output.
Hook = Callable[[Any, Site, Any, list, Any, Any], tuple[Any, Any]]


def streams(config: ClipConfig, traced: Traced, pflat: _norms.FlatTree) -> bool:
    """Whether the streamed path measures this loss exactly: every active leaf by its own sites
    (used once, or once per layer of a scan: no cross terms between uses), none summed in one
    rounding pass (whose norm the weighting would have to raise), the plan of the batched loss;
    and whether it stores less than the probed path: with checkpointed or stacked layers."""
    closed, plan = traced
    if config.ghost_sum is GhostSum.BOOKKEEPING and not config.per_layer:
        return False  # (book-keeping asked for by name: the probed path's)
    if not own_uses(plan, pflat):
        return False
    if plan.remat is None and all(s.scan is None for s in plan.sites):
        # Without checkpoints or stacked layers the probed path stores no more than the
        # non-private step (1.02x on an unrolled Llama decoder) in fewer FLOPs (one forward pass,
        # not two: 1.35x the non-private step's against 2x). Stacked layers without checkpoints
        # are streamed: the probed path stacks every layer's operands and cotangents (1.4x).
        return False
    return not any(
        sums_once(s, site_eqn(closed.jaxpr, s).outvars[0].aval, pflat.leaves[s.leaf])
        for s in plan.sites
    )


def _site_norm(closed: Any, site: Site, param: Any, ops: list, g: jax.Array, acc: Any) -> jax.Array:
    """A site's per-example norm, ``(B,)``: by its rule's :meth:`Rule.norm`, or from the leaf's
    per-example gradients through that one use (:func:`~._measure.local_grads`: an elementwise
    scale's, ``(B, D)``). Norms, not squares, leave the use: their squares overflow float32 for
    gradients above ``2**64``, and the norms combine in range (:func:`combine_l2`)."""
    n = site.rule.norm(site, closed.jaxpr.eqns[site.eqn], ops, g, acc)
    if n is None:
        n = leaf_example_norms(
            [as_rows(local_grads(closed, site, param, ops, g, acc).astype(acc))], branch_free=True
        )[0]
    elif isinstance(n, RowNorms):
        n = n.combine(leaf_example_norms(list(n.arrays), branch_free=True))
    return n.astype(acc)


def _op_cotangents(closed: Any, site: Site, param: Any, ops: list, g: jax.Array) -> list:
    """The ordinary cotangents of the site's operands (the parameter's operand: zero, as the
    leaf's gradient comes from its sink)."""

    def out(o: list) -> Any:
        return apply_site(closed, site, o, param)

    cts = jax.vjp(out, ops)[1](g)[0]
    return list(cts)


def _site_fn(
    closed: Any, site: Site, acc: Any, z: Any, sink: Any, zero_dropped: bool
) -> Callable[..., Any]:
    """The site's operation as a ``custom_vjp`` of ``(param, ops, z, sink)`` returning
    ``(output, E)``, ``E`` a zero ``(B,)``. From the output's cotangent ``g`` and ``E``'s, ``w``,
    its backward gives its per-example norm as ``z``'s cotangent and its book-kept weighted
    sum :math:`\\sum_b w_b G_b` (:func:`~._sums.site_sum`) as the sink's: one pull-back with
    ``w`` zero takes the norms, one with the clip weights the sums (what a pull leaves unused,
    XLA removes). With ``zero_dropped`` (NaN-safe sums), the examples weighted 0 have their
    operand rows and cotangent zeroed in the sum, which is then exact even where those hold
    NaN or inf (a kept example weighted 0 adds 0 either way). Every array the backward reads is an argument, not a closure (a backward
    rule traced inside a scan's transpose cannot read the body's values); ``z`` and ``sink``
    give only their shapes and dtypes."""
    z_dtype, s_shape, s_dtype = z.dtype, sink.shape, sink.dtype
    s_like = jax.ShapeDtypeStruct(s_shape, s_dtype, sharding=jc.typed_sharding(sink))

    @jax.custom_vjp
    def f(param: Any, ops: list, z: Any, sink: Any) -> tuple:
        return apply_site(closed, site, ops, param), jnp.zeros_like(z)

    def fwd(param: Any, ops: list, z: Any, sink: Any) -> tuple:
        return f(param, ops, z, sink), (param, ops)

    def bwd(res: tuple, cts: tuple) -> tuple:
        param, ops = res
        g, w = cts
        norm = _site_norm(closed, site, param, ops, g, acc).astype(z_dtype)
        summed = site_sum(closed, site, param, ops, g, w, (w != 0) if zero_dropped else None)
        return (
            jnp.zeros_like(param),
            _op_cotangents(closed, site, param, ops, g),
            norm,
            # of the sink's type: a sum over a model-split block comes back split as the block
            jc.sharded_like(jnp.reshape(summed, s_shape).astype(s_dtype), s_like),
        )

    f.defvjp(fwd, bwd)
    return f


def _hook(acc: Any, zero_dropped: bool) -> Hook:
    """Each site run by its :func:`_site_fn`."""

    def hook(closed: Any, site: Site, param: Any, ops: list, z: Any, sink: Any) -> tuple:
        f = _site_fn(closed, site, acc, z, sink, zero_dropped)
        return f(param, ops, z, sink)  # type: ignore[no-any-return]

    return hook


def _evaluate(
    closed: Any,
    inputs: Sequence[Any],
    n_params: int,
    sites: Sequence[Site],
    hook: Hook,
    sinks: Sequence[tuple[Any, Any]],
    remat: Any,
) -> tuple[list[Any], list[Any]]:
    """``closed`` on ``inputs`` with every site's equation run by ``hook``, with its sinks
    (``sinks[j]``, ``(z, sink)``, for ``sites[j]``), also inside the scans over stacked layers,
    whose steps run under ``remat``'s checkpoint when given. Returns the outputs and each
    site's ``E`` (stacked over the steps in a scan)."""
    at = {s.eqn: j for j, s in enumerate(sites) if s.scan is None}
    inner: dict[int, list[int]] = {}
    for j, s in enumerate(sites):
        if s.scan is not None:
            inner.setdefault(s.scan, []).append(j)
    leaf_of = {v: i for i, v in enumerate(closed.jaxpr.invars[:n_params])}
    es: list[Any] = [None] * len(sites)

    def run(k: int, eqn: Any, invals: list) -> list[Any] | None:
        if k in at:
            s = sites[at[k]]
            out, es[at[k]] = hook(closed, s, inputs[s.leaf], invals, *sinks[at[k]])
            return [out]
        if k in inner:
            body_sites = {
                sites[j].eqn: (dataclasses.replace(sites[j], scan=None, length=1), sinks[j])
                for j in inner[k]
            }
            outs, body_es = _scan(
                eqn, invals, [leaf_of.get(v) for v in eqn.invars], body_sites, hook, remat
            )
            for j in inner[k]:
                es[j] = body_es[sites[j].eqn]
            return outs
        return None

    return evaluate(closed.jaxpr, closed.consts, inputs, run), es


def _scan(
    eqn: Any,
    invals: list,
    leaves: list[int | None],
    sites: dict[int, tuple[Site, tuple[Any, Any]]],
    hook: Hook,
    remat: Any,
) -> tuple[list[Any], dict[int, Any]]:
    """A scan over stacked layers with its body's sites (by equation: the site, its sinks stacked
    over the steps) run by ``hook``; the sinks are sliced one step at a time, like the leaves,
    and the sites' ``E`` stacked (returned by equation)."""
    info = jc.scan_info(eqn)
    n_consts, n_carry = info.n_consts, info.n_carry
    consts = invals[:n_consts]
    xs_leaves = leaves[n_consts + n_carry :]
    order = sorted(sites)

    def step(c: list, x: tuple) -> tuple[list, tuple]:
        xs, sink_steps = x
        by_eqn = {k: (sites[k][0], sk) for k, sk in zip(order, sink_steps, strict=True)}
        leaf_vals = {i: v for i, v in zip(xs_leaves, xs, strict=True) if i is not None}
        outs, es = _body(info.body, [*consts, *c, *xs], by_eqn, leaf_vals, hook)
        return outs[:n_carry], (outs[n_carry:], [es[k] for k in order])

    if remat is not None:
        step = jax.checkpoint(step, prevent_cse=remat.prevent_cse, policy=remat.policy)
    xs = (list(invals[n_consts + n_carry :]), [sites[k][1] for k in order])
    carry, (ys, es) = lax.scan(
        step,
        list(invals[n_consts : n_consts + n_carry]),
        xs,
        length=info.length,
        reverse=info.reverse,
        unroll=info.unroll,
    )
    return [*carry, *ys], dict(zip(order, es, strict=True))


def _body(
    body: Any,
    args: Sequence[Any],
    sites: dict[int, tuple[Site, tuple[Any, Any]]],
    leaf_vals: dict[int, Any],
    hook: Hook,
) -> tuple[list[Any], dict[int, Any]]:
    """One step of a scan's body, its sites (by equation, with this step's sinks) run by
    ``hook``; returns its outputs and each site's ``E`` (by equation)."""
    j, consts = open_jaxpr(body)
    es: dict[int, Any] = {}

    def run(k: int, eqn: Any, invals: list) -> list[Any] | None:
        if k not in sites:
            return None
        s, (z, sink) = sites[k]
        out, es[k] = hook(body, s, leaf_vals[s.leaf], invals, z, sink)
        return [out]

    return evaluate(j, consts or [], args, run), es


def _inputs(call: Call, batch: Any) -> list[Any]:
    return jax.tree_util.tree_leaves((call.params, batch, call.args))


def _pass(
    call: Call, traced: Traced, batch: Any, zero_dropped: bool
) -> tuple[jax.Array, list[Any], Callable]:
    """One forward pass of the sites' :func:`_site_fn` over ``batch``: the per-example losses,
    every site's ``E`` and the pull-back of ``(loss cotangent, E cotangents)`` to the sites' sinks
    ``(z cotangents, sink cotangents)``. A site's ``z`` is ``(B,)``, or ``(L, B)`` in the body of a
    scan of ``L`` steps; its sink is shaped like its leaf; both vary like the batch (inside
    ``shard_map``: each device's own norms and sums)."""
    closed, plan = traced
    pflat = call.pflat
    acc = acc_dtype_of(pflat)
    ref = first_leaf(batch)
    inputs = _inputs(call, batch)

    def zeros(length: int | None) -> jax.Array:
        z = match_batch_sharding(vary_like(jnp.zeros((ref.shape[0], length or 1), acc), ref), ref)
        return z[:, 0] if length is None else z.T

    def sink(i: int) -> jax.Array:
        leaf = pflat.leaves[i]
        return vary_like(jnp.zeros(leaf.shape, _norms.sum_dtype(leaf.dtype)), ref)

    def f(zs: list, sinks: list) -> tuple:
        outs, es = _evaluate(
            closed,
            inputs,
            len(pflat.leaves),
            plan.sites,
            _hook(acc, zero_dropped),
            list(zip(zs, sinks, strict=True)),
            plan.remat,
        )
        return outs[0], es

    zs = [zeros(None if s.scan is None else s.length) for s in plan.sites]
    (losses, es), pull = jax.vjp(f, zs, [sink(s.leaf) for s in plan.sites])
    return losses, es, pull


def streamed_pass(
    call: Call, traced: Traced, batch: Any, zero_dropped: bool
) -> tuple[jax.Array, LeafNorms, Callable[[Sequence[jax.Array]], list[jax.Array]]]:
    """Per-example losses, every active leaf's per-example norm, and the clipped sums as a function
    of the clip weights (one ``(B,)`` per active leaf), from ONE forward pass pulled back twice
    (each pull a rematerialized backward pass where the layers were checkpointed).

    The first pull (ones on the losses, zeros on every site's ``E``) gives each site's norm as its
    ``z``'s cotangent. The sums' pull (ones on the losses, each site's leaf weights ``w_{b,l}`` on
    its ``E``: its output cotangent stays the unweighted per-example one, and the book-kept sum
    applies ``w`` once) gives :math:`\\sum_b w_{b,l} G_{b,l}` as each site's sink's cotangent.
    With ``zero_dropped`` (NaN-safe sums: dropped examples weighted 0), each site zeroes the
    values of the examples weighted 0 in its sum (see :func:`_site_fn`)."""
    plan = traced.plan
    losses, es, pull = _pass(call, traced, batch, zero_dropped)
    ones = jnp.ones_like(losses)
    norm_cts = pull((ones, [jnp.zeros_like(e) for e in es]))[0]
    parts: dict[int, list[jax.Array]] = {}
    for s, n in zip(plan.sites, norm_cts, strict=True):
        parts.setdefault(s.leaf, []).append(n if n.ndim == 1 else combine_l2_stacked(n))
    norms = {i: ns[0] if len(ns) == 1 else combine_l2(ns) for i, ns in parts.items()}

    def sums(weights: Sequence[jax.Array]) -> list[jax.Array]:
        return _pulled_sums(call, traced, pull, ones, es, weights)

    return losses, LeafNorms(norms, {}, acc_dtype_of(call.pflat)), sums


def _pulled_sums(
    call: Call,
    traced: Traced,
    pull: Callable,
    ones: jax.Array,
    es: list[Any],
    weights: Sequence[jax.Array],
) -> list[jax.Array]:
    """Every active leaf's clipped sum by ``pull`` with each site's leaf weights (``weights``:
    one ``(B,)`` per active leaf) on its ``E``, summed over the leaf's sites."""
    pflat, sites = call.pflat, traced.plan.sites
    w_of = dict(zip(pflat.active, weights, strict=True))
    w_es = [
        jnp.broadcast_to(w_of[s.leaf].astype(e.dtype), e.shape)
        for s, e in zip(sites, es, strict=True)
    ]
    totals: dict[int, jax.Array] = {}
    for s, t in zip(sites, pull((ones, w_es))[1], strict=True):
        totals[s.leaf] = t if s.leaf not in totals else totals[s.leaf] + t
    out = []
    for i in pflat.active:
        leaf = pflat.leaves[i]
        out.append(totals.get(i, jnp.zeros(leaf.shape, _norms.sum_dtype(leaf.dtype))))
    return out
