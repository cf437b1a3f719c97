"""Small numerical helpers shared across the library: one copy of each.

Every helper keeps derivatives finite where the naive form would not (the
double-``where`` trick) and never turns a NaN into a number.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "bounded_factor",
    "count0",
    "divide_or_zero",
    "lowest_precision",
    "rounding_margin",
    "sqrt_nonneg",
    "sqrt_safe",
]


def count0() -> jax.Array:
    """A fresh int32 step counter (also the zero count of an empty tree)."""
    return jnp.zeros([], jnp.int32)


def _floating(s: Any) -> jax.Array:
    """``s`` as an array of the dtype ``jnp.sqrt`` gives it (integers promoted, nothing staged)."""
    s = jnp.asarray(s)
    return (
        s if jnp.issubdtype(s.dtype, jnp.inexact) else s.astype(jax.eval_shape(jnp.sqrt, s).dtype)
    )


# The two below are written in lax's elementwise operations, not jax.numpy's: every norm
# takes them, and each jax.numpy function is a jitted wrapper that tracing enters anew for
# every shape (about 1.2 ms a call against 0.3 ms: 40 calls in the small transformer's
# ghost step). The values are the same.


def sqrt_safe(s: jax.Array) -> jax.Array:
    """``sqrt(s)`` with a zero (not NaN) derivative at 0: the double-where trick. NaN stays NaN
    (a norm whose square overflowed to ``inf - inf`` must not read as 0), and a negative ``s``
    gives 0."""
    s = _floating(s)
    zero = lax.full_like(s, 0)
    pos = lax.gt(s, zero)
    off = lax.select(lax.ne(s, s), s, zero)  # NaN where s is NaN, else 0
    return lax.select(pos, lax.sqrt(lax.select(pos, s, lax.full_like(s, 1))), off)


def sqrt_nonneg(s: jax.Array) -> jax.Array:
    """:func:`sqrt_safe` of a sum of products that is >= 0 in exact arithmetic (rounding may not be)."""
    s = _floating(s)
    return sqrt_safe(lax.max(s, lax.full_like(s, 0)))


def divide_or_zero(num: Any, den: jax.Array) -> jax.Array:
    """``num / den`` where ``den > 0``, else 0, with finite derivatives everywhere."""
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, jnp.ones_like(den)), jnp.zeros_like(den))


# Units of rounding of the accumulation dtype the margin leaves for the factor
# (the division C / n and the product x * f: one each) and for the norm as
# measured (the norm engine's float32 norms are within 2 units of the exact norm
# of the values even for 10**6 elements; the rest is headroom).
_ACC_UNITS = 8


def _unit_roundoff(dtype: Any) -> float:
    return float(jnp.finfo(dtype).eps) / 2.0


def rounding_margin(store: Any, acc: Any) -> float:
    """``1 - (u_store + 8 u_acc)``: what a clip factor below 1 is multiplied by.

    ``u`` is the unit roundoff (half the machine epsilon) of a dtype. A value
    scaled by ``f * rounding_margin(store, acc)`` in ``acc`` and rounded to
    ``store`` (round to nearest, possibly twice) is at most ``|x| f`` in
    magnitude, elementwise, even when ``f = C / n`` was itself rounded and ``n``
    (the measured norm) is a few units below the exact norm: so the stored
    result's norm, measured exactly, is at most ``C``. The relative cost is a few
    units in the last place of ``store`` (``2**-8`` for bfloat16, ``2**-11`` for
    float16, ``5.4e-7`` for float32).
    """
    return 1.0 - (_unit_roundoff(store) + _ACC_UNITS * _unit_roundoff(acc))


def bounded_factors(factors: Sequence[jax.Array], stores: Sequence[Any]) -> list[jax.Array]:
    """:func:`bounded_factor` of each factor for its store, formed once per distinct pair.

    A global clip passes one factor for every leaf: under ``jit`` XLA merges the copies of
    its lowering, but an eager call dispatches each op, three per leaf.
    """
    done: dict[tuple[int, np.dtype], jax.Array] = {}
    keys = [(id(f), np.dtype(s)) for f, s in zip(factors, stores, strict=True)]
    for f, key in zip(factors, keys, strict=True):
        if key not in done:
            done[key] = bounded_factor(f, key[1])
    return [done[key] for key in keys]


def lowest_precision(dtypes: Iterable[Any]) -> np.dtype:
    """The floating dtype of ``dtypes`` with the fewest mantissa bits: the one a clip factor's
    rounding margin must cover when values are stored in each of them."""
    return min((np.dtype(d) for d in dtypes), key=lambda d: jnp.finfo(d).nmant)


def bounded_factor(factor: jax.Array, store: Any) -> jax.Array:
    """A clip factor made safe for storing in ``store``: a factor below 1 lowered by
    :func:`rounding_margin` (computed in the factor's dtype); 1 (no clipping), NaN
    and factors above 1 (scaling up) are returned unchanged, so an unclipped
    value is stored exactly.

    Example:
      >>> import jax.numpy as jnp
      >>> f = jnp.array([0.5, 1.0], jnp.float32)
      >>> bounded_factor(f, jnp.bfloat16) < f
      Array([ True, False], dtype=bool)
    """
    acc = np.dtype(factor.dtype)
    m = jnp.asarray(rounding_margin(np.dtype(store), acc), acc)
    return jnp.where(factor < 1, factor * m, factor)
