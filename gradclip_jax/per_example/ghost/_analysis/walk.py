"""The walk over the loss's jaxpr: the row state of every value (which example it belongs to,
or whether examples were mixed) and every use of every parameter leaf, followed through the
chain of operations on the leaf alone, classified by the rules (a site) or not (why)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import is_literal, open_jaxpr, shape, sub_jaxprs
from gradclip_jax.per_example.ghost._jaxpr import concrete_operand
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


class _Walk(NamedTuple):
    uses: dict[
        int, list[Site | str]
    ]  # per leaf: its recognised uses (a str: the primitive of an unrecognised one)
    row_wise: bool
    act_elems: int
    mixing: str | None  # the first primitive that mixed examples, if any
    crossing: str | None  # the first primitive that certainly combines examples, if any
    unreadable: str | None = (
        None  # why the first equation whose parameters JAX laid out unknowingly was not read
    )
    unknown: str | None = (
        None  # the first primitive no rule knows applied to values carrying the batch
    )


class _Alias(NamedTuple):
    """A value that is a parameter leaf seen through a chain of operations on it alone (and on
    constants)."""

    leaf: int
    chain: list[int]
    bcast: bool  # the chain broadcasts the leaf
    box: Box  # the block of the leaf the chain selects
    plain: bool  # the chain so far only casts or copies (the value is in the leaf's coordinates)
    through: bool = (
        False  # the chain computes with the leaf (see _through): its norm is not the leaf's
    )
    batch_axes: frozenset[int] = (
        frozenset()
    )  # axes the chain's last step copies the value along, B times
    batch_step: int | None = None  # that step
    zeroed: tuple[
        tuple[int, int], ...
    ] = ()  # steps adding or joining other leaves' values (see _partial)


def _partial(eqn: Any, aliased: list[tuple[int, _Alias]], fixed: set[Any]) -> bool:
    """``eqn`` adds, subtracts or joins values of several parameter leaves (and constants): a
    BatchNorm's ``-mean * inv + offset``, flax's LSTM gates' kernels joined into one. For each leaf
    the value is a chain step, the other leaves' operands zeroed when it is replayed: the step and
    every later one are linear in that leaf's operand (``names.LINEAR``; every rule's operation is
    linear in the parameter operand), so the leaf's gradient does not depend on their values."""
    if eqn.primitive.name not in names.JOINS or len(eqn.outvars) != 1:
        return False
    positions = {pos for pos, _ in aliased}
    if (
        len(positions) < 2
    ):  # (what each leaf's chain computed before does not matter: it is its own)
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
    if (
        eqn.primitive.name not in names.THROUGH
        or len({pos for pos, _ in aliased}) != 1
        or len(eqn.outvars) != 1
    ):
        return False
    pos = aliased[0][0]
    if not all(is_literal(v) or v in fixed for i, v in enumerate(eqn.invars) if i != pos):
        return False
    if any(a.zeroed for _, a in aliased) and eqn.primitive.name not in names.LINEAR:
        return False  # (after other leaves' values were zeroed: see _partial)
    return bool(np.issubdtype(np.dtype(eqn.outvars[0].aval.dtype), np.floating))


def _copied_axes(
    eqn: Any,
    pos: int,
    mine: frozenset[int],
    uniform: Callable[[Any], frozenset[int] | None],
    bsize: int,
) -> frozenset[int]:
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
        new = {
            j
            for j, n in enumerate(out)
            if n == bsize and (j not in dims or src[dims.index(j)] == 1)
        }
        return frozenset(new | {dims[i] for i in mine})
    ops = [mine if i == pos else uniform(v) for i, v in enumerate(eqn.invars)]
    if name == names.DOT_GENERAL:
        (lc, rc), (lb, rb) = jc.param(eqn, "dimension_numbers")
        free = [
            [d for d in range(len(shape(v))) if d not in c and d not in b]
            for v, c, b in zip(eqn.invars, (lc, rc), (lb, rb), strict=True)
        ]
        offsets = (len(lb), len(lb) + len(free[0]))
        return frozenset(
            offsets[i] + free[i].index(d) for i in (0, 1) for d in (ops[i] or ()) if d in free[i]
        )
    if name in names.SAME_SHAPE and all(
        o is None or len(shape(v)) == len(out) for o, v in zip(ops, eqn.invars, strict=True)
    ):
        common = frozenset(j for j, n in enumerate(out) if n == bsize)
        for o, v in zip(
            ops, eqn.invars, strict=True
        ):  # (an operand of size 1 on an axis is broadcast along it)
            common = (
                common
                if o is None
                else common & (o | {j for j, n in enumerate(shape(v)) if n == 1})
            )
        return common
    return frozenset()


