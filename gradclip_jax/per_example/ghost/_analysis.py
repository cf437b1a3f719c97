"""Which parameter leaves ghost clipping measures how: the loss is traced once per
call and its jaxpr analysed once; the resulting :class:`Plan` is passed down."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core import norms as _norms
from gradclip_jax._core.jaxcompat import is_literal, open_jaxpr, shape, sub_jaxprs
from gradclip_jax.per_example._batch import (
    LOSS_CONTRACT,
    batch_size_of,
    batchnorm_error,
    check_loss_out,
    keystr,
)
from gradclip_jax.per_example._config import ClipConfig, GhostSum, Method
from gradclip_jax.per_example._products import product_setting, rounds_to_tf32
from gradclip_jax.per_example.ghost._jaxpr import (
    MAX_UNROLL,
    concrete_operand,
    const_values,
    narrower,
    site_eqn,
    trace,
)
from gradclip_jax.per_example.ghost.rules import (
    CONST,
    MIXED,
    OPAQUE,
    ROW,
    RULES,
    Box,
    Formed,
    Merged,
    RowCtx,
    Site,
    State,
    Use,
    is_row_lookup,
    names,
    row_rule,
    rule_for,
    unmerged,
)
from gradclip_jax.per_example.ghost.rules.calls import scan_body_states
from gradclip_jax.per_example.ghost.rules.unsupported import REASONS

# Operations that keep a value in the leaf's own coordinates (a later slice's box is the leaf's).

AUTO_MIN_ELEMENTS = 2**20
"""``method='auto'`` uses ghost clipping when the per-example gradients of the
ghost-measurable leaves would hold at least this many elements (``B`` times their
size) and those leaves hold at least half of the parameters; below that, the
single backward pass of the vmap path is as cheap and exact to the last bit."""

BOOKKEEPING_MAX_SHARE = 0.5
"""``ghost_sum='auto'`` uses book-keeping when the output cotangents it holds
(the elements of every recognised operation's output) are at most this share
of the loss's batched intermediates (a proxy for the activations a backward
pass keeps): then holding them costs little beside the activations, and it
saves the second backward pass. Above it (plain MLPs, where the layer outputs
are most of the activations) the second backward pass keeps the peak memory
near a non-private step's."""


@dataclass
class Plan:
    row_wise: bool
    sites: list[Site]
    ghost: set[int]  # leaf indices (flattened params) measured without materializing
    reasons: dict[int, str] = field(default_factory=dict)  # fallback leaf -> why
    act_elems: int = 0  # elements of the batched intermediates of the loss (a proxy for activations)
    blocks: set[int] = field(default_factory=set)  # ghost leaves whose uses read disjoint blocks
    crossing: str | None = None  # the first primitive that certainly combines examples
    narrow_leaf: int | None = None  # the first active leaf narrower than the accumulation dtype (16-bit)
    narrow_op: tuple[str, str] | None = None  # (primitive, dtype): the first narrower value computed from params

    def ct_elems(self, jaxpr: Any) -> int:
        """Elements of the site output cotangents that book-keeping holds at once."""
        return sum(s.length * math.prod(shape(site_eqn(jaxpr, s).outvars[0])) for s in self.sites)


class Traced(NamedTuple):
    """The loss's closed jaxpr (over flattened ``(params, batch, args)``) and its plan."""

    closed: Any
    plan: Plan


class _Walk(NamedTuple):
    uses: dict[int, list[Site | str]]  # per leaf: its recognised uses (a str: the primitive of an unrecognised one)
    row_wise: bool
    act_elems: int
    mixing: str | None  # the first primitive that mixed examples, if any
    crossing: str | None  # the first primitive that certainly combines examples, if any
    unreadable: str | None = None  # why the first equation whose parameters JAX laid out unknowingly was not read


class _Alias(NamedTuple):
    """A value that is a parameter leaf seen through a chain of operations on it alone (and on
    constants)."""

    leaf: int
    chain: list[int]
    bcast: bool  # the chain broadcasts the leaf
    box: Box  # the block of the leaf the chain selects
    plain: bool  # the chain so far only casts or copies (the value is in the leaf's coordinates)
    through: bool = False  # the chain computes with the leaf (see _through): its norm is not the leaf's
    batch_axes: frozenset[int] = frozenset()  # axes the chain's last step copies the value along, B times
    batch_step: int | None = None  # that step
    zeroed: tuple[tuple[int, int], ...] = ()  # steps adding or joining other leaves' values (see _partial)


