"""Jaxpr mechanics of ghost clipping: tracing the loss once, inlining nested
``jit`` and ``checkpoint`` calls (also inside scans over stacked layers) and
unrolling other short scans over parameters, and evaluating the jaxpr with
probes on chosen equations, also inside a scan's body."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import is_literal, open_jaxpr, shape, sub_jaxpr
from gradclip_jax.per_example._products import product_precision
from gradclip_jax.per_example.ghost._fold import fold, folds
from gradclip_jax.per_example.ghost.rules import names

MAX_UNROLL = 128
"""A ``lax.scan`` that reads a parameter otherwise than as a stacked leaf sliced
one layer per step (a weight shared by every step, or a stacked leaf cast or
reshaped first) and runs at most this many steps is unrolled for the analysis,
so each step's use of the parameter is a site; longer ones keep such
parameters on the vmap path. A scan over stacked layers (``nn.scan``,
``nnx.scan``, a ``lax.scan`` over ``eqx.filter_vmap``-built stacks) whose
parameters are only those stacked leaves stays a loop, measured inside."""


def narrower(dtype: Any, acc: Any) -> bool:
    """Whether ``dtype`` is a floating dtype with fewer bits than ``acc`` (bf16, fp16, fp8 below float32)."""
    d = np.dtype(dtype)
    return bool(jnp.issubdtype(d, jnp.floating) and jnp.finfo(d).bits < jnp.finfo(acc).bits)


def widen(dtype: Any, acc: Any) -> np.dtype:
    """``acc`` for a floating dtype narrower than ``acc`` (16-bit), else ``dtype``."""
    return np.dtype(acc) if narrower(dtype, acc) else np.dtype(dtype)


_FULL = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _widened(
    eqn: Any, invals: Sequence[Any], acc: Any, precision: Any = None
) -> tuple[list[Any], dict[str, Any]]:
    """``invals`` and ``eqn.params`` with every floating operand and result dtype narrower than
    ``acc`` widened to ``acc``, and products at full precision (dots: :func:`product_precision`),
    or at ``precision`` when given (one pass of a product written out as several)."""
    vals = [x.astype(acc) if narrower(getattr(x, "dtype", np.float64), acc) else x for x in invals]
    params = {k: widen(v, acc) if isinstance(v, np.dtype) else v for k, v in jc.params(eqn).items()}
    if "precision" in params:
        # float32 too: at the backend's default precision (TF32 on NVIDIA GPUs, bf16 passes
        # on TPUs) a book-kept contribution would differ from the gradient whose norm
        # the full-precision norms measured by up to ~1e-3, beyond the stored bound.
        # A dot takes the per-example products' precision (PRODUCT_PRECISION); others HIGHEST.
        prec = _FULL
        if eqn.primitive is lax.dot_general_p:
            p = product_precision(*(getattr(x, "dtype", np.float64) for x in vals[:2]))
            if not isinstance(p, lax.Precision):
                prec = p
                params["preferred_element_type"] = np.dtype(np.float32)
        if precision is not None:
            prec = (precision, precision)
        params["precision"] = prec
    return vals, params


def bind(eqn: Any, invals: Sequence[Any], acc: Any = None, precision: Any = None) -> list[Any]:
    """Applies one equation's primitive to ``invals``; with ``acc``, evaluated in ``acc``
    (operands and results narrower than ``acc`` widened to it) with products at full precision
    (or at ``precision``, when given)."""
    if acc is None:
        return jc.bind(eqn, invals)
    invals, eqn_params = _widened(eqn, invals, acc, precision)
    return jc.bind(eqn, invals, eqn_params)


def _env(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> dict[Any, Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    return env


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if is_literal(v) else env[v]


# An equation's override: ``(index, equation, operand values) -> output values``, or ``None``
# to bind the equation as it is.
EqnHook = Callable[[int, Any, list], "list[Any] | None"]


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], hook: EqnHook) -> list[Any]:
    """``jaxpr`` evaluated on ``args`` (its constants ``consts``), equation ``k`` run by
    ``hook(k, eqn, operands)`` where that returns its outputs, else bound as traced: the one
    evaluator of the probed and streamed passes, which differ only in the equations they own."""
    env = _env(jaxpr, consts, args)
    for k, eqn in enumerate(jaxpr.eqns):
        invals = [_read(env, v) for v in eqn.invars]
        outs = hook(k, eqn, invals)
        env.update(zip(eqn.outvars, bind(eqn, invals) if outs is None else outs, strict=True))
    return [_read(env, v) for v in jaxpr.outvars]


def _unroll_scan(eqn: Any, invals: Sequence[Any], deps: Sequence[bool]) -> list[Any]:
    """A ``scan`` equation evaluated step by step: ``xs`` sliced with static slices
    (one block of a stacked parameter per step), ``ys`` stacked again."""
    info = jc.scan_info(eqn)
    n_consts, n_carry, length = info.n_consts, info.n_carry, info.length
    body, body_consts = open_jaxpr(info.body)
    consts, carry = list(invals[:n_consts]), list(invals[n_consts : n_consts + n_carry])
    xs = invals[n_consts + n_carry :]
    d_consts, d_xs = list(deps[:n_consts]), list(deps[n_consts + n_carry :])
    d_carry = list(deps[n_consts : n_consts + n_carry])
    ys: list[list[Any]] = [[] for _ in range(length)]
    for i in reversed(range(length)) if info.reverse else range(length):
        x_i = [lax.squeeze(lax.slice_in_dim(x, i, i + 1, axis=0), (0,)) for x in xs]
        outs, out_deps = _inline_eval(
            body, body_consts or [], [*consts, *carry, *x_i], [*d_consts, *d_carry, *d_xs]
        )
        carry = outs[:n_carry]
        d_carry = [a or b for a, b in zip(d_carry, out_deps[:n_carry], strict=True)]
        ys[i] = outs[n_carry:]
    n_ys = len(body.outvars) - n_carry
    return [*carry, *[jnp.stack([ys[i][j] for i in range(length)]) for j in range(n_ys)]]


def _concrete_index(x: Any) -> int | None:
    """A scalar integer index known while tracing (a literal, a constant, a folded value), else ``None``."""
    if jc.is_tracer(x):
        return None
    try:
        a = np.asarray(x)
    except Exception:  # an abstract value
        return None
    return int(a) if a.shape == () and np.issubdtype(a.dtype, np.integer) else None


def _rewritten(eqn: Any, invals: Sequence[Any]) -> list[Any] | None:
    """``split``, and ``dynamic_slice`` at indices known while tracing, as static slices, so the
    analysis sees which block of a parameter each piece reads (a fused q/k/v weight split in
    three is three blocks, as with ``W[:, :d]``); ``tile`` along size-1 axes as a broadcast,
    which a parameter's chain passes through. ``None`` for any other equation."""
    name = eqn.primitive.name
    if name == names.SPLIT:
        axis, x = int(jc.param(eqn, "axis")), invals[0]
        outs, start = [], 0
        for size in jc.param(eqn, "sizes"):
            outs.append(lax.slice_in_dim(x, start, start + int(size), axis=axis))
            start += int(size)
        return outs
    if name == names.TILE:  # copies along size-1 axes (a class token over the batch): a broadcast
        x, reps = invals[0], tuple(int(r) for r in jc.param(eqn, "reps"))
        if all(r == 1 or d == 1 for r, d in zip(reps, np.shape(x), strict=True)):
            out = tuple(d * r for d, r in zip(np.shape(x), reps, strict=True))
            return [lax.broadcast_in_dim(x, out, tuple(range(len(out))))]
        return None
    if name == names.DYNAMIC_SLICE:
        x, sizes = invals[0], tuple(int(n) for n in jc.param(eqn, "slice_sizes"))
        starts = [_concrete_index(i) for i in invals[1:]]
        if len(starts) != len(sizes) or any(i is None for i in starts):
            return None
        # dynamic_slice clamps its start so that the slice fits in the operand
        lo = [
            min(max(int(i or 0), 0), d - n)
            for i, d, n in zip(starts, np.shape(x), sizes, strict=True)
        ]
        return [lax.slice(x, lo, [a + n for a, n in zip(lo, sizes, strict=True)])]
    return None


