"""Deprecated: ``gradclip_jax.ghost`` moved to :mod:`gradclip_jax.per_example.ghost`.

Importing this module warns (``DeprecationWarning``); ``ghost_report``, ``GhostReport`` and
``GhostFallbackWarning`` are served from their home, ``gradclip_jax``, with a warning naming it,
and the settings (``AUTO_MIN_ELEMENTS``, ...) are forwarded to
:mod:`gradclip_jax.per_example.ghost`, so assigning them here still takes effect. Removed in the
next release.
"""

from typing import TYPE_CHECKING

import gradclip_jax as _gcx
from gradclip_jax._core.deprecations import deprecation_getattr, moved_message, warn_moved
from gradclip_jax._core.settings import forward_settings
from gradclip_jax.per_example import ghost as _ghost

if TYPE_CHECKING:  # at run time forwarded to gradclip_jax.per_example.ghost (and on to the policy)
    pass

warn_moved(__name__, "gradclip_jax.per_example.ghost")
SETTINGS = ("AUTO_MIN_ELEMENTS", "AUTO_MIN_ELEMENTS_NO_FALLBACK", "BOOKKEEPING_MAX_SHARE")
forward_settings(__name__, _ghost, SETTINGS)
__getattr__ = deprecation_getattr(
    __name__,
    {
        name: (moved_message(f"{__name__}.{name}", f"gradclip_jax.{name}"), getattr(_gcx, name))
        for name in ("GhostFallbackWarning", "GhostReport", "ghost_report")
    },
)

__all__: list[str] = []  # a shim: every name has its home elsewhere