def _extended(
    a: _Alias,
    eqn: Any,
    k: int,
    pos: int,
    bsize: int,
    lookup: bool,
    through: bool,
    uniform: Callable[[Any], frozenset[int] | None],
    zeroed: bool = False,
) -> _Alias:
    """``a``'s chain with equation ``k`` appended, the leaf's value its operand ``pos`` (``zeroed``: a
    step whose other leaves' operands are zeroed when it is replayed).

    The axes of length ``B`` along which the value is copies of one value (:func:`_copied_axes`)
    let a use on batched values measure it, one example's replay making one copy (see
    :func:`~._jaxpr.replay`): at the broadcast that made them (``batch_step``) when only casts
    and copies follow it, otherwise by slicing the chain's value."""
    name = eqn.primitive.name
    box = OPAQUE if lookup else _slice_box(eqn, a) if name == names.SLICE else a.box
    axes = _copied_axes(eqn, pos, a.batch_axes, uniform, bsize)
    step = (
        a.batch_step
        if name in names.CASTS
        else k
        if name == names.BROADCAST and not a.batch_axes and axes
        else None
    )
    return _Alias(
        a.leaf,
        [*a.chain, k],
        a.bcast or name == names.BROADCAST,
        box,
        a.plain and name in names.CASTS,
        a.through or through or zeroed,
        axes,
        step if axes else None,
        (*a.zeroed, (k, pos)) if zeroed else a.zeroed,
    )


def _slice_box(eqn: Any, a: _Alias) -> Box:
    """The block a static slice selects, in leaf coordinates when it applies to the leaf itself."""
    p = jc.params(eqn)
    strides = p.get("strides")
    if a.box is not None or not a.plain or (strides is not None and any(x != 1 for x in strides)):
        return OPAQUE
    return (tuple(int(x) for x in p["start_indices"]), tuple(int(x) for x in p["limit_indices"]))


def _complex_values(eqn: Any) -> bool:
    """The equation reads or writes complex values (the rules measure real ones only)."""
    return any(
        np.issubdtype(np.dtype(getattr(v.aval, "dtype", np.float32)), np.complexfloating)
        for v in (*eqn.invars, *eqn.outvars)
        if hasattr(getattr(v, "aval", None), "dtype")
    )


# Site kinds measured on a merged batch too (their views regroup each example's rows).
_MERGED_KINDS = frozenset({"dense", "elementwise"})


def _classify_merged(use: Use, merged: Merged) -> Site | str:
    """A use on values whose batch is merged with each example's positions (``x.reshape(-1, d) @ w``):
    classified as at a batch of ``B * per_example`` rows, kept if its rule regroups the rows by example
    (a dense use, whose views take each example's rows as more positions, on any axis; an
    elementwise use with the rows on axis 0)."""
    name = use.eqn.primitive.name
    rows = unmerged(use.in_states, 1)
    if rows is None or not all(
        isinstance(s, Merged) and s.per_example == merged.per_example for s in use.out_states
    ):
        return name
    outs: list[State] = [s.axis if isinstance(s, Merged) else s for s in use.out_states]
    site = rule_for(name).classify(dataclasses.replace(use, in_states=rows[0], out_states=outs))
    if (
        site is None
        or site.kind not in _MERGED_KINDS
        or (site.kind != "dense" and (site.axis != 0 or site.out_axis != 0))
    ):
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
    if (
        isinstance(site, Site)
        and site.kind in _PULLED_BACK
        and use.batch_step is None
        and use.batch_axes
    ):
        return dataclasses.replace(
            site, cut_axes=use.batch_axes
        )  # its copies over the batch: see replay
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
    return (
        eqn.primitive.name == names.GATHER
        and {pos for pos, _ in aliased} == {0}
        and concrete_operand(eqn.invars[1], consts) is not None
        and is_row_lookup(eqn)
    )