def const_values(closed: Any) -> dict[Any, Any]:
    """The values of a closed jaxpr's constants, by variable."""
    return dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))


def concrete_operand(v: Any, consts: dict[Any, Any]) -> Any | None:
    """The value of a literal or constant operand of a traced jaxpr, else ``None``."""
    if is_literal(v):
        return v.val
    return consts.get(v)


def _unrolls(eqn: Any, deps: Sequence[bool]) -> bool:
    info = jc.scan_or_none(eqn)
    return bool(info is not None and any(deps) and 0 < info.length <= MAX_UNROLL)


def _rolls(eqn: Any, direct: Sequence[bool], views: Sequence[bool]) -> bool:
    """A scan over stacked layers kept as a loop: some ``xs`` operand is a parameter leaf itself
    (``direct``), and no other operand is a view of one (``views``: a weight every step reads,
    or a stacked leaf cast or reshaped before the loop)."""
    info = jc.scan_or_none(eqn)
    if info is None or info.length < 1:
        return False
    n = info.n_fixed
    if any(views[:n]):
        return False
    xs = list(zip(direct[n:], views[n:], strict=True))
    return any(d for d, _ in xs) and all(d or not v for d, v in xs)


def _roll_scan(eqn: Any, invals: Sequence[Any], deps: Sequence[bool]) -> list[Any]:
    """A scan over stacked layers evaluated as a scan again, its body inlined (nested ``jit`` and
    ``checkpoint`` calls run inline, splits as slices, shorter nested scans over parameters
    unrolled): each use of a layer's parameters appears at the top level of the body."""
    info = jc.scan_info(eqn)
    n_consts, n_carry = info.n_consts, info.n_carry
    body, body_consts = open_jaxpr(info.body)
    consts, carry = list(invals[:n_consts]), list(invals[n_consts : n_consts + n_carry])
    # a carry depends on the parameters after one step when any operand does
    body_deps = [*deps[:n_consts], *([any(deps)] * n_carry), *deps[n_consts + n_carry :]]

    def step(c: list, x: list) -> tuple[list, list]:
        outs, _ = _inline_eval(body, body_consts or [], [*consts, *c, *x], body_deps)
        return outs[:n_carry], outs[n_carry:]

    out_carry, ys = lax.scan(
        step,
        carry,
        list(invals[n_consts + n_carry :]),
        length=info.length,
        reverse=info.reverse,
        unroll=info.unroll,
    )
    return [*out_carry, *ys]


