"""Privacy accounting and noise helpers for DP-SGD.

The accounting functions are thin, validated wrappers around Google's
``dp-accounting`` package, which is an optional dependency: install it with
``pip install "gradclip_jax[dp]"``. It is imported only when an accounting
function is called, so the rest of gradclip_jax works without it.

DP-SGD with Poisson sampling at rate :math:`q`, noise multiplier :math:`z` and
:math:`T` steps is the :math:`T`-fold composition of the Poisson-subsampled
Gaussian mechanism (noise :math:`\\mathcal{N}(0, (zC)^2)` on a sum of sensitivity
:math:`C`). :func:`epsilon` gives its :math:`\\varepsilon` at a given
:math:`\\delta`; :func:`calibrate_noise_multiplier` the smallest :math:`z` that
meets a target :math:`\\varepsilon`. With :func:`gradclip_jax.dp_quantile_aggregate`
account with the overall ``noise_multiplier`` you gave it (its count and gradient
noises are split so that they compose to exactly that Gaussian mechanism).
Another batch selection is accounted through its sampler
(:class:`gradclip_jax.dp.BatchSampler`): its ``dp_event`` is the event of a
step, which :func:`calibrate` and :class:`PrivacyAccountant` compose.

Here: ``_accountants`` (dp-accounting's accountants, imported when first needed, and the
epsilon of an event), ``_composition`` (a run's epsilon from each step's PLD or RDP built once,
its composition kept and extended), ``_dpsgd`` (Poisson-sampled DP-SGD in one call: :func:`epsilon`,
:func:`calibrate_noise_multiplier`), ``_calibration`` (:func:`calibrate`, the search for the
noise multiplier), ``_privacy_accountant`` (:class:`PrivacyAccountant`, step by step) and
``_subsampled_rdp`` (the RDP of a Poisson-subsampled mechanism from its own, and the discrete
Gaussian's event of ``make_private(hardened='discrete')``).
"""

from gradclip_jax.dp.accounting._accountants import pld_interval as pld_interval  # (tests, docs)
from gradclip_jax.dp.accounting._calibration import calibrate
from gradclip_jax.dp.accounting._dpsgd import (
    calibrate_noise_multiplier,
    dp_sgd_event,
    epsilon,
    sampled_gaussian_event,
)
from gradclip_jax.dp.accounting._privacy_accountant import (
    PrivacyAccountant as PrivacyAccountant,
    PrivacyPhase,
    phase_event,
)
from gradclip_jax.dp.accounting._subsampled_rdp import (
    PoissonSampledDiscreteGaussianEvent,
    poisson_subsampled_rdp,
)

__all__ = [
    "PoissonSampledDiscreteGaussianEvent",
    "PrivacyPhase",
    "calibrate_noise_multiplier",
    "dp_sgd_event",
    "calibrate",
    "epsilon",
    "phase_event",
    "poisson_subsampled_rdp",
    "sampled_gaussian_event",
]
