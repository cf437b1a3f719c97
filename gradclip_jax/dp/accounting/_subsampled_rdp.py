"""The RDP of a Poisson-subsampled mechanism from the mechanism's own RDP (Zhu and Wang's general
bound), and the event of one step of the discrete Gaussian on an integer grid, accounted with it.

dp-accounting's RDP of the sampled Gaussian (Mironov, Talwar and Zhang 2019) is computed from the
continuous Gaussian's densities. The discrete Gaussian's Renyi divergences are at most the
continuous one's for integer shifts (Canonne, Kamath and Steinke 2020), which bounds the
unsampled mechanism; for the subsampled one, the general bound below needs nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from scipy.special import gammaln, logsumexp


def poisson_subsampled_rdp(
    q: float, base_rdp: Callable[[float], float], orders: np.ndarray
) -> np.ndarray:
    """An upper bound on the RDP of a mechanism run on a Poisson sample of rate ``q``, at ``orders``.

    Zhu and Wang (ICML 2019, "Poisson Subsampled Renyi Differential Privacy",
    general upper bound): for a mechanism with RDP :math:`\\varepsilon(j)` at
    integer orders and an integer :math:`\\alpha \\ge 2`, the subsampled mechanism
    has RDP at most

    .. math::

        \\tfrac{1}{\\alpha-1}\\log\\Big[(1-q)^{\\alpha-1}(1+(\\alpha-1)q)
        + \\tbinom{\\alpha}{2} q^2 (1-q)^{\\alpha-2} e^{\\varepsilon(2)}
        + 3\\sum_{j=3}^{\\alpha} \\tbinom{\\alpha}{j} q^j (1-q)^{\\alpha-j} e^{(j-1)\\varepsilon(j)}\\Big]

    under add-or-remove neighbours. RDP grows with the order, so a fractional
    order :math:`\\alpha` takes the bound at :math:`\\lceil\\alpha\\rceil`
    (and :math:`\\alpha < 2` the one at 2). With :math:`q = 1` nothing is
    sampled: the base RDP at the order itself.
    """
    orders = np.asarray(orders, dtype=np.float64)
    if q >= 1.0:
        return np.array([base_rdp(float(a)) for a in orders])
    ints = np.maximum(np.ceil(orders), 2.0).astype(np.int64)
    return np.array([_bound_at(int(a), q, base_rdp) for a in ints])


def _bound_at(alpha: int, q: float, base_rdp: Callable[[float], float]) -> float:
    """The bound at one integer order, its terms summed in log space (no overflow at large orders)."""
    j = np.arange(2, alpha + 1)
    log_binom = gammaln(alpha + 1) - gammaln(j + 1) - gammaln(alpha - j + 1)
    log_q, log_1q = math.log(q), math.log1p(-q)
    exponent = np.array([(k - 1) * base_rdp(float(k)) for k in j])
    log_terms = (
        log_binom
        + j * log_q
        + (alpha - j) * log_1q
        + exponent
        + np.where(j >= 3, math.log(3.0), 0.0)
    )
    first = (alpha - 1) * log_1q + math.log1p((alpha - 1) * q)
    return float(logsumexp(np.append(log_terms, first)) / (alpha - 1))


@dataclasses.dataclass(frozen=True)
class PoissonSampledDiscreteGaussianEvent:
    """One step of ``make_private(hardened='discrete')``: a Poisson sample, then discrete Gaussian noise.

    Attributes:
      sampling_probability: the Poisson rate :math:`q`.
      noise_multiplier: :math:`z = \\sigma / (\\gamma\\Delta)`: the noise's
        standard deviation on the grid over the largest integer L2 distance
        between neighbouring sums (the grid step :math:`\\gamma` times the
        clipped sum's sensitivity).

    Its RDP (:meth:`rdp`) is :func:`poisson_subsampled_rdp` of the discrete
    Gaussian's, :math:`\\alpha / (2 z^2)` (Canonne, Kamath and Steinke 2020,
    for integer shifts of any dimension). dp-accounting does not know the
    event: the accountants of :mod:`gradclip_jax.dp.accounting` read it
    (RDP only; PLD raises ``UnsupportedEventError``).
    """

    sampling_probability: float
    noise_multiplier: float

    def rdp(self, orders: np.ndarray) -> np.ndarray:
        """The RDP of one step at ``orders`` (add-or-remove neighbours)."""
        z = self.noise_multiplier
        if z == 0.0:
            return np.full(np.shape(orders), np.inf)
        return poisson_subsampled_rdp(
            self.sampling_probability, lambda a: a / (2.0 * z * z), orders
        )
