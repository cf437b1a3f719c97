"""Hardened noise and randomness for DP-SGD (opt-in): OS-seeded keys, noise robust to the known
floating-point attacks, and an integer-grid mechanism with discrete Gaussian noise.

* :func:`os_key`, :func:`os_seed`: keys and seeds from the OS's entropy (:mod:`secrets`) or a
  caller's generator, never from a user integer.
* :func:`add_sum_of_normals_noise`: Gaussian noise as :math:`(Z_1 + Z_2 + Z_3 + Z_4)/2` (Holohan
  and Braghin 2021; Opacus' ``secure_mode``): the Gaussian mechanism, accounted as such.
* The integer grid: :func:`grid_clipped_sum` (clip, scale by a power of two, truncate toward zero:
  :math:`\\|r_i\\|_2 \\le \\gamma C` exactly; an exact int32 sum), :func:`add_discrete_gaussian_noise`
  (:func:`discrete_gaussian`: Canonne, Kamath and Steinke 2020, from an exact 96-bit CDF) and
  :func:`from_grid`. Accounting: for integer shifts :math:`\\mu - \\nu` the Rényi divergence of
  the discrete Gaussians is at most the continuous ones', :math:`\\alpha \\|\\mu -
  \\nu\\|_2^2 / 2\\sigma^2` (CKS20; per coordinate, and additive over the product), so RDP at noise
  multiplier :func:`grid_noise_multiplier` bounds it; for Poisson sampling, Zhu and Wang's
  general bound on a subsampled mechanism's RDP from its own (ICML 2019), which assumes no
  density (:class:`gradclip_jax.dp.accounting.PoissonSampledDiscreteGaussianEvent`: what
  ``make_private(hardened='discrete')`` records, with ``accountant='rdp'``). Add
  :func:`sampler_tv_bound` (times the draws, times
  :math:`1 + e^\\varepsilon`) to delta.

See the guide's "Hardened noise" section (docs/guides/dp-sgd.md) for the threat, what this
defends and what it does not (timing, the host, the accelerator's generator).
"""

from typing import TYPE_CHECKING

from gradclip_jax._core.settings import forward_settings
from gradclip_jax.dp.hardened import _discrete_gaussian
from gradclip_jax.dp.hardened._discrete_gaussian import (
    discrete_gaussian,
    sampler_tv_bound,
)
from gradclip_jax.dp.hardened._entropy import BitGenerator, os_key, os_seed
from gradclip_jax.dp.hardened._integer_grid import (
    add_discrete_gaussian_noise,
    from_grid,
    grid_clipped_sum,
    grid_noise_multiplier,
    grid_sensitivity,
)
from gradclip_jax.dp.hardened._sum_of_normals import add_sum_of_normals_noise

if TYPE_CHECKING:  # at run time forwarded to the module that reads it
    from gradclip_jax.dp.hardened._discrete_gaussian import MAX_SIGMA

forward_settings(__name__, _discrete_gaussian, ("MAX_SIGMA",))

__all__ = [
    "MAX_SIGMA",
    "BitGenerator",
    "add_discrete_gaussian_noise",
    "add_sum_of_normals_noise",
    "discrete_gaussian",
    "from_grid",
    "grid_clipped_sum",
    "grid_noise_multiplier",
    "grid_sensitivity",
    "os_key",
    "os_seed",
    "sampler_tv_bound",
]
