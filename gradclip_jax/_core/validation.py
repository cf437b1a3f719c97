"""Argument checks shared by every package: each check once, with one behaviour.

Every check takes the name of the public function the user called first
(``fn``), then the argument's name, then its value, and its errors start with
``"{fn}: `{name}` ..."`` so that a message always says where the bad value went:
``TypeError`` for a value of the wrong kind (a bool where an int is due, a
string, a float mask), ``ValueError`` for a value of the right kind out of
range. A check never converts silently what would change the meaning (a float
mask is refused, not cast to bool; 2.5 is not an int).

Hyperparameters (numbers, arrays, schedules) are checked by :func:`check_scalar`;
structural arguments (ints, bools, choices, which decide shapes and code paths)
must be Python values and are unwrapped by :func:`static_value` first; host-side
numbers of the privacy API by :func:`check_number`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "STATIC_ARGS",
    "StaticDefault",
    "check_bool",
    "check_choice",
    "check_int",
    "check_mask",
    "check_number",
    "check_scalar",
    "check_transform",
    "clip_norm_arg",
    "either_spelling",
    "is_traced",
    "renamed_kwarg",
    "static_value",
]


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
        raise ValueError(f"{fn}: `{name}` must be a scalar, got an array of shape {arr.shape}")
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


def check_number(fn: str, name: str, value: Any, **bounds: Any) -> float:
    """A plain number known on the host (accounting, calibration, sampling) as a Python float.

    :func:`check_scalar` without schedules or tracers: the privacy API plans a
    run before any step, so its numbers must be known then. ``bounds`` are
    :func:`check_scalar`'s keywords (``low``, ``high``, ``low_inclusive``,
    ``high_inclusive``, ``allow_inf``).

    Raises:
      TypeError: naming ``fn`` and ``name`` for ``None``, a schedule, a traced
        array, a bool or anything but a real number.
      ValueError: for NaN, a non-scalar or a value outside the interval.

    Example:
      >>> check_number("epsilon", "delta", 1e-5, low=0.0, high=1.0, low_inclusive=False)
      1e-05
    """
    if value is None or callable(value) or is_traced(value):
        raise TypeError(f"{fn}: `{name}` must be a number, got {value!r}")
    check_scalar(fn, name, value, **bounds)
    return float(np.asarray(value).reshape(()))


def is_int(value: Any) -> TypeGuard[int | np.integer]:
    """Whether ``value`` is a Python or numpy int and not a bool (``True`` is not the count 1).

    Example:
      >>> is_int(3), is_int(np.int32(3)), is_int(True), is_int(3.0)
      (True, True, False, False)
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(fn: str, name: str, value: Any, low: int | None = None) -> int:
    """An integer argument (a size, a count, an index) as a Python int.

    Accepts Python and numpy ints, one-element integer arrays, and an
    integer-valued float (:func:`optax.inject_hyperparams` hands numbers over as
    float arrays); never a bool (``True`` is not the count 1).

    Args:
      fn, name: the function called and the argument's name (start every message).
      value: the value given.
      low: the smallest valid value (default ``None``: no bound).

    Raises:
      TypeError: for a bool, a non-integer float (2.5), a string or any other
        non-int, and (from :func:`static_value`) a traced array.
      ValueError: for a value below ``low``.

    Example:
      >>> check_int("autoclip", "history_size", 10.0, low=1)
      10
    """
    if type(value) is not int:  # a Python int (samplers' per-step calls) needs no conversion
        value = static_value(fn, name, value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{fn}: `{name}` must be an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{fn}: `{name}` must be >= {low}, got {value}")
    return int(value)


def check_bool(fn: str, name: str, value: Any) -> bool:
    """A structural flag (``tensorwise``, ``skip_nonfinite``) as a Python bool; ``TypeError`` otherwise.

    Example:
      >>> check_bool("ema", "tensorwise", np.bool_(True))
      True
    """
    value = static_value(fn, name, value)
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: `{name}` must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_choice(fn: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """A string option, case-insensitive, as its lower-case form.

    Raises:
      TypeError: for a non-string; ValueError naming the choices for another string.

    Example:
      >>> check_choice("zclip", "mode", "ZScore", ("zscore", "percentile"))
      'zscore'
    """
    value = static_value(fn, name, value)
    if not isinstance(value, str):
        raise TypeError(
            f"{fn}: `{name}` must be one of the strings {tuple(choices)}, got {value!r}"
        )
    if value.lower() in choices:
        return value.lower()
    raise ValueError(f"{fn}: `{name}` must be one of {tuple(choices)}, got {value!r}")


def check_transform(fn: str, name: str, value: Any) -> None:
    """``None`` or an optax transformation (anything with callable ``init`` and ``update``).

    Raises:
      TypeError: naming ``fn`` and ``name`` for anything else.
    """
    if value is None:
        return
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
        raise TypeError(
            f"{fn}: `{name}` must be an optax.GradientTransformation or None, got {value!r}"
        )


def check_mask(fn: str, mask: Any, rows: int) -> jax.Array | None:
    """The padding mask of a batch: ``None``, or a bool array of shape ``(rows,)``.

    A mask decides which examples are in a private sum, so it is never cast: a
    float or int mask (``0.5``, ``2``, ``-1`` would all turn into ``True``) is
    refused rather than reinterpreted.

    Args:
      fn: the function called.
      mask: ``None`` (every row real) or array-like of bools, ``True`` for a real row.
      rows: the batch size :math:`B`.

    Returns:
      ``None`` or ``mask`` as a jax bool array.

    Raises:
      ValueError: for a shape other than ``(rows,)``.
      TypeError: for a dtype other than bool.

    Example:
      >>> check_mask("clipped_grad", [True, False], 2)
      Array([ True, False], dtype=bool)
    """
    if mask is None:
        return None
    m = jnp.asarray(mask)
    if m.shape != (rows,):
        raise ValueError(
            f"{fn}: `mask` must have shape (B,) = ({rows},) (one entry per row of the batch), "
            f"got shape {m.shape}"
        )
    if m.dtype != jnp.bool_:
        raise TypeError(
            f"{fn}: `mask` must be a bool array (True for a real example), got dtype {m.dtype}; "
            "a numeric mask is not cast, write `mask != 0` if that is what you mean"
        )
    return m


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


# public function name -> its structural arguments (filled by hyperparam_rules.mark_static)
STATIC_ARGS: dict[str, tuple[str, ...]] = {}


def check_sum_dtype(fn: str, dtype: Any) -> None:
    """ValueError when ``dtype``, the dtype a clipped sum is returned in before any noise, is a
    16-bit float.

    Rounding the sum moves it by up to half a unit in its last place, which grows with
    the sum, not with one example: removing one of 256 aligned examples clipped at 0.7
    moved a bfloat16 sum by 1.25. The sensitivity then no longer bounds what one example
    changes. Rounding after the noise is post-processing, and costs nothing.
    """
    if dtype is None:
        return
    dt = np.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).bits < 32:
        raise ValueError(
            f"{fn}: dtype={dt.name} would return the clipped sum rounded to {dt.name} before any "
            "noise is added: the rounding grows with the sum, so one example could move the "
            "result by more than the clip norm and the sensitivity would not hold (256 examples "
            "clipped at 0.7: a bfloat16 sum moved by 1.25). Keep the sum in float32 (dtype=None or "
            "float32) and cast after adding the noise"
        )


def check_state(fn: str, state: Any, cls: type) -> None:
    """``TypeError`` naming ``fn`` unless ``state`` is a ``cls`` (this transform's state)."""
    if isinstance(state, cls):
        return
    got = type(state).__name__
    hint = ""
    if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
        hint = (
            " (this looks like the state of an optax.chain; pass this transform's own "
            "entry, e.g. state[0])"
        )
    elif state is None:
        hint = " (call tx.init(params) first)"
    elif isinstance(state, dict):
        hint = (
            " (a checkpoint restored without a target gives dicts for NamedTuple states: restore "
            "with tx.init(params)'s state, or jax.eval_shape of it, as the target)"
        )
    raise TypeError(
        f"{fn}: expected a {cls.__name__} (from this transform's init) as state, got {got}{hint}"
    )


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
        names = STATIC_ARGS.get(fn, (name,))
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
        if isinstance(item, float) and item.is_integer() and np.issubdtype(arr.dtype, np.integer):
            return int(item)
        return item
    return value


def _given(value: Any, default: Any) -> bool:
    """Whether an argument was given: not ``default``, nor the :class:`StaticDefault` wrapping it."""
    return value is not default and not (isinstance(value, StaticDefault) and value == default)


def renamed_kwarg(
    fn: str, old: str, new: str, old_value: Any, new_value: Any, default: Any = None
) -> Any:
    """The value of a renamed keyword argument, accepting the old spelling for a while.

    Returns ``old_value`` (with a ``DeprecationWarning`` that names ``fn`` and both
    spellings) when only the old spelling was given, else ``new_value``. An
    argument counts as not given when it is ``default`` or the
    :class:`StaticDefault` of ``default`` (the form :func:`mark_static` shows).
    For two spellings that both stay, use :func:`either_spelling` (no warning).

    Raises:
      TypeError: naming both spellings when both were given.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as w:
      ...     warnings.simplefilter("always")
      ...     renamed_kwarg("f", "axis", "dim", 1, None)
      1
      >>> w[0].category.__name__
      'DeprecationWarning'
    """
    if not _given(old_value, default):
        return new_value
    if _given(new_value, default):
        raise TypeError(
            f"{fn}: got both `{new}` and its deprecated spelling `{old}`; pass `{new}` only"
        )
    warnings.warn(
        f"{fn}: `{old}` is deprecated, use `{new}` (same meaning)", DeprecationWarning, stacklevel=3
    )
    return old_value


def either_spelling(
    fn: str, name: str, alias: str, value: Any, alias_value: Any, *, required: bool = False
) -> Any:
    """The value of an argument accepted under two names, with no warning for either.

    Args:
      fn: the public function the user called (starts every message).
      name: the canonical spelling (the one the docs use).
      alias: the other accepted spelling.
      value, alias_value: what was given under each (``None``: not given).
      required: raise when neither was given (default False: return ``None``).

    Returns:
      The one value given (``None`` when neither was and ``required`` is False).

    Raises:
      TypeError: naming both spellings when both were given (even with equal
        values: one of them is a typo or a leftover), and naming ``name`` when
        neither was given and ``required``.

    Example:
      >>> either_spelling("f", "l2_clip_norm", "l2_norm_clip", None, 1.0)
      1.0
    """
    if value is not None and alias_value is not None:
        raise TypeError(
            f"{fn}: got both `{name}` and `{alias}`: they are two spellings of one argument; pass one"
        )
    out = alias_value if value is None else value
    if out is None and required:
        raise TypeError(
            f"{fn}: missing the required argument `{name}` (or its other spelling `{alias}`)"
        )
    return out


def clip_norm_arg(
    fn: str, l2_clip_norm: Any, l2_norm_clip: Any, *, default: Any = None, **bounds: Any
) -> Any:
    """The clip norm :math:`C`, given as ``l2_clip_norm`` (canonical) or ``l2_norm_clip``.

    The DP API accepts both spellings without a warning: ``l2_clip_norm`` is
    jax-privacy's and this library's canonical name, ``l2_norm_clip`` optax's
    and TensorFlow Privacy's, so code written for either peer runs unchanged.
    Every function that takes the clip norm reads it here.

    Args:
      fn: the public function the user called (starts every message).
      l2_clip_norm, l2_norm_clip: what was given under each spelling (``None``: not given).
      default: the value when neither was given (``None``, the default: one must be).
      **bounds: when given, the value must be a plain number within them
        (:func:`check_number`'s keywords, e.g. ``low=0.0, low_inclusive=False``),
        and is returned as a Python float.

    Raises:
      TypeError: naming both spellings when both were given, or ``l2_clip_norm``
        when neither was and there is no default.
      ValueError: for a value outside ``bounds``.

    Example:
      >>> clip_norm_arg("dpsgd", None, 0.5)
      0.5
      >>> clip_norm_arg("audit", None, None, default=1.0, low=0.0, low_inclusive=False)
      1.0
    """
    c = either_spelling(
        fn, "l2_clip_norm", "l2_norm_clip", l2_clip_norm, l2_norm_clip, required=default is None
    )
    c = default if c is None else c
    return check_number(fn, "l2_clip_norm", c, **bounds) if bounds else c
