"""How a transform's numeric hyperparameters are checked, resolved and guarded.

:class:`Hyperparams` checks each value when the transform is built (with
:func:`~gradclip_jax._core.validation.check_scalar`) and resolves it at every update
(schedules are called, traced values kept), turning the update into NaN where a
traced or scheduled value is out of range; :func:`mark_static` records a factory's
structural arguments for :func:`gradclip_jax.inject_hyperparams`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core.validation import STATIC_ARGS, StaticDefault, check_scalar, is_traced

Numeric = float | int | jax.Array | np.ndarray
Hyperparam = Numeric | Callable[[jax.Array], Numeric]
"""A hyperparameter: a number, an array (also traced) or a schedule ``step -> value``."""


def resolve(value: Hyperparam | None, count: jax.Array) -> Any:
    """The hyperparameter's value at step ``count`` (schedules are called)."""
    if callable(value):
        return value(count)
    return value


def as_scalar(value: Any, dtype: Any) -> jax.Array:
    """A hyperparameter as a 0-d array of ``dtype`` (shape ``(1,)`` is squeezed)."""
    arr = jnp.asarray(value, dtype=dtype)
    if arr.ndim:
        if arr.size != 1:
            raise ValueError(f"hyperparameters must be scalars, got an array of shape {arr.shape}")
        arr = arr.reshape(())
    return arr


def increment(count: jax.Array) -> jax.Array:
    """Step counter + 1, saturating instead of overflowing."""
    return optax.safe_increment(count)


def mark_static(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator recording a factory's structural arguments.

    Records them in ``factory.static_args`` (read by :func:`inject_hyperparams`)
    and for the error messages of :func:`static_value`, and shows their numeric
    defaults in the signature as :class:`StaticDefault`, so that plain
    :func:`optax.inject_hyperparams` leaves them static when they are not passed.
    """

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.static_args = tuple(names)  # type: ignore[attr-defined]
        STATIC_ARGS[factory.__name__] = tuple(names)
        sig = inspect.signature(factory)
        params = []
        for p in sig.parameters.values():
            d = p.default
            if p.name in names and isinstance(d, (int, float)) and not isinstance(d, bool):
                p = p.replace(default=StaticDefault(d))
            params.append(p)
        factory.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return factory

    return wrap


# ----------------------------------------------------------------------------
# Run-time guard of traced and scheduled hyperparameters
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid range of a numeric hyperparameter (see :func:`check_scalar`)."""

    low: float | None = 0.0
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    allow_none: bool = False
    allow_inf: bool = True

    def holds(self, v: jax.Array) -> jax.Array:
        """A 0-d bool: ``v`` is in range (NaN never is)."""
        ok = ~jnp.isnan(v)
        if not self.allow_inf:
            ok = ok & jnp.isfinite(v)
        if self.low is not None:
            ok = ok & ((v >= self.low) if self.low_inclusive else (v > self.low))
        if self.high is not None:
            ok = ok & ((v <= self.high) if self.high_inclusive else (v < self.high))
        return ok


class Hyperparams:
    """The numeric hyperparameters of one transform: checked when it is built, guarded when used.

    ``add`` validates a value with :func:`check_scalar` at construction. At
    update time ``at(count, dtype)`` resolves every hyperparameter (schedules are
    called) to a 0-d array and returns ``(values, invalid)``: ``invalid`` is a
    0-d bool that is true when a traced or scheduled value is outside its range
    (NaN, negative, ...), or ``None`` when every value was a constant checked at
    construction (then no run-time check is compiled). Every transform turns its
    whole update into NaN where ``invalid`` is true, so that
    :func:`optax.apply_if_finite` skips the step: an invalid value never flips a
    sign or switches clipping off.
    """

    def __init__(self, fn: str):
        self.fn = fn
        self.values: dict[str, Any] = {}
        self.rules: dict[str, Range] = {}
        self.orders: list[tuple[str, str]] = []

    def add(self, name: str, value: Any, **rule: Any) -> None:
        r = Range(**rule)
        check_scalar(self.fn, name, value, **dataclasses.asdict(r))
        self.values[name] = value
        self.rules[name] = r

    def order(self, lo: str, hi: str) -> None:
        """Requires ``lo <= hi`` for two hyperparameters already added (``None`` bounds nothing).

        Two constants are compared now (``ValueError``); a traced or scheduled
        pair is compared at update time, where ``lo > hi`` makes ``invalid`` true.
        """
        a, b = self.values[lo], self.values[hi]
        if _is_constant(a) and _is_constant(b) and float(np.asarray(a)) > float(np.asarray(b)):
            raise ValueError(f"{self.fn}: `{lo}` ({a}) must not exceed `{hi}` ({b})")
        self.orders.append((lo, hi))

    def exact(self, name: str, resolved: dict[str, Any]) -> Any:
        """``name``'s value as given when it is a constant (a Python or NumPy number, not
        rounded to any dtype), else its value in ``resolved`` (from :meth:`at`): what a
        stored bound is checked against."""
        value = self.values[name]
        return value if _is_constant(value) and not isinstance(value, jax.Array) else resolved[name]

    def at(self, count: jax.Array, dtype: Any) -> tuple[dict[str, Any], jax.Array | None]:
        out: dict[str, Any] = {}
        runtime: set[str] = set()
        invalid = None
        for name, value in self.values.items():
            if value is None:
                out[name] = None
                continue
            v = as_scalar(resolve(value, count), dtype)
            out[name] = v
            if callable(value) or is_traced(value) or is_traced(v):
                runtime.add(name)
                bad = ~self.rules[name].holds(v)
                invalid = bad if invalid is None else invalid | bad
        for lo, hi in self.orders:
            if out[lo] is None or out[hi] is None or not {lo, hi} & runtime:
                continue
            bad = out[lo] > out[hi]
            invalid = bad if invalid is None else invalid | bad
        return out, invalid


def _is_constant(value: Any) -> bool:
    """A value known at construction (neither ``None``, a schedule nor traced)."""
    return value is not None and not callable(value) and not is_traced(value)


def counts(invalid: jax.Array | None) -> jax.Array:
    """A 0-d bool: the step may advance a transform's statistics (no hyperparameter is invalid)."""
    return jnp.ones((), bool) if invalid is None else ~invalid


def poison(x: Any, invalid: jax.Array | None) -> Any:
    """``x`` (an array or a tree) with every element NaN where ``invalid`` is true."""
    if invalid is None:
        return x

    def one(a: Any) -> Any:
        if a is None or getattr(a, "dtype", None) == jax.dtypes.float0:
            return a
        a = jnp.asarray(a)
        if not (jnp.issubdtype(a.dtype, jnp.inexact)):
            return a
        return jnp.where(invalid, jnp.full_like(a, jnp.nan), a)

    return jax.tree_util.tree_map(one, x)
