"""The registry of gradclip_jax's optimizer-state classes.

Every transform's state class is registered where it is defined
(``@register_state``), so code that needs to recognise our states (notably
:func:`gradclip_jax.norms_from_state`, which must tell a flax ``nnx.State``
mapping made from one of our states from a parameter tree) reads
:data:`STATE_CLASSES` instead of importing the whole package to scan its
``__all__``. A module is imported before any of its states exists, so every
state an optimizer holds is registered by then.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["STATE_CLASSES", "register_state"]

T = TypeVar("T", bound=type)

STATE_CLASSES: list[type] = []


def register_state(cls: T) -> T:
    """Class decorator: records ``cls``, a ``NamedTuple`` state class, in :data:`STATE_CLASSES`.

    Raises:
      TypeError: naming the class when it is not a ``NamedTuple``.

    Example:
      >>> from typing import NamedTuple
      >>> @register_state
      ... class MyState(NamedTuple):
      ...     norm: float
      >>> MyState in STATE_CLASSES
      True
      >>> _ = STATE_CLASSES.remove(MyState)
    """
    if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
        raise TypeError(f"register_state: {cls!r} is not a NamedTuple state class")
    if cls not in STATE_CLASSES:
        STATE_CLASSES.append(cls)
    return cls
