"""Control flow that stays cheap outside ``jit``.

``lax.cond`` called eagerly traces its branches into a fresh jaxpr on every call and
compiles it again (the branches are new closures each time): an eager
``clip_by_global_norm`` step would cost a compilation a call. When the
predicate is a concrete value (eager code, or a constant under ``jit``) the
branch is taken in Python instead: same result, nothing compiled. A traced
predicate (``jit``, ``vmap``, ``grad``) still gets ``lax.cond``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

__all__ = ["cond"]


def cond(
    pred: Any, true_fn: Callable[..., Any], false_fn: Callable[..., Any], *operands: Any
) -> Any:
    """``lax.cond(pred, true_fn, false_fn, *operands)``, taken in Python when ``pred`` is concrete."""
    if isinstance(pred, jax.core.Tracer):
        return lax.cond(pred, true_fn, false_fn, *operands)
    return true_fn(*operands) if bool(pred) else false_fn(*operands)
