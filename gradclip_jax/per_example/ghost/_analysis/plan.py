"""The plan: the loss traced once and its jaxpr walked once, then every active parameter leaf
measured by ghost clipping (its sites) or falling back to per-example gradients (why)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.jaxcompat import is_literal, shape, sub_jaxprs
from gradclip_jax.per_example._batch import LOSS_CONTRACT, check_loss_out
from gradclip_jax.per_example.ghost import _jaxpr
from gradclip_jax.per_example.ghost._analysis.one_example import batch_states, vmapped_loss
from gradclip_jax.per_example.ghost._analysis.walk import walk_jaxpr
from gradclip_jax.per_example.ghost._jaxpr import (
    Remat,
    const_values,
    narrower,
    site_eqn,
    trace,
    trace_kept,
)
from gradclip_jax.per_example.ghost.rules import RULES, Box, Site, names
from gradclip_jax.per_example.ghost.rules.unsupported import REASONS


@dataclass
class Plan:
    row_wise: bool
    sites: list[Site]
    ghost: set[int]  # leaf indices (flattened params) measured without materializing
    reasons: dict[int, str] = field(default_factory=dict)  # fallback leaf -> why
    act_elems: int = (
        0  # elements of the batched intermediates of the loss (a proxy for activations)
    )
    blocks: set[int] = field(default_factory=set)  # ghost leaves whose uses read disjoint blocks
    crossing: str | None = None  # the first primitive that certainly combines examples
    narrow_leaf: int | None = (
        None  # the first active leaf narrower than the accumulation dtype (16-bit)
    )
    narrow_op: tuple[str, str] | None = (
        None  # (primitive, dtype): the first narrower value computed from params
    )
    one_example: bool = (
        False  # analysed (and run) as the one-example program vmapped (see one_example)
    )
    unknown: str | None = (
        None  # where the rules lost the batch: a primitive with no rule, an unreadable layout
    )
    remat: Remat | None = (
        None  # the checkpoint the scans' bodies ran under (the streamed path keeps it)
    )
    checkpointed: bool = False  # the loss runs something under jax.checkpoint (at any depth)

    def ct_elems(self, jaxpr: Any) -> int:
        """Elements of the site output cotangents that book-keeping holds at once."""
        return sum(s.length * math.prod(shape(site_eqn(jaxpr, s).outvars[0])) for s in self.sites)


class Traced(NamedTuple):
    """The loss's closed jaxpr (over flattened ``(params, batch, args)``) and its plan."""

    closed: Any
    plan: Plan


def _disjoint(boxes: Sequence[Box]) -> bool:
    """Whether static boxes (no whole-leaf or opaque one) pairwise share no element."""
    static = [b for b in boxes if isinstance(b, tuple)]
    if len(static) != len(boxes):
        return False
    for i, (s1, l1) in enumerate(static):
        for s2, l2 in static[i + 1 :]:
            if all(max(a, c) < min(b, d) for a, b, c, d in zip(s1, l1, s2, l2, strict=True)):
                return False
    return True


# Why some uses of a parameter are not measured, where the primitive's name alone does not say.
_CUSTOM = (
    " (a parameter inside a function with a custom derivative: its gradient is the custom rule's, "
    "which ghost clipping cannot see; custom functions of activations are measured)"
)
_WHY = {
    **REASONS,
    names.SCAN: f" (a scan is measured inside the loop when its only parameters are leaves stacked on "
    f"axis 0, read one layer per step; one that reads a parameter otherwise is unrolled for "
    f"the analysis when it runs at most MAX_UNROLL={_jaxpr.MAX_UNROLL} steps)",
    names.CUSTOM_VJP: _CUSTOM,
    names.CUSTOM_JVP: _CUSTOM,
}


def _leaf_verdict(u: list[Site | str]) -> tuple[list[Site], bool, str | None]:
    """``(sites, blocks, None)`` for a leaf measured by ghost clipping (``blocks``: its uses read
    disjoint blocks, so its squared norm is the sum of theirs), ``([], False, reason)`` otherwise."""
    if len(u) == 0:
        return [], False, None
    bad = [x for x in u if isinstance(x, str)]
    if bad:
        return (
            [],
            False,
            f"used by {bad[0]!r}, which ghost clipping does not measure{_WHY.get(bad[0], '')}",
        )
    sites = [x for x in u if isinstance(x, Site)]
    if len(sites) == 1:
        return sites, False, None
    if any(x.scan is not None for x in sites):
        return (
            [],
            False,
            (
                f"used {len(sites)} times, in a scan over stacked layers (one use of a layer's "
                "block per step is measured inside the loop)"
            ),
        )
    if _disjoint([x.box for x in sites]):  # stacked layers: one block per use
        return sites, True, None
    # tied: measured from factors when every use reads the whole leaf through transposes and casts
    # (_factored), else from the sum of its uses' per-example gradients, each pulled back through
    # its chain (slices of any parts, its batch on any axis): the gradient adds over the uses
    return sites, False, None


