"""dp-accounting's accountants as the accounting uses them: imported when first needed, kept
quiet, and the PLD grid of :func:`pld_interval` (which follows a run's loss spread,
:func:`step_loss_std`)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any

ACCOUNTANTS = ("rdp", "pld")


class _DropUnconverged(logging.Filter):
    """Drops dp-accounting's "failed to converge" warnings (an RDP order it skips)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in str(record.msg)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silences dp-accounting's absl "failed to converge" warnings while accounting.

    The RDP accountant logs one such line for every order :math:`\\alpha` whose
    series it gives up on; that order is then left out of the minimum over orders,
    which only makes the bound (slightly) looser, never wrong, so the lines carry
    nothing the caller can act on.
    """
    logger = logging.getLogger("absl")
    filt = _DropUnconverged()
    logger.addFilter(filt)
    try:
        yield
    finally:
        logger.removeFilter(filt)


def import_dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "gradclip_jax.dp.accounting needs the optional 'dp-accounting' package: "
            'pip install "gradclip_jax[dp]"  (or: pip install dp-accounting)'
        ) from err
    return dp_accounting


PLD_INTERVAL = 1e-4  # dp-accounting's default value_discretization_interval, used from z = 1 up
PLD_GRID_POINTS = (
    2**15
)  # a run's PLD spans about this many grid points at most (16 standard deviations)


def pld_interval(noise_multiplier: float, loss_std: float = 0.0) -> float:
    """The PLD accountant's ``value_discretization_interval`` for a run whose smallest noise multiplier is ``z``.

    The privacy loss of a step of noise multiplier :math:`z` spreads over a range
    of width about :math:`1/z^2`, and dp-accounting's PLD holds it on a grid of
    this interval: at the fixed default (1e-4) a small :math:`z` (a large
    :math:`\\varepsilon`) needs a grid of millions of points, whose composition
    took minutes and gigabytes (``target_epsilon=1e6`` never finished). The
    loss of a whole run spreads over some standard deviations :math:`s`
    (``loss_std``, :func:`loss_std`: :math:`\\sqrt{T}` times a step's), and
    every composition and epsilon query walks all of its grid. The interval is

    .. math::
        \\Delta = \\Delta_0 \\cdot 2^{k}, \\quad \\Delta_0 = \\frac{10^{-4}}{\\min(z, 1)^2},

    with the smallest :math:`k \\ge 0` at which :math:`16 s / \\Delta` is at most
    :math:`2^{15}` points: :math:`\\Delta_0` keeps the grid of a step near its
    size at :math:`z = 1` for every smaller :math:`z`, and the factor keeps a long
    run's grid to a bounded size (it is a power of two, so that a run's per-step
    PLD is rebuilt only when its loss's spread doubles, i.e. its steps quadruple).

    A coarser grid keeps the guarantee: dp-accounting's PLD is the
    **pessimistic** estimate (every loss is rounded up to the grid), so the
    :math:`\\varepsilon` it reports stays an upper bound on the true one; it is
    looser by a little (100 steps at rate 0.043 and :math:`z = 0.3`,
    :math:`\\delta = 10^{-5}`: 59.85720 instead of 59.85718).
    Calibration and :class:`PrivacyAccountant` use the same rule, so the
    accountant reports the epsilon the calibration planned.

    Example:
      >>> from gradclip_jax.dp.accounting import pld_interval
      >>> pld_interval(2.0), pld_interval(1.0), round(pld_interval(0.1), 6)
      (0.0001, 0.0001, 0.01)
      >>> pld_interval(1.0, loss_std=0.2), pld_interval(1.0, loss_std=1.0)
      (0.0001, 0.0008)
    """
    z = min(float(noise_multiplier), 1.0)
    interval = PLD_INTERVAL / (z * z) if z > 0.0 else PLD_INTERVAL
    span = 16.0 * float(loss_std)
    if not math.isfinite(span):
        return interval
    while span > PLD_GRID_POINTS * interval:
        interval *= 2.0
    return interval


def step_loss_std(event: Any) -> float | None:
    """About the standard deviation of the privacy loss of one step of ``event`` (``None``: not known).

    For a Poisson-subsampled Gaussian step (rate :math:`q`, noise multiplier
    :math:`z`; also truncated) the smaller of :math:`q\\sqrt{e^{1/z^2} - 1}` (the
    loss's spread when :math:`z` is large: the :math:`\\mu`-GDP limit) and
    :math:`\\sqrt{q}\\,(1/(2z^2) + 1/z)` (when it is small: each sampled step
    adds a loss of mean :math:`1/(2z^2)` and deviation :math:`1/z`). Only the
    grid depends on it, never the guarantee.
    """
    dpa = import_dp_accounting()
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        q, z = float(event.sampling_probability), float(event.event.noise_multiplier)
    elif isinstance(event, dpa.TruncatedSubsampledGaussianDpEvent):
        q, z = float(event.sampling_probability), float(event.noise_multiplier)
    else:
        return None
    if not z > 0.0:
        return None
    small_noise = math.sqrt(q) * (0.5 / (z * z) + 1.0 / z)
    return min(q * math.sqrt(math.expm1(min(1.0 / (z * z), 700.0))), small_noise)


def relation_of(neighboring: str) -> Any:
    """dp-accounting's ``NeighboringRelation`` of ``'add_or_remove'`` or ``'replace'``."""
    rel = import_dp_accounting().NeighboringRelation
    return rel.REPLACE_ONE if neighboring == "replace" else rel.ADD_OR_REMOVE_ONE


def make_accountant(
    name: str, fn: str, noise_multiplier: float = 1.0, neighboring: str = "add_or_remove"
) -> Any:
    """A fresh dp-accounting accountant; for PLD with the interval of :func:`pld_interval`."""
    dpa = import_dp_accounting()
    key = str(name).lower()
    if key == "rdp":
        return dpa.rdp.RdpAccountant(neighboring_relation=relation_of(neighboring))
    if key == "pld":
        return dpa.pld.PLDAccountant(
            relation_of(neighboring), value_discretization_interval=pld_interval(noise_multiplier)
        )
    raise ValueError(f"{fn}: unknown accountant {name!r}; expected one of {ACCOUNTANTS}")