def _partial(eqn: Any, aliased: list[tuple[int, _Alias]], fixed: set[Any]) -> bool:
    """``eqn`` adds, subtracts or joins values of several parameter leaves (and constants): a
    BatchNorm's ``-mean * inv + offset``, flax's LSTM gates' kernels joined into one. For each leaf
    the value is a chain step, the other leaves' operands zeroed when it is replayed: the step and
    every later one are linear in that leaf's operand (``names.LINEAR``; every rule's operation is
    linear in the parameter operand), so the leaf's gradient does not depend on their values."""
    if eqn.primitive.name not in names.JOINS or len(eqn.outvars) != 1:
        return False
    positions = {pos for pos, _ in aliased}
    if len(positions) < 2:  # (what each leaf's chain computed before does not matter: it is its own)
        return False
    if not all(is_literal(v) or v in fixed or i in positions for i, v in enumerate(eqn.invars)):
        return False
    return bool(np.issubdtype(np.dtype(eqn.outvars[0].aval.dtype), np.floating))


def _through(eqn: Any, aliased: list[tuple[int, _Alias]], fixed: set[Any]) -> bool:
    """``eqn`` computes a floating value from one parameter operand and constants alone (``fixed``:
    values computed from the closed jaxpr's constants and literals): that value is then a function
    of the leaf alone, the same for every example, and a chain step. Its gradient is pulled back
    through the equation, replayed with the same constants (:func:`~._jaxpr.replay`), so only rules
    that form the leaf's per-example gradient by that pull-back measure such a use."""
    if eqn.primitive.name not in names.THROUGH or len({pos for pos, _ in aliased}) != 1 or len(eqn.outvars) != 1:
        return False
    pos = aliased[0][0]
    if not all(is_literal(v) or v in fixed for i, v in enumerate(eqn.invars) if i != pos):
        return False
    if any(a.zeroed for _, a in aliased) and eqn.primitive.name not in names.LINEAR:
        return False  # (after other leaves' values were zeroed: see _partial)
    return bool(np.issubdtype(np.dtype(eqn.outvars[0].aval.dtype), np.floating))


def _copied_axes(eqn: Any, pos: int, mine: frozenset[int], uniform: Callable[[Any], frozenset[int] | None],
                 bsize: int) -> frozenset[int]:
    """The axes of length ``B`` along which ``eqn``'s output is copies of one value, given those of
    its operand ``pos`` (``mine``) and of the others (``uniform``: ``None`` for a scalar literal).
    A broadcast creates them (new axes, or stretched from size 1); casts, copies and transposes
    keep or move them; an elementwise operation keeps those all its operands share; a product
    keeps its operands' free ones."""
    name = eqn.primitive.name
    out = shape(eqn.outvars[0])
    if name in names.CASTS:
        return mine
    if name == names.TRANSPOSE:
        perm = tuple(jc.param(eqn, "permutation"))
        return frozenset(j for j, i in enumerate(perm) if i in mine)
    if name == names.SLICE:  # the axes it keeps whole
        return frozenset(j for j in mine if shape(eqn.invars[0])[j] == out[j])
    if name == names.BROADCAST:
        dims, src = tuple(jc.param(eqn, "broadcast_dimensions")), shape(eqn.invars[0])
        new = {j for j, n in enumerate(out) if n == bsize and (j not in dims or src[dims.index(j)] == 1)}
        return frozenset(new | {dims[i] for i in mine})
    ops = [mine if i == pos else uniform(v) for i, v in enumerate(eqn.invars)]
    if name == names.DOT_GENERAL:
        (lc, rc), (lb, rb) = jc.param(eqn, "dimension_numbers")
        free = [[d for d in range(len(shape(v))) if d not in c and d not in b]
                for v, c, b in zip(eqn.invars, (lc, rc), (lb, rb), strict=True)]
        offsets = (len(lb), len(lb) + len(free[0]))
        return frozenset(offsets[i] + free[i].index(d) for i in (0, 1) for d in (ops[i] or ()) if d in free[i])
    if name in names.SAME_SHAPE and all(o is None or len(shape(v)) == len(out) for o, v in zip(ops, eqn.invars, strict=True)):
        common = frozenset(j for j, n in enumerate(out) if n == bsize)
        for o, v in zip(ops, eqn.invars, strict=True):  # (an operand of size 1 on an axis is broadcast along it)
            common = common if o is None else common & (o | {j for j, n in enumerate(shape(v)) if n == 1})
        return common
    return frozenset()


def _extended(a: _Alias, eqn: Any, k: int, pos: int, bsize: int, lookup: bool, through: bool,
              uniform: Callable[[Any], frozenset[int] | None], zeroed: bool = False) -> _Alias:
    """``a``'s chain with equation ``k`` appended, the leaf's value its operand ``pos`` (``zeroed``: a
    step whose other leaves' operands are zeroed when it is replayed).

    The axes of length ``B`` along which the value is copies of one value (:func:`_copied_axes`)
    let a use on batched values measure it, one example's replay making one copy (see
    :func:`~._jaxpr.replay`): at the broadcast that made them (``batch_step``) when only casts
    and copies follow it, otherwise by slicing the chain's value."""
    name = eqn.primitive.name
    box = OPAQUE if lookup else _slice_box(eqn, a) if name == names.SLICE else a.box
    axes = _copied_axes(eqn, pos, a.batch_axes, uniform, bsize)
    step = (a.batch_step if name in names.CASTS else k if name == names.BROADCAST and not a.batch_axes and axes
            else None)
    return _Alias(a.leaf, [*a.chain, k], a.bcast or name == names.BROADCAST, box, a.plain and name in names.CASTS,
                  a.through or through or zeroed, axes, step if axes else None,
                  (*a.zeroed, (k, pos)) if zeroed else a.zeroed)


