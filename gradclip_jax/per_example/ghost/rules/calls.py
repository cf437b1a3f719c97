"""Call-like primitives whose sub-jaxpr runs once on the equation's operands (not
loops or conditionals: a scan over a batched axis would run over examples)."""

from __future__ import annotations

from gradclip_jax.per_example.ghost._jaxpr import open_jaxpr, sub_jaxpr
from gradclip_jax.per_example.ghost.rules._registry import RowCtx, Rule, State, register, row_states


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
