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
Another batch selection is accounted through its sampler
(:class:`gradclip_jax.dp.BatchSampler`): its ``dp_event`` is the event of a
step, which :func:`calibrate` and :class:`PrivacyAccountant` compose.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from gradclip_jax._core.validation import check_choice, check_int, check_number
from gradclip_jax.dp.batch_selection import NEIGHBORING, check_sampler

__all__ = [
    "PrivacyAccountant",
    "PrivacyPhase",
    "calibrate_noise_multiplier",
    "dp_sgd_event",
    "calibrate",
    "epsilon",
    "phase_event",
    "sampled_gaussian_event",
]

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


def sampled_gaussian_event(
    noise_multiplier: float, sample_rate: float, truncated_batch_size: int | None = None,
    dataset_size: int | None = None,
) -> Any:
    """The ``dp_accounting.DpEvent`` of one step of (truncated) Poisson sampling.

    ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, or with a cap :math:`m`
    ``TruncatedSubsampledGaussianDpEvent(n, q, m, z)``: the event of
    :meth:`gradclip_jax.dp.PoissonSampler.dp_event` and of the accountant's
    Poisson phases.
    """
    dpa = _dp_accounting()
    if truncated_batch_size is None:
        return dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier))
    return dpa.TruncatedSubsampledGaussianDpEvent(dataset_size, sample_rate, truncated_batch_size, noise_multiplier)


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
    z = check_number(fn, "noise_multiplier", noise_multiplier, low=0.0)
    q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
    t = check_int(fn, "steps", steps, 0)
    return _dp_accounting().SelfComposedDpEvent(sampled_gaussian_event(z, q), t)


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
      >>> from gradclip_jax.privacy import epsilon
      >>> steps = 60 * 60000 // 256  # the JAX DP-SGD example: MNIST, 60 epochs
      >>> round(epsilon(1.1, 256 / 60000, steps, delta=1e-5), 2)
      2.38
      >>> round(epsilon(1.1, 256 / 60000, steps, delta=1e-5, accountant='rdp'), 2)
      2.6
    """
    fn = "epsilon"
    z = check_number(fn, "noise_multiplier", noise_multiplier, low=0.0)
    q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
    t = check_int(fn, "steps", steps, 0)
    d = check_number(fn, "delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    _accountant(accountant, fn)  # validates the name
    if t == 0:
        return 0.0
    if z == 0.0:
        return math.inf
    with _quiet():
        return _event_epsilon(accountant, dp_sgd_event(z, q, t), d, z, fn)


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

    Inverts :func:`epsilon` in :math:`z` (Brent's method, see :func:`calibrate`); the result :math:`z` satisfies
    ``epsilon(z, ...) <= target_epsilon`` and is within ``tol`` of the exact root.

    Args:
      target_epsilon: :math:`\\varepsilon > 0`.
      sample_rate: :math:`q \\in (0, 1]`.
      steps: :math:`T \\ge 1`.
      delta: :math:`\\delta \\in (0, 1)`.
      accountant: ``'pld'`` (default, as :func:`epsilon`) or ``'rdp'``.
      tol: absolute tolerance on :math:`z` (default 1e-4).

    Returns:
      :math:`z` as a Python float.

    Raises:
      ImportError: when ``dp-accounting`` is not installed.
      ValueError: for out-of-range arguments.

    Example:
      >>> from gradclip_jax.privacy import calibrate_noise_multiplier, epsilon
      >>> z = calibrate_noise_multiplier(3.0, 0.05, 100, 1e-5)
      >>> epsilon(z, 0.05, 100, 1e-5) <= 3.0
      True
    """
    fn = "calibrate_noise_multiplier"
    eps = check_number(fn, "target_epsilon", target_epsilon, low=0.0, low_inclusive=False, allow_inf=False)
    q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
    t = check_int(fn, "steps", steps, 0)
    if t == 0:
        raise ValueError(f"{fn}: `steps` must be at least 1 (zero steps spend nothing)")
    d = check_number(fn, "delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    check_number(fn, "tol", tol, low=0.0, low_inclusive=False, allow_inf=False)
    _accountant(accountant, fn)  # validates the name early
    return calibrate(lambda z: dp_sgd_event(z, q, t), eps, d, accountant, tol=tol, fn=fn)


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


class PrivacyPhase(NamedTuple):
    """A run of identical DP-SGD steps recorded by :class:`PrivacyAccountant`.

    Attributes:
      noise_multiplier: :math:`z` of every step of the phase.
      sample_rate: the Poisson rate :math:`q`.
      steps: how many steps.
      truncated_batch_size: the cap of truncated Poisson sampling, or ``None``
        (plain Poisson sampling).
      dataset_size: :math:`n` (needed with truncation only).
      sampler: ``None`` (the phase is (truncated) Poisson sampling), or the
        :class:`gradclip_jax.dp.BatchSampler` whose ``dp_event`` is the event
        of one step (then ``sample_rate`` is its expected batch size over
        :math:`n`, for reading only).
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    truncated_batch_size: int | None = None
    dataset_size: int | None = None
    sampler: Any = None


def phase_event(phase: PrivacyPhase) -> Any:
    """The ``dp_accounting.DpEvent`` of a :class:`PrivacyPhase`: ``SelfComposedDpEvent(one, T)``.

    ``one`` is the sampler's ``dp_event(z)`` for a sampler's phase, else
    :func:`sampled_gaussian_event` (``PoissonSampledDpEvent(q, GaussianDpEvent(z))``,
    or with truncation ``TruncatedSubsampledGaussianDpEvent(n, q, m, z)``).
    """
    z = phase.noise_multiplier
    if phase.sampler is not None:
        one = phase.sampler.dp_event(z)
    else:
        one = sampled_gaussian_event(z, phase.sample_rate, phase.truncated_batch_size, phase.dataset_size)
    return _dp_accounting().SelfComposedDpEvent(one, phase.steps)


class PrivacyAccountant:
    """Follows a DP-SGD run step by step and answers :math:`\\varepsilon(\\delta)` at any time.

    Record every noisy release with :meth:`step` (consecutive steps with the same
    parameters are kept as one :class:`PrivacyPhase`, so a run whose noise or
    rate changes between phases is accounted exactly as it ran); ask
    :meth:`epsilon` whenever. The guarantee is that of the composition of the
    recorded sampled Gaussian mechanisms (Poisson-subsampled, or each step a
    sampler's ``dp_event``) under the accountant's ``neighboring`` relation,
    computed by ``dp-accounting``: ``'pld'`` (default; privacy-loss
    distributions, numerically tight) or ``'rdp'`` (Rényi DP, a looser bound).

    It is a host-side record, not a pytree: keep it outside ``jit`` and call
    :meth:`step` in the Python training loop (or use
    :meth:`gradclip_jax.dp.PrivateTraining.batches`, which does it for you).
    Its :meth:`state_dict` / :meth:`load_state_dict` (or :meth:`from_state_dict`)
    pair lets you checkpoint it.

    A step of any :class:`gradclip_jax.dp.BatchSampler` is recorded with
    ``step(z, sampler=sampler)``: its event is the sampler's ``dp_event(z)``.

    Args:
      accountant: ``'pld'`` (default) or ``'rdp'``.
      neighboring: ``'add_or_remove'`` (default) or ``'replace'``: the
        neighbouring relation of the guarantee (a sampler's must match).

    Example:
      >>> from gradclip_jax.privacy import PrivacyAccountant
      >>> acc = PrivacyAccountant()
      >>> acc.step(noise_multiplier=1.1, sample_rate=256 / 60000, steps=14062)
      >>> round(acc.epsilon(1e-5), 2)  # 60 epochs of MNIST at batch 256
      2.38
      >>> acc.step(noise_multiplier=2.0, sample_rate=256 / 60000, steps=1000)  # a second phase
      >>> acc.steps, len(acc.phases)
      (15062, 2)
    """

    def __init__(self, accountant: str = "pld", neighboring: str = "add_or_remove"):
        key = str(accountant).lower()
        if key not in _ACCOUNTANTS:
            raise ValueError(
                f"PrivacyAccountant: unknown accountant {accountant!r}; expected one of {_ACCOUNTANTS}"
            )
        self.accountant = key
        self.neighboring = check_choice("PrivacyAccountant", "neighboring", neighboring, NEIGHBORING)
        self._phases: list[PrivacyPhase] = []
        self._cache: tuple[list[PrivacyPhase], Any] | None = None

    @property
    def phases(self) -> tuple[PrivacyPhase, ...]:
        """The recorded phases, oldest first."""
        return tuple(self._phases)

    @property
    def steps(self) -> int:
        """The number of steps recorded."""
        return sum(p.steps for p in self._phases)

    def __repr__(self) -> str:
        return f"PrivacyAccountant({self.accountant!r}, steps={self.steps}, phases={len(self._phases)})"

    def step(
        self,
        noise_multiplier: float,
        sample_rate: float | None = None,
        steps: int = 1,
        *,
        truncated_batch_size: int | None = None,
        dataset_size: int | None = None,
        sampler: Any = None,
    ) -> None:
        """Records ``steps`` DP-SGD steps: of Poisson sampling (``sample_rate``), or of a ``sampler``.

        Args:
          noise_multiplier: :math:`z \\ge 0` (noise std over sensitivity).
          sample_rate: the Poisson rate :math:`q \\in (0, 1]` (without ``sampler``).
          steps: how many steps (default 1).
          truncated_batch_size: with truncated Poisson sampling (see
            :class:`gradclip_jax.dp.PoissonSampler`), its cap :math:`m`; needs
            ``dataset_size`` and the PLD accountant.
          dataset_size: :math:`n`, with ``truncated_batch_size``.
          sampler: a :class:`gradclip_jax.dp.BatchSampler` (instead of the
            three above): each step is its ``dp_event(noise_multiplier)``.

        Raises:
          ValueError: naming the argument, for out-of-range values, truncation
            with the RDP accountant (dp-accounting has no RDP bound for it), a
            sampler with both Poisson arguments, or of another neighbouring relation.
          TypeError: for neither ``sample_rate`` nor ``sampler``, or a ``sampler``
            that does not follow the protocol.
        """
        fn = "PrivacyAccountant.step"
        z = check_number(fn, "noise_multiplier", noise_multiplier, low=0.0)
        t = check_int(fn, "steps", steps, 0)
        poisson = (sample_rate, truncated_batch_size, dataset_size)
        if sampler is not None:
            if any(v is not None for v in poisson):
                raise ValueError(f"{fn}: give `sampler` or `sample_rate` (and truncation), not both")
            phase = self._sampler_phase(fn, z, t, sampler)
        else:
            phase = self._poisson_phase(fn, z, t, *poisson)
        last = self._phases[-1] if self._phases else None
        if t == 0:
            return
        if last is not None and last._replace(steps=t) == phase and last.sampler is phase.sampler:
            self._phases[-1] = last._replace(steps=last.steps + t)
        else:
            self._phases.append(phase)

    def _sampler_phase(self, fn: str, z: float, t: int, sampler: Any) -> PrivacyPhase:
        check_sampler(fn, sampler)
        if sampler.neighboring != self.neighboring:
            raise ValueError(
                f"{fn}: the sampler's events are for {sampler.neighboring!r} neighbours, this accountant's "
                f"guarantee for {self.neighboring!r} ones (PrivacyAccountant(neighboring=...))"
            )
        # a sampler's own rate where it has one (over users, for user-level sampling), for reading only
        q = getattr(sampler, "sample_rate", sampler.expected_batch_size / sampler.dataset_size)
        return PrivacyPhase(z, float(q), t, sampler=sampler)

    def _poisson_phase(self, fn: str, z: float, t: int, sample_rate: Any, truncated_batch_size: Any,
                       dataset_size: Any) -> PrivacyPhase:
        if sample_rate is None:
            raise TypeError(f"{fn}: give `sample_rate` (Poisson sampling) or `sampler`")
        q = check_number(fn, "sample_rate", sample_rate, low=0.0, high=1.0, low_inclusive=False)
        if truncated_batch_size is None:
            return PrivacyPhase(z, q, t)
        if self.accountant != "pld":
            raise ValueError(
                f"{fn}: `truncated_batch_size` needs the 'pld' accountant (dp-accounting has no "
                "RDP bound for truncated Poisson sampling)"
            )
        if dataset_size is None:
            raise ValueError(f"{fn}: `dataset_size` is required with `truncated_batch_size`")
        m = check_int(fn, "truncated_batch_size", truncated_batch_size, 1)
        return PrivacyPhase(z, q, t, m, check_int(fn, "dataset_size", dataset_size, 1))

    def dp_event(self) -> Any:
        """The ``dp_accounting.DpEvent`` of everything recorded (a ``ComposedDpEvent``)."""
        dpa = _dp_accounting()
        return dpa.ComposedDpEvent([phase_event(p) for p in self._phases])

    def _composed(self) -> Any:
        """The dp-accounting accountant of the recorded phases (kept until the next step)."""
        if self._cache is None or self._cache[0] != self._phases:
            acc = _accountant(self.accountant, "PrivacyAccountant",
                              min(p.noise_multiplier for p in self._phases), self.neighboring)
            dpa = _dp_accounting()
            with _quiet():
                for p in self._phases:
                    try:
                        acc.compose(phase_event(p))
                    except dpa.UnsupportedEventError as err:
                        raise ValueError(
                            f"PrivacyAccountant: the {self.accountant!r} accountant cannot account for "
                            f"{p.sampler!r} under {self.neighboring!r} neighbours ({err})"
                        ) from None
            self._cache = (list(self._phases), acc)
        return self._cache[1]

    def _spends_nothing_or_all(self) -> float | None:
        if not self._phases:
            return 0.0
        if any(p.noise_multiplier == 0.0 for p in self._phases):
            return math.inf
        return None

    def epsilon(self, delta: float) -> float:
        """The :math:`\\varepsilon` spent so far at ``delta``.

        Args:
          delta: :math:`\\delta \\in (0, 1)`.

        Returns:
          A Python float: 0 before any step, ``inf`` if a step had no noise.
        """
        d = check_number("PrivacyAccountant.epsilon", "delta", delta, low=0.0, high=1.0, low_inclusive=False,
                         high_inclusive=False)
        trivial = self._spends_nothing_or_all()
        if trivial is not None:
            return trivial
        with _quiet():
            return _event_epsilon(self.accountant, self.dp_event(), d,
                                  min(p.noise_multiplier for p in self._phases),
                                  "PrivacyAccountant.epsilon", composed=self._composed(),
                                  neighboring=self.neighboring)

    def delta(self, epsilon: float) -> float:
        """The :math:`\\delta` spent so far at ``epsilon``.

        Args:
          epsilon: :math:`\\varepsilon \\ge 0`.

        Returns:
          A Python float in [0, 1].
        """
        e = check_number("PrivacyAccountant.delta", "epsilon", epsilon, low=0.0, allow_inf=False)
        trivial = self._spends_nothing_or_all()
        if trivial is not None:
            return 0.0 if trivial == 0.0 else 1.0
        with _quiet():
            return float(self._composed().get_delta(e))

    def state_dict(self) -> dict[str, Any]:
        """The accountant as a plain dict, for checkpoints.

        ``{'accountant': 'pld' | 'rdp', 'phases': [[z, q, steps, m, n], ...]}``
        with Python floats, ints and ``None`` only: it round-trips exactly
        through JSON (e.g. ``orbax.checkpoint.args.JsonSave``) and ``pickle``.
        A sampler's phase ends with the sampler's ``plan()``
        (``[z, q, steps, None, None, plan]``), and a ``'replace'`` accountant
        adds ``'neighboring': 'replace'``.

        Example:
          >>> from gradclip_jax.privacy import PrivacyAccountant
          >>> acc = PrivacyAccountant()
          >>> acc.step(1.1, 0.01, steps=10)
          >>> acc.state_dict()
          {'accountant': 'pld', 'phases': [[1.1, 0.01, 10, None, None]]}
        """
        out: dict[str, Any] = {"accountant": self.accountant, "phases": [_saved(p) for p in self._phases]}
        if self.neighboring != "add_or_remove":
            out["neighboring"] = self.neighboring
        return out

    def load_state_dict(self, state: dict[str, Any], *, sampler: Any = None) -> None:
        """Replaces the record of this accountant with the one saved by :meth:`state_dict`.

        Args:
          state: a :meth:`state_dict` of an accountant of the same kind.
          sampler: the sampler of the saved sampler phases (its ``plan()`` must
            equal the saved one); not needed for Poisson phases.

        Raises:
          ValueError: naming ``state``, when it is not such a dict or was saved
            by another kind of accountant (``'pld'`` vs ``'rdp'``), or a phase
            is out of range.

        Example:
          >>> from gradclip_jax.privacy import PrivacyAccountant
          >>> acc = PrivacyAccountant()
          >>> acc.step(1.1, 0.01, steps=10)
          >>> resumed = PrivacyAccountant()
          >>> resumed.load_state_dict(acc.state_dict())
          >>> resumed.steps, resumed.phases == acc.phases
          (10, True)
        """
        fn = "PrivacyAccountant.load_state_dict"
        if not isinstance(state, dict) or "accountant" not in state or "phases" not in state:
            raise ValueError(
                f"{fn}: `state` must be a dict from PrivacyAccountant.state_dict() "
                f"(keys 'accountant', 'phases'), got {state!r}"
            )
        kind = str(state["accountant"]).lower()
        if kind != self.accountant:
            raise ValueError(
                f"{fn}: `state` was saved by a {kind!r} accountant, this one is {self.accountant!r}"
            )
        saved = state.get("neighboring", "add_or_remove")
        if saved != self.neighboring:
            raise ValueError(f"{fn}: `state` is for {saved!r} neighbours, this accountant for {self.neighboring!r}")
        fresh = PrivacyAccountant(self.accountant, self.neighboring)
        for phase in state["phases"]:
            _load_phase(fn, fresh, phase, sampler)
        self._phases = fresh._phases
        self._cache = None

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, sampler: Any = None) -> PrivacyAccountant:
        """The accountant saved by :meth:`state_dict` (a new one; see :meth:`load_state_dict`)."""
        if not isinstance(state, dict) or "accountant" not in state:
            raise ValueError(f"PrivacyAccountant.from_state_dict: `state` must be a dict from state_dict(), got {state!r}")
        acc = cls(state["accountant"], state.get("neighboring", "add_or_remove"))
        acc.load_state_dict(state, sampler=sampler)
        return acc


def _saved(p: PrivacyPhase) -> list[Any]:
    """A phase as plain values: ``[z, q, steps, m, n]``, and a sampler's ``plan()`` last."""
    out = [float(p.noise_multiplier), float(p.sample_rate), int(p.steps),
           None if p.truncated_batch_size is None else int(p.truncated_batch_size),
           None if p.dataset_size is None else int(p.dataset_size)]
    return out if p.sampler is None else [*out, dict(p.sampler.plan())]


def _load_phase(fn: str, acc: PrivacyAccountant, phase: Any, sampler: Any) -> None:
    """Records a saved phase in ``acc``; a sampler's phase needs that sampler (the same ``plan()``)."""
    if not isinstance(phase, (list, tuple)) or len(phase) not in (5, 6):
        raise ValueError(f"{fn}: every phase of `state` must be [z, q, steps, m, n(, plan)], got {phase!r}")
    z, q, t, m, n = phase[:5]
    if len(phase) == 5:
        acc.step(z, q, t, truncated_batch_size=m, dataset_size=n)
        return
    if sampler is None or dict(sampler.plan()) != phase[5]:
        raise ValueError(
            f"{fn}: `state` has a phase of the sampler {phase[5]!r}: pass that sampler (`sampler=`), got "
            f"{None if sampler is None else sampler.plan()!r}"
        )
    acc.step(z, steps=t, sampler=sampler)