def _slice_box(eqn: Any, a: _Alias) -> Box:
    """The block a static slice selects, in leaf coordinates when it applies to the leaf itself."""
    p = jc.params(eqn)
    strides = p.get("strides")
    if a.box is not None or not a.plain or (strides is not None and any(x != 1 for x in strides)):
        return OPAQUE
    return (tuple(int(x) for x in p["start_indices"]), tuple(int(x) for x in p["limit_indices"]))


def _complex_values(eqn: Any) -> bool:
    """The equation reads or writes complex values (the rules measure real ones only)."""
    return any(np.issubdtype(np.dtype(getattr(v.aval, "dtype", np.float32)), np.complexfloating)
               for v in (*eqn.invars, *eqn.outvars) if hasattr(getattr(v, "aval", None), "dtype"))


# Site kinds measured on a merged batch too (their views regroup each example's rows).
_MERGED_KINDS = frozenset({"dense", "elementwise"})


def _classify_merged(use: Use, merged: Merged) -> Site | str:
    """A use on values whose batch is merged with each example's positions (``x.reshape(-1, d) @ w``):
    classified as at a batch of ``B * per_example`` rows, kept if its rule regroups the rows by example
    (a dense use, whose views take each example's rows as more positions, on any axis; an
    elementwise use with the rows on axis 0)."""
    name = use.eqn.primitive.name
    rows = unmerged(use.in_states, 1)
    if rows is None or not all(isinstance(s, Merged) and s.per_example == merged.per_example
                               for s in use.out_states):
        return name
    outs: list[State] = [s.axis if isinstance(s, Merged) else s for s in use.out_states]
    site = rule_for(name).classify(dataclasses.replace(use, in_states=rows[0], out_states=outs))
    if (site is None or site.kind not in _MERGED_KINDS
            or (site.kind != "dense" and (site.axis != 0 or site.out_axis != 0))):
        return f"{name} on rows merged across positions"
    return dataclasses.replace(site, merged=merged.per_example)


# Site kinds whose leaf's per-example gradient is formed by pulling the cotangent back through
# the site's operation and the leaf's chain: measured through any chain (see _through).
_PULLED_BACK = frozenset({"elementwise", names.CONCATENATE})  # the kinds of those rules


def _classify(use: Use, n_aliased: int) -> Site | str:
    site = _classify_use(use, n_aliased)
    if isinstance(site, Site) and use.through and site.kind not in _PULLED_BACK:
        # the rule would measure the gradient with respect to the computed value: form the leaf's
        return dataclasses.replace(site, rule=Formed(site.rule))
    if isinstance(site, Site) and site.kind in _PULLED_BACK and use.batch_step is None and use.batch_axes:
        return dataclasses.replace(site, cut_axes=use.batch_axes)  # its copies over the batch: see replay
    return site


def _classify_use(use: Use, n_aliased: int) -> Site | str:
    name = use.eqn.primitive.name
    if n_aliased == 1 and isinstance(use.out_states[0], Merged) and not _complex_values(use.eqn):
        return _classify_merged(use, use.out_states[0])
    if n_aliased != 1 or not isinstance(use.out_states[0], int):
        return name
    if _complex_values(use.eqn):
        return f"{name} on complex values"
    site = rule_for(name).classify(use)
    return name if site is None else site


def _const_lookup(eqn: Any, aliased: list, consts: dict[Any, Any]) -> bool:
    """A row lookup of a parameter table at constant positions (a position embedding):
    a chain step, since the gradient flows back through it to the table alone."""
    return (eqn.primitive.name == names.GATHER and {pos for pos, _ in aliased} == {0}
            and concrete_operand(eqn.invars[1], consts) is not None and is_row_lookup(eqn))


def _as_rows(eqn: Any, states: list[State], bsize: int) -> RowCtx:
    """The equation's context, a merged batch seen as a batch of ``B * per_example`` rows (so that a
    reduction over all of a flattened batch's rows is found to combine examples)."""
    rows = unmerged(states, bsize)
    return RowCtx(eqn, states, bsize) if rows is None else RowCtx(eqn, rows[0], rows[1])


def _walk(jaxpr: Any, n_params: int, n_batch: int, bsize: int, consts: dict[Any, Any] | None = None) -> _Walk:
    """Row states of every value, and every use of every parameter leaf (through its chain)."""
    invars = jaxpr.invars
    states: dict[Any, State] = {v: ROW if n_params <= i < n_params + n_batch else CONST
                                for i, v in enumerate(invars)}
    alias: dict[Any, list[_Alias]] = {invars[i]: [_Alias(i, [], False, None, True)] for i in range(n_params)}
    return _walk_from(jaxpr, states, alias, bsize, consts or {}, jaxpr.outvars[:1])


