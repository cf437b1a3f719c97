"""Privacy accounting and noise helpers (the public face of :mod:`gradclip_jax.dp`).

``gcx.privacy.epsilon``, ``gcx.privacy.calibrate_noise_multiplier``,
``gcx.privacy.dp_sgd_event`` and the step-by-step
``gcx.privacy.PrivacyAccountant`` are backed by ``dp-accounting`` (extra ``dp``);
``gcx.privacy.add_gaussian_noise`` adds the DP-SGD noise to a clipped sum
(``NOISE_STRATEGY`` picks, per backend, one draw per leaf or one blocked draw).
"""

from typing import TYPE_CHECKING

from gradclip_jax._core.settings import forward_settings
from gradclip_jax.dp import noise as _noise
from gradclip_jax.dp.accounting import (
    PrivacyAccountant,
    PrivacyPhase,
    calibrate_noise_multiplier,
    dp_sgd_event,
    epsilon,
)
from gradclip_jax.dp.noise import NOISE_STRATEGY, add_gaussian_noise

if TYPE_CHECKING:  # at run time forwarded: assigning it here assigns the one gradclip_jax.dp.noise reads
    from gradclip_jax.dp.noise import NOISE_BLOCK_SIZE

forward_settings(__name__, _noise, ("NOISE_BLOCK_SIZE",))

__all__ = [
    "NOISE_BLOCK_SIZE",
    "NOISE_STRATEGY",
    "PrivacyAccountant",
    "PrivacyPhase",
    "add_gaussian_noise",
    "calibrate_noise_multiplier",
    "dp_sgd_event",
    "epsilon",
]
