"""Calibration: the smallest noise multiplier whose event meets a target epsilon (a bracket by
secant steps on log z, then Brent's method on log epsilon)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gradclip_jax.dp.accounting._accountants import _quiet
from gradclip_jax.dp.accounting._composition import Composition, phases_of

_MAX_EVALUATIONS = 60  # a bracket is found in a handful; this only stops a non-monotone epsilon
_MAX_STEP = math.log(100.0)  # a secant step moves z by at most this factor (log), while bracketing


def calibrate(
    event_fn: Any, target_epsilon: float, delta: float, accountant: str = "pld", *,
    tol: float = 1e-4, max_noise_multiplier: float = 1e3, fn: str = "calibrate",
    neighboring: str = "add_or_remove",
) -> float:
    """The smallest :math:`z` with ``epsilon(event_fn(z)) <= target_epsilon``, to a relative ``tol``.

    :math:`\\varepsilon(z)` decreases in :math:`z`, and :math:`\\log\\varepsilon`
    is close to linear in :math:`\\log z` (:math:`\\varepsilon \\propto 1/z`
    for small sampling rates, :math:`1/z^2` at very large :math:`\\varepsilon`).
    So the search works on :math:`u = \\log z`: secant steps on
    :math:`\\log\\varepsilon(u) - \\log\\varepsilon^*` from :math:`z = 1`
    bracket the root (each step at most a factor 100 in :math:`z`), then
    Brent's method finds it, stopping at the first :math:`z` with
    :math:`(1 - \\text{tol})\\,\\varepsilon^* \\le \\varepsilon(z) \\le \\varepsilon^*`
    (or a bracket narrower than a factor :math:`1 + \\text{tol}` in :math:`z`).
    That is 4 to 10 evaluations at any target from 0.1 to 1e6.

    Every evaluation is the accountant that reports the run: with PLD the grid
    of :func:`pld_interval` at :math:`z` and the event's number of steps, each
    step's PLD built once and self-composed (:class:`Composition`). The
    returned :math:`z` is the smallest evaluated one that meets the target, so
    its epsilon under that accountant is at most ``target_epsilon``.
    ``neighboring`` is the relation ``event_fn``'s events are stated for (a sampler's).

    Raises:
      ValueError: naming ``target_epsilon`` when even ``max_noise_multiplier``
        does not reach it.
    """
    comp = Composition(accountant, neighboring, fn)
    seen: dict[float, float] = {}

    def eps_at(z: float) -> float:
        if z not in seen:
            seen[z] = comp.epsilon(phases_of(event_fn(z)), delta, z)
        return seen[z]

    with _quiet():
        lo, hi = _bracket(eps_at, target_epsilon, max_noise_multiplier, tol, fn, delta)
        if lo is not None:
            _brent(eps_at, target_epsilon, lo, hi, tol)
    return min(z for z, e in seen.items() if e <= target_epsilon)


def _excess(eps: float, target: float, tol: float) -> float:
    """:math:`\\log(\\varepsilon/\\varepsilon^*)`, 0 within ``[(1 - tol) target, target]`` (where Brent stops)."""
    if (1.0 - tol) * target <= eps <= target:
        return 0.0
    return 1e3 if math.isinf(eps) else math.log(eps / target)


def _bracket(eps_at: Callable[[float], float], target: float, max_z: float, tol: float, fn: str,
             delta: float) -> tuple[float | None, float]:
    """``(lo, hi)`` with ``eps_at(lo) > target >= eps_at(hi)`` (``lo`` None: ``hi`` is within tolerance already).

    Secant steps on :math:`(\\log z, \\log\\varepsilon)` through the last two
    points, aimed 5% past the root so the next point lands on the other side,
    each at most a factor 100 in :math:`z` (a first step assumes
    :math:`\\varepsilon \\propto 1/z`).
    """
    lo: float | None = None
    hi: float | None = None
    prev: tuple[float, float] | None = None
    z = min(1.0, max_z)
    for _ in range(_MAX_EVALUATIONS):
        e = eps_at(z)
        if e <= target:
            hi = z if hi is None else min(hi, z)
        else:
            lo = z if lo is None else max(lo, z)
            if z >= max_z:
                raise ValueError(
                    f"{fn}: `target_epsilon`={target:g} is unreachable at delta={delta:g}: even "
                    f"noise_multiplier={max_z:g} spends epsilon={e:.4g}; raise the target, "
                    "lower the number of steps or the sampling rate, or raise delta"
                )
        if hi is not None and (lo is not None or _excess(e, target, tol) == 0.0):
            return lo, hi
        u, v = math.log(z), (1e3 if math.isinf(e) else math.log(e / target))
        slope = -1.0  # d log eps / d log z, until two finite points give it
        if prev is not None and not math.isinf(e) and v != prev[1] and u != prev[0]:
            slope = min(-0.1, (v - prev[1]) / (u - prev[0]))
        step = min(_MAX_STEP, max(-_MAX_STEP, -1.05 * v / slope))
        prev = (u, v)
        z = min(max_z, math.exp(u + step))
    raise ValueError(f"{fn}: calibration found no bracket for `target_epsilon`={target:g} (epsilon not monotone?)")


def _brent(eps_at: Callable[[float], float], target: float, lo: float, hi: float, tol: float) -> None:
    """Brent's method on :math:`\\log z` between ``lo`` and ``hi``; ``eps_at`` records what it evaluates."""
    from scipy.optimize import brentq

    def excess(u: float) -> float:
        return _excess(eps_at(math.exp(u)), target, tol)

    brentq(excess, math.log(lo), math.log(hi), xtol=tol / 2)