def _walk_from(jaxpr: Any, states: dict[Any, State], alias: dict[Any, list[_Alias]], bsize: int,
               consts: dict[Any, Any], loss_outs: Sequence[Any], scan_length: int | None = None) -> _Walk:
    """:func:`_walk` from given row states and parameter aliases of the invars. ``loss_outs``:
    the outputs whose computation must not combine examples. ``scan_length``: ``jaxpr`` is the
    body of a scan over stacked layers of that length (its uses are measured inside the loop).
    ``alias``: per value, the parameter leaves it is a chain of (several: a sum of leaves' values)."""
    uses: dict[int, list[Site | str]] = {a.leaf: [] for al in alias.values() for a in al}
    act_elems, mixing, unreadable = 0, None, None
    crossings: list[tuple[int, str]] = []  # equations that certainly combine examples, and where
    fixed = {v for v in jaxpr.constvars if v in consts}  # values computed from constants alone
    copies: dict[Any, frozenset[int]] = {}  # their axes of length B holding copies (an RNN's zero state)

    def uniform(v: Any) -> frozenset[int] | None:
        """The axes of length ``B`` along which ``v`` is copies of one value (``None``: a scalar literal)."""
        if is_literal(v):
            return None if not shape(v) else frozenset()
        if v in alias:
            return frozenset.intersection(*(a.batch_axes for a in alias[v]))
        return copies.get(v, frozenset())

    def state(v: Any) -> State:
        return CONST if is_literal(v) else states.get(v, CONST)

    live = _needed(jaxpr, jaxpr.outvars)
    for k, eqn in enumerate(jaxpr.eqns):
        if k not in live:  # dead code (a leftover product): no use, and it mixes nothing
            continue
        name = eqn.primitive.name
        if not eqn.effects and not sub_jaxprs(eqn) and all(is_literal(v) or v in fixed for v in eqn.invars):
            fixed.update(eqn.outvars)
            if len(eqn.outvars) == 1 and eqn.invars and name in (*names.CASTS, names.BROADCAST, names.TRANSPOSE):
                axes = _copied_axes(eqn, 0, uniform(eqn.invars[0]) or frozenset(), uniform, bsize)
                if axes:
                    copies[eqn.outvars[0]] = axes
        in_states = [state(v) for v in eqn.invars]
        aliased = [(pos, a) for pos, v in enumerate(eqn.invars) if not is_literal(v) and v in alias
                   for a in alias[v]]
        lookup = _const_lookup(eqn, aliased, consts)
        through = not lookup and _through(eqn, aliased, fixed)
        if ((name in names.CHAIN_OPS or name == names.SLICE) and len(eqn.invars) == 1 and aliased) or lookup or through:
            alias[eqn.outvars[0]] = [_extended(a, eqn, k, pos, bsize, lookup, through, uniform) for pos, a in aliased]
            states[eqn.outvars[0]] = CONST
            continue
        if _partial(eqn, aliased, fixed):
            alias[eqn.outvars[0]] = [_extended(a, eqn, k, pos, bsize, False, False, uniform, zeroed=True)
                                     for pos, a in aliased]
            states[eqn.outvars[0]] = CONST
            continue
        try:
            out_states = row_rule(eqn, in_states, bsize)
        except jc.LayoutError as err:  # a JAX release changed this primitive's parameters
            out_states, unreadable = [MIXED] * len(eqn.outvars), unreadable or str(err)
        if MIXED in out_states and MIXED not in in_states:
            mixing = mixing or name
            if rule_for(name).crosses(_as_rows(eqn, in_states, bsize)):
                crossings.append((k, name))
        for v, s in zip(eqn.outvars, out_states, strict=True):
            states[v] = s
            if isinstance(s, (int, Merged)) and name not in names.CHAIN_OPS:
                act_elems += math.prod(shape(v))
        body = _stacked_scan(eqn, k, in_states, aliased, bsize) if scan_length is None else None
        if body is not None:  # the stacked leaves' uses, inside the loop
            for leaf, u in body.uses.items():
                uses[leaf].extend(u)
            act_elems += body.act_elems
            if body.crossing is not None:
                crossings.append((k, body.crossing))
            continue
        n_aliased = len({pos for pos, _ in aliased})
        for pos, a in aliased:
            use = Use(eqn, k, pos, a.leaf, a.chain, a.bcast, in_states, out_states, a.box, a.through,
                      a.batch_axes, a.batch_step, a.zeroed)
            site = _classify(use, n_aliased)
            if scan_length is not None and isinstance(site, Site):
                site = _in_loop(site, eqn, scan_length)
            uses[a.leaf].append(site)
    where = "an output of the loss" if scan_length is None else "an output of a scan's body"
    for v in jaxpr.outvars:
        if not is_literal(v) and v in alias:
            for a in alias[v]:
                uses[a.leaf].append(where)
    needed = _needed(jaxpr, loss_outs) if crossings else set()
    crossing = next((n for k, n in crossings if k in needed), None)
    return _Walk(uses, state(jaxpr.outvars[0]) in (ROW, CONST), act_elems, mixing, crossing, unreadable)


