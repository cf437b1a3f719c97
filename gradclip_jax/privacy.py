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
meets a target :math:`\\varepsilon`. With :func:`gradclip_jax.dp.dp_quantile_aggregate`
account with the overall ``noise_multiplier`` you gave it (its count and gradient
noises are split so that they compose to exactly that Gaussian mechanism).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax import norms as _norms
from gradclip_jax.hyperparams import check_scalar, is_traced

__all__ = [
    "add_gaussian_noise",
    "calibrate_noise_multiplier",
    "dp_sgd_event",
    "epsilon",
]

_ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "gradclip_jax.privacy needs the optional 'dp-accounting' package: "
            'pip install "gradclip_jax[dp]"  (or: pip install dp-accounting)'
        ) from err
    return dp_accounting


def _check(fn: str, name: str, value: Any, low: float, high: float, low_open: bool, high_open: bool) -> float:
    """A plain number in the given interval (accounting runs on the host: no schedules or tracers)."""
    if value is None or callable(value) or is_traced(value):
        raise TypeError(f"{fn}: `{name}` must be a number, got {value!r}")
    check_scalar(fn, name, value, low=low, high=high, low_inclusive=not low_open,
                 high_inclusive=not high_open)
    return float(value)


def _check_steps(fn: str, steps: Any) -> int:
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"{fn}: `steps` must be a non-negative int, got {steps!r}")
    return int(steps)


