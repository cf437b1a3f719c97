"""What a norm is: ``ord`` values parsed into a :class:`NormSpec`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from gradclip_jax._core.validation import is_traced, static_value

OrdLike = int | float | str
DimLike = None | int | Sequence[int] | str
Axes = tuple[int, ...] | None


_STRING_ORDS = {
    "l0": 0.0,
    "l1": 1.0,
    "l2": 2.0,
    "l3": 3.0,
    "l4": 4.0,
    "linf": math.inf,
}
_STAT_ORDS = ("mad", "rms", "std", "var", "sum")
# kinds whose partial statistics are sums (and so combine across leaves by +)
_SUM_KINDS = ("pow", "count", "mad", "rms", "sum", "var", "std")
# kinds whose fast path can underflow (powers of small numbers)
UNDERFLOW_KINDS = ("rms", "var", "std")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A parsed ``ord``.

    Attributes:
      kind: ``'pow'`` (a p-norm with ``p`` not 0 or +-inf), ``'max'``, ``'min'``,
        ``'count'``, ``'mad'``, ``'rms'``, ``'std'``, ``'var'`` or ``'sum'``.
      p: the exponent of a ``'pow'`` norm.
      label: the ``ord`` as the user wrote it, for messages.
    """

    kind: str
    p: float = 2.0
    label: str = "2"

    @property
    def signed(self) -> bool:
        """True when the "norm" can be negative (only ``'sum'``)."""
        return self.kind == "sum"


def parse_ord(ord: OrdLike | NormSpec, fn: str = "gradclip_jax") -> NormSpec:  # noqa: A002
    """Parses an ``ord`` argument.

    Args:
      ord: a number (``p``, ``inf``, ``-inf``, ``0``), one of the strings
        ``'l0' 'l1' 'l2' 'l3' 'l4' 'linf' 'mad' 'rms' 'std' 'var' 'sum'`` (case
        insensitive; ``'inf'`` and ``'-inf'`` are accepted too), or a
        :class:`NormSpec`.
      fn: the calling function's name, for error messages.

    Returns:
      The :class:`NormSpec`.

    Raises:
      ValueError: for an unknown string, NaN or a non-scalar.
      TypeError: for a traced ``ord`` or a non-number.
    """
    if isinstance(ord, NormSpec):
        return ord
    if is_traced(ord):
        static_value(fn, "ord", ord)  # raises the explanatory TypeError
    ord = static_value(fn, "ord", ord)  # noqa: A001
    if isinstance(ord, str):
        key = ord.strip().lower()
        if key in _STAT_ORDS:
            return NormSpec(kind=key, p=math.nan, label=key)
        if key in ("inf", "+inf", "infinity"):
            p = math.inf
        elif key in ("-inf", "-infinity"):
            p = -math.inf
        elif key in _STRING_ORDS:
            p = _STRING_ORDS[key]
        else:
            raise ValueError(
                f"{fn}: unknown ord {ord!r}; expected a number or one of "
                "'l0', 'l1', 'l2', 'l3', 'l4', 'linf', 'mad', 'rms', 'std', 'var', 'sum'"
            )
        label = key
    elif isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise TypeError(f"{fn}: ord must be a number or a string, got {ord!r}")
    else:
        p = float(ord)
        label = repr(ord)
        if math.isnan(p):
            raise ValueError(f"{fn}: ord must not be NaN")
    if p == math.inf:
        return NormSpec(kind="max", p=p, label=label)
    if p == -math.inf:
        return NormSpec(kind="min", p=p, label=label)
    if p == 0.0:
        return NormSpec(kind="count", p=p, label=label)
    return NormSpec(kind="pow", p=p, label=label)
