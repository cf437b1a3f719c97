"""Which jax-privacy is installed beside the drop-in: 2.0.0 (PyPI) or a later source (GitHub).

Their contracts differ in two places, and the drop-in follows the installed one, so code
written against it keeps working: ``clip_pytree``'s ``nan_safe`` (2.0.0: zero the non-finite
elements first, by default; later: no such step, a non-finite input gives a non-finite norm),
with ``clipped_fun``'s (2.0.0: per element; later: an example whose norm is not finite
contributes zero), and ``clipped_fun``'s output with ``return_norms`` alone (2.0.0:
``(value, ((), norms))``; later: ``(value, norms)``). Read :data:`AFTER_2_0_0` when a
function is made or called (not at import), so tests can set it.
"""

from __future__ import annotations

import re

import jax_privacy


def after_2_0_0(version: str) -> bool:
    """Whether the version string names a jax-privacy after 2.0.0 (``2.3.0.dev0``: yes).

    Example:
      >>> after_2_0_0('2.0.0'), after_2_0_0('2.3.0.dev0')
      (False, True)
    """
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3]) > (2, 0, 0)


AFTER_2_0_0: bool = after_2_0_0(getattr(jax_privacy, "__version__", "2.0.0"))
