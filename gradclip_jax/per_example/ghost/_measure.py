"""Per-leaf per-example norms on the ghost path: from each site's operands and
output cotangent (by its rule), from factors for tied leaves, or from that leaf's
per-example gradients alone (local pull-backs, or vmap for fallback leaves)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax._core.backend import per_backend
from gradclip_jax.per_example._batch import (
    Call,
    explicit_spec,
    gathered_over_batch,
    match_batch_sharding,
    one_example_loss,
)
from gradclip_jax.per_example._config import ClipConfig
from gradclip_jax.per_example._example_norms import (
    as_rows,
    combine_l2,
    combine_l2_stacked,
    leaf_example_norms,
)
from gradclip_jax.per_example._products import ONCE_ROUNDING, rounds_weighted_once
from gradclip_jax.per_example.ghost._analysis import Traced
from gradclip_jax.per_example.ghost._factored import (
    factored_is_cheaper,
    factored_norm,
    site_factors,
)
from gradclip_jax.per_example.ghost._jaxpr import narrower, replay, site_eqn, site_jaxpr, widen
from gradclip_jax.per_example.ghost.rules import RowNorms, Site


class Pass(NamedTuple):
    """What the probed forward and backward pass gives: per-example losses, the
    pull-back, and every site's operands and output cotangents."""

    losses: jax.Array
    pull: Any
    operands: list[Any]
    cts: list[Any]


class LeafNorms(NamedTuple):
    norms: dict[int, jax.Array]  # per-example norm of each measured leaf, (B,)
    rows: dict[int, jax.Array]  # per-example gradients of the leaves that had to form them, (B, D)
    acc: Any  # the accumulation dtype of the norms
    # Global clipping: per-example norms of groups of formed rows measured together
    # (``(B,)`` each), standing for those leaves, which have no entry in ``norms``.
    joint: tuple[jax.Array, ...] = ()


def acc_dtype_of(pflat: _norms.FlatTree) -> np.dtype:
    """The dtype the ghost norms accumulate in: the active leaves' common accumulation dtype."""
    return _norms.tree_acc_dtype(pflat.arrays) if pflat.arrays else np.dtype(np.float32)


def _pin(xs: list[Any], acc: Any) -> list[Any]:
    """``xs`` with the arrays narrower than ``acc`` passed through one optimization barrier.

    XLA may keep a 16-bit value in excess (float32) precision inside one fusion
    and round it where another consumer reads it (``xla_allow_excess_precision``):
    the norm and the clipped sum would then see different values, and the
    contribution could exceed the clip norm. Behind the barrier every consumer
    reads the same stored 16-bit values.
    """
    idx = [k for k, x in enumerate(xs) if isinstance(x, jax.Array) and narrower(x.dtype, acc)]
    if not idx:
        return xs
    pinned = lax.optimization_barrier([xs[k] for k in idx])
    out = list(xs)
    for k, x in zip(idx, pinned, strict=True):
        out[k] = x
    return out


def pin_narrow(fwd: Pass, sites: Sequence[Site], acc: Any) -> Pass:
    """``fwd`` with every site's batched operands and cotangent narrower than ``acc`` pinned
    (see :func:`_pin`): what the norms measure is what the sums add."""
    it = iter(
        _pin(
            [ops[r] for s, ops in zip(sites, fwd.operands, strict=True) for r in s.rows]
            + list(fwd.cts),
            acc,
        )
    )
    operands = []
    for s, ops in zip(sites, fwd.operands, strict=True):
        new = list(ops)
        for r in s.rows:
            new[r] = next(it)
        operands.append(new)
    return fwd._replace(operands=operands, cts=list(it))


def apply_site(
    closed: Any,
    site: Site,
    vals: Sequence[Any],
    param: jax.Array,
    acc: Any = None,
    precision: Any = None,
    example_of: int | None = None,
) -> jax.Array:
    """The site's one operation on ``vals``, with ``param`` (through its chain) as the parameter operand;
    with ``acc``, evaluated in ``acc`` (16-bit operands widened, products at full precision, or at
    ``precision`` when given); ``example_of``: the batch size, when ``vals`` hold one example (on
    the output's batch axis)."""
    return replay(
        closed,
        site.eqn,
        site.chain,
        vals,
        site.pos,
        param,
        acc,
        precision,
        example_of,
        site.out_axis,
        site.batch_step,
        site.zeroed,
        site.cut_axes,
    )


