"""Index arithmetic of a traced loss, computed while tracing, in NumPy.

The analysis folds integer and boolean values computed from constants alone
(``jnp.arange(T)`` position ids, a causal mask's comparisons), so that a lookup of a
parameter table at constant positions shows its indices. Run as JAX operations, each
distinct one compiles an XLA program of its own the first time a process meets it
(about 20 ms each on the CPU: seven, 0.15 s, in the first trace of the small
transformer LM's ghost step, a third of its trace). NumPy computes the same integers
exactly and compiles nothing; an operation it is not given here is still run by JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax.per_example.ghost.rules import names

__all__ = ["FOLD_MAX_ELEMENTS", "fold", "folds"]

FOLD_MAX_ELEMENTS = 2**16
"""Integer and boolean values computed from constants alone (``jnp.arange(T)`` position ids)
with at most this many elements are computed while tracing, so that a lookup
of a parameter table at constant positions (a position embedding) shows its
indices to the analysis."""


def _exact(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == jnp.bool_


def folds(eqn: Any, invals: Sequence[Any]) -> bool:
    """Whether ``eqn`` is index arithmetic on values known while tracing, small enough to fold."""
    if eqn.primitive.name not in names.FOLDABLE or any(jc.is_tracer(x) for x in invals):
        return False
    outs = [v.aval for v in eqn.outvars]
    return all(_exact(a) and math.prod(a.shape) <= FOLD_MAX_ELEMENTS for a in outs)


def _broadcast(x: np.ndarray, p: dict) -> np.ndarray:
    shape = [1] * len(p["shape"])
    for axis, d in zip(p["broadcast_dimensions"], x.shape, strict=True):
        shape[axis] = d
    return np.broadcast_to(np.reshape(x, shape), p["shape"])


def _iota(p: dict) -> np.ndarray:
    shape = [1] * len(p["shape"])
    shape[p["dimension"]] = p["shape"][p["dimension"]]
    return np.broadcast_to(np.reshape(np.arange(shape[p["dimension"]]), shape), p["shape"])


def _slice(x: np.ndarray, p: dict) -> np.ndarray:
    strides = p["strides"] or (1,) * x.ndim
    return x[
        tuple(
            slice(a, b, s)
            for a, b, s in zip(p["start_indices"], p["limit_indices"], strides, strict=True)
        )
    ]


def _select(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0])
    return np.choose(which, cases)


def _rem(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if np.any(y == 0):  # XLA's result differs from NumPy's: let JAX compute it
        raise _NotHere
    return np.fmod(x, y)  # the sign of the dividend, as lax.rem


class _NotHere(Exception):
    """The operation is left to JAX."""


# primitive name -> NumPy evaluation of (params, operands); each exact on integers and booleans
# (wrapping as XLA's two's-complement arithmetic does)
_NUMPY: dict[str, Callable[..., Any]] = {
    "iota": lambda p: _iota(p),
    names.BROADCAST: lambda p, x: _broadcast(x, p),
    "reshape": lambda p, x: np.reshape(x, p["new_sizes"]) if p.get("dimensions") is None else None,
    "squeeze": lambda p, x: np.squeeze(x, tuple(p["dimensions"])),
    "convert_element_type": lambda p, x: x.astype(p["new_dtype"]) if _exact(x) else None,
    "concatenate": lambda p, *xs: np.concatenate(xs, axis=p["dimension"]),
    names.SLICE: lambda p, x: _slice(x, p),
    "add": lambda p, x, y: np.add(x, y),
    "sub": lambda p, x, y: np.subtract(x, y),
    "mul": lambda p, x, y: np.multiply(x, y),
    "neg": lambda p, x: np.negative(x),
    "rem": lambda p, x, y: _rem(x, y),
    "max": lambda p, x, y: np.maximum(x, y),
    "min": lambda p, x, y: np.minimum(x, y),
    "clamp": lambda p, lo, x, hi: np.minimum(np.maximum(x, lo), hi),
    "select_n": lambda p, which, *cases: _select(which, *cases),
    "lt": lambda p, x, y: np.less(x, y),
    "le": lambda p, x, y: np.less_equal(x, y),
    "gt": lambda p, x, y: np.greater(x, y),
    "ge": lambda p, x, y: np.greater_equal(x, y),
    "eq": lambda p, x, y: np.equal(x, y),
    "ne": lambda p, x, y: np.not_equal(x, y),
    "and": lambda p, x, y: np.bitwise_and(x, y),
    "or": lambda p, x, y: np.bitwise_or(x, y),
    "not": lambda p, x: np.invert(x),
}


def _numpy(eqn: Any, invals: Sequence[Any]) -> list[np.ndarray] | None:
    """``eqn``'s result computed by NumPy, or ``None`` where it is left to JAX."""
    run = _NUMPY.get(eqn.primitive.name)
    if run is None or len(eqn.outvars) != 1:
        return None
    xs = [np.asarray(x) for x in invals]
    if not all(_exact(x) for x in xs):
        return None
    try:
        with np.errstate(over="ignore"):
            out = run(jc.params(eqn), *xs)
    except (_NotHere, jc.LayoutError, ValueError, TypeError):
        return None
    aval = eqn.outvars[0].aval
    if out is None or np.shape(out) != tuple(aval.shape):
        return None
    return [np.array(out, dtype=aval.dtype)]


def fold(
    eqn: Any, invals: Sequence[Any], bind: Callable[[Any, Sequence[Any]], list[Any]]
) -> list[Any]:
    """The values of an equation :func:`folds` accepts: by NumPy where it can, else by
    ``bind(eqn, invals)`` run eagerly, at trace time."""
    out = _numpy(eqn, invals)
    if out is not None:
        return out
    with jax.ensure_compile_time_eval():
        return bind(eqn, invals)
