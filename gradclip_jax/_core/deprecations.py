"""Old import paths kept for one release: modules that moved warn, and their names still work.

optax's pattern (``optax._src.deprecations``): a moved module keeps a file at its old path that
warns when imported and serves each old name through a module ``__getattr__`` that warns again,
naming the new path, and returns the very object the new path gives (so ``isinstance`` checks,
``pickle`` and checkpoints that name the old path keep working). The changelog lists each shim,
and the release after removes it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

__all__ = ["deprecation_getattr", "moved_names", "top_level_getattr", "warn_moved"]


def moved_message(old: str, new: str) -> str:
    """The warning of a module moved from ``old`` to ``new``."""
    return f"{old} is deprecated and will be removed in the next release: import from {new} instead"


def warn_moved(old: str, new: str) -> None:
    """Warns (``DeprecationWarning``, at the importer's line) that module ``old`` moved to ``new``."""
    warnings.warn(moved_message(old, new), DeprecationWarning, stacklevel=3)


def deprecation_getattr(
    module: str, deprecations: Mapping[str, tuple[str, Any]]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving deprecated names.

    Args:
      module: the module's ``__name__`` (for the error on an unknown name).
      deprecations: each deprecated name's ``(message, object)``; reading the name warns
        ``message`` (``DeprecationWarning``) and returns ``object``.

    Returns:
      The function to bind as the module's ``__getattr__``.
    """

    return _warning_getattr(module, deprecations, deprecations.__getitem__)


def moved_names(
    old: str, new: Any, names: Sequence[str] | None = None
) -> dict[str, tuple[str, Any]]:
    """The deprecations of the names of module ``new`` shown at the old path ``old``.

    Args:
      old: the old module's dotted path.
      new: the module that is now the names' home.
      names: the names served; by default every name of ``new.__all__``.

    Returns:
      Each name's ``(message, object)``, for :func:`deprecation_getattr`.
    """
    return {
        name: (moved_message(f"{old}.{name}", f"{new.__name__}.{name}"), getattr(new, name))
        for name in (new.__all__ if names is None else names)
    }


def top_level_getattr(
    module: str, names: Sequence[str], homes: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A package ``__getattr__`` serving the old paths of names whose home is ``gradclip_jax``.

    A package that used to re-export top-level names (``gradclip_jax.dp.make_private``)
    no longer holds them; reading one warns, naming ``gradclip_jax.<name>``, and returns
    the very object the top level gives. The top level is imported when a name is read,
    not when the package is (it imports the package).

    Args:
      module: the package's ``__name__``.
      names: the top-level names the package used to show.
      homes: names read at this package that have their home in one of its submodules, each
        with that submodule: reading one is an ``AttributeError`` that names the home (one
        import path per name).

    Returns:
      The function to bind as the package's ``__getattr__``.
    """

    def entry(name: str) -> tuple[str, Any]:
        top = importlib.import_module("gradclip_jax")
        return moved_message(f"{module}.{name}", f"gradclip_jax.{name}"), getattr(top, name)

    return _warning_getattr(module, frozenset(names), entry, homes)


def _warning_getattr(
    module: str,
    served: Collection[str],
    entry: Callable[[str], tuple[str, Any]],
    homes: Mapping[str, str] | None = None,
) -> Callable[[str], Any]:
    """A module ``__getattr__``: a name in ``served`` warns ``entry(name)``'s message
    (``DeprecationWarning``, at the reader's line) and returns its object; any other name is
    an ``AttributeError``, as for a module without the hook. ``entry`` is called on each read,
    so an object can be resolved lazily."""

    def getattr_(name: str) -> Any:
        if name in served:
            message, obj = entry(name)
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return obj
        if homes and name in homes:
            raise AttributeError(
                f"module {module!r} has no attribute {name!r}: its one import path is "
                f"{homes[name]}.{name} (from {homes[name]} import {name})"
            )
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return getattr_
