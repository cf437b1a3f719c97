"""Deprecated: ``gradclip_jax.privacy`` moved to :mod:`gradclip_jax.dp.accounting` and :mod:`gradclip_jax.dp.noise`.

Importing this module warns (``DeprecationWarning``); each old name is served from its home
with a warning naming it: ``epsilon``, ``calibrate_noise_multiplier``, ``dp_sgd_event`` and
``PrivacyPhase`` from :mod:`gradclip_jax.dp.accounting`, ``add_gaussian_noise`` and
``NOISE_STRATEGY`` from :mod:`gradclip_jax.dp.noise`, ``PrivacyAccountant`` from
``gradclip_jax``. ``NOISE_BLOCK_SIZE`` is forwarded to :mod:`gradclip_jax.dp.noise`, so
assigning it here still takes effect. Removed in the next release.
"""

from typing import TYPE_CHECKING

import gradclip_jax as _gcx
from gradclip_jax._core.deprecations import deprecation_getattr, moved_message, warn_moved
from gradclip_jax._core.settings import forward_settings
from gradclip_jax.dp import accounting as _accounting, noise as _noise

if (
    TYPE_CHECKING
):  # at run time forwarded: assigning it here assigns the one gradclip_jax.dp.noise reads
    pass

warn_moved(__name__, "gradclip_jax.dp.accounting and gradclip_jax.dp.noise")
forward_settings(__name__, _noise, ("NOISE_BLOCK_SIZE",))
_HOMES = {
    **{
        name: _accounting
        for name in ("PrivacyPhase", "calibrate_noise_multiplier", "dp_sgd_event", "epsilon")
    },
    **{name: _noise for name in ("NOISE_STRATEGY", "add_gaussian_noise")},
    "PrivacyAccountant": _gcx,
}
__getattr__ = deprecation_getattr(
    __name__,
    {
        name: (moved_message(f"{__name__}.{name}", f"{home.__name__}.{name}"), getattr(home, name))
        for name, home in _HOMES.items()
    },
)

__all__: list[str] = []  # a shim: every name has its home elsewhere