def _narrow_dtype(eqn: Any, acc: Any) -> Any | None:
    """A floating dtype narrower than ``acc`` that ``eqn`` (or a jaxpr nested in it) computes, if any."""
    for v in eqn.outvars:
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and narrower(dtype, acc):
            return dtype
    return next(
        (d for j in sub_jaxprs(eqn) for e in j.eqns if (d := _narrow_dtype(e, acc)) is not None),
        None,
    )


def _narrow_op(jaxpr: Any, n_params: int, acc: Any) -> tuple[str, str] | None:
    """``(primitive, dtype)`` of the first equation computing, from the parameters, a floating value
    narrower than ``acc``: a backward pass through it carries its cotangents in that dtype."""
    dep = set(jaxpr.invars[:n_params])
    for eqn in jaxpr.eqns:
        if not any(not is_literal(v) and v in dep for v in eqn.invars):
            continue
        dep.update(eqn.outvars)
        dtype = _narrow_dtype(eqn, acc)
        if dtype is not None:
            return eqn.primitive.name, np.dtype(dtype).name
    return None


def _not_row_wise(mixing: str | None, unreadable: str | None, bsize: int) -> str:
    """Why no leaf is measured when the loss is not row-wise, naming the first primitive that made it so."""
    if bsize == 1:  # one example mixes with none: the rules lost a size-1 axis that ops move freely
        return (
            f"a batch of one example, whose batch axis the rules lose at {mixing or unreadable!r} "
            "(JAX moves a size-1 axis freely); its per-example gradient is the gradient, formed at "
            "no extra cost"
        )
    if unreadable is not None:
        return f"the loss could not be analysed: {unreadable}"
    if mixing is not None and mixing not in RULES:
        return (
            f"ghost clipping has no rule for {mixing!r}{REASONS.get(mixing, '')}, which the loss applies to "
            "batched values, so it cannot tell that each example's loss depends on that example alone"
        )
    return (
        f"the loss mixes examples (first at {mixing!r}: an operation across the batch axis, or one "
        "that changes its length)"
    )


def analyse(
    jaxpr: Any,
    n_params: int,
    active: Sequence[int],
    n_batch: int,
    bsize: int,
    consts: dict[Any, Any] | None = None,
    known: dict[Any, Any] | None = None,
) -> Plan:
    """Classifies every active parameter leaf of the top-level ``jaxpr``.

    ``jaxpr.invars`` are the flattened ``(params, batch, args)``; the first output
    is the per-example loss. ``known``: every value's state, read from the program
    (:func:`~.one_example.batch_states`), instead of the rules' propagation.
    """
    walk = walk_jaxpr(jaxpr, n_params, n_batch, bsize, consts, known)
    acc = _norms.tree_acc_dtype([jaxpr.invars[i].aval for i in active])
    narrow_leaf = next((i for i in active if narrower(jaxpr.invars[i].aval.dtype, acc)), None)
    # where the rules lost the batch, if they did (not where they found examples mixed)
    unknown = walk.unreadable if walk.unreadable is not None else walk.unknown
    plan = Plan(
        walk.row_wise,
        [],
        set(),
        {},
        act_elems=walk.act_elems,
        crossing=walk.crossing,
        narrow_leaf=narrow_leaf,
        narrow_op=_narrow_op(jaxpr, n_params, acc),
        unknown=None if walk.row_wise else unknown,
    )
    for leaf in active:
        if not walk.row_wise:
            plan.reasons[leaf] = _not_row_wise(walk.mixing, walk.unreadable, bsize)
            continue
        sites, blocks, reason = _leaf_verdict(walk.uses[leaf])
        if reason is not None and walk.unreadable is not None and names.SCAN in walk.uses[leaf]:
            reason = f"used by a scan that could not be analysed: {walk.unreadable}"
        if reason is None:
            plan.sites.extend(sites)
            plan.ghost.add(leaf)
            if blocks:
                plan.blocks.add(leaf)
        else:
            plan.reasons[leaf] = reason
    return plan