def _inline_eval(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    deps: Sequence[bool],
    leaves: Sequence[bool] | None = None,
) -> tuple[list[Any], list[bool]]:
    """Evaluates ``jaxpr``, running nested ``jit`` / ``checkpoint`` calls inline and
    unrolling short scans that read a parameter (``deps[i]``: argument ``i``
    depends on a parameter), so that, traced, every use of a parameter appears at
    the top level, or at the top level of the body of a scan over stacked layers
    (``leaves[i]``: argument ``i`` is a parameter leaf; see :func:`_rolls`).
    Returns the outputs and whether each depends on a parameter."""
    env = _env(jaxpr, consts, args)
    dep: dict[Any, bool] = dict(zip(jaxpr.invars, deps, strict=True))
    direct = {v for v, d in zip(jaxpr.invars, leaves or [False] * len(args), strict=True) if d}
    views = set(direct)  # the parameter leaves and values that are views of them

    def read_dep(v: Any) -> bool:
        return False if is_literal(v) else dep.get(v, False)

    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        in_deps = [read_dep(v) for v in eqn.invars]
        in_direct = [not is_literal(v) and v in direct for v in eqn.invars]
        in_views = [not is_literal(v) and v in views for v in eqn.invars]
        sub = sub_jaxpr(eqn) if eqn.primitive.name in names.INLINE else None
        j, sub_consts = open_jaxpr(sub) if sub is not None else (None, None)
        if j is not None and (sub_consts is not None or not j.constvars):
            outs, out_deps = _inline_eval(j, sub_consts or [], invals, in_deps, in_direct)
        elif leaves is not None and _rolls(eqn, in_direct, in_views):
            outs = _roll_scan(eqn, invals, in_deps)
            out_deps = [any(in_deps)] * len(outs)
        elif _unrolls(eqn, in_deps):
            outs = _unroll_scan(eqn, invals, in_deps)
            out_deps = [any(in_deps)] * len(outs)
        elif (rewritten := _rewritten(eqn, invals)) is not None:
            outs = rewritten
            out_deps = [any(in_deps)] * len(outs)
        elif folds(eqn, invals):
            outs = fold(eqn, invals, bind)
            out_deps = [False] * len(outs)
        else:
            outs = bind(eqn, invals)
            out_deps = [any(in_deps)] * len(outs)
        env.update(zip(eqn.outvars, outs, strict=True))
        dep.update(zip(eqn.outvars, out_deps, strict=True))
        if eqn.primitive.name in names.VIEWS and len(eqn.invars) == 1 and in_views[0]:
            views.update(eqn.outvars)
    return [_read(env, v) for v in jaxpr.outvars], [read_dep(v) for v in jaxpr.outvars]


