"""Calibration: the smallest noise multiplier whose event meets a target epsilon (a bracket by
secant steps on log z, then Brent's method on log epsilon; with PLD first on a coarser grid)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from gradclip_jax.dp.accounting._accountants import quiet
from gradclip_jax.dp.accounting._composition import Composition, phases_of

_MAX_EVALUATIONS = 60  # a bracket is found in a handful; this only stops a non-monotone epsilon
_SEARCH_COARSEN = 8.0  # the PLD grid of the first search, relative to the accountant's
_MAX_STEP = math.log(100.0)  # a secant step moves z by at most this factor (log), while bracketing


def calibrate(
    event_fn: Any,
    target_epsilon: float,
    delta: float,
    accountant: str = "pld",
    *,
    tol: float = 1e-4,
    max_noise_multiplier: float = 1e3,
    fn: str = "calibrate",
    neighboring: str = "add_or_remove",
) -> float:
    """The smallest :math:`z` with ``epsilon(event_fn(z)) <= target_epsilon``, to a relative ``tol``.

    :math:`\\varepsilon(z)` decreases in :math:`z`, and :math:`\\log\\varepsilon`
    is close to linear in :math:`\\log z` (:math:`\\varepsilon \\propto 1/z`
    for small sampling rates, :math:`1/z^2` at very large :math:`\\varepsilon`).
    So the search works on :math:`u = \\log z`: secant steps on
    :math:`\\log\\varepsilon(u) - \\log\\varepsilon^*` bracket the root
    (each step at most a factor 100 in :math:`z`), then Brent's method finds
    it, stopping at the first :math:`z` with
    :math:`(1 - \\text{tol})\\,\\varepsilon^* \\le \\varepsilon(z) \\le \\varepsilon^*`
    (or a bracket narrower than a factor :math:`1 + \\text{tol}` in :math:`z`):
    4 to 10 evaluations at any target from 0.1 to 1e6.

    With PLD that search runs first on a grid 8 times coarser than the
    accountant's (building a step's PLD, most of an evaluation's cost, is 8
    times cheaper), and then again on the accountant's grid from its answer and
    slope: there it takes 1 to 4 evaluations. Every evaluation on the
    accountant's grid is the accountant that reports the run (:class:`Composition`:
    :func:`pld_interval` at :math:`z` and the run's loss spread), and the
    returned :math:`z` is the smallest evaluated there that meets the target,
    so its epsilon under that accountant is at most ``target_epsilon``.
    ``neighboring`` is the relation ``event_fn``'s events are stated for (a sampler's).

    Raises:
      ValueError: naming ``target_epsilon`` when even ``max_noise_multiplier``
        does not reach it.
    """
    args = (target_epsilon, max_noise_multiplier, tol, fn, delta)
    with quiet():
        start, slope = 1.0, -1.0
        if str(accountant).lower() == "pld":
            coarse = _Evaluations(
                Composition(accountant, neighboring, fn, coarsen=_SEARCH_COARSEN), event_fn, delta
            )
            with contextlib.suppress(
                ValueError
            ):  # unreachable on the coarse grid: searched on the exact one
                start = _search(coarse, *args)
                slope = coarse.slope_near(target_epsilon)
        exact = _Evaluations(Composition(accountant, neighboring, fn), event_fn, delta)
        return _search(exact, *args, start=start, slope=slope)


class _Evaluations:
    """``eps_at(z)``: the epsilon of ``event_fn(z)`` by a :class:`Composition`, each ``z`` evaluated once."""

    def __init__(self, comp: Composition, event_fn: Any, delta: float):
        self.comp, self.event_fn, self.delta = comp, event_fn, delta
        self.seen: dict[float, float] = {}

    def __call__(self, z: float) -> float:
        if z not in self.seen:
            self.seen[z] = self.comp.epsilon(phases_of(self.event_fn(z)), self.delta, z)
        return self.seen[z]

    def slope_near(self, target: float) -> float:
        """:math:`d\\log\\varepsilon / d\\log z` through the two finite evaluations nearest the target."""
        near = sorted(
            ((abs(math.log(e / target)), z, e) for z, e in self.seen.items() if 0.0 < e < math.inf)
        )
        if len(near) < 2 or near[0][1] == near[1][1]:
            return -1.0
        (_, z0, e0), (_, z1, e1) = near[:2]
        return min(-0.1, math.log(e1 / e0) / math.log(z1 / z0))


def _search(
    eps_at: _Evaluations,
    target: float,
    max_z: float,
    tol: float,
    fn: str,
    delta: float,
    start: float = 1.0,
    slope: float = -1.0,
) -> float:
    """The smallest evaluated :math:`z` meeting ``target``, after bracketing from ``start`` and Brent's method."""
    lo, hi = _bracket(eps_at, target, max_z, tol, fn, delta, start, slope)
    if lo is not None:
        _brent(eps_at, target, lo, hi, tol)
    return min(z for z, e in eps_at.seen.items() if e <= target)


