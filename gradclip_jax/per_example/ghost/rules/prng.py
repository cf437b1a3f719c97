"""PRNG primitives on per-example keys (``clipped_grad(..., prng_argnum=...)``):
each example's key yields that example's bits, so the batch axis passes through
when it leads (axis 0) on every batched operand and output."""

from __future__ import annotations

from gradclip_jax.per_example.ghost.rules._registry import RowCtx, Rule, State, axis0_only, register


class Random(Rule):
    """Key arrays of shape ``(B, ...)`` in, values of shape ``(B, ...)`` out, row by row."""

    primitives = (
        "random_bits",
        "random_wrap",
        "random_unwrap",
        "random_split",
        "random_fold_in",
        "random_seed",
        "threefry2x32",
        "bitcast_convert_type",
    )

    def row(self, c: RowCtx) -> list[State]:
        return c.res(axis0_only(c))


register(Random())
