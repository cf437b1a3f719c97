"""Module-level settings kept in one module and read there at call time.

A setting (``AUTO_MIN_ELEMENTS``, ``NOISE_BLOCK_SIZE``, ...) is a module constant that the
code reads each time it decides, so that ``module.SETTING = value`` (or pytest's
``monkeypatch.setattr``) changes what the package does. A ``from home import SETTING`` in
another module would copy the value at import time, and assigning the copy would change
nothing. So the modules that show a setting under another path (a package's ``__init__``,
an older public module) forward it instead: :func:`forward_settings` makes reading the name
there read the defining module's current value and assigning it assign the defining
module's, whichever path a user goes through.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["forward_settings"]


def forward_settings(module_name: str, home: types.ModuleType, names: Sequence[str]) -> None:
    """Makes ``names`` of module ``module_name`` live views of the same names of ``home``.

    Reading ``module.NAME`` returns ``home.NAME`` as it is now; assigning ``module.NAME``
    assigns ``home.NAME`` (which may forward it again). Other attributes are untouched.

    Args:
      module_name: the forwarding module's ``__name__`` (call it from that module).
      home: the module the settings are defined in, or one that forwards them there.
      names: the settings' names.

    Raises:
      AttributeError: when ``home`` has no attribute of one of ``names``.
    """
    module = sys.modules[module_name]
    attributes: dict[str, Any] = {}
    for name in names:
        getattr(home, name)  # a misspelt name fails here, at import
        module.__dict__.pop(name, None)  # a copy would shadow the forwarding
        attributes[name] = _forwarded(home, name)
    base = type(module)

    def listed(self: types.ModuleType) -> list[str]:  # dir() and completion show the settings
        return sorted({*base.__dir__(self), *names})

    attributes["__dir__"] = listed
    # a data descriptor per name on the module's class: reads, assignments (and pytest's
    # monkeypatch, which restores through the descriptor) all go to ``home``
    module.__class__ = type("ForwardingModule", (base,), attributes)


def _forwarded(home: types.ModuleType, name: str) -> property:
    """A property reading and assigning ``home.<name>``."""

    def get(_: types.ModuleType) -> Any:
        return getattr(home, name)

    def put(_: types.ModuleType, value: Any) -> None:
        setattr(home, name, value)

    return property(get, put, doc=f"``{home.__name__}.{name}``, read and assigned there.")
