"""The one-example program: the loss on a batch of one, vmapped over the batch.

The batched loss is analysed first: it is the program the user wrote, and the
rules prove, primitive by primitive, that it keeps each example's values apart.
Where they cannot (a primitive with no rule, or one whose parameters a JAX release
laid out anew) and nothing in it certainly combines examples, the loss is read as
the contract of ``clipped_grad`` states it: each example's loss computed from that
example alone. That is the program ``jax.vmap`` makes of the loss on one example,
the one the vmap path differentiates, and in it no operation can mix examples.

Which axis of each of its values carries the batch is read from two traces, at
``B`` and ``B + 1`` examples: the axes whose length changes. ``vmap`` gives every
mapped value one such axis of length ``B``, one example per slice (it is how
batching rules compose), so no rule is needed to follow an operation, only to
measure how a parameter is used (dense, convolution, gather, elementwise, stacked
under a scan). A primitive no rule knows is then an opaque per-example
computation; a parameter it reads falls back alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from gradclip_jax._core.jaxcompat import is_literal, shape, sub_jaxprs
from gradclip_jax.per_example._batch import one_example_loss
from gradclip_jax.per_example.ghost.rules import CONST, MIXED, State

__all__ = ["batch_states", "vmapped_loss"]


def vmapped_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``(params, batch, args) -> losses``: ``loss_fn`` on each example alone (a batch of one),
    vmapped over axis 0 of every batch leaf, as the vmap path evaluates it."""
    scalar_loss = one_example_loss(loss_fn, has_aux)

    def losses(p: Any, b: Any, a: Sequence[Any]) -> Any:
        return jax.vmap(lambda ex: scalar_loss(p, ex, *a)[0])(b)

    return losses


def _state(at_b: tuple[int, ...], at_c: tuple[int, ...], b: int, c: int) -> State:
    """A value's state from its shapes in the traces at ``b`` and ``c`` examples: the one axis
    whose length goes from ``b`` to ``c``; ``CONST`` where none changes; ``MIXED`` for anything
    else (a batch merged with other positions into one axis, which no batching rule of the
    one-example program's own axes of length 1 makes: treated as not followed)."""
    if len(at_b) != len(at_c):
        return MIXED
    changed = [j for j, (m, n) in enumerate(zip(at_b, at_c, strict=True)) if m != n]
    if not changed:
        return CONST
    if len(changed) == 1 and at_b[changed[0]] == b and at_c[changed[0]] == c:
        return changed[0]
    return MIXED


def batch_states(at_b: Any, at_c: Any, b: int, c: int) -> dict[Any, State] | None:
    """The state of every value of the jaxpr ``at_b`` (and of the jaxprs nested in it), traced at
    ``b`` examples, read against the same program traced at ``c`` examples (``at_c``): see
    :func:`_state`. ``None`` when the two programs differ in more than their shapes (a loss
    that branches in Python on the batch size)."""
    states: dict[Any, State] = {}

    def pair(x: Any, y: Any) -> bool:
        if any(
            len(getattr(x, f)) != len(getattr(y, f))
            for f in ("constvars", "invars", "eqns", "outvars")
        ):
            return False
        for u, v in zip((*x.constvars, *x.invars), (*y.constvars, *y.invars), strict=True):
            states[u] = _state(shape(u), shape(v), b, c)
        for e, f in zip(x.eqns, y.eqns, strict=True):
            if e.primitive.name != f.primitive.name or len(e.outvars) != len(f.outvars):
                return False
            for u, v in zip(e.outvars, f.outvars, strict=True):
                if not is_literal(u):
                    states[u] = _state(shape(u), shape(v), b, c)
            inner_x, inner_y = sub_jaxprs(e), sub_jaxprs(f)
            if len(inner_x) != len(inner_y) or not all(
                pair(i, j) for i, j in zip(inner_x, inner_y, strict=True)
            ):
                return False
        return True

    return states if pair(at_b, at_c) else None