class Remat(NamedTuple):
    """The ``jax.checkpoint`` a scan's body runs under (``nnx.remat`` in ``nnx.scan``)."""

    policy: Any
    prevent_cse: bool


def scan_remat(jaxpr: Any) -> Remat | None:
    """The checkpoint found in the body of a top-level scan of ``jaxpr`` (through nested calls),
    or ``None``: the streamed path recomputes each step of the scans it keeps as loops under it."""

    def within(j: Any) -> Remat | None:
        for e in j.eqns:
            if e.primitive.name in names.REMAT:
                return Remat(jc.param(e, "policy", None), bool(jc.param(e, "prevent_cse", True)))
            sub = sub_jaxpr(e) if e.primitive.name in names.INLINE else None
            found = within(open_jaxpr(sub)[0]) if sub is not None else None
            if found is not None:
                return found
        return None

    for e in jaxpr.eqns:
        info = jc.scan_or_none(e)
        found = within(open_jaxpr(info.body)[0]) if info is not None else None
        if found is not None:
            return found
    return None


def checkpointed(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` runs anything under a ``jax.checkpoint`` (at any depth): the loss asks
    for activations to be recomputed rather than stored, which the probed path undoes."""
    return any(
        e.primitive.name in names.REMAT or any(checkpointed(j) for j in jc.sub_jaxprs(e))
        for e in jaxpr.eqns
    )


def trace(loss: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any]) -> Any:
    """The closed jaxpr of :func:`trace_kept`."""
    return trace_kept(loss, params, batch, args)[0]


def trace_kept(
    loss: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any]
) -> tuple[Any, Remat | None, bool]:
    """The closed jaxpr of ``loss(params, batch, args)`` over the flattened inputs, calls
    inlined, scans over stacked layers kept as loops with their bodies inlined, other
    short scans over parameters unrolled, splits and dynamic slices at indices
    known while tracing written as static slices, and tiles along size-1 axes as broadcasts.

    ``loss`` is called exactly once (the inlining re-traces the jaxpr, not ``loss``). Also returns
    the checkpoint the scans' bodies ran under (:func:`scan_remat`), which the inlining removes,
    and whether the loss checkpoints anything (:func:`checkpointed`).
    """
    closed = jax.make_jaxpr(loss)(params, batch, tuple(args))
    remat, ckpt = scan_remat(closed.jaxpr), checkpointed(closed.jaxpr)
    if not any(
        e.primitive.name in names.INLINE or e.primitive.name in names.RETRACED
        for e in closed.jaxpr.eqns
    ):
        return closed, remat, ckpt
    n_params = len(jax.tree_util.tree_leaves(params))
    deps = [i < n_params for i in range(len(closed.jaxpr.invars))]

    def inlined(p: Any, b: Any, a: Any) -> Any:
        return _inline_eval(
            closed.jaxpr, closed.consts, jax.tree_util.tree_leaves((p, b, a)), deps, deps
        )[0][0]

    return jax.make_jaxpr(inlined)(params, batch, tuple(args)), remat, ckpt


def run_probed(
    closed: Any,
    inputs: Sequence[Any],
    at: dict[int, int],
    probes: Sequence[Any],
    inner: dict[int, dict[int, int]] | None = None,
    kept: dict[int, tuple[int, ...]] | None = None,
) -> tuple[list, list]:
    """Evaluates ``closed`` on ``inputs``, adding ``probes[j]`` to the output of equation ``k``
    for every ``at[k] = j``, and inside the body of the scan equation ``s`` for every
    ``inner[s][k] = j`` (then ``probes[j]`` is stacked over the steps, and so are the operands
    returned: only those at the positions ``kept[j]``, the others ``None``).

    Returns ``(outputs, operand values of each probed equation, by j)``.
    """
    operands: list[Any] = [None] * len(probes)

    def probed(k: int, eqn: Any, invals: list) -> list[Any] | None:
        if inner and k in inner:
            outs = _probed_scan(eqn, invals, inner[k], probes, kept or {}, operands)
        else:
            outs = bind(eqn, invals)
        j = at.get(k)
        if j is not None:
            operands[j] = invals
            outs = [outs[0] + probes[j].astype(outs[0].dtype)]
        return outs

    return evaluate(closed.jaxpr, closed.consts, inputs, probed), operands


def _probed_scan(
    eqn: Any,
    invals: Sequence[Any],
    at: dict[int, int],
    probes: Sequence[Any],
    kept: dict[int, tuple[int, ...]],
    operands: list[Any],
) -> list[Any]:
    """A scan equation run with ``probes[j]`` (stacked over the steps) added to the output of
    equation ``k`` of its body for every ``at[k] = j``; the operands at ``kept[j]`` of each probed
    equation come out of the loop stacked over the steps, into ``operands[j]``."""
    info = jc.scan_info(eqn)
    n_consts, n_carry = info.n_consts, info.n_carry
    order = sorted(at.items())
    local = {k: i for i, (k, _) in enumerate(order)}
    consts = list(invals[:n_consts])

    def step(c: list, x: tuple) -> tuple[list, list]:
        xs, prs = x
        res, ops = run_probed(info.body, [*consts, *c, *xs], local, prs)
        out = [
            [o if r in kept.get(j, ()) else None for r, o in enumerate(op)]
            for op, (_, j) in zip(ops, order, strict=True)
        ]
        return res[:n_carry], [res[n_carry:], out]

    xs = (list(invals[n_consts + n_carry :]), [probes[j] for _, j in order])
    carry, (ys, ops) = lax.scan(
        step,
        list(invals[n_consts : n_consts + n_carry]),
        xs,
        length=info.length,
        reverse=info.reverse,
        unroll=info.unroll,
    )
    for (_, j), op in zip(order, ops, strict=True):
        operands[j] = op
    return [*carry, *ys]


def site_eqn(jaxpr: Any, site: Any) -> Any:
    """The equation of ``site`` of the top-level (open) ``jaxpr``, in a scan's body when the site is."""
    if site.scan is None:
        return jaxpr.eqns[site.eqn]
    return open_jaxpr(jc.scan_info(jaxpr.eqns[site.scan]).body)[0].eqns[site.eqn]


def site_jaxpr(closed: Any, site: Any) -> Any:
    """The closed jaxpr whose equations ``site.eqn`` and ``site.chain`` index: ``closed``, or the
    body of the scan the site is in."""
    return closed if site.scan is None else jc.scan_info(closed.jaxpr.eqns[site.scan]).body


def _for_one_example(e: Any, bsize: int, axis: int) -> Any:
    """A chain's broadcast of the parameter over the batch on ``axis`` (a class token copied to every
    example, ``(1, 1, d)`` to ``(B, 1, d)``; a bias broadcast to ``(B, d)``) made for one example;
    any other equation as it is."""
    if e.primitive.name != names.BROADCAST:
        return e
    out, dims = tuple(jc.param(e, "shape")), tuple(jc.param(e, "broadcast_dimensions"))
    if (
        len(out) <= axis
        or out[axis] != bsize
        or (axis in dims and shape(e.invars[0])[dims.index(axis)] != 1)
    ):
        return e
    return jc.with_params(e, shape=(*out[:axis], 1, *out[axis + 1 :]))


def fixed_value(
    jaxpr: Any, v: Any, consts: dict[Any, Any], memo: dict[Any, Any] | None = None
) -> Any | None:
    """The value of ``v`` computed from the jaxpr's constants (``consts``) and literals alone, by
    binding the equations that compute it (staged, under a trace); ``None`` when it depends on an
    input of the jaxpr."""
    memo = {} if memo is None else memo
    if is_literal(v):
        return v.val
    if v in consts:
        return consts[v]
    if v in memo:
        return memo[v]
    eqn = next((e for e in jaxpr.eqns if v in e.outvars), None)
    if eqn is None or eqn.effects:
        return None
    ins = [fixed_value(jaxpr, u, consts, memo) for u in eqn.invars]
    if any(x is None for x in ins):
        return None
    memo.update(zip(eqn.outvars, bind(eqn, ins), strict=True))
    return memo[v]


def replay(
    closed: Any,
    eqn: int,
    chain: Sequence[int],
    vals: Sequence[Any],
    pos: int,
    param: jax.Array,
    acc: Any = None,
    precision: Any = None,
    example_of: int | None = None,
    example_axis: int = 0,
    batch_step: int | None = None,
    zeroed: Sequence[tuple[int, int]] = (),
    cut_axes: frozenset[int] = frozenset(),
) -> jax.Array:
    """Equation ``eqn`` on ``vals``, with ``param`` passed through the equations ``chain`` as operand ``pos``
    (with ``acc``: every step evaluated in ``acc``, see :func:`bind`; ``precision``: that of
    equation ``eqn``'s product; ``example_of``: the batch size, when ``vals`` hold one example
    and the chain's step ``batch_step``, a broadcast over the batch on ``example_axis``, must
    make one copy, or, when ``example_axis`` is in ``cut_axes`` (the chain's value is copies of one
    value along it, made otherwise), the value is sliced to its first copy).

    A chain step's other operands are constants (literals, the closed jaxpr's constants, or
    values computed from those alone), computed again here; the parameter's operand is the one
    that is not, or, for a step ``k`` listed in ``zeroed`` as ``(k, operand)``, that operand (the
    step adds or joins other leaves' values, replayed as zeros: the rest of the chain is linear
    in the parameter's operand, so its gradient does not depend on them)."""
    x = param
    steps = [closed.jaxpr.eqns[k] for k in chain]
    if example_of is not None:
        steps = [
            _for_one_example(e, example_of, example_axis) if k == batch_step else e
            for k, e in zip(chain, steps, strict=True)
        ]
    consts = const_values(closed) if any(len(e.invars) > 1 for e in steps) else {}
    memo: dict[Any, Any] = {}
    at_step = dict(zeroed)
    for k, e in zip(chain, steps, strict=True):
        ops = [
            fixed_value(closed.jaxpr, v, consts, memo) if len(e.invars) > 1 else None
            for v in e.invars
        ]
        at = at_step.get(k)
        if at is None:
            free = [i for i, o in enumerate(ops) if o is None]
            assert len(free) == 1, "a chain step has one operand computed from the parameter"
            at = free[0]
        else:
            ops = [
                jnp.zeros(shape(v), v.aval.dtype) if o is None else o
                for o, v in zip(ops, e.invars, strict=True)
            ]
        ops[at] = x
        x = bind(e, ops, acc)[0]
    if (
        example_of is not None
        and example_axis in cut_axes
        and np.shape(x)[example_axis] == example_of
    ):
        x = lax.slice_in_dim(x, 0, 1, axis=example_axis)
    v = list(vals)
    v[pos] = x
    return bind(closed.jaxpr.eqns[eqn], v, acc, precision)[0]  # type: ignore[no-any-return]
