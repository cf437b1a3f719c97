"""The step-by-step accountant: a run's steps recorded as phases of identical steps, its epsilon
(or delta) at any time, and its record as a plain dict for checkpoints."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from gradclip_jax._core.validation import check_choice, check_int, check_number
from gradclip_jax.dp.accounting._accountants import ACCOUNTANTS, import_dp_accounting, quiet
from gradclip_jax.dp.accounting._composition import Composition
from gradclip_jax.dp.accounting._dpsgd import sampled_gaussian_event
from gradclip_jax.dp.sampling.protocol import NEIGHBORING, check_sampler


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
        one = sampled_gaussian_event(
            z, phase.sample_rate, phase.truncated_batch_size, phase.dataset_size
        )
    return import_dp_accounting().SelfComposedDpEvent(one, phase.steps)


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
      >>> from gradclip_jax import PrivacyAccountant
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
        if key not in ACCOUNTANTS:
            raise ValueError(
                f"PrivacyAccountant: unknown accountant {accountant!r}; expected one of {ACCOUNTANTS}"
            )
        self.accountant = key
        self.neighboring = check_choice(
            "PrivacyAccountant", "neighboring", neighboring, NEIGHBORING
        )
        self._phases: list[PrivacyPhase] = []
        # each step's PLD or RDP built once, and each phase's composition kept and extended
        self._composition = Composition(key, self.neighboring, "PrivacyAccountant")

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
            :class:`gradclip_jax.PoissonSampler`), its cap :math:`m`; needs
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
        z = check_number(fn, "noise_multiplier", noise_multiplier, low=0.0, allow_inf=False)
        t = check_int(fn, "steps", steps, 0)
        poisson = (sample_rate, truncated_batch_size, dataset_size)
        if sampler is not None:
            if any(v is not None for v in poisson):
                raise ValueError(
                    f"{fn}: give `sampler` or `sample_rate` (and truncation), not both"
                )
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

    def _poisson_phase(
        self,
        fn: str,
        z: float,
        t: int,
        sample_rate: Any,
        truncated_batch_size: Any,
        dataset_size: Any,
    ) -> PrivacyPhase:
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
        dpa = import_dp_accounting()
        return dpa.ComposedDpEvent([phase_event(p) for p in self._phases])

    def _events(self) -> list[tuple[Any, int]]:
        """The recorded phases as ``(one step's event, steps)`` pairs (what :meth:`dp_event` composes)."""
        return [(phase_event(p._replace(steps=1)).event, p.steps) for p in self._phases]

    def _min_noise(self) -> float:
        return min(p.noise_multiplier for p in self._phases)

    def _spends_nothing_or_all(self) -> float | None:
        if not self._phases:
            return 0.0
        if any(p.noise_multiplier == 0.0 for p in self._phases):
            return math.inf
        return None

    def epsilon(self, delta: float) -> float:
        """The :math:`\\varepsilon` spent so far at ``delta``.

        Each step's PLD (or RDP curve) is built once and each phase's
        composition is kept: a call after new steps composes the kept one with
        the new steps (dp-accounting's ``compose``, by powers of two), a few
        milliseconds at any number of steps, and equals dp-accounting's
        composition from scratch on the same grid up to rounding (relative
        differences below 1e-7).

        Args:
          delta: :math:`\\delta \\in (0, 1)`.

        Returns:
          A Python float: 0 before any step, ``inf`` if a step had no noise.
        """
        d = check_number(
            "PrivacyAccountant.epsilon",
            "delta",
            delta,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            high_inclusive=False,
        )
        trivial = self._spends_nothing_or_all()
        if trivial is not None:
            return trivial
        with quiet():
            return self._composition.epsilon(self._events(), d, self._min_noise())

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
        with quiet():
            return self._composition.delta(self._events(), e, self._min_noise())

    def state_dict(self) -> dict[str, Any]:
        """The accountant as a plain dict, for checkpoints.

        ``{'accountant': 'pld' | 'rdp', 'phases': [[z, q, steps, m, n], ...]}``
        with Python floats, ints and ``None`` only: it round-trips exactly
        through JSON (e.g. ``orbax.checkpoint.args.JsonSave``) and ``pickle``.
        A sampler's phase ends with the sampler's ``plan()``
        (``[z, q, steps, None, None, plan]``), and a ``'replace'`` accountant
        adds ``'neighboring': 'replace'``.

        Example:
          >>> from gradclip_jax import PrivacyAccountant
          >>> acc = PrivacyAccountant()
          >>> acc.step(1.1, 0.01, steps=10)
          >>> acc.state_dict()
          {'accountant': 'pld', 'phases': [[1.1, 0.01, 10, None, None]]}
        """
        out: dict[str, Any] = {
            "accountant": self.accountant,
            "phases": [_saved(p) for p in self._phases],
        }
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
          >>> from gradclip_jax import PrivacyAccountant
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
            raise ValueError(
                f"{fn}: `state` is for {saved!r} neighbours, this accountant for {self.neighboring!r}"
            )
        fresh = PrivacyAccountant(self.accountant, self.neighboring)
        for phase in state["phases"]:
            _load_phase(fn, fresh, phase, sampler)
        self._phases = fresh._phases

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, sampler: Any = None) -> PrivacyAccountant:
        """The accountant saved by :meth:`state_dict` (a new one; see :meth:`load_state_dict`)."""
        if not isinstance(state, dict) or "accountant" not in state:
            raise ValueError(
                f"PrivacyAccountant.from_state_dict: `state` must be a dict from state_dict(), got {state!r}"
            )
        acc = cls(state["accountant"], state.get("neighboring", "add_or_remove"))
        acc.load_state_dict(state, sampler=sampler)
        return acc


def _saved(p: PrivacyPhase) -> list[Any]:
    """A phase as plain values: ``[z, q, steps, m, n]``, and a sampler's ``plan()`` last."""
    out = [
        float(p.noise_multiplier),
        float(p.sample_rate),
        int(p.steps),
        None if p.truncated_batch_size is None else int(p.truncated_batch_size),
        None if p.dataset_size is None else int(p.dataset_size),
    ]
    return out if p.sampler is None else [*out, dict(p.sampler.plan())]


def _load_phase(fn: str, acc: PrivacyAccountant, phase: Any, sampler: Any) -> None:
    """Records a saved phase in ``acc``; a sampler's phase needs that sampler (the same ``plan()``)."""
    if not isinstance(phase, (list, tuple)) or len(phase) not in (5, 6):
        raise ValueError(
            f"{fn}: every phase of `state` must be [z, q, steps, m, n(, plan)], got {phase!r}"
        )
    z, q, t, m, n = phase[:5]
    if len(phase) == 5:
        acc.step(z, q, t, truncated_batch_size=m, dataset_size=n)
        return
    if sampler is None or dict(sampler.plan()) != phase[5]:
        raise ValueError(
            f"{fn}: `state` has a phase of the sampler {phase[5]!r}: pass that sampler (`sampler=`), got "
            f"{None if sampler is None else sampler.plan()!r}"
        )
    # the plan names the sampling, not always its rate (a user-level sampler's expected users):
    # the saved steps are recorded again from `sampler`'s events, so its rate must be the saved one
    rate = acc._sampler_phase(fn, z, t, sampler).sample_rate
    if rate != q:
        raise ValueError(
            f"{fn}: `state` has {t} steps of the sampler {phase[5]!r} at sampling rate {q!r}; the "
            f"`sampler` passed samples at rate {rate!r} (its epsilon would account the saved steps at "
            "that rate): pass the sampler of the saved run"
        )
    acc.step(z, steps=t, sampler=sampler)