def _accountant(name: str, fn: str) -> Any:
    dpa = _dp_accounting()
    key = str(name).lower()
    if key == "rdp":
        return dpa.rdp.RdpAccountant()
    if key == "pld":
        return dpa.pld.PLDAccountant()
    raise ValueError(f"{fn}: unknown accountant {name!r}; expected one of {_ACCOUNTANTS}")


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
      >>> from gradclip_jax.privacy import dp_sgd_event
      >>> event = dp_sgd_event(1.1, 256 / 60000, 1000)  # doctest: +SKIP
    """
    fn = "dp_sgd_event"
    z = _check(fn, "noise_multiplier", noise_multiplier, 0.0, math.inf, False, False)
    q = _check(fn, "sample_rate", sample_rate, 0.0, 1.0, True, False)
    t = _check_steps(fn, steps)
    dpa = _dp_accounting()
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), t)


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """The :math:`\\varepsilon` spent by DP-SGD at a given :math:`\\delta`.

    Composes :math:`T` Poisson-subsampled Gaussian mechanisms (rate :math:`q`,
    noise multiplier :math:`z`) under add/remove-one neighbouring and returns
    :math:`\\varepsilon(\\delta)` from ``dp-accounting``'s RDP accountant
    (default; Mironov 2017, tight subsampling bounds) or its PLD accountant
    (``accountant='pld'``: tighter, slower).

    Args:
      noise_multiplier: :math:`z \\ge 0`; 0 gives ``inf`` (no privacy) when
        ``steps > 0``.
      sample_rate: :math:`q \\in (0, 1]` (expected batch size / dataset size).
      steps: :math:`T \\ge 0`; 0 gives 0.
      delta: :math:`\\delta \\in (0, 1)`.
      accountant: ``'rdp'`` (default) or ``'pld'``.

    Returns:
      :math:`\\varepsilon` (a Python float, possibly ``inf``).

    Raises:
      ImportError: when ``dp-accounting`` is not installed (``pip install
        "gradclip_jax[dp]"``).
      ValueError: for out-of-range arguments or an unknown accountant.

    Example:
      >>> from gradclip_jax.privacy import epsilon
      >>> eps = epsilon(1.1, 256 / 60000, steps=60 * 60000 // 256, delta=1e-5)
      >>> 2.5 < eps < 3.5  # the JAX DP-SGD example's setting
      True
    """
    fn = "epsilon"
    z = _check(fn, "noise_multiplier", noise_multiplier, 0.0, math.inf, False, False)
    q = _check(fn, "sample_rate", sample_rate, 0.0, 1.0, True, False)
    t = _check_steps(fn, steps)
    d = _check(fn, "delta", delta, 0.0, 1.0, True, True)
    acc = _accountant(accountant, fn)
    if t == 0:
        return 0.0
    if z == 0.0:
        return math.inf
    acc.compose(dp_sgd_event(z, q, t))
    return float(acc.get_epsilon(d))


def calibrate_noise_multiplier(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
    *,
    tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier whose DP-SGD run spends at most ``target_epsilon``.

    Inverts :func:`epsilon` in :math:`z` (Brent's method in
    ``dp_accounting.calibrate_dp_mechanism``); the result :math:`z` satisfies
    ``epsilon(z, ...) <= target_epsilon`` and is within ``tol`` of the exact root.

    Args:
      target_epsilon: :math:`\\varepsilon > 0`.
      sample_rate: :math:`q \\in (0, 1]`.
      steps: :math:`T \\ge 1`.
      delta: :math:`\\delta \\in (0, 1)`.
      accountant: ``'rdp'`` (default) or ``'pld'``.
      tol: absolute tolerance on :math:`z` (default 1e-4).

    Returns:
      :math:`z` as a Python float.

    Raises:
      ImportError: when ``dp-accounting`` is not installed.
      ValueError: for out-of-range arguments.

    Example:
      >>> from gradclip_jax.privacy import calibrate_noise_multiplier, epsilon
      >>> z = calibrate_noise_multiplier(3.0, 256 / 60000, 14062, 1e-5)
      >>> epsilon(z, 256 / 60000, 14062, 1e-5) <= 3.0
      True
    """
    fn = "calibrate_noise_multiplier"
    eps = _check(fn, "target_epsilon", target_epsilon, 0.0, math.inf, True, True)
    q = _check(fn, "sample_rate", sample_rate, 0.0, 1.0, True, False)
    t = _check_steps(fn, steps)
    if t == 0:
        raise ValueError(f"{fn}: `steps` must be at least 1 (zero steps spend nothing)")
    d = _check(fn, "delta", delta, 0.0, 1.0, True, True)
    _check(fn, "tol", tol, 0.0, math.inf, True, True)
    _accountant(accountant, fn)  # validates the name early
    dpa = _dp_accounting()
    return float(
        dpa.calibrate_dp_mechanism(
            lambda: _accountant(accountant, fn),
            lambda z: dp_sgd_event(z, q, t),
            eps,
            d,
            bracket_interval=dpa.LowerEndpointAndGuess(0.0, 1.0),
            tol=tol,
        )
    )


def add_gaussian_noise(tree: Any, stddev: Any, key: jax.Array) -> Any:
    """Adds independent :math:`\\mathcal{N}(0, \\sigma^2)` noise to every element.

    Noise is drawn and added in float32 at least (the accumulation dtype of each
    leaf), and the result keeps that dtype: round it yourself after dividing by
    the batch size. One key per leaf is split from ``key``.

    Args:
      tree: a pytree of floating-point arrays (e.g. the sum from ``clipped_grad``).
      stddev: :math:`\\sigma \\ge 0`.
      key: a ``jax.random`` key.

    Returns:
      The noised tree.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.privacy import add_gaussian_noise
      >>> noisy = add_gaussian_noise({'w': jnp.zeros(3)}, 1.0, jax.random.key(0))
      >>> noisy['w'].shape
      (3,)
    """
    flat = _norms.flatten(tree, "add_gaussian_noise")
    arrays = flat.arrays
    if not arrays:
        return tree
    keys = jax.random.split(key, len(arrays))
    out = []
    for x, k in zip(arrays, keys, strict=True):
        acc = _norms.acc_dtype(x.dtype)
        out.append(x.astype(acc) + jnp.asarray(stddev, acc) * jax.random.normal(k, x.shape, acc))
    return flat.rebuild(out)
