"""Ghost clipping: per-example gradient norms without per-example gradients.

``ghost_report``, ``GhostReport`` and ``GhostFallbackWarning`` are imported from ``gradclip_jax``;
this package is the home of the settings (``AUTO_MIN_ELEMENTS``, ...). The method is told in the guide "Ghost clipping: how it works" (``docs/guides/ghost-clipping.md``). Here: ``_jaxpr`` (tracing and evaluation), ``_analysis`` (the plan:
which leaf is measured how, and what follows from it: the path, the sum, the fallback
warning and the report), ``rules`` (one file per primitive family, one
table), ``_measure`` and ``_sums`` (norms and clipped sums), ``_strategy`` (the
``clipped_grad`` implementation).
"""

from typing import TYPE_CHECKING

from gradclip_jax._core.deprecations import top_level_getattr
from gradclip_jax._core.settings import forward_settings
from gradclip_jax.per_example.ghost._analysis import policy

if (
    TYPE_CHECKING
):  # at run time forwarded: ``ghost.AUTO_MIN_ELEMENTS = n`` sets the one the policy reads
    from gradclip_jax.per_example.ghost._analysis.policy import (
        AUTO_MIN_ELEMENTS,
        AUTO_MIN_ELEMENTS_NO_FALLBACK,
        BOOKKEEPING_MAX_SHARE,
    )

forward_settings(
    __name__,
    policy,
    ("AUTO_MIN_ELEMENTS", "AUTO_MIN_ELEMENTS_NO_FALLBACK", "BOOKKEEPING_MAX_SHARE"),
)

# The report and the warning this package used to show; ``gradclip_jax`` is their home (one release).
__getattr__ = top_level_getattr(__name__, ("GhostFallbackWarning", "GhostReport", "ghost_report"))

__all__ = [
    "AUTO_MIN_ELEMENTS",
    "AUTO_MIN_ELEMENTS_NO_FALLBACK",
    "BOOKKEEPING_MAX_SHARE",
]
