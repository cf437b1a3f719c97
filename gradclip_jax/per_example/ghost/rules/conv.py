"""``conv_general_dilated``: a kernel applied to a batched input is a ``conv`` site
(its per-example gradients are formed by pulling the cotangent back through the
one convolution)."""

from __future__ import annotations

from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    ROW,
    RowCtx,
    Rule,
    Site,
    State,
    Use,
    axis0_only,
    register,
)


class Conv(Rule):
    primitives = ("conv_general_dilated",)
    kind = "conv"

    def row(self, c: RowCtx) -> list[State]:
        if not axis0_only(c):
            return c.mixed()
        dn = c.params["dimension_numbers"]
        return c.res(
            c.states[0] == ROW and c.states[1] == CONST and dn.lhs_spec[0] == 0 and dn.out_spec[0] == 0
            and c.params["batch_group_count"] == 1
        )

    def classify(self, use: Use) -> Site | None:
        rows = use.row_operands()
        if rows != (0,) or use.pos != 1 or use.bcast:
            return None
        return self.site(use, rows)


register(Conv())
