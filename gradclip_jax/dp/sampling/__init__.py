"""Samplers: which examples each DP-SGD step uses, and the privacy event that implies.

One folder, one file per idea:

* ``protocol``: the protocol every sampler follows (:class:`BatchSampler`: a step's
  indices and mask, and the ``dp_accounting`` event its sampling implies), and
  :class:`IndexSampler`, the base class of a new scheme in one file;
* ``poisson``: Poisson and truncated Poisson batch selection padded to fixed shapes
  (:class:`PoissonSampler`, the default of ``make_private``), and the overflow
  helpers :func:`overflow_probability` and :func:`max_batch_size_for`;
* ``users``: user-level DP (Poisson sampling over users, each user's gradient clipped
  as one unit: :class:`UserPoissonSampler`, :func:`user_loss`).

A new sampler goes in a new file here, a subclass of :class:`IndexSampler`
(``draw`` and ``dp_event``), exported below and from :mod:`gradclip_jax.dp`.
The modules ``gradclip_jax.dp.batch_selection`` and ``gradclip_jax.dp.user_sampling``
are the old homes of ``protocol`` and ``users``, kept for one release as deprecation shims.
"""

from gradclip_jax._core.deprecations import top_level_getattr
from gradclip_jax.dp.sampling.poisson import max_batch_size_for, overflow_probability
from gradclip_jax.dp.sampling.protocol import (
    NEIGHBORING,
    BatchSampler,
    IndexSampler,
    SampledBatch,
    check_sampler,
    processes,
)
from gradclip_jax.dp.sampling.users import UserBatch, UserPoissonSampler, user_loss

# The Poisson sampler's names this package used to show; ``gradclip_jax`` is their home (one release).
__getattr__ = top_level_getattr(__name__, ("BatchOverflowError", "PoissonBatch", "PoissonSampler"))

__all__ = [
    "NEIGHBORING",
    "BatchSampler",
    "IndexSampler",
    "SampledBatch",
    "UserBatch",
    "UserPoissonSampler",
    "check_sampler",
    "max_batch_size_for",
    "overflow_probability",
    "processes",
    "user_loss",
]
