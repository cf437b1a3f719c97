"""Differentially private training: aggregation, noise and accounting.

* :mod:`gradclip_jax.dp.aggregate`: DP-SGD transforms over per-example gradients
  (:func:`~gradclip_jax.dp_aggregate`, :func:`~gradclip_jax.dpsgd`, :func:`~gradclip_jax.dp_quantile_aggregate`) and over
  clipped sums (:func:`~gradclip_jax.dp_noise`).
* :mod:`gradclip_jax.dp.noise`: the Gaussian noise adder.
* :mod:`gradclip_jax.dp.accounting`: privacy accounting on ``dp-accounting``
  (the step-by-step accountant is :class:`gradclip_jax.PrivacyAccountant`).
* :mod:`gradclip_jax.dp.sampling`: the samplers, one folder: the protocol
  (:class:`BatchSampler`: a step's indices and mask, and the ``dp_accounting``
  event its sampling implies) and :class:`IndexSampler`, the base of a new
  scheme in one file (``sampling/protocol.py``); Poisson and truncated Poisson
  batch selection padded to fixed shapes (:class:`~gradclip_jax.PoissonSampler`,
  ``sampling/poisson.py``); user-level DP (Poisson sampling over users, each
  user's gradient clipped as one unit: :class:`UserPoissonSampler`,
  :func:`user_loss`, ``sampling/users.py``).
* :mod:`gradclip_jax.dp.private_step`: the whole private step in one call
  (:func:`~gradclip_jax.make_private`).
* :mod:`gradclip_jax.dp.hardened`: opt-in hardened randomness and noise (OS-seeded keys, the
  sum-of-normals Gaussian, the integer grid with discrete Gaussian noise); ``make_private(...,
  hardened=True)`` uses it.
* :mod:`gradclip_jax.dp.audit`: an empirical lower bound on a run's epsilon
  from gradient canaries (the bound needs jax-privacy, imported when used).
"""

from gradclip_jax._core.deprecations import top_level_getattr
from gradclip_jax.dp import (
    audit as audit,  # the submodule, as gcx.dp.audit
    hardened as hardened,  # the submodule, as gcx.dp.hardened
)
from gradclip_jax.dp.hardened import (
    add_discrete_gaussian_noise as add_discrete_gaussian_noise,
    add_sum_of_normals_noise as add_sum_of_normals_noise,
    discrete_gaussian as discrete_gaussian,
    grid_clipped_sum as grid_clipped_sum,
    os_key as os_key,
)
from gradclip_jax.dp.sampling import (
    BatchSampler as BatchSampler,
    IndexSampler as IndexSampler,
    SampledBatch as SampledBatch,
    UserBatch as UserBatch,
    UserPoissonSampler as UserPoissonSampler,
    user_loss as user_loss,
)

#: The everyday API this package used to show; ``gradclip_jax`` is their home (one release).
_TOP_LEVEL = (
    "BatchOverflowError",
    "DPAggregateState",
    "DPNoiseState",
    "DPQuantileAggregateState",
    "PoissonBatch",
    "PoissonSampler",
    "PrivacyBudgetError",
    "PrivacyBudgetWarning",
    "PrivateStepMetrics",
    "PrivateTraining",
    "dp_aggregate",
    "dp_noise",
    "dp_quantile_aggregate",
    "dpsgd",
    "make_private",
    "noise_multiplier_for_gradient",
)
#: Names ``shared/API.md`` shows under ``gcx.dp`` whose home is one of its submodules: reading
#: them here is an AttributeError naming that home.
_HOMES = {
    "add_gaussian_noise": "gradclip_jax.dp.noise",
    "calibrate_noise_multiplier": "gradclip_jax.dp.accounting",
    "epsilon": "gradclip_jax.dp.accounting",
}
__getattr__ = top_level_getattr(__name__, _TOP_LEVEL, _HOMES)

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")
