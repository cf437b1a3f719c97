"""Call-like primitives whose sub-jaxpr runs once on the equation's operands (not
loops or conditionals: a scan over a batched axis would run over examples)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import open_jaxpr, sub_jaxpr
from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    MIXED,
    RowCtx,
    Rule,
    State,
    register,
    row_states,
)


class NestedCall(Rule):
    """Nested calls (jit, closed_call, custom_jvp/vjp, checkpoint, ...): the row states of their body."""

    primitives = (
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "checkpoint",
        "remat2",
        "xla_metadata_call",
        "compute_on",
    )

    def row(self, c: RowCtx) -> list[State]:
        sub = sub_jaxpr(c.eqn)
        if sub is None:
            return c.mixed()
        jaxpr, _ = open_jaxpr(sub)
        if len(jaxpr.invars) != len(c.states):
            return c.mixed()
        return row_states(jaxpr, c.states, c.bsize)


register(NestedCall())


def scan_body_states(
    eqn: Any, states: Sequence[State], bsize: int
) -> tuple[list[State], list[State]] | None:
    """``(body input states, scan output states)`` of a ``scan`` over a non-batch axis whose
    carry keeps its state from step to step, else ``None`` (it runs over the batch axis, or
    the carry's batch axis moves)."""
    info = jc.scan_info(eqn)
    n_consts, n_carry = info.n_consts, info.n_carry
    jaxpr, _ = open_jaxpr(info.body)
    xs = states[n_consts + n_carry :]
    if any(s == 0 for s in xs):  # scanning over the batch axis: one example feeds the next
        return None
    x_states = [s - 1 if isinstance(s, int) else s for s in xs]
    carry = list(states[n_consts : n_consts + n_carry])
    for _ in range(2):  # the carry's state after one step must be its state before
        body_in = [*states[:n_consts], *carry, *x_states]
        out = row_states(jaxpr, body_in, bsize)
        if out[:n_carry] == carry:
            ys = [s + 1 if isinstance(s, int) else s for s in out[n_carry:]]
            return body_in, [*carry, *ys]
        carry = [
            MIXED if a != b and CONST not in (a, b) else (b if a == CONST else a)
            for a, b in zip(carry, out[:n_carry], strict=True)
        ]
    return None


class Scan(Rule):
    """A ``lax.scan`` over a non-batch axis (stacked layers, time steps) is row-wise
    when its body is, with the carry keeping its batch axis from step to step. A
    parameter stacked on axis 0 and read one layer per step is measured inside
    the loop (``Site.scan``); a scan that reads a parameter otherwise is unrolled
    before the analysis when it is short (``_jaxpr.MAX_UNROLL``); a longer one is
    followed here, and such a parameter falls back."""

    primitives = ("scan",)

    def row(self, c: RowCtx) -> list[State]:
        res = scan_body_states(c.eqn, c.states, c.bsize)
        return c.mixed() if res is None else res[1]

    def crosses(self, c: RowCtx) -> bool:
        info = jc.scan_or_none(c.eqn)
        return info is not None and any(s == 0 for s in c.states[info.n_fixed :])


register(Scan())
