"""dp-accounting's accountants as the accounting uses them: imported when first needed, kept
quiet, made on the PLD grid of :func:`pld_interval`, and asked the epsilon of an event."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

_ACCOUNTANTS = ("rdp", "pld")


class _DropUnconverged(logging.Filter):
    """Drops dp-accounting's "failed to converge" warnings (an RDP order it skips)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in str(record.msg)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
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


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "gradclip_jax.privacy needs the optional 'dp-accounting' package: "
            'pip install "gradclip_jax[dp]"  (or: pip install dp-accounting)'
        ) from err
    return dp_accounting


PLD_INTERVAL = 1e-4  # dp-accounting's default value_discretization_interval, used from z = 1 up


def pld_interval(noise_multiplier: float) -> float:
    """The PLD accountant's ``value_discretization_interval`` for a run whose smallest noise multiplier is ``z``.

    The privacy loss of a step of noise multiplier :math:`z` spreads over a range
    of width about :math:`1/z^2`, and dp-accounting's PLD holds it on a grid of
    this interval: at the fixed default (1e-4) a small :math:`z` (a large
    :math:`\\varepsilon`) needs a grid of millions of points, whose composition
    took minutes and gigabytes (``target_epsilon=1e6`` never finished). The
    interval is ``1e-4 / min(z, 1)**2``, which keeps the grid (time and memory)
    at its size at :math:`z = 1` for every smaller :math:`z`.

    A coarser grid keeps the guarantee: dp-accounting's PLD is the
    **pessimistic** estimate (every loss is rounded up to the grid), so the
    :math:`\\varepsilon` it reports stays an upper bound on the true one; it is
    looser by a little (100 steps at rate 0.043, :math:`\\delta = 10^{-5}`:
    59.85720 instead of 59.85718 at :math:`z = 0.3`; 16.19222 at both
    intervals at :math:`z = 0.5`).
    Calibration and :class:`PrivacyAccountant` use the same rule, so the
    accountant reports the epsilon the calibration planned.

    Example:
      >>> from gradclip_jax.dp.accounting import pld_interval
      >>> pld_interval(2.0), pld_interval(1.0), round(pld_interval(0.1), 6)
      (0.0001, 0.0001, 0.01)
    """
    z = min(float(noise_multiplier), 1.0)
    return PLD_INTERVAL / (z * z) if z > 0.0 else PLD_INTERVAL


def _relation(neighboring: str) -> Any:
    """dp-accounting's ``NeighboringRelation`` of ``'add_or_remove'`` or ``'replace'``."""
    rel = _dp_accounting().NeighboringRelation
    return rel.REPLACE_ONE if neighboring == "replace" else rel.ADD_OR_REMOVE_ONE


def _accountant(name: str, fn: str, noise_multiplier: float = 1.0, neighboring: str = "add_or_remove") -> Any:
    """A fresh dp-accounting accountant; for PLD with the interval of :func:`pld_interval`."""
    dpa = _dp_accounting()
    key = str(name).lower()
    if key == "rdp":
        return dpa.rdp.RdpAccountant(neighboring_relation=_relation(neighboring))
    if key == "pld":
        return dpa.pld.PLDAccountant(_relation(neighboring),
                                     value_discretization_interval=pld_interval(noise_multiplier))
    raise ValueError(f"{fn}: unknown accountant {name!r}; expected one of {_ACCOUNTANTS}")


PLD_RELIABLE = 500.0  # above, dp-accounting's PLD epsilon nears exp() overflow (inf past ~709)


def _event_epsilon(name: str, event: Any, delta: float, noise_multiplier: float, fn: str,
                   composed: Any = None, neighboring: str = "add_or_remove") -> float:
    """The epsilon of ``event`` at ``delta`` (``composed``: its accountant, already composed).

    With PLD (grid of :func:`pld_interval` at the smallest ``noise_multiplier``),
    an epsilon of ``PLD_RELIABLE`` or more is replaced by the RDP bound when that
    is smaller: dp-accounting's PLD epsilon is computed through ``exp(epsilon)``,
    which overflows near 709 (it then answers ``inf`` for some noise multipliers
    and finite values for their neighbours). Both are upper bounds, so their
    minimum is one too; below ``PLD_RELIABLE`` the PLD epsilon is used as is.
    """
    dpa = _dp_accounting()
    acc = composed
    if acc is None:
        acc = _accountant(name, fn, noise_multiplier, neighboring)
        try:
            acc.compose(event)
        except dpa.UnsupportedEventError as err:
            raise ValueError(
                f"{fn}: the {str(name).lower()!r} accountant cannot account for this sampling under "
                f"{neighboring!r} neighbours ({err}); try the other accountant (`accountant=`)"
            ) from None
    eps = float(acc.get_epsilon(delta))
    if str(name).lower() == "pld" and not eps < PLD_RELIABLE:
        try:
            rdp = _accountant("rdp", fn, neighboring=neighboring)
            rdp.compose(event)
            eps = min(eps, float(rdp.get_epsilon(delta)))
        except dpa.UnsupportedEventError:
            pass  # e.g. truncated Poisson sampling: no RDP bound
    return eps