def _stacked_scan(eqn: Any, k: int, in_states: list[State], aliased: list[tuple[int, _Alias]],
                  bsize: int) -> _Walk | None:
    """The walk of the body of a scan over stacked layers (parameter leaves as ``xs``, read one
    layer per step; no other operand a parameter), its sites tagged with the scan; ``None``
    for any other equation."""
    info = jc.scan_or_none(eqn)
    if info is None or not aliased:
        return None
    if any(pos < info.n_fixed or a.chain or a.box is not None for pos, a in aliased):
        return None
    res = scan_body_states(eqn, in_states, bsize)
    if res is None:
        return None
    body = open_jaxpr(info.body)[0]
    states = dict(zip(body.invars, res[0], strict=True))
    alias = {body.invars[pos]: [_Alias(a.leaf, [], False, None, True)] for pos, a in aliased}
    walk = _walk_from(body, states, alias, bsize, {}, body.outvars, scan_length=info.length)
    uses = {leaf: [dataclasses.replace(u, scan=k) if isinstance(u, Site) else u for u in us]
            for leaf, us in walk.uses.items()}
    return walk._replace(uses=uses, act_elems=walk.act_elems * info.length)


def _in_loop(site: Site, eqn: Any, length: int) -> Site | str:
    """A site in the body of a scan over stacked layers, measured on its operands stacked over
    the steps: every operand but the parameter must carry the batch."""
    if any(r != site.pos and r not in site.rows for r in range(len(eqn.invars))):
        return f"{eqn.primitive.name} in a scan's body with an operand that is neither batched nor the parameter"
    return dataclasses.replace(site, length=length)


def _needed(jaxpr: Any, outvars: Sequence[Any]) -> set[int]:
    """The equations that ``outvars`` depend on (the loss alone: an aux output may reduce
    over the batch, as it is evaluated per example)."""
    live = {v for v in outvars if not is_literal(v)}
    needed: set[int] = set()
    for k in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[k]
        if any(v in live for v in eqn.outvars):
            needed.add(k)
            live.update(v for v in eqn.invars if not is_literal(v))
    return needed


def _disjoint(boxes: Sequence[Box]) -> bool:
    """Whether static boxes (no whole-leaf or opaque one) pairwise share no element."""
    static = [b for b in boxes if isinstance(b, tuple)]
    if len(static) != len(boxes):
        return False
    for i, (s1, l1) in enumerate(static):
        for s2, l2 in static[i + 1:]:
            if all(max(a, c) < min(b, d) for a, b, c, d in zip(s1, l1, s2, l2, strict=True)):
                return False
    return True


# Why some uses of a parameter are not measured, where the primitive's name alone does not say.
_CUSTOM = (" (a parameter inside a function with a custom derivative: its gradient is the custom rule's, "
           "which ghost clipping cannot see; custom functions of activations are measured)")
