"""Jaxpr mechanics of ghost clipping: tracing the loss once, inlining nested
``jit`` calls, and evaluating the jaxpr with probes on chosen equations."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as _jcore

_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})


def shape(v: Any) -> tuple[int, ...]:
    """The shape of a jaxpr variable."""
    return tuple(getattr(v.aval, "shape", ()))


def is_literal(v: Any) -> bool:
    return isinstance(v, _jcore.Literal)


def sub_jaxpr(eqn: Any) -> Any | None:
    """The (closed or open) jaxpr a call-like equation runs on its operands, if any."""
    for name in _CALL_PARAMS:
        j = eqn.params.get(name)
        if j is not None and (hasattr(j, "eqns") or hasattr(j, "jaxpr")):
            return j
    return None


def open_jaxpr(j: Any) -> tuple[Any, list[Any] | None]:
    """``(jaxpr, consts)`` of a ClosedJaxpr, or ``(jaxpr, None)`` of an open one."""
    if hasattr(j, "jaxpr") and hasattr(j, "consts"):
        return j.jaxpr, list(j.consts)
    return j, None


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Applies one equation's primitive to ``invals``."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _env(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> dict[Any, Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    return env


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if is_literal(v) else env[v]


def _inline_eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr``, running nested ``jit`` calls inline (so that, traced, the
    parameters used inside library helpers such as ``jnp.take`` appear at the top level)."""
    env = _env(jaxpr, consts, args)
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        sub = sub_jaxpr(eqn) if eqn.primitive.name in _INLINE else None
        j, sub_consts = open_jaxpr(sub) if sub is not None else (None, None)
        if j is not None and (sub_consts is not None or not j.constvars):
            outs = _inline_eval(j, sub_consts or [], invals)
        else:
            outs = bind(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [_read(env, v) for v in jaxpr.outvars]


def trace(loss: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any]) -> Any:
    """The closed jaxpr of ``loss(params, batch, args)`` over the flattened inputs, calls inlined.

    ``loss`` is called exactly once (the inlining re-traces the jaxpr, not ``loss``).
    """
    closed = jax.make_jaxpr(loss)(params, batch, tuple(args))
    if not any(e.primitive.name in _INLINE for e in closed.jaxpr.eqns):
        return closed

    def inlined(p: Any, b: Any, a: Any) -> Any:
        return _inline_eval(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves((p, b, a)))[0]

    return jax.make_jaxpr(inlined)(params, batch, tuple(args))


def run_probed(closed: Any, inputs: Sequence[Any], at: dict[int, int], probes: Sequence[Any]) -> tuple[list, list]:
    """Evaluates ``closed`` on ``inputs``, adding ``probes[j]`` to the output of equation ``k``
    for every ``at[k] = j``.

    Returns ``(outputs, operand values of each probed equation, by j)``.
    """
    jaxpr = closed.jaxpr
    env = _env(jaxpr, closed.consts, inputs)
    operands: list[Any] = [None] * len(probes)
    for k, eqn in enumerate(jaxpr.eqns):
        invals = [_read(env, v) for v in eqn.invars]
        outs = bind(eqn, invals)
        j = at.get(k)
        if j is not None:
            operands[j] = invals
            outs = [outs[0] + probes[j].astype(outs[0].dtype)]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [_read(env, v) for v in jaxpr.outvars], operands


def replay(closed: Any, eqn: int, chain: Sequence[int], vals: Sequence[Any], pos: int, param: jax.Array) -> jax.Array:
    """Equation ``eqn`` on ``vals``, with ``param`` passed through the equations ``chain`` as operand ``pos``."""
    x = param
    for k in chain:
        x = bind(closed.jaxpr.eqns[k], [x])[0]
    v = list(vals)
    v[pos] = x
    return bind(closed.jaxpr.eqns[eqn], v)[0]  # type: ignore[no-any-return]
