"""Calibration: the smallest noise multiplier whose event meets a target epsilon (Brent's method)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from gradclip_jax.dp.accounting._accountants import (
    _accountant,
    _dp_accounting,
    _event_epsilon,
    _quiet,
)


def calibrate(
    event_fn: Any, target_epsilon: float, delta: float, accountant: str = "pld", *,
    tol: float = 1e-4, max_noise_multiplier: float = 1e3, fn: str = "calibrate",
    neighboring: str = "add_or_remove",
) -> float:
    """The smallest :math:`z` with ``epsilon(event_fn(z)) <= target_epsilon`` (Brent's method).

    With PLD the search is bracketed by the RDP answer first when ``event_fn``
    has an RDP bound (RDP is an upper bound, so its :math:`z` meets the target
    under PLD too), and every PLD evaluation at :math:`z` uses the grid of
    :func:`pld_interval` (as :class:`PrivacyAccountant` does): about a second
    at any target from 0.1 to 1e6, and a few hundred MB at most. ``neighboring``
    is the relation ``event_fn``'s events are stated for (a sampler's).

    Raises:
      ValueError: naming ``target_epsilon`` when even ``max_noise_multiplier``
        does not reach it.
    """
    dpa = _dp_accounting()

    seen: dict[float, float] = {}

    def eps_at(z: float) -> float:
        if z not in seen:
            seen[z] = _event_epsilon(accountant, event_fn(z), delta, z, fn, neighboring=neighboring)
        return seen[z]

    with _quiet():
        top = eps_at(max_noise_multiplier)
        if not top <= target_epsilon:
            raise ValueError(
                f"{fn}: `target_epsilon`={target_epsilon:g} is unreachable at delta={delta:g}: even "
                f"noise_multiplier={max_noise_multiplier:g} spends epsilon={top:.4g}; raise the target, "
                "lower the number of steps or the sampling rate, or raise delta"
            )
        hi = max_noise_multiplier
        if str(accountant).lower() == "pld":
            # no RDP bound for this event (e.g. truncation): bracket from max_noise_multiplier
            with contextlib.suppress(ValueError, dpa.UnsupportedEventError):
                hi = min(hi, float(dpa.calibrate_dp_mechanism(
                    lambda: _accountant("rdp", fn, neighboring=neighboring), event_fn, target_epsilon, delta,
                    bracket_interval=dpa.LowerEndpointAndGuess(0.0, 1.0), tol=tol,
                )))
        return _smallest_meeting(eps_at, target_epsilon, hi, tol)


def _smallest_meeting(eps_at: Any, target: float, hi: float, tol: float) -> float:
    """The smallest :math:`z \\le` ``hi`` (to ``tol``) with ``eps_at(z) <= target``, given ``eps_at(hi) <= target``.

    Brackets down from ``hi`` (epsilon decreases in :math:`z`: first
    ``0.85 hi``, near where PLD lands from the RDP answer, then halving), then
    Brent's method; the returned :math:`z` meets the target (checked).
    """
    from scipy.optimize import brentq

    lo, shrink = hi, 0.85
    while True:
        lo, shrink = lo * shrink, 0.5
        if lo < tol:
            return hi if eps_at(tol) > target else tol
        if eps_at(lo) > target:
            break
        hi = lo

    def excess(z: float) -> float:
        e = eps_at(z)
        return 1.0 if math.isinf(e) else e - target

    z = float(brentq(excess, lo, hi, xtol=tol / 2))
    return z if excess(z) <= 0.0 else (z + tol / 2 if excess(z + tol / 2) <= 0.0 else hi)
