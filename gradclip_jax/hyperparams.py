"""Hyperparameters: validation at construction, resolution at update time.

Every numeric hyperparameter of a gradclip_jax transform (``max_norm``, ``threshold``,
``beta``, ...) may be

* a Python number or a concrete array: checked when the transform is built, so a
  bad value raises ``ValueError`` naming the argument before any training starts;
* a traced array (for example under :func:`optax.inject_hyperparams` or when the
  transform is built inside ``jax.jit``): accepted as is, since it cannot be
  inspected;
* a schedule ``step -> value``: evaluated at the transform's own step counter.

Structural arguments (``ord``, ``dim``, ``min_size``, ``axis``) decide shapes and
which code runs, so they must be Python values. :func:`inject_hyperparams` wraps
:func:`optax.inject_hyperparams` and marks them static automatically.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Numeric = float | int | jax.Array | np.ndarray
Hyperparam = Numeric | Callable[[jax.Array], Numeric]

__all__ = ["Hyperparam", "inject_hyperparams"]




def is_traced(value: Any) -> bool:
    """True when ``value`` is a JAX tracer (its value is unknown at trace time)."""
    return isinstance(value, jax.core.Tracer)


def check_scalar(
    fn: str,
    name: str,
    value: Any,
    *,
    low: float | None = 0.0,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
    allow_inf: bool = True,
) -> None:
    """Validates a numeric hyperparameter when it is known at construction.

    Schedules and traced arrays are accepted unchecked (see :class:`Hyperparams`
    for their run-time guard). Raises ``TypeError`` naming ``fn`` and ``name`` for
    values that are not numbers (``None`` where it is not allowed, strings,
    bools, objects) and ``ValueError`` for NaN, out-of-range or non-scalar numbers.
    """
    if value is None:
        if allow_none:
            return
        raise TypeError(f"{fn}: `{name}` must be a number, got None")
    if callable(value) or is_traced(value):
        return
    if isinstance(value, bool):
        raise TypeError(f"{fn}: `{name}` must be a number, got bool {value!r}")
    if isinstance(value, complex):
        raise TypeError(f"{fn}: `{name}` must be a real number, got complex {value!r}")
    if not isinstance(value, (int, float, np.generic, np.ndarray, jax.Array)):
        # lists, tuples, strings, objects: np.asarray would turn [1.0] into a valid-looking array
        raise TypeError(f"{fn}: `{name}` must be a number, got {type(value).__name__} {value!r}")
    try:
        arr = np.asarray(value)
    except Exception as err:  # pragma: no cover - exotic array types
        raise TypeError(f"{fn}: `{name}` must be a number, got {value!r}") from err
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == jnp.bfloat16
    ):
        raise TypeError(f"{fn}: `{name}` must be a number, got {type(value).__name__} {value!r}")
    if np.issubdtype(arr.dtype, np.complexfloating):
        raise TypeError(f"{fn}: `{name}` must be a real number, got complex {value!r}")
    if arr.size != 1:
        raise ValueError(
            f"{fn}: `{name}` must be a scalar, got an array of shape {arr.shape}"
        )
    v = float(arr.reshape(()))
    if math.isnan(v):
        raise ValueError(f"{fn}: `{name}` must not be NaN")
    if not allow_inf and math.isinf(v):
        raise ValueError(f"{fn}: `{name}` must be finite, got {v}")
    if low is not None and (v < low or (v == low and not low_inclusive)):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"{fn}: `{name}` must be {bound} {low}, got {v}")
    if high is not None and (v > high or (v == high and not high_inclusive)):
        bound = "<=" if high_inclusive else "<"
        raise ValueError(f"{fn}: `{name}` must be {bound} {high}, got {v}")


class StaticDefault:
    """The default of a structural argument, as a factory's signature shows it.

    :func:`optax.inject_hyperparams` turns every argument whose value (default
    included) is a number into an array held in its state, and under ``jit``
    that array is traced, which a structural argument (``ord``, ``min_size``,
    ``warmup_steps``, ...) cannot be. :func:`mark_static` therefore shows the
    numeric defaults of structural arguments wrapped in this class (it prints as
    the bare value), which optax leaves alone, so plain
    ``optax.inject_hyperparams(gcx.zclip)()`` works; :func:`static_value`
    unwraps it.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, StaticDefault) else other
        return bool(self.value == other)

    def __hash__(self) -> int:
        return hash(self.value)


# public function name -> its structural arguments (filled by mark_static)
_STATIC_ARGS: dict[str, tuple[str, ...]] = {}


