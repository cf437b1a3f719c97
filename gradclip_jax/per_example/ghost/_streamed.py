"""The streamed ghost path: per-example norms and clipped sums taken inside the backward pass.

The probed pass (:mod:`._strategy`) keeps every site's operands and output cotangent
until the norms are taken: a scan over checkpointed layers (``nnx.remat`` in
``nnx.scan``) then stores every layer's activations, which the non-private step
recomputes. Here each site runs as a ``jax.custom_vjp`` whose backward rule holds
the site's operands and output cotangent at once, as ordinary autodiff does:

* the norm pass differentiates with respect to a zero ``(leaves, B)`` input ``z``; a
  site's rule returns, as ``z``'s cotangent, its per-example squared norm
  (:meth:`Rule.norm`), which the scan's backward sums over the layers;
* the sum pass differentiates with respect to zero "sinks" shaped like the leaves; a
  site returns, as its sink's cotangent, its book-kept weighted sum
  :math:`\\sum_b w_b G_b` (:func:`~._sums.site_sum`, formed in float32 at full precision).

NaN-safe sums (an example whose gradient is not finite dropped, adding exactly zero) run
the sum pass on the batch with each dropped example replaced by a kept one, weighted 0
(:func:`patch_dropped`): no select on the stored activations, which XLA would make on a
copy of them all.

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

# A site's hook: ``(closed, site, leaf value, operands, sink) -> output`` (``sink``: the leaf's
# sink in the sum pass, else ``None``).
Hook = Callable[[Any, Site, Any, list, Any], Any]


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
    closed: Any,
    site: Site,
    norm: Callable[..., jax.Array] | None,
    summed: Callable[..., jax.Array] | None,
) -> Callable[..., Any]:
    """The site's operation as a ``custom_vjp`` of ``(param, ops, z, sink, w)``. Its backward
    gives ``norm(param, ops, g, z)`` as ``z``'s cotangent (the norm pass) or ``summed(param, ops, g, w)``
    as the sink's (the sum pass); every value it reads is an argument, not a closure (a backward
    rule traced inside a scan's transpose cannot read the body's values)."""

    @jax.custom_vjp
    def f(param: Any, ops: list, z: Any, sink: Any, w: Any) -> Any:
        return apply_site(closed, site, ops, param)

    def fwd(param: Any, ops: list, z: Any, sink: Any, w: Any) -> tuple:
        return f(param, ops, z, sink, w), (param, ops, z, sink, w)

    def bwd(res: tuple, g: jax.Array) -> tuple:
        param, ops, z, sink, w = res
        z_ct = None if norm is None else norm(param, ops, g, z)
        s_ct = (
            None
            if summed is None
            else jnp.reshape(summed(param, ops, g, w), sink.shape).astype(sink.dtype)
        )
        return (
            jnp.zeros_like(param),
            _op_cotangents(closed, site, param, ops, g),
            z_ct,
            s_ct,
            None if w is None else jnp.zeros_like(w),
        )

    f.defvjp(fwd, bwd)
    return f


def _norm_hook(acc: Any) -> Hook:
    """Sites whose backward gives their per-example norm as their sink's cotangent (``(B,)``)."""

    def hook(closed: Any, site: Site, param: Any, ops: list, sink: Any) -> Any:
        def norm(p: Any, o: list, g: jax.Array, z: jax.Array) -> jax.Array:
            return _site_norm(closed, site, p, o, g, acc).astype(z.dtype)

        return _site_fn(closed, site, norm, None)(param, ops, sink, None, None)

    return hook


def _sum_hook(weights: dict[int, jax.Array]) -> Hook:
    """Sites whose backward gives their weighted sum (``weights[leaf]``) as their sink's cotangent."""

    def hook(closed: Any, site: Site, param: Any, ops: list, sink: Any) -> Any:
        def summed(p: Any, o: list, g: jax.Array, w: jax.Array) -> jax.Array:
            return site_sum(closed, site, p, o, g, w)

        return _site_fn(closed, site, None, summed)(param, ops, None, sink, weights[site.leaf])

    return hook