def steps_as_batch(x: jax.Array, axis: int, merged: int = 1) -> jax.Array:
    """A value stacked over the ``L`` steps of a scan, ``(L, ...)`` with the batch on ``axis`` of
    each step's value, as one batch of ``B * L`` rows on that axis, example-major (example ``b``'s
    rows first, each step's ``merged`` rows together), so that a batch sharded over devices
    stays sharded the same way."""
    steps, shape = x.shape[0], x.shape[1:]
    y = jnp.reshape(x, (steps, *shape[:axis], shape[axis] // merged, merged, *shape[axis + 1 :]))
    y = jnp.moveaxis(y, 0, axis + 1)  # (..., B, L, merged, ...)
    spec = explicit_spec(y)  # under Explicit axes the merge states its sharding: the batch's
    out = None if spec is None else jc.on_mesh_of(y, P(*spec[: axis + 1], *spec[axis + 3 :]))
    return jnp.reshape(y, (*shape[:axis], -1, *shape[axis + 1 :]), out_sharding=out)


def each_step(
    f: Callable[..., jax.Array],
    closed: Any,
    site: Site,
    param: jax.Array,
    invals: Sequence[Any],
    g: jax.Array,
) -> jax.Array:
    """``f(body, step_site, block, operands, cotangent)`` of a site in a scan's body for every step
    (its block of the stacked ``param``, its stacked operands and cotangent), stacked on axis 0."""
    body, step_site = site_jaxpr(closed, site), dataclasses.replace(site, scan=None, length=1)
    return jax.vmap(lambda p, v, gl: f(body, step_site, p, v, gl))(param, list(invals), g)  # type: ignore[no-any-return]


def _steps_as_one_batch(site: Site, ops: Sequence[Any], g: jax.Array) -> dict[str, Any]:
    """A site in a scan's body as the site in the body at a batch of ``B * L`` rows: the
    ``site``, ``ops`` and ``g`` arguments of its rule's per-example measures."""
    one = dataclasses.replace(site, scan=None, length=1)
    flat = [
        steps_as_batch(o, one.axis, one.merged) if r in one.rows else o for r, o in enumerate(ops)
    ]
    return {"site": one, "ops": flat, "g": steps_as_batch(g, one.out_axis, one.merged)}


def _combine_steps(x: jax.Array, length: int) -> jax.Array:
    """Per-example values of ``B * L`` rows (example-major) combined in L2 over the ``L`` steps."""
    return combine_l2_stacked(jnp.transpose(jnp.reshape(x, (-1, length))))


def site_norm(
    closed: Any, site: Site, ops: Sequence[Any], g: jax.Array, acc: Any
) -> jax.Array | RowNorms | None:
    """The site's rule's per-example norm (see :meth:`Rule.norm`). A site in a scan's body is
    measured once on the steps' operands taken as one batch of ``B * L`` rows; the blocks of
    the ``L`` layers are disjoint, so an example's squared norm is the sum over the steps."""
    eqn = site_eqn(closed.jaxpr, site)
    if site.scan is None:
        return site.rule.norm(site, eqn, ops, g, acc)
    n = site.rule.norm(eqn=eqn, acc=acc, **_steps_as_one_batch(site, ops, g))
    if n is None:
        return None

    def over_steps(x: jax.Array) -> jax.Array:
        return _combine_steps(x, site.length)

    if isinstance(n, RowNorms):
        combine = n.combine

        def combined(ns: list[jax.Array]) -> jax.Array:
            return over_steps(combine(ns))

        return RowNorms(n.arrays, combined)
    return over_steps(n)


def site_spread(
    closed: Any, site: Site, ops: Sequence[Any], g: jax.Array, acc: Any
) -> jax.Array | None:
    """The site's rule's per-example spread (see :meth:`Rule.spread`), ``(B,)``. A site in a scan's
    body: per step on the steps' operands as one batch of ``B * L`` rows, the steps' blocks
    disjoint, so the L2 combination over the steps bounds the stacked leaf's change."""
    eqn = site_eqn(closed.jaxpr, site)
    if site.scan is None:
        return site.rule.spread(site, eqn, ops, g, acc)
    s = site.rule.spread(eqn=eqn, acc=acc, **_steps_as_one_batch(site, ops, g))
    return None if s is None else _combine_steps(s, site.length)


def sums_once(site: Site, g: jax.Array, param: jax.Array) -> bool:
    """Whether the book-kept sum of ``site`` (output cotangent ``g``, leaf ``param``) runs in one pass
    on a weighted operand rounded once (:func:`rounds_weighted_once` in the dtype the sum is formed
    in: the cotangent's, widened to the leaf's accumulation dtype)."""
    return rounds_weighted_once(site.kind, widen(g.dtype, _norms.acc_dtype(param.dtype)))


def weighting_excess(
    traced: Traced, pflat: _norms.FlatTree, fwd: Pass, rows: dict[int, jax.Array], acc: Any
) -> dict[int, jax.Array]:
    """Per leaf, what its book-kept sum may add beyond ``w_b`` times the measured per-example
    gradient, per unit of weight, ``(B,)``: :data:`ONCE_ROUNDING` times the spread of each site
    whose sum rounds its weighted operand once (:func:`rounds_weighted_once`), summed over a tied
    leaf's uses (their changes add in the same coordinates). Empty where no sum does.

    The clip factor is then taken from the norm plus this excess (per leaf, before the leaves'
    norms combine), so that each clipped contribution stays within the clip norm.
    """
    out: dict[int, jax.Array] = {}
    for s, ops, g in zip(traced.plan.sites, fwd.operands, fwd.cts, strict=True):
        if s.leaf in rows or not sums_once(s, g, pflat.leaves[s.leaf]):
            continue
        spread = site_spread(traced.closed, s, ops, g, acc)
        if spread is None:  # the kind has no spread: its sum must not round once
            raise AssertionError(f"ghost sums: a {s.kind!r} site rounds once but has no spread")
        e = (ONCE_ROUNDING * spread).astype(acc)
        out[s.leaf] = e if s.leaf not in out else out[s.leaf] + e
    return out


def local_grads(
    closed: Any, site: Site, param: jax.Array, invals: Sequence[Any], g: jax.Array, acc: Any
) -> jax.Array:
    """Per-example gradients of one parameter leaf through one operation only, ``(B, *leaf)``.

    Example ``b``'s gradient is the pull-back of ``g_b`` through that single
    operation evaluated on row ``b`` of its batched operands, and through the
    parameter's chain (cast, reshape, broadcast): the leaf's size per example.
    The operation is evaluated in ``acc``: with 16-bit operands the gradient is
    exact to float32 rounding, and its norm is that of what book-keeping adds.
    A site in a scan's body gives each step's block of the stacked leaf.
    """
    if site.scan is not None:  # (L, B, *block) -> (B, L, *block)
        steps = each_step(
            lambda c, s, p, v, gl: local_grads(c, s, p, v, gl, acc), closed, site, param, invals, g
        )
        return jnp.moveaxis(steps, 0, 1)

    # The batch axes: a dense use may carry the batch elsewhere than on axis 0 (``W @ x.T``, as
    # ``jax.vmap`` of equinox's ``Linear`` gives: the output's batch on axis 1).
    axis, out_axis = site.axis, site.out_axis
    bsize = invals[site.rows[0]].shape[axis]
    param = gathered_over_batch(param, invals[site.rows[0]], axis)  # unmapped in the vmap below

    def one(row_vals: list, gb: jax.Array) -> jax.Array:
        vals = list(invals)
        for r, x in zip(site.rows, row_vals, strict=True):
            vals[r] = jnp.expand_dims(x, axis)
        out, pull = jax.vjp(
            lambda w: apply_site(closed, site, vals, w, acc, example_of=bsize),
            param.astype(widen(param.dtype, acc)),
        )
        ct = jc.sharded_like(jnp.expand_dims(gb, out_axis).astype(out.dtype), out)
        return pull(ct)[0]  # type: ignore[no-any-return]

    ref = invals[site.rows[0]]
    row_vals = [
        invals[r] if axis else match_batch_sharding(invals[r], ref) for r in site.rows
    ]  # one batch sharding
    g = g if axis or out_axis else match_batch_sharding(g, ref)
    per_row = jax.vmap(one, in_axes=([axis] * len(site.rows), out_axis))(row_vals, g)
    if site.merged == 1:
        return per_row  # type: ignore[no-any-return]
    # a merged batch: an example's gradient is the sum over its rows
    return jnp.sum(jnp.reshape(per_row, (-1, site.merged, *per_row.shape[1:])), axis=1)


def _fallback_rows(
    config: ClipConfig, call: Call, fb: Sequence[int], batch: Any
) -> list[jax.Array]:
    """Per-example gradients of the fallback leaves only (others held fixed), one row per example."""
    scalar_loss = one_example_loss(config.loss_fn, config.has_aux)
    pflat = call.pflat

    def one(sub: list, example: Any, *a: Any) -> list:
        def f(s: list) -> jax.Array:
            leaves = list(pflat.leaves)
            for i, x in zip(fb, s, strict=True):
                leaves[i] = x
            return scalar_loss(jax.tree_util.tree_unflatten(pflat.treedef, leaves), example, *a)[0]  # type: ignore[no-any-return]

        return jax.grad(f)(sub)  # type: ignore[no-any-return]

    in_axes = (None, 0) + (None,) * len(call.args)
    sub = [pflat.leaves[i] for i in fb]
    g = jax.vmap(one, in_axes=in_axes, spmd_axis_name=config.spmd_axis_name)(sub, batch, *call.args)
    return [as_rows(x) for x in g]


def _factored_norms(
    traced: Traced, pflat: _norms.FlatTree, fwd: Pass, uses: Counter, acc: Any
) -> dict[int, jax.Array]:
    """Norms of the tied leaves whose every use factors (and for which that is cheaper)."""
    factored: dict[int, list | None] = {}
    for s, ops, g in zip(traced.plan.sites, fwd.operands, fwd.cts, strict=True):
        prev = factored.get(s.leaf, [])
        if uses[s.leaf] > 1 and s.leaf not in traced.plan.blocks and prev is not None:
            f2 = site_factors(traced.closed, s, ops, g, pflat.leaves[s.leaf], acc)
            factored[s.leaf] = None if f2 is None else [*prev, f2]
    return {
        i: factored_norm(fl, acc)
        for i, fl in factored.items()
        if fl is not None and factored_is_cheaper(fl, pflat.leaves[i].shape)
    }


def _joint_groups(rows: dict[int, jax.Array]) -> list[list[int]]:
    """The formed rows that global clipping measures together: 2-D rows without an explicit
    sharding, small enough that the norm engine would stack them (``SLICE_PACK_MAX_SIZE``),
    grouped by dtype (groups of two or more)."""
    groups: dict[Any, list[int]] = {}
    for i, r in rows.items():
        if r.ndim == 2 and r.size <= _norms.SLICE_PACK_MAX_SIZE and explicit_spec(r) is None:
            groups.setdefault(np.dtype(r.dtype), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


# Per backend, how the ghost step measures its formed rows and RowNorms requests (outside loop
# bodies; a rule's norm inside a loop is always branch-free):
#
# * ``"branch-free"``: Blue's algorithm, no overflow conditional in the step (on a GPU a
#   conditional copies its predicate to the host, and the host can no longer queue the kernels
#   after it ahead of the device);
# * ``"engine"``: the norm engine's own per-backend strategy (``SUMSQ_STRATEGY``; on the CPU one
#   plain sum of squares per row and a ``lax.cond`` that recomputes on over- or underflow).
#   XLA:CPU compiles Blue's three-sum variadic reduction as a scalar loop, not vectorized: on an
#   MLP, where these rows are most of the ghost work, it cost the CPU step about a third more
#   (benchmarks/results/MEASUREMENTS.md), while a conditional on the CPU costs nothing.
#
# Backends not listed use ``"branch-free"``.
ROW_NORMS = {"cpu": "engine"}


def _row_norms_branch_free() -> bool:
    return (
        per_backend(
            ROW_NORMS,
            "gradclip_jax.per_example.ghost._measure.ROW_NORMS",
            "branch-free",
            ("branch-free", "engine"),
        )
        == "branch-free"
    )


def leaf_norms(config: ClipConfig, call: Call, traced: Traced, batch: Any, fwd: Pass) -> LeafNorms:
    """The per-example norm of every measured leaf, and the rows of those whose gradients were formed.

    A leaf used once, or whose uses read disjoint blocks (a stacked layer's
    parameter read one layer per step), is measured by its sites' rules: the
    squared norms of disjoint blocks add. A tied leaf is measured from factors,
    or from the sum of its uses' local per-example gradients.

    Under global clipping only the per-example norm over all leaves is used:
    the small formed rows (biases, scales) are then laid side by side and
    measured as one row per example (:attr:`LeafNorms.joint`), whose norm is that
    of their per-leaf norms combined. Measured one by one, each leaf's norm would
    be read out of a stacked result, a slice that XLA compiles as a kernel of
    its own for every leaf (GPT-2 small: 74 of them).
    """
    closed, plan = traced
    pflat = call.pflat
    acc = acc_dtype_of(pflat)
    uses = Counter(s.leaf for s in plan.sites)
    norms = _factored_norms(traced, pflat, fwd, uses, acc)
    site_norms: list[jax.Array | RowNorms | None] = []
    for s, ops, g in zip(plan.sites, fwd.operands, fwd.cts, strict=True):
        alone = s.leaf not in norms and (uses[s.leaf] == 1 or s.leaf in plan.blocks)
        site_norms.append(site_norm(closed, s, ops, g, acc) if alone else None)
    # A leaf with a site no rule measures forms its per-example gradients from all its sites.
    formed = {
        s.leaf
        for s, n in zip(plan.sites, site_norms, strict=True)
        if n is None and s.leaf not in norms
    }
    local: dict[int, jax.Array] = {}  # summed per-example gradients of the leaves in `formed`
    for s, ops, g in zip(plan.sites, fwd.operands, fwd.cts, strict=True):
        if s.leaf in formed:
            lg = local_grads(closed, s, pflat.leaves[s.leaf], ops, g, acc).astype(acc)
            local[s.leaf] = lg if s.leaf not in local else local[s.leaf] + lg
    rows = {i: as_rows(lg) for i, lg in local.items()}
    fb = [i for i in pflat.active if i not in plan.ghost]
    if fb:
        rows.update(zip(fb, _pin(_fallback_rows(config, call, fb, batch), acc), strict=True))
    # The formed rows and every RowNorms request in one call (ROW_NORMS says how).
    requests = [n for n in site_norms if isinstance(n, RowNorms)]
    groups = [] if config.per_layer else _joint_groups(rows)
    grouped = {i for g in groups for i in g}
    own = [i for i in rows if i not in grouped]
    together = [jnp.concatenate([rows[i] for i in g], axis=1) for g in groups]
    measured = iter(
        leaf_example_norms(
            [*together, *[rows[i] for i in own], *[a for r in requests for a in r.arrays]],
            branch_free=_row_norms_branch_free(),
        )
    )
    joint = [next(measured).astype(acc) for _ in together]
    norms.update((i, next(measured)) for i in own)
    resolved = {
        r: r.combine([next(measured) for _ in r.arrays]) for r in requests
    }  # keyed by identity
    parts: dict[int, list[jax.Array]] = {}  # per-block norms (one for a leaf used once)
    for s, n in zip(plan.sites, site_norms, strict=True):
        if s.leaf not in formed and n is not None:
            value = resolved[n] if isinstance(n, RowNorms) else n
            parts.setdefault(s.leaf, []).append(value.astype(acc))
    for i, ns in parts.items():
        norms[i] = ns[0] if len(ns) == 1 else combine_l2(ns)
    return LeafNorms(norms, rows, acc, tuple(joint))
