"""DP-SGD with Poisson sampling in one call: the event of a step and of a run, the epsilon a run
spends, and the smallest noise multiplier that meets a target epsilon."""

from __future__ import annotations

import math
from typing import Any

from gradclip_jax._core.validation import check_int, check_number
from gradclip_jax.dp.accounting._accountants import import_dp_accounting, make_accountant, quiet
from gradclip_jax.dp.accounting._calibration import calibrate
from gradclip_jax.dp.accounting._composition import Composition


def sampled_gaussian_event(
    noise_multiplier: float,
    sample_rate: float,
    truncated_batch_size: int | None = None,
    dataset_size: int | None = None,
) -> Any:
    """The ``dp_accounting.DpEvent`` of one step of (truncated) Poisson sampling.

    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, or with a cap :math:`m`
    ``TruncatedSubsampledGaussianDpEvent(n, q, m, z)``: the event of
    :meth:`gradclip_jax.dp.PoissonSampler.dp_event` and of the accountant's
    Poisson phases.
    """
    dpa = import_dp_accounting()
    if truncated_batch_size is None:
        return dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier))
    return dpa.TruncatedSubsampledGaussianDpEvent(
        dataset_size, sample_rate, truncated_batch_size, noise_multiplier
    )


def dp_sgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> Any:
    """The ``dp_accounting.DpEvent`` of DP-SGD with Poisson sampling.

    ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(z)), T)``.

    Args:
      noise_multiplier: :math:`z \\ge 0` (noise std over sensitivity).
      sample_rate: :math:`q \\in (0, 1]`, the probability that an example is in a
        batch (expected batch size over dataset size).
      steps: :math:`T \\ge 0`.

    Returns:
      A ``dp_accounting.DpEvent``; compose it with any accountant.

    Example:
      >>> from gradclip_jax.dp.accounting import dp_sgd_event
      >>> event = dp_sgd_event(1.1, 256 / 60000, 1000)  # doctest: +SKIP
    """
    fn = "dp_sgd_event"
    z = check_number(fn, "noise_multiplier", noise_multiplier, low=0.0, allow_inf=False)
    q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
    t = check_int(fn, "steps", steps, 0)
    return import_dp_accounting().SelfComposedDpEvent(sampled_gaussian_event(z, q), t)


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
) -> float:
    """The :math:`\\varepsilon` spent by DP-SGD at a given :math:`\\delta`.

    Composes :math:`T` Poisson-subsampled Gaussian mechanisms (rate :math:`q`,
    noise multiplier :math:`z`) under add/remove-one neighbouring and returns
    :math:`\\varepsilon(\\delta)` from ``dp-accounting``'s privacy-loss-distribution
    accountant (default ``'pld'``: numerically tight, e.g. 2.38 where RDP gives
    2.60 on the MNIST setting below) or its RDP accountant (``'rdp'``: Mironov
    2017; an upper bound, faster).

    Args:
      noise_multiplier: :math:`z \\ge 0`; 0 gives ``inf`` (no privacy) when
        ``steps > 0``.
      sample_rate: :math:`q \\in (0, 1]` (expected batch size / dataset size).
      steps: :math:`T \\ge 0`; 0 gives 0.
      delta: :math:`\\delta \\in (0, 1)`.
      accountant: ``'pld'`` (default) or ``'rdp'``.

    Returns:
      :math:`\\varepsilon` (a Python float, possibly ``inf``).

    Raises:
      ImportError: when ``dp-accounting`` is not installed (``pip install
        "gradclip_jax[dp]"``).
      ValueError: for out-of-range arguments or an unknown accountant.

    Example:
      >>> from gradclip_jax.dp.accounting import epsilon
      >>> steps = 60 * 60000 // 256  # the JAX DP-SGD example: MNIST, 60 epochs
      >>> round(epsilon(1.1, 256 / 60000, steps, delta=1e-5), 2)
      2.38
      >>> round(epsilon(1.1, 256 / 60000, steps, delta=1e-5, accountant='rdp'), 2)
      2.6
    """
    fn = "epsilon"
    z = check_number(fn, "noise_multiplier", noise_multiplier, low=0.0, allow_inf=False)
    q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
    t = check_int(fn, "steps", steps, 0)
    d = check_number(
        fn, "delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
    )
    comp = Composition(accountant, "add_or_remove", fn)  # validates the name
    if t == 0:
        return 0.0
    if z == 0.0:
        return math.inf
    with quiet():
        return comp.epsilon([(sampled_gaussian_event(z, q), t)], d, z)


def calibrate_noise_multiplier(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    *,
    tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier whose DP-SGD run spends at most ``target_epsilon``.

    Inverts :func:`epsilon` in :math:`z` (secant steps and Brent's method on :math:`\\log z`, see
    :func:`calibrate`); the result :math:`z` satisfies ``epsilon(z, ...) <= target_epsilon``, and
    spends at least :math:`(1 - \\text{tol})` ``target_epsilon`` or is within a factor
    :math:`1 + \\text{tol}` of the exact root.

    Args:
      target_epsilon: :math:`\\varepsilon > 0`.
      sample_rate: :math:`q \\in (0, 1]`.
      steps: :math:`T \\ge 1`.
      delta: :math:`\\delta \\in (0, 1)`.
      accountant: ``'pld'`` (default, as :func:`epsilon`) or ``'rdp'``.
      tol: relative tolerance (default 1e-4), on epsilon or on :math:`z` (above).

    Returns:
      :math:`z` as a Python float.

    Raises:
      ImportError: when ``dp-accounting`` is not installed.
      ValueError: for out-of-range arguments.

    Example:
      >>> from gradclip_jax.dp.accounting import calibrate_noise_multiplier, epsilon
      >>> z = calibrate_noise_multiplier(3.0, 0.05, 100, 1e-5)
      >>> epsilon(z, 0.05, 100, 1e-5) <= 3.0
      True
    """
    fn = "calibrate_noise_multiplier"
    eps = check_number(
        fn, "target_epsilon", target_epsilon, low=0.0, low_inclusive=False, allow_inf=False
    )
    q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
    t = check_int(fn, "steps", steps, 0)
    if t == 0:
        raise ValueError(f"{fn}: `steps` must be at least 1 (zero steps spend nothing)")
    d = check_number(
        fn, "delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False
    )
    check_number(fn, "tol", tol, low=0.0, low_inclusive=False, allow_inf=False)
    make_accountant(accountant, fn)  # validates the name early
    return calibrate(lambda z: dp_sgd_event(z, q, t), eps, d, accountant, tol=tol, fn=fn)