_WHY = {
    **REASONS,
    names.SCAN: f" (a scan is measured inside the loop when its only parameters are leaves stacked on "
            f"axis 0, read one layer per step; one that reads a parameter otherwise is unrolled for "
            f"the analysis when it runs at most MAX_UNROLL={MAX_UNROLL} steps)",
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
        return [], False, f"used by {bad[0]!r}, which ghost clipping does not measure{_WHY.get(bad[0], '')}"
    sites = [x for x in u if isinstance(x, Site)]
    if len(sites) == 1:
        return sites, False, None
    if any(x.scan is not None for x in sites):
        return [], False, (f"used {len(sites)} times, in a scan over stacked layers (one use of a layer's "
                           "block per step is measured inside the loop)")
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
    return next((d for j in sub_jaxprs(eqn) for e in j.eqns if (d := _narrow_dtype(e, acc)) is not None), None)


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


def _not_row_wise(mixing: str | None, unreadable: str | None = None) -> str:
    """Why no leaf is measured when the loss is not row-wise, naming the first primitive that made it so."""
    if unreadable is not None:
        return f"the loss could not be analysed: {unreadable}"
    if mixing is not None and mixing not in RULES:
        return (f"ghost clipping has no rule for {mixing!r}{REASONS.get(mixing, '')}, which the loss applies to "
                "batched values, so it cannot tell that each example's loss depends on that example alone")
    return (f"the loss mixes examples (first at {mixing!r}: an operation across the batch axis, or one "
            "that changes its length)")


def analyse(jaxpr: Any, n_params: int, active: Sequence[int], n_batch: int, bsize: int,
            consts: dict[Any, Any] | None = None) -> Plan:
    """Classifies every active parameter leaf of the top-level ``jaxpr``.

    ``jaxpr.invars`` are the flattened ``(params, batch, args)``; the first output
    is the per-example loss.
    """
    walk = _walk(jaxpr, n_params, n_batch, bsize, consts)
    acc = _norms.tree_acc_dtype([jaxpr.invars[i].aval for i in active])
    narrow_leaf = next((i for i in active if narrower(jaxpr.invars[i].aval.dtype, acc)), None)
    plan = Plan(walk.row_wise, [], set(), {}, act_elems=walk.act_elems, crossing=walk.crossing,
                narrow_leaf=narrow_leaf, narrow_op=_narrow_op(jaxpr, n_params, acc))
    for leaf in active:
        if not walk.row_wise:
            plan.reasons[leaf] = _not_row_wise(walk.mixing, walk.unreadable)
            continue
        sites, blocks, reason = _leaf_verdict(walk.uses[leaf])
        if reason is None:
            plan.sites.extend(sites)
            plan.ghost.add(leaf)
            if blocks:
                plan.blocks.add(leaf)
        else:
            plan.reasons[leaf] = reason
    return plan


def trace_and_plan(loss_fn: Callable[..., Any], has_aux: bool, fn: str, params: Any, pflat: _norms.FlatTree,
                   batch: Any, args: Sequence[Any], bsize: int, check: bool = True) -> Traced:
    """Traces ``loss_fn`` once (checking, with ``check``, that it returns losses of shape ``(B,)``)
    and analyses the jaxpr once."""

    closed = trace(_flat_loss(loss_fn, has_aux, fn, bsize, check), params, batch, args)
    n_batch = len(jax.tree_util.tree_leaves(batch))
    return Traced(closed, analyse(closed.jaxpr, len(pflat.leaves), pflat.active, n_batch, bsize,
                                  const_values(closed)))


def _flat_loss(loss_fn: Callable[..., Any], has_aux: bool, fn: str, bsize: int, check: bool) -> Callable[..., Any]:
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
            f"a loss averaged over the batch); {LOSS_CONTRACT}. Per-example clipping would silently "
            "compute something else (each example alone), and batch statistics break the privacy "
            "accounting of DP-SGD."
        )


def loss_crossing(loss_fn: Callable[..., Any], has_aux: bool, fn: str, params: Any, batch: Any,
                  args: Sequence[Any], bsize: int) -> str | None:
    """Traces ``loss_fn`` once on the whole batch: checks it returns losses of shape ``(B,)`` and
    returns the first primitive that certainly combines examples (``None``: none does).

    Nested ``jit`` and ``checkpoint`` calls are inlined first (as for the ghost
    analysis), so a batch statistic inside a wrapped layer is found too."""
    closed = trace(_flat_loss(loss_fn, has_aux, fn, bsize, check=True), params, batch, args)
    n_params, n_batch = len(jax.tree_util.tree_leaves(params)), len(jax.tree_util.tree_leaves(batch))
    return _walk(closed.jaxpr, n_params, n_batch, bsize).crossing


def narrow_values(plan: Plan, pflat: _norms.FlatTree) -> str | None:
    """What makes a backward pass round below the accumulation dtype (16-bit parameters or
    activations), in words; ``None`` when nothing does."""
    if plan.narrow_leaf is not None:
        i = plan.narrow_leaf
        return f"parameter leaf {keystr(pflat.paths[i])} is {np.dtype(pflat.leaves[i].dtype).name}"
    if plan.narrow_op is not None:
        return f"the loss computes {plan.narrow_op[1]} values from the parameters, first at {plan.narrow_op[0]!r}"
    return None


def reduced_matmul_precision() -> str | None:
    """Why float32 products are not computed in full precision by default here (``None``: they are).

    At ``Precision.DEFAULT`` NVIDIA GPUs from Ampere on multiply float32 in TF32
    (10-bit mantissas) and TPUs in bfloat16 passes, unless
    ``jax_default_matmul_precision`` asks for float32.
    """
    if str(getattr(jax.config, "jax_default_matmul_precision", None)).lower() in ("highest", "float32", "precision.highest"):
        return None
    backend = jax.default_backend()
    if backend == "cpu":
        return None
    return (f"on the {backend} backend float32 products default to reduced precision (TF32 or "
            "bfloat16 passes; jax_default_matmul_precision is not 'float32')")


def tf32_products() -> str | None:
    """Why a second backward pass cannot add what the norms measured at ``PRODUCT_PRECISION``
    ``"tf32"`` (``None`` at any other setting): they measure the per-example gradients of the
    TF32-rounded activations and cotangents, which only book-keeping adds."""
    if not rounds_to_tf32(np.float32):
        return None
    return (f"gradclip_jax.per_example.PRODUCT_PRECISION is {product_setting()!r} for this backend (the norms measure "
            "the per-example gradients of TF32-rounded activations and cotangents)")