def static_value(fn: str, name: str, value: Any) -> Any:
    """Returns a structural argument as a Python value.

    Concrete arrays of one element become Python numbers (so a value that
    :func:`optax.inject_hyperparams` wrapped in an array still works at ``init``);
    traced arrays raise a ``TypeError`` that names every structural argument of
    ``fn`` and explains the fix.
    """
    if isinstance(value, StaticDefault):
        return value.value
    if is_traced(value):
        names = _STATIC_ARGS.get(fn, (name,))
        listed = ", ".join(repr(n) for n in names)
        raise TypeError(
            f"{fn}: `{name}` decides shapes and code paths, so it must be a Python "
            "value, not a traced array (optax.inject_hyperparams turns every number it "
            f"is given into an array). The structural arguments of {fn} are {listed}: "
            f"pass them to optax.inject_hyperparams in static_args=({listed},), or use "
            "gradclip_jax.inject_hyperparams, which does that for you."
        )
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.size != 1:
            raise ValueError(f"{fn}: `{name}` must be a scalar, got shape {arr.shape}")
        item = arr.reshape(()).item()
        if isinstance(item, float) and item.is_integer() and np.issubdtype(
            arr.dtype, np.integer
        ):
            return int(item)
        return item
    return value


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
            raise ValueError(
                f"hyperparameters must be scalars, got an array of shape {arr.shape}"
            )
        arr = arr.reshape(())
    return arr


def increment(count: jax.Array) -> jax.Array:
    """Step counter + 1, saturating instead of overflowing."""
    return optax.safe_increment(count)


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    """:func:`optax.inject_hyperparams` that knows gradclip_jax's structural args.

    optax turns every numeric argument (``ord=2``, ``min_size=1``, ...) into an
    array held in the state, but those arguments decide shapes and code paths and
    cannot be traced. This wrapper adds the factory's structural arguments
    (listed in its ``static_args`` attribute) to ``static_args``; everything else
    behaves exactly as in optax.

    Args:
      inner_factory: a gradclip_jax (or any optax) transform factory.
      static_args: further arguments to keep static.
      hyperparam_dtype: as in :func:`optax.inject_hyperparams`.

    Returns:
      A factory with the same arguments whose state exposes the numeric
      hyperparameters under ``state.hyperparams``.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.inject_hyperparams(gcx.clip_by_norm)(max_norm=1.0, ord=2)
      >>> state = tx.init({'w': jnp.ones(3)})
      >>> state.hyperparams['max_norm'] = jnp.asarray(0.5)
      >>> out, _ = tx.update({'w': jnp.ones(3)}, state)
      >>> round(float(jnp.linalg.norm(out['w'])), 4)
      0.5
    """
    extra = {static_args} if isinstance(static_args, str) else set(static_args)
    known = set(getattr(inner_factory, "static_args", ()))
    return optax.inject_hyperparams(
        inner_factory,
        static_args=tuple(sorted(extra | known)),
        hyperparam_dtype=hyperparam_dtype,
    )


def mark_static(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator recording a factory's structural arguments.

    Records them in ``factory.static_args`` (read by :func:`inject_hyperparams`)
    and for the error messages of :func:`static_value`, and shows their numeric
    defaults in the signature as :class:`StaticDefault`, so that plain
    :func:`optax.inject_hyperparams` leaves them static when they are not passed.
    """

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.static_args = tuple(names)  # type: ignore[attr-defined]
        _STATIC_ARGS[factory.__name__] = tuple(names)
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


def renamed_kwarg(
    fn: str, old: str, new: str, old_value: Any, new_value: Any, default: Any = None
) -> Any:
    """The value of a renamed keyword argument, accepting the old spelling.

    Returns ``old_value`` (with a ``DeprecationWarning`` that names ``fn`` and both
    spellings) when only the old spelling was given, else ``new_value``. Giving
    both raises ``TypeError``. ``default`` is the value that means "not given"
    for both.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     renamed_kwarg("f", "axis", "dim", 1, None)
      1
      >>> w[0].category.__name__
      'DeprecationWarning'
    """
    if old_value is default or (isinstance(old_value, StaticDefault) and old_value == default):
        return new_value
    if new_value is not default and not (
        isinstance(new_value, StaticDefault) and new_value == default
    ):
        raise TypeError(f"{fn}: got both `{new}` and its deprecated spelling `{old}`; pass `{new}` only")
    warnings.warn(
        f"{fn}: `{old}` is deprecated, use `{new}` (same meaning)", DeprecationWarning, stacklevel=3
    )
    return old_value


# ----------------------------------------------------------------------------
# Run-time guard of traced and scheduled hyperparameters
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
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
        self.rules: dict[str, Rule] = {}
        self.orders: list[tuple[str, str]] = []

    def add(self, name: str, value: Any, **rule: Any) -> None:
        r = Rule(**rule)
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