def _as_rows(eqn: Any, states: list[State], bsize: int) -> RowCtx:
    """The equation's context, a merged batch seen as a batch of ``B * per_example`` rows (so that a
    reduction over all of a flattened batch's rows is found to combine examples)."""
    rows = unmerged(states, bsize)
    return RowCtx(eqn, states, bsize) if rows is None else RowCtx(eqn, rows[0], rows[1])


def walk_jaxpr(
    jaxpr: Any,
    n_params: int,
    n_batch: int,
    bsize: int,
    consts: dict[Any, Any] | None = None,
    known: dict[Any, State] | None = None,
) -> _Walk:
    """Row states of every value, and every use of every parameter leaf (through its chain).

    ``known``: the state of every value, read from the program itself (the one-example program's,
    :mod:`.one_example`), instead of the rules' row-wise propagation."""
    invars = jaxpr.invars
    states: dict[Any, State] = {
        v: ROW if n_params <= i < n_params + n_batch else CONST for i, v in enumerate(invars)
    }
    alias: dict[Any, list[_Alias]] = {
        invars[i]: [_Alias(i, [], False, None, True)] for i in range(n_params)
    }
    return _walk_from(jaxpr, states, alias, bsize, consts or {}, jaxpr.outvars[:1], known=known)


def _walk_from(
    jaxpr: Any,
    states: dict[Any, State],
    alias: dict[Any, list[_Alias]],
    bsize: int,
    consts: dict[Any, Any],
    loss_outs: Sequence[Any],
    scan_length: int | None = None,
    known: dict[Any, State] | None = None,
) -> _Walk:
    """:func:`walk_jaxpr` from given row states and parameter aliases of the invars. ``loss_outs``:
    the outputs whose computation must not combine examples. ``scan_length``: ``jaxpr`` is the
    body of a scan over stacked layers of that length (its uses are measured inside the loop).
    ``alias``: per value, the parameter leaves it is a chain of (several: a sum of leaves' values).
    ``known``: see :func:`walk_jaxpr`."""
    uses: dict[int, list[Site | str]] = {a.leaf: [] for al in alias.values() for a in al}
    act_elems, mixing, unreadable, unknown = 0, None, None, None
    crossings: list[tuple[int, str]] = []  # equations that certainly combine examples, and where
    fixed = {v for v in jaxpr.constvars if v in consts}  # values computed from constants alone
    copies: dict[
        Any, frozenset[int]
    ] = {}  # their axes of length B holding copies (an RNN's zero state)

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
        if (
            not eqn.effects
            and not sub_jaxprs(eqn)
            and all(is_literal(v) or v in fixed for v in eqn.invars)
        ):
            fixed.update(eqn.outvars)
            if (
                len(eqn.outvars) == 1
                and eqn.invars
                and name in (*names.CASTS, names.BROADCAST, names.TRANSPOSE)
            ):
                axes = _copied_axes(eqn, 0, uniform(eqn.invars[0]) or frozenset(), uniform, bsize)
                if axes:
                    copies[eqn.outvars[0]] = axes
        in_states = [state(v) for v in eqn.invars]
        if unknown is None and any(s != CONST for s in in_states):
            unknown = _unknown_in(eqn)
        aliased = [
            (pos, a)
            for pos, v in enumerate(eqn.invars)
            if not is_literal(v) and v in alias
            for a in alias[v]
        ]
        lookup = _const_lookup(eqn, aliased, consts)
        through = not lookup and _through(eqn, aliased, fixed)
        if (
            ((name in names.CHAIN_OPS or name == names.SLICE) and len(eqn.invars) == 1 and aliased)
            or lookup
            or through
        ):
            alias[eqn.outvars[0]] = [
                _extended(a, eqn, k, pos, bsize, lookup, through, uniform) for pos, a in aliased
            ]
            states[eqn.outvars[0]] = CONST
            continue
        if _partial(eqn, aliased, fixed):
            alias[eqn.outvars[0]] = [
                _extended(a, eqn, k, pos, bsize, False, False, uniform, zeroed=True)
                for pos, a in aliased
            ]
            states[eqn.outvars[0]] = CONST
            continue
        if known is not None:
            out_states = [known.get(v, MIXED) for v in eqn.outvars]
            if (
                name == names.SCAN
            ):  # a scan whose layout is not read has its parameters' uses unread
                try:
                    jc.scan_info(eqn)
                except jc.LayoutError as err:
                    unreadable = unreadable or str(err)
        else:
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
        body = (
            _stacked_scan(eqn, k, in_states, aliased, bsize, known) if scan_length is None else None
        )
        if body is not None:  # the stacked leaves' uses, inside the loop
            for leaf, u in body.uses.items():
                uses[leaf].extend(u)
            act_elems += body.act_elems
            if body.crossing is not None:
                crossings.append((k, body.crossing))
            continue
        n_aliased = len({pos for pos, _ in aliased})
        for pos, a in aliased:
            use = Use(
                eqn,
                k,
                pos,
                a.leaf,
                a.chain,
                a.bcast,
                in_states,
                out_states,
                a.box,
                a.through,
                a.batch_axes,
                a.batch_step,
                a.zeroed,
            )
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
    return _Walk(
        uses,
        state(jaxpr.outvars[0]) in (ROW, CONST),
        act_elems,
        mixing,
        crossing,
        unreadable,
        unknown,
    )


