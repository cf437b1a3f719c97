"""Ghost clipping: per-example gradient norms without per-example gradients.

The public names are also reachable as :mod:`gradclip_jax.ghost`; the method
is told in the guide "Ghost clipping: how it works" (``docs/guides/ghost-clipping.md``). Here: ``_jaxpr`` (tracing and evaluation), ``_analysis`` (the plan:
which leaf is measured how, and what follows from it: the path, the sum, the fallback
warning and the report), ``rules`` (one file per primitive family, one
table), ``_measure`` and ``_sums`` (norms and clipped sums), ``_strategy`` (the
``clipped_grad`` implementation).
"""

from gradclip_jax.per_example.ghost._analysis import (
    AUTO_MIN_ELEMENTS,
    AUTO_MIN_ELEMENTS_NO_FALLBACK,
    BOOKKEEPING_MAX_SHARE,
    GhostFallbackWarning,
    GhostReport,
    ghost_report,
)

__all__ = ["AUTO_MIN_ELEMENTS", "AUTO_MIN_ELEMENTS_NO_FALLBACK", "BOOKKEEPING_MAX_SHARE", "GhostFallbackWarning", "GhostReport", "ghost_report"]