def trace_and_plan(
    loss_fn: Callable[..., Any],
    has_aux: bool,
    fn: str,
    params: Any,
    pflat: _norms.FlatTree,
    batch: Any,
    args: Sequence[Any],
    bsize: int,
    check: bool = True,
) -> Traced:
    """Traces ``loss_fn`` once (checking, with ``check``, that it returns losses of shape ``(B,)``)
    and analyses the jaxpr once.

    Where the rules lose the batch in the batched loss (at a primitive no rule knows, or one
    whose parameters they cannot read) and nothing in it certainly combines examples, the
    one-example program is analysed instead (:mod:`.one_example`), and its plan kept when it
    measures more leaves. A loss the rules find mixing examples (a reshape regrouping them, a
    loop over them) keeps its batched plan: every leaf falls back, and the warning says where."""

    closed, remat, ckpt = trace_kept(
        _flat_loss(loss_fn, has_aux, fn, bsize, check), params, batch, args
    )
    n_batch = len(jax.tree_util.tree_leaves(batch))
    plan = analyse(
        closed.jaxpr, len(pflat.leaves), pflat.active, n_batch, bsize, const_values(closed)
    )
    plan.remat, plan.checkpointed = remat, ckpt
    if plan.unknown is None or plan.crossing is not None:
        return Traced(closed, plan)
    one = _one_example(loss_fn, has_aux, params, pflat, batch, args, bsize, n_batch)
    if one is not None:
        one.plan.checkpointed = ckpt
    return (
        one if one is not None and len(one.plan.ghost) > len(plan.ghost) else Traced(closed, plan)
    )


def _one_example(
    loss_fn: Callable[..., Any],
    has_aux: bool,
    params: Any,
    pflat: _norms.FlatTree,
    batch: Any,
    args: Sequence[Any],
    bsize: int,
    n_batch: int,
) -> Traced | None:
    """The one-example program traced at ``B`` and ``B + 1`` examples and analysed with the
    states read from the two (``None`` when they differ in more than their shapes, or the loss
    fails on one example: the batched plan stands, and the path it takes reports that)."""
    loss = vmapped_loss(loss_fn, has_aux)
    more = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((bsize + 1, *x.shape[1:]), x.dtype), batch
    )
    try:
        closed = trace(loss, params, batch, args)
        known = batch_states(closed.jaxpr, trace(loss, params, more, args).jaxpr, bsize, bsize + 1)
    except Exception:  # any error of the user's loss on one example
        return None
    if known is None:
        return None
    plan = analyse(
        closed.jaxpr, len(pflat.leaves), pflat.active, n_batch, bsize, const_values(closed), known
    )
    plan.one_example = True
    return Traced(closed, plan)


def _flat_loss(
    loss_fn: Callable[..., Any], has_aux: bool, fn: str, bsize: int, check: bool
) -> Callable[..., Any]:
    """``(params, batch, args) -> losses``, checked (with ``check``) to be of shape ``(B,)``."""

    def flat_loss(p: Any, b: Any, a: Any) -> Any:
        out = loss_fn(p, b, *a)
        if check:
            return check_loss_out(fn, out, bsize, has_aux)
        return out[0] if has_aux else out

    return flat_loss


def check_per_example(fn: str, crossing: str | None) -> None:
    """ValueError when the loss certainly combines examples (``crossing`` names where)."""
    if crossing is not None:
        raise ValueError(
            f"{fn}: loss_fn combines examples at {crossing!r} (a reduction, accumulation or "
            "contraction over the batch axis, e.g. a batch mean, batch-statistics normalization or "
            "a loss averaged over the batch; or examples paired or ranked: in-batch contrastive "
            "logits za @ zb.T, attention across the batch, a sort or top-k over it); "
            f"{LOSS_CONTRACT}. Per-example clipping would silently "
            "compute something else (each example alone), and batch statistics break the privacy "
            "accounting of DP-SGD."
        )


def loss_crossing(
    loss_fn: Callable[..., Any],
    has_aux: bool,
    fn: str,
    params: Any,
    batch: Any,
    args: Sequence[Any],
    bsize: int,
) -> str | None:
    """Traces ``loss_fn`` once on the whole batch: checks it returns losses of shape ``(B,)`` and
    returns the first primitive that certainly combines examples (``None``: none does).

    Nested ``jit`` and ``checkpoint`` calls are inlined first (as for the ghost
    analysis), so a batch statistic inside a wrapped layer is found too."""
    closed = trace(_flat_loss(loss_fn, has_aux, fn, bsize, check=True), params, batch, args)
    n_params, n_batch = (
        len(jax.tree_util.tree_leaves(params)),
        len(jax.tree_util.tree_leaves(batch)),
    )
    return walk_jaxpr(closed.jaxpr, n_params, n_batch, bsize).crossing