def backward_refusal() -> str | None:
    """Why this backend refuses ``ghost_sum='backward'`` for float32 models, now (``None``: it
    runs it): the products of the norms at ``PRODUCT_PRECISION`` ``"tf32"`` (:func:`tf32_products`),
    or the model's float32 products at reduced precision (:func:`reduced_matmul_precision`).
    16-bit parameters or activations are refused everywhere (:func:`check_sum_precision`)."""
    return tf32_products() or reduced_matmul_precision()


def check_sum_precision(config: ClipConfig, plan: Plan, pflat: _norms.FlatTree) -> None:
    """ValueError for ``ghost_sum='backward'`` where its second pass would round below float32.

    With 16-bit parameters or activations that pass carries every reweighted
    cotangent :math:`c_b g_b` in 16 bits (each rounding up to ``2**-9`` relative in
    bfloat16); on a backend whose float32 products default to TF32 or bfloat16
    passes, it multiplies at that precision (up to ``2**-11`` relative). Either
    way an example's clipped contribution could exceed :math:`C` by far more than
    the stored-bound margin. Book-keeping forms the sum in float32 at full
    precision, from the values whose norms were measured.
    """
    if config.per_layer or config.ghost_sum is not GhostSum.BACKWARD:
        return
    narrow, tf32 = narrow_values(plan, pflat), tf32_products()
    why = narrow or backward_refusal()
    if why is not None:
        fix = ("" if narrow else ", or set PRODUCT_PRECISION[jax.default_backend()] = 'highest'" if tf32
               else ", or set jax.config.update('jax_default_matmul_precision', 'float32')")
        raise ValueError(
            f"{config.fn}: ghost_sum='backward' cannot be used here: {why}, and a second backward "
            "pass would round each example's clipped contribution at that precision (its norm could "
            "exceed the clip norm). Use ghost_sum='bookkeeping' or 'auto' (book-keeping forms the sum "
            f"in float32 at full precision from the stored activations and cotangents), method='vmap'{fix}."
        )


def sum_mode(config: ClipConfig, traced: Traced) -> GhostSum:
    """``BACKWARD`` or ``BOOKKEEPING``: how the clipped sum is formed (per-layer clipping, 16-bit
    parameters or activations, or a backend whose default float32 products are not full precision:
    book-keeping, see :func:`check_sum_precision`)."""
    closed, plan = traced
    if config.per_layer or plan.narrow_leaf is not None or plan.narrow_op is not None:
        return GhostSum.BOOKKEEPING
    if config.ghost_sum is GhostSum.AUTO and backward_refusal() is not None:
        return GhostSum.BOOKKEEPING
    if config.ghost_sum is not GhostSum.AUTO:
        return config.ghost_sum
    share = plan.ct_elems(closed.jaxpr) <= BOOKKEEPING_MAX_SHARE * plan.act_elems
    return GhostSum.BOOKKEEPING if share else GhostSum.BACKWARD


def use_ghost(plan: Plan, pflat: _norms.FlatTree, bsize: int, method: Method) -> bool:
    """Whether to take the ghost path (else the vmap path computes everything)."""
    if not plan.row_wise or not plan.ghost:
        return False
    if method is Method.GHOST:
        return True
    sizes = {i: math.prod(np.shape(pflat.leaves[i])) for i in pflat.active}
    ghost_size = sum(sizes[i] for i in plan.ghost)
    return bsize * ghost_size >= AUTO_MIN_ELEMENTS and 2 * ghost_size >= sum(sizes.values())


class GhostFallbackWarning(UserWarning):
    """Ghost clipping forms the per-example gradients of some leaves (the vmap fallback)."""


# Messages already given, per clipped-grad function (keyed by the id of its
# configuration's origin, dropped with it): each function tells its user once, also when another model's
# function gave the same message before.
_WARNED: dict[int, set[str]] = {}


# gradclip_jax's folder (three up from this file's) and jax's
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
                 os.path.dirname(os.path.abspath(jax.__file__)) + os.sep)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside gradclip_jax and jax: the user's line that
    called the clipped-grad function (directly, or through ``jax.jit`` tracing it)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level if frame is not None else 2


def warn_fallback(plan: Plan, pflat: _norms.FlatTree, bsize: int, method: Method, fn: str,
                  owner: object = None) -> None:
    """Tells the user once per clipped-grad function (``owner``: its configuration's origin) and distinct
    message which leaves fall back to vmap and why.

    Silent for ``method='auto'`` on a model too small for ghost clipping to be
    worth it (then vmap is the choice, not a fallback).
    """
    sizes = {i: math.prod(np.shape(pflat.leaves[i])) for i in pflat.active}
    if method is Method.AUTO and bsize * sum(sizes.values()) < AUTO_MIN_ELEMENTS:
        return
    fb = [i for i in pflat.active if i in plan.reasons]
    if not fb:
        return
    by_reason: dict[str, list[str]] = {}
    for i in fb:
        by_reason.setdefault(plan.reasons[i], []).append(keystr(pflat.paths[i]))
    parts = [f"{', '.join(paths[:6])}{f' and {len(paths) - 6} more' if len(paths) > 6 else ''} ({why})"
             for why, paths in by_reason.items()]
    msg = (f"{fn}: ghost clipping forms the per-example gradients of {len(fb)} of {len(pflat.active)} "
           f"parameter leaves (vmap fallback): {'; '.join(parts)}. "
           "ghost_report(loss_fn, params, batch) lists every leaf.")
    key = id(owner)
    if key not in _WARNED:
        _WARNED[key] = set()
        if owner is not None:
            weakref.finalize(owner, _WARNED.pop, key, None)
    if msg not in _WARNED[key]:
        _WARNED[key].add(msg)
        warnings.warn(msg, GhostFallbackWarning, stacklevel=_user_stacklevel())


