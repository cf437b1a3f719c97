"""Argument checks shared by every package: one place, one behaviour per check.

Every check takes the name of the public function the user called first
(``fn``), then the argument's name, then its value, and its errors start with
``"{fn}: `{name}` ..."`` so that a message always says where the bad value went.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clip_norm_arg", "either_spelling"]


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
        raise TypeError(f"{fn}: missing the required argument `{name}` (or its other spelling `{alias}`)")
    return out


def clip_norm_arg(fn: str, l2_clip_norm: Any, l2_norm_clip: Any) -> Any:
    """The clip norm :math:`C`, given as ``l2_clip_norm`` (canonical) or ``l2_norm_clip``.

    The DP API accepts both spellings without a warning: ``l2_clip_norm`` is
    jax-privacy's and this library's canonical name, ``l2_norm_clip`` optax's
    and TensorFlow Privacy's, so code written for either peer runs unchanged.

    Raises:
      TypeError: naming both spellings when both were given, or when neither was.

    Example:
      >>> clip_norm_arg("dpsgd", None, 0.5)
      0.5
    """
    return either_spelling(fn, "l2_clip_norm", "l2_norm_clip", l2_clip_norm, l2_norm_clip, required=True)
