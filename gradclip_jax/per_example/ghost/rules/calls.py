"""Call-like primitives whose sub-jaxpr runs once on the equation's operands (not
loops or conditionals: a scan over a batched axis would run over examples)."""

from __future__ import annotations

from gradclip_jax.per_example.ghost._jaxpr import open_jaxpr, sub_jaxpr
from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    MIXED,
    RowCtx,
    Rule,
    State,
    register,
    row_states,
)


class Call(Rule):
    primitives = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                  "custom_vjp_call_jaxpr", "remat", "checkpoint", "remat2")

    def row(self, c: RowCtx) -> list[State]:
        sub = sub_jaxpr(c.eqn)
        if sub is None:
            return c.mixed()
        jaxpr, _ = open_jaxpr(sub)
        if len(jaxpr.invars) != len(c.states):
            return c.mixed()
        return row_states(jaxpr, c.states, c.bsize)


register(Call())


class Scan(Rule):
    """A ``lax.scan`` over a non-batch axis (stacked layers, time steps) is row-wise
    when its body is, with the carry keeping its batch axis from step to step. A
    scan that reads a parameter is unrolled before the analysis when it is short
    (``_jaxpr.MAX_UNROLL``); a longer one is followed here, and a parameter it
    reads falls back."""

    primitives = ("scan",)

    def row(self, c: RowCtx) -> list[State]:
        p = c.params
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        jaxpr, _ = open_jaxpr(p["jaxpr"])
        xs = c.states[n_consts + n_carry:]
        if any(s == 0 for s in xs):  # scanning over the batch axis: one example feeds the next
            return c.mixed()
        x_states = [s - 1 if isinstance(s, int) else s for s in xs]
        carry = list(c.states[n_consts:n_consts + n_carry])
        for _ in range(2):  # the carry's state after one step must be its state before
            out = row_states(jaxpr, [*c.states[:n_consts], *carry, *x_states], c.bsize)
            if out[:n_carry] == carry:
                ys = [s + 1 if isinstance(s, int) else s for s in out[n_carry:]]
                return [*carry, *ys]
            carry = [MIXED if a != b and CONST not in (a, b) else (b if a == CONST else a)
                     for a, b in zip(carry, out[:n_carry], strict=True)]
        return c.mixed()

    def crosses(self, c: RowCtx) -> bool:
        n = c.params["num_consts"] + c.params["num_carry"]
        return any(s == 0 for s in c.states[n:])


register(Scan())