class GhostReport(tuple):
    """Which parameter leaves ghost clipping measures directly.

    A pair ``(ghost, fallback)``: ``ghost`` lists ``(path, kind)`` for leaves whose
    per-example norms come from activations (``kind`` is ``'dense'``,
    ``'elementwise'``, ``'embedding'``, ``'conv'``, ``'tied:...'`` (one leaf used
    several times), ``'stacked:...'`` (a stacked-layers leaf, one block per use),
    ``'scan:...'`` (a stacked-layers leaf read one layer per step of a ``lax.scan``,
    measured inside the loop) or ``'unused'``);
    ``fallback`` lists ``(path, reason)`` for leaves whose per-example gradients
    are materialized.
    """

    __slots__ = ()

    @property
    def ghost(self) -> list[tuple[str, str]]:
        return self[0]  # type: ignore[no-any-return]

    @property
    def fallback(self) -> list[tuple[str, str]]:
        return self[1]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"GhostReport(ghost={self.ghost!r}, fallback={self.fallback!r})"

    def __str__(self) -> str:
        """A table: one row per parameter leaf, its kind (ghost) or why it falls back.

        Example:
          >>> from gradclip_jax.ghost import GhostReport
          >>> print(GhostReport(([("['w']", 'dense')], [("['s']", "used by 'mul'")])))
          ghost clipping measures 1 of 2 parameter leaves; 1 falls back to per-example gradients
          leaf   clipping  kind / why it falls back
          -----  --------  ------------------------
          ['w']  ghost     dense
          ['s']  fallback  used by 'mul'
        """
        rows = [(path, "ghost", kind) for path, kind in self.ghost]
        rows += [(path, "fallback", why) for path, why in self.fallback]
        head = ("leaf", "clipping", "kind / why it falls back")
        width = [max(len(r[i]) for r in (head, *rows)) for i in range(2)]
        lines = [
            f"ghost clipping measures {len(self.ghost)} of {len(rows)} parameter leaves; "
            f"{len(self.fallback)} fall{'s' if len(self.fallback) == 1 else ''} back to per-example gradients",
        ]
        for r in (head, tuple("-" * len(h) if i == 2 else "-" * width[i] for i, h in enumerate(head)), *rows):
            lines.append(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip())
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython/Jupyter shows the table of :meth:`__str__`."""
        printer.text("GhostReport(...)" if cycle else str(self))


def ghost_report(loss_fn: Callable[..., Any], params: Any, batch: Any, *args: Any, has_aux: bool = False) -> GhostReport:
    """Which leaves of ``params`` ghost clipping measures directly, and why others fall back.

    Static (nothing is computed); use it to check a model before training.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.ghost import ghost_report
      >>> def loss(p, b):
      ...     return jnp.sum((b @ p['w'] + p['b']) ** 2, axis=-1)
      >>> rep = ghost_report(loss, {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}, jnp.ones((4, 3)))
      >>> rep.ghost, rep.fallback
      ([("['b']", 'elementwise'), ("['w']", 'dense')], [])
    """
    fn = "ghost_report"
    pflat = _norms.flatten(params, fn)
    bsize = batch_size_of(batch, fn)
    try:
        plan = trace_and_plan(loss_fn, has_aux, fn, params, pflat, batch, args, bsize, check=False).plan
    except Exception as err:  # as clipped_grad: a loss updating BatchNorm statistics gets the remedies
        bn = batchnorm_error(err, fn)
        if bn is not None:
            raise bn from err
        raise
    by_leaf: dict[int, list[str]] = {}
    for site in plan.sites:
        kind = f"formed:{site.kind}" if isinstance(site.rule, Formed) else site.kind
        by_leaf.setdefault(site.leaf, []).append(kind if site.scan is None else f"scan:{kind}")
    kinds = {i: (k[0] if len(k) == 1 else ("stacked:" if i in plan.blocks else "tied:") + "+".join(k))
             for i, k in by_leaf.items()}
    ghost = [(keystr(pflat.paths[i]), kinds.get(i, "unused")) for i in pflat.active if i in plan.ghost]
    fallback = [(keystr(pflat.paths[i]), plan.reasons[i]) for i in pflat.active if i not in plan.ghost]
    return GhostReport((ghost, fallback))
