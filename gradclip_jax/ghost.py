"""Ghost clipping's public names: an alias of :mod:`gradclip_jax.per_example.ghost`.

:func:`gradclip_jax.per_example.clipped_grad` with ``method='ghost'`` (or
``'auto'``) measures per-example gradient norms without forming per-example
gradients; how (the rules per layer kind, the probes, the two ways to form the
clipped sum, 16-bit inputs, soundness) is told in the guide "Ghost clipping: how
it works" (``docs/guides/ghost-clipping.md``).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from gradclip_jax.per_example import clipped_grad
    >>> def loss(p, x):  # per-example losses, shape (B,)
    ...     return jnp.sum(jnp.tanh(x @ p['w'] + p['b']), axis=-1)
    >>> params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}
    >>> x = jnp.arange(12.0).reshape(4, 3) / 10
    >>> g_ghost, info = jax.jit(clipped_grad(loss, 1.0, method='ghost'))(params, x)
    >>> g_vmap, _ = clipped_grad(loss, 1.0, method='vmap')(params, x)
    >>> bool(jnp.allclose(g_ghost['w'], g_vmap['w'], rtol=1e-5)), info.norms.shape
    (True, (4,))
"""

from typing import TYPE_CHECKING

from gradclip_jax._core.settings import forward_settings
from gradclip_jax.per_example import ghost as _ghost
from gradclip_jax.per_example.ghost import GhostFallbackWarning, GhostReport, ghost_report

if TYPE_CHECKING:  # at run time forwarded to gradclip_jax.per_example.ghost (and on to the policy)
    from gradclip_jax.per_example.ghost import (
        AUTO_MIN_ELEMENTS,
        AUTO_MIN_ELEMENTS_NO_FALLBACK,
        BOOKKEEPING_MAX_SHARE,
    )

forward_settings(__name__, _ghost, ("AUTO_MIN_ELEMENTS", "AUTO_MIN_ELEMENTS_NO_FALLBACK", "BOOKKEEPING_MAX_SHARE"))

__all__ = [
    "AUTO_MIN_ELEMENTS",
    "AUTO_MIN_ELEMENTS_NO_FALLBACK",
    "BOOKKEEPING_MAX_SHARE",
    "GhostFallbackWarning",
    "GhostReport",
    "ghost_report",
]