def _evaluate(
    closed: Any,
    inputs: Sequence[Any],
    n_params: int,
    sites: Sequence[Site],
    hook: Hook,
    sinks: Sequence[Any],
    remat: Any,
) -> list[Any]:
    """``closed`` on ``inputs`` with every site's equation run by ``hook``, with its sink
    (``sinks[j]`` for ``sites[j]``), also inside the scans over stacked layers, whose steps
    run under ``remat``'s checkpoint when given."""
    at = {s.eqn: j for j, s in enumerate(sites) if s.scan is None}
    inner: dict[int, list[int]] = {}
    for j, s in enumerate(sites):
        if s.scan is not None:
            inner.setdefault(s.scan, []).append(j)
    leaf_of = {v: i for i, v in enumerate(closed.jaxpr.invars[:n_params])}

    def run(k: int, eqn: Any, invals: list) -> list[Any] | None:
        if k in at:
            s = sites[at[k]]
            return [hook(closed, s, inputs[s.leaf], invals, sinks[at[k]])]
        if k in inner:
            body_sites = {
                sites[j].eqn: (dataclasses.replace(sites[j], scan=None, length=1), sinks[j])
                for j in inner[k]
            }
            return _scan(eqn, invals, [leaf_of.get(v) for v in eqn.invars], body_sites, hook, remat)
        return None

    return evaluate(closed.jaxpr, closed.consts, inputs, run)


def _scan(
    eqn: Any,
    invals: list,
    leaves: list[int | None],
    sites: dict[int, tuple[Site, Any]],
    hook: Hook,
    remat: Any,
) -> list[Any]:
    """A scan over stacked layers with its body's sites (by equation: the site, its sink stacked
    over the steps) run by ``hook``; the sinks are sliced one step at a time, like the leaves."""
    info = jc.scan_info(eqn)
    n_consts, n_carry = info.n_consts, info.n_carry
    consts = invals[:n_consts]
    xs_leaves = leaves[n_consts + n_carry :]
    order = sorted(sites)

    def step(c: list, x: tuple) -> tuple[list, list]:
        xs, sink_steps = x
        by_eqn = {k: (sites[k][0], sk) for k, sk in zip(order, sink_steps, strict=True)}
        leaf_vals = {i: v for i, v in zip(xs_leaves, xs, strict=True) if i is not None}
        outs = _body(info.body, [*consts, *c, *xs], by_eqn, leaf_vals, hook)
        return outs[:n_carry], outs[n_carry:]

    if remat is not None:
        step = jax.checkpoint(step, prevent_cse=remat.prevent_cse, policy=remat.policy)
    xs = (list(invals[n_consts + n_carry :]), [sites[k][1] for k in order])
    carry, ys = lax.scan(
        step,
        list(invals[n_consts : n_consts + n_carry]),
        xs,
        length=info.length,
        reverse=info.reverse,
        unroll=info.unroll,
    )
    return [*carry, *ys]


def _body(
    body: Any,
    args: Sequence[Any],
    sites: dict[int, tuple[Site, Any]],
    leaf_vals: dict[int, Any],
    hook: Hook,
) -> list[Any]:
    """One step of a scan's body, its sites (by equation, with this step's sink) run by ``hook``."""
    j, consts = open_jaxpr(body)

    def run(k: int, eqn: Any, invals: list) -> list[Any] | None:
        if k not in sites:
            return None
        s, sink = sites[k]
        return [hook(body, s, leaf_vals[s.leaf], invals, sink)]

    return evaluate(j, consts or [], args, run)


def _inputs(call: Call, batch: Any) -> list[Any]:
    return jax.tree_util.tree_leaves((call.params, batch, call.args))


def patch_dropped(batch: Any, keep: jax.Array) -> Any:
    """``batch`` with each dropped example (``keep`` False) replaced by the first kept one.

    The sum pass runs on it with the dropped examples' weights 0, so no value it reads is NaN
    or inf: examples are independent (the per-example contract), and a kept example's norm,
    and so each of its uses' operands and cotangents, is finite. A dropped example then adds
    exactly ``0 * finite`` to each sum, with no select on the stored activations (which XLA
    makes as a copy of them all in a scan over layers not rematerialized). With no example
    kept, the first example stands in, and the caller zeroes the sums.
    """
    first = jnp.arange(keep.shape[0]) == jnp.argmax(keep)  # (the first example when none is kept)

    def patch(x: Any) -> Any:
        return jnp.where(_rows(keep, x), x, _pick(x, first))

    return jax.tree_util.tree_map(patch, batch)


def _rows(mask: jax.Array, x: Any) -> jax.Array:
    return jnp.reshape(mask, mask.shape + (1,) * (jnp.ndim(x) - 1))