def _excess(eps: float, target: float, tol: float) -> float:
    """:math:`\\log(\\varepsilon/\\varepsilon^*)`, 0 within ``[(1 - tol) target, target]`` (where Brent stops)."""
    if (1.0 - tol) * target <= eps <= target:
        return 0.0
    return _log_ratio(eps, target)


def _log_ratio(eps: float, ref: float) -> float:
    """:math:`\\log(\\varepsilon / \\text{ref})`, held to +-1e3: an infinite epsilon far above, and
    an epsilon of 0 (a delta so large that nothing is spent) far below."""
    if math.isinf(eps):
        return 1e3
    return -1e3 if eps <= 0.0 else math.log(eps / ref)


def _bracket(
    eps_at: Callable[[float], float],
    target: float,
    max_z: float,
    tol: float,
    fn: str,
    delta: float,
    start: float,
    slope: float,
) -> tuple[float | None, float]:
    """``(lo, hi)`` with ``eps_at(lo) > target >= eps_at(hi)`` (``lo`` None: ``hi`` is within tolerance already).

    Secant steps on :math:`(\\log z, \\log\\varepsilon)` through the last two
    points, aimed at the middle of the accepted band :math:`[(1 - \\text{tol})\\varepsilon^*, \\varepsilon^*]`
    (where the search ends at once; past it, there is a bracket), each at most a factor 100 in :math:`z` (a first step takes ``slope`` for
    :math:`d\\log\\varepsilon / d\\log z`).
    """
    lo: float | None = None
    hi: float | None = None
    prev: tuple[float, float] | None = None
    z, first_slope = min(start, max_z), slope
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
        # v: log epsilon above the middle of the accepted band, where the step aims
        u, v = math.log(z), _log_ratio(e, (1.0 - tol / 2) * target)
        slope = first_slope  # d log eps / d log z, until two finite points give it
        if prev is not None and abs(v) < 1e3 and v != prev[1] and u != prev[0]:
            slope = min(-0.1, (v - prev[1]) / (u - prev[0]))
        step = min(_MAX_STEP, max(-_MAX_STEP, -v / slope))
        prev = (u, v)
        z = min(max_z, math.exp(u + step))
    raise ValueError(
        f"{fn}: calibration found no bracket for `target_epsilon`={target:g} (epsilon not monotone?)"
    )


def _brent(
    eps_at: Callable[[float], float], target: float, lo: float, hi: float, tol: float
) -> None:
    """Brent's method on :math:`\\log z` between ``lo`` and ``hi``; ``eps_at`` records what it evaluates."""
    from scipy.optimize import brentq

    def excess(u: float) -> float:
        return _excess(eps_at(math.exp(u)), target, tol)

    brentq(excess, math.log(lo), math.log(hi), xtol=tol / 2)
