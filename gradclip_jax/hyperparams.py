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

import math
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

    Schedules and traced arrays are accepted unchecked. Raises ``ValueError``
    naming ``fn`` and ``name`` for NaN, out-of-range or non-scalar values and
    ``TypeError`` for values that are not numbers.
    """
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{fn}: `{name}` must be a number, got None")
    if callable(value) or is_traced(value):
        return
    if isinstance(value, bool):
        raise TypeError(f"{fn}: `{name}` must be a number, got bool {value!r}")
    try:
        arr = np.asarray(value)
    except Exception as err:  # pragma: no cover - exotic array types
        raise TypeError(f"{fn}: `{name}` must be a number, got {value!r}") from err
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == jnp.bfloat16
    ):
        raise TypeError(f"{fn}: `{name}` must be a number, got {value!r}")
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


def static_value(fn: str, name: str, value: Any) -> Any:
    """Returns a structural argument as a Python value.

    Concrete arrays of one element become Python numbers (so a value that
    :func:`optax.inject_hyperparams` wrapped in an array still works at ``init``);
    traced arrays raise a ``TypeError`` that explains the fix.
    """
    if is_traced(value):
        raise TypeError(
            f"{fn}: `{name}` decides shapes and code paths, so it must be a Python "
            "value, not a traced array. With optax.inject_hyperparams pass "
            f"static_args=({name!r},), or use gradclip_jax.inject_hyperparams, which "
            "does that for you."
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
    """Decorator recording a factory's structural arguments for inject_hyperparams."""

    def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
        factory.static_args = tuple(names)  # type: ignore[attr-defined]
        return factory

    return wrap