def _pick(x: Any, one: jax.Array) -> jax.Array:
    """The example of ``x`` where ``one`` is True, ``(1, ...)``, its bits unchanged: a sum over the
    batch (sharded, an all-reduce of one example; a dynamic slice gathers the whole batch)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return _pick(x.astype(jnp.uint8), one).astype(jnp.bool_)
    if not jnp.issubdtype(x.dtype, jnp.integer):  # floats by their bits
        bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        return lax.bitcast_convert_type(_pick(lax.bitcast_convert_type(x, bits), one), x.dtype)
    picked = jnp.where(_rows(one, x), x, jnp.zeros((), x.dtype))
    return jnp.sum(picked, axis=0, keepdims=True, dtype=x.dtype)


def streamed_norms(call: Call, traced: Traced, batch: Any) -> tuple[jax.Array, LeafNorms]:
    """Per-example losses and every active leaf's per-example norm, from one forward and one
    (rematerialized) backward pass: each site's norm is the cotangent of its zero sink,
    ``(B,)``, or ``(L, B)`` for a site in the body of a scan of ``L`` steps (one per layer)."""
    closed, plan = traced
    acc = acc_dtype_of(call.pflat)
    ref = first_leaf(batch)
    inputs = _inputs(call, batch)

    def losses(sinks: list[jax.Array]) -> jax.Array:
        return _evaluate(
            closed, inputs, len(call.pflat.leaves), plan.sites, _norm_hook(acc), sinks, plan.remat
        )[0]

    def zeros(length: int | None) -> jax.Array:
        """A site's zero sink, sharded (and varying) like the batch: its cotangent is the norms."""
        z = match_batch_sharding(vary_like(jnp.zeros((ref.shape[0], length or 1), acc), ref), ref)
        return z[:, 0] if length is None else z.T

    out, pull = jax.vjp(losses, [zeros(None if s.scan is None else s.length) for s in plan.sites])
    parts: dict[int, list[jax.Array]] = {}
    for s, n in zip(plan.sites, pull(jnp.ones_like(out))[0], strict=True):
        parts.setdefault(s.leaf, []).append(n if n.ndim == 1 else combine_l2_stacked(n))
    norms = {i: ns[0] if len(ns) == 1 else combine_l2(ns) for i, ns in parts.items()}
    return out, LeafNorms(norms, {}, acc)


def streamed_sums(
    call: Call, traced: Traced, batch: Any, weights: Sequence[jax.Array], keep: jax.Array | None
) -> list[jax.Array]:
    """Every active leaf's clipped sum :math:`\\sum_b w_{b,l} G_{b,l}` (``weights``: one ``(B,)``
    per active leaf), each site's book-kept in the backward pass that holds its operands, as
    the cotangent of its zero sink shaped like the leaf (stacked over the steps in a scan).
    With ``keep`` (NaN-safe sums), the pass runs on the batch with the dropped examples patched
    (:func:`patch_dropped`); their weights must be 0."""
    if keep is not None:
        sums = streamed_sums(call, traced, patch_dropped(batch, keep), weights, None)
        kept = jnp.any(keep)  # none kept: the patched batch may hold NaN, the sums are 0
        return [jnp.where(kept, t, jnp.zeros_like(t)) for t in sums]
    closed, plan = traced
    pflat = call.pflat
    active = list(pflat.active)
    # Behind a barrier with the weights, the second forward pass runs after the first backward
    # (XLA would otherwise run it early, and both passes' stored values would be live at once).
    inputs, weights = lax.optimization_barrier((_inputs(call, batch), list(weights)))
    w_of = dict(zip(active, weights, strict=True))

    def losses(sinks: list[jax.Array]) -> jax.Array:
        return _evaluate(
            closed, inputs, len(pflat.leaves), plan.sites, _sum_hook(w_of), sinks, plan.remat
        )[0]

    dtype = {i: _norms.sum_dtype(pflat.leaves[i].dtype) for i in active}
    ref = first_leaf(
        batch
    )  # (inside shard_map the sinks vary like the batch: each device's own sums)
    out, pull = jax.vjp(
        losses,
        [vary_like(jnp.zeros(pflat.leaves[s.leaf].shape, dtype[s.leaf]), ref) for s in plan.sites],
    )
    totals: dict[int, jax.Array] = {}
    for s, t in zip(plan.sites, pull(jnp.ones_like(out))[0], strict=True):
        totals[s.leaf] = t if s.leaf not in totals else totals[s.leaf] + t
    return [totals.get(i, jnp.zeros(pflat.leaves[i].shape, dtype[i])) for i in active]
