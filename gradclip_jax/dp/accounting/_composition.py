"""A run's epsilon from per-step pieces built once: each step's PLD or RDP vector is cached
across calls, and a phase's composition over its steps is kept and extended as steps are added.

dp-accounting's accountants rebuild every step's privacy loss distribution (or RDP curve) each
time an event is composed, which is most of the cost of an epsilon; here the step's piece is
built once (by dp-accounting's own accountant, so every event type it knows is handled as it
handles it) and composed :math:`T` times with dp-accounting's ``self_compose`` / ``compose``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import numpy as np

from gradclip_jax.dp.accounting._accountants import (
    import_dp_accounting,
    make_accountant,
    pld_interval,
    relation_of,
    step_loss_std,
)
from gradclip_jax.dp.accounting._subsampled_rdp import PoissonSampledDiscreteGaussianEvent

Phases = list[tuple[Any, int]]  # (the DpEvent of one step, how many steps), in composition order
_MAX_COARSE_INTERVAL = 64.0
_MAX_EXTEND_PIECES = (
    3  # grow a kept composition by at most this many compositions, else self-compose
)


def phases_of(event: Any, count: int = 1) -> Phases:
    """``event`` as ``(one step's event, count)`` pairs, as dp-accounting's accountants traverse it.

    A ``SelfComposedDpEvent(e, k)`` multiplies the count of every event in
    ``e``; a ``ComposedDpEvent`` lists its events in order. Pairs of count 0
    spend nothing and are left out.
    """
    dpa = import_dp_accounting()
    if isinstance(event, dpa.SelfComposedDpEvent):
        return phases_of(event.event, count * event.count)
    if isinstance(event, dpa.ComposedDpEvent):
        return [p for e in event.events for p in phases_of(e, count)]
    return [(event, count)] if count else []


def loss_std(phases: Phases) -> float:
    """About the standard deviation of the privacy loss of ``phases`` (0 when a step's is not known).

    :math:`\\sqrt{\\sum_i T_i s_i^2}` with :math:`s_i` a step's (:func:`step_loss_std`):
    only :func:`pld_interval`'s grid depends on it.
    """
    var = 0.0
    for event, count in phases:
        s = step_loss_std(event)
        if s is None:
            return 0.0  # the finest grid
        var += count * s * s
    return math.sqrt(var)


def _step_pld_uncached(event: Any, neighboring: str, interval: float) -> Any:
    """One step's PLD on the grid ``interval``, or ``None`` for a step without noise.

    dp-accounting's ``PLDAccountant`` composed with the event once: its dispatch
    over event types builds the PLD, which it keeps in ``_pld`` (it exposes
    only epsilon and delta, and reading its PLD lets a run reuse it).
    """
    if isinstance(event, PoissonSampledDiscreteGaussianEvent):
        raise import_dp_accounting().UnsupportedEventError(
            "the discrete Gaussian's step has no privacy loss distribution here: use the 'rdp' accountant"
        )
    acc = import_dp_accounting().pld.PLDAccountant(
        relation_of(neighboring), value_discretization_interval=interval
    )
    acc.compose(event)  # UnsupportedEventError for an event it has no PLD of
    return None if acc._contains_non_dp_event else acc._pld


def _step_rdp_uncached(event: Any, neighboring: str) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, rdp)``: one step's RDP at dp-accounting's default orders (``RdpAccountant.rdp``).

    The discrete Gaussian's step, which dp-accounting does not know, by its own bound.
    """
    acc = import_dp_accounting().rdp.RdpAccountant(neighboring_relation=relation_of(neighboring))
    if isinstance(event, PoissonSampledDiscreteGaussianEvent):
        if neighboring != "add_or_remove":
            raise import_dp_accounting().UnsupportedEventError(
                f"the discrete Gaussian's subsampled RDP is bounded for add-or-remove neighbours, not {neighboring!r}"
            )
        return acc.orders, event.rdp(acc.orders)
    acc.compose(event)
    return acc.orders, acc.rdp


# dp-accounting's sparse PMF holds at most this many losses; past it, self_compose goes dense
_SPARSE_LIMIT = 1000


def _dense_if_it_will_be(pmf: Any, times: int) -> Any:
    """``pmf`` as dp-accounting's dense PMF where its ``self_compose(times)`` turns it into one.

    Its sparse PMF decides by computing ``size ** times`` exactly, a Python integer of millions
    of digits on long runs (9.4 s of a 9.5 s epsilon at 4 million steps; 40 s at 10 million).
    ``size ** min(times, 10)`` decides the same (a size of 2 or more passes the limit by 10
    composition already), and converting first runs the very code it would have run.
    """
    sparse = isinstance(pmf, import_dp_accounting().pld.pld_pmf.SparsePLDPmf)
    if sparse and pmf.size ** min(times, 10) > _SPARSE_LIMIT:
        return pmf.to_dense_pmf()
    return pmf


def self_composed(pld: Any, times: int) -> Any:
    """``pld.self_compose(times)`` (dp-accounting's), without its cost of ``size ** times``."""
    pld_module = import_dp_accounting().pld.privacy_loss_distribution
    remove = _dense_if_it_will_be(pld._pmf_remove, times)
    if pld._symmetric:
        return pld_module.PrivacyLossDistribution(remove).self_compose(times)
    add = _dense_if_it_will_be(pld._pmf_add, times)
    return pld_module.PrivacyLossDistribution(remove, add).self_compose(times)


_step_pld_cached = functools.lru_cache(maxsize=32)(_step_pld_uncached)
_step_rdp_cached = functools.lru_cache(maxsize=64)(_step_rdp_uncached)


def _step_pld(event: Any, neighboring: str, interval: float) -> Any:
    try:
        return _step_pld_cached(event, neighboring, interval)
    except TypeError:  # an unhashable event (a sampler's own class): built each time
        return _step_pld_uncached(event, neighboring, interval)


def _step_rdp(event: Any, neighboring: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return _step_rdp_cached(event, neighboring)
    except TypeError:
        return _step_rdp_uncached(event, neighboring)


class Composition:
    """The epsilon (or delta) of phases of identical steps, with what is fixed built once.

    With RDP the RDP of :math:`T` steps is :math:`T` times a step's RDP vector,
    summed over phases (as dp-accounting's ``RdpAccountant`` does, so the
    answer is the same to the last bit). With PLD a phase's PLD is the step's PLD
    self-composed :math:`T` times; the last one asked is kept per step event,
    and a later, larger :math:`T' = T + d` is that one composed with the
    step's PLD composed :math:`2^j` times for the binary digits of :math:`d`
    (each power built once by squaring). The result equals dp-accounting's
    ``self_compose(T')`` up to rounding (the same convolutions in another
    order; relative differences below 1e-7) and is pessimistic as it is.
    The grid is :func:`pld_interval` at the smallest noise multiplier and the
    spread of the whole record's loss (:func:`loss_std`), so a
    :class:`PrivacyAccountant` reports at the planned number of steps the
    epsilon the calibration planned.

    Args:
      name: ``'pld'`` or ``'rdp'``.
      neighboring: ``'add_or_remove'`` or ``'replace'``.
      fn: the public function's name, for errors.
      coarsen: a factor on the PLD grid (default 1: the accountant's): a
        coarser grid is cheaper and its epsilon a looser bound, for a search
        whose answer is checked on the accountant's grid.
    """

    def __init__(self, name: str, neighboring: str, fn: str, coarsen: float = 1.0):
        make_accountant(name, fn)  # validates the name
        self.name, self.neighboring, self.fn = str(name).lower(), neighboring, fn
        self.coarsen = coarsen
        self._kept: dict[
            tuple[Any, float], tuple[int, Any]
        ] = {}  # (event, interval) -> (T, PLD of T steps)
        self._powers: dict[
            tuple[Any, float], list[Any]
        ] = {}  # (event, interval) -> [PLD of 2**j steps]

    def epsilon(self, phases: Phases, delta: float, noise_multiplier: float) -> float:
        """:math:`\\varepsilon(\\delta)` of ``phases`` (grid of :func:`pld_interval` at ``noise_multiplier``).

        With PLD, the RDP bound of the same steps replaces the PLD's epsilon
        where it is smaller. Both are upper bounds, so their minimum is one too.
        It is smaller on long runs, where the PLD's grid, coarsened to keep its
        size bounded (:func:`pld_interval`), rounds each step's loss up further
        (10**7 steps at ``z=2``, ``q=1e-3``, ``delta=1e-6``: 14.96 by PLD, 9.54 by
        RDP), and near ``exp()`` overflow, where dp-accounting's PLD epsilon is
        ``inf`` for some noise multipliers and finite for their neighbours.
        """
        if self.name == "rdp":
            return self._rdp_epsilon(phases, delta)
        pld = self.pld(phases, noise_multiplier)
        eps = math.inf if pld is None else float(pld.get_epsilon_for_delta(delta))
        with contextlib.suppress(ValueError):  # e.g. truncated Poisson sampling: no RDP bound
            eps = min(eps, self._rdp_epsilon(phases, delta))
        return eps

    def delta(self, phases: Phases, epsilon: float, noise_multiplier: float) -> float:
        """:math:`\\delta(\\varepsilon)` of ``phases`` (with PLD, the smaller of the PLD's and
        the RDP bound's, as :meth:`epsilon`)."""
        if self.name == "rdp":
            return self._rdp_delta(phases, epsilon)
        pld = self.pld(phases, noise_multiplier)
        delta = 1.0 if pld is None else float(pld.get_delta_for_epsilon(epsilon))
        with contextlib.suppress(ValueError):
            delta = min(delta, self._rdp_delta(phases, epsilon))
        return delta

    def _rdp_delta(self, phases: Phases, epsilon: float) -> float:
        orders, rdp = self._rdp(phases)
        return float(
            import_dp_accounting().rdp.rdp_privacy_accountant.compute_delta(orders, rdp, epsilon)[0]
        )

    def _rdp(self, phases: Phases) -> tuple[np.ndarray, np.ndarray]:
        """``(orders, rdp)`` of ``phases``: each step's RDP times its count, summed in order (as ``RdpAccountant``)."""
        orders = import_dp_accounting().rdp.RdpAccountant().orders
        total = np.zeros_like(orders, dtype=np.float64)
        for event, count in phases:
            orders, rdp = self._guarded(_step_rdp, event, self.neighboring, name="rdp")
            total += count * rdp
        return orders, total

    def _rdp_epsilon(self, phases: Phases, delta: float) -> float:
        orders, rdp = self._rdp(phases)
        return float(
            import_dp_accounting().rdp.rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0]
        )

    def pld(self, phases: Phases, noise_multiplier: float) -> Any:
        """The PLD of ``phases`` composed in order (``None`` when a step has no noise)."""
        interval = pld_interval(noise_multiplier, loss_std(phases))
        # coarsened up to a loss of 64 a grid step: dp-accounting takes exp() of the interval
        interval = max(interval, min(interval * self.coarsen, _MAX_COARSE_INTERVAL))
        # compositions on another grid (fewer steps, before the grid coarsened) are not reused
        self._kept = {k: v for k, v in self._kept.items() if k[1] == interval}
        self._powers = {k: v for k, v in self._powers.items() if k[1] == interval}
        out = None
        for event, count in phases:
            piece = self._phase_pld(event, count, interval)
            if piece is None:
                return None
            out = piece if out is None else out.compose(piece)
        if out is None:  # no steps
            out = import_dp_accounting().pld.privacy_loss_distribution.identity(
                value_discretization_interval=interval
            )
        return out

    def _phase_pld(self, event: Any, count: int, interval: float) -> Any:
        step = self._guarded(_step_pld, event, self.neighboring, interval, name="pld")
        if step is None:
            return None
        key = (event, interval)
        try:
            kept_steps, kept = self._kept.get(key, (0, None))
        except TypeError:  # unhashable event: nothing kept
            return self_composed(step, count)
        if kept_steps == count:
            return kept
        extra = count - kept_steps
        if kept is not None and extra > 0 and bin(extra).count("1") <= _MAX_EXTEND_PIECES:
            out = kept
            for j, bit in enumerate(reversed(bin(extra)[2:])):
                if bit == "1":
                    out = out.compose(self._power(key, step, j))
        else:
            out = self_composed(step, count)
        self._kept[key] = (count, out)
        return out

    def _power(self, key: tuple[Any, float], step: Any, j: int) -> Any:
        """The step's PLD composed :math:`2^j` times (by squaring, each power once)."""
        powers = self._powers.setdefault(key, [step])
        while len(powers) <= j:
            powers.append(powers[-1].compose(powers[-1]))
        return powers[j]

    def _guarded(self, build: Any, *args: Any, name: str) -> Any:
        """``build(*args)``; dp-accounting's ``UnsupportedEventError`` as a ValueError naming the accountant."""
        dpa = import_dp_accounting()
        try:
            return build(*args)
        except dpa.UnsupportedEventError as err:
            raise ValueError(
                f"{self.fn}: the {name!r} accountant cannot account for this sampling under "
                f"{self.neighboring!r} neighbours ({err}); try the other accountant (`accountant=`)"
            ) from None