def _unknown_in(eqn: Any) -> str | None:
    """The first primitive no rule knows: ``eqn``'s own, or one in a jaxpr nested in it (a scan's body)."""
    if eqn.primitive.name not in RULES:
        return str(eqn.primitive.name)
    return next(
        (n for j in sub_jaxprs(eqn) for e in j.eqns if (n := _unknown_in(e)) is not None), None
    )


def _stacked_scan(
    eqn: Any,
    k: int,
    in_states: list[State],
    aliased: list[tuple[int, _Alias]],
    bsize: int,
    known: dict[Any, State] | None = None,
) -> _Walk | None:
    """The walk of the body of a scan over stacked layers (parameter leaves as ``xs``, read one
    layer per step; no other operand a parameter), its sites tagged with the scan; ``None``
    for any other equation. ``known``: see :func:`walk_jaxpr`."""
    info = jc.scan_or_none(eqn)
    if info is None or not aliased:
        return None
    if any(pos < info.n_fixed or a.chain or a.box is not None for pos, a in aliased):
        return None
    body = open_jaxpr(info.body)[0]
    if known is None:
        res = scan_body_states(eqn, in_states, bsize)
        if res is None:
            return None
        states = dict(zip(body.invars, res[0], strict=True))
    elif any(not is_literal(v) and known.get(v) == ROW for v in eqn.invars[info.n_fixed :]):
        return None  # (a scan over the batch axis: not one of stacked layers)
    else:
        states = {v: known.get(v, MIXED) for v in body.invars}
    alias = {body.invars[pos]: [_Alias(a.leaf, [], False, None, True)] for pos, a in aliased}
    walk = _walk_from(
        body, states, alias, bsize, {}, body.outvars, scan_length=info.length, known=known
    )
    uses = {
        leaf: [dataclasses.replace(u, scan=k) if isinstance(u, Site) else u for u in us]
        for leaf, us in walk.uses.items()
    }
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
