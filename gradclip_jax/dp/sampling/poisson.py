"""Poisson batch selection with fixed shapes, for jit-compiled DP-SGD.

:class:`PoissonSampler` is the default :class:`gradclip_jax.dp.BatchSampler`
(the protocol of :mod:`gradclip_jax.dp.sampling.protocol`): its
:meth:`~PoissonSampler.dp_event` is the Poisson-subsampled Gaussian mechanism,
or the truncated one with ``on_overflow='truncate'``.

The privacy accounting of DP-SGD (:mod:`gradclip_jax.dp.accounting`) assumes **Poisson
sampling**: at every step each of the :math:`n` examples is in the batch
independently with probability :math:`q`, so the batch size is
:math:`\\mathrm{Binomial}(n, q)` and varies from step to step. Shuffled
fixed-size batches are a different mechanism with a different (weaker, and not
what the accountant computes) guarantee.

A varying batch size would make ``jax.jit`` compile once per size, so
:class:`PoissonSampler` pads every batch to one fixed size ``max_batch_size``
and returns a boolean mask; pass the mask to
:func:`gradclip_jax.clipped_grad` and padded rows contribute nothing (they are
not neighbours of anything, so the sensitivity is unchanged).

**Truncation.** A batch larger than ``max_batch_size`` cannot be padded. By
default ``max_batch_size`` is the smallest size with

.. math:: P\\big(\\exists\\, t \\le T:\\ |B_t| > m\\big)
    = 1 - \\big(1 - P(\\mathrm{Binomial}(n, q) > m)\\big)^T \\le 10^{-9},

computed from the exact binomial tail (``scipy.stats.binom``), and reported as
:attr:`PoissonSampler.overflow_probability`. What happens when a draw is larger
anyway is ``on_overflow``:

* ``'raise'`` (default): :class:`BatchOverflowError`. The run stops rather than
  release a step the accountant does not describe; at the default size this
  happens with probability at most ``1e-9`` per run, and the message says how to
  resume. Dropping the extra examples silently would change the mechanism.
* ``'truncate'``: keep a uniformly random subset of ``max_batch_size`` of the
  drawn examples (truncated Poisson sampling, as jax-privacy's
  ``truncated_batch_size``), and account for it:
  :meth:`PoissonSampler.accounting` returns the truncation, which
  :class:`gradclip_jax.PrivacyAccountant` turns into
  ``dp_accounting.TruncatedSubsampledGaussianDpEvent`` (PLD only).

**Determinism and processes.** Step :math:`t`'s batch is a function of
``(seed, t)`` only (a ``numpy.random.Generator`` seeded with ``[seed, t]``), so
:meth:`PoissonSampler.batch` gives any step directly (resume after a restart)
and every process of a multi-process run computes the same global selection.
The global padded batch (``max_batch_size`` rows: the drawn indices in
increasing order, then padding) is cut into ``process_count`` equal consecutive
pieces and process ``process_index`` gets its piece: stacking the pieces of all
processes in process order (``jax.make_array_from_process_local_data``) gives
back the global batch. Padding rows hold index 0, so ``data[indices]`` is
always valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from gradclip_jax._core.validation import check_int, check_number
from gradclip_jax.dp.sampling.protocol import IndexSampler, SampledBatch, processes

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")

_ON_OVERFLOW = ("raise", "truncate")


class BatchOverflowError(RuntimeError):
    """A Poisson draw had more examples than ``max_batch_size`` (with ``on_overflow='raise'``)."""


PoissonBatch = SampledBatch  # the batch of every sampler (the name this module has always exported)


def poisson_rate(fn: str, dataset_size: int, expected_batch_size: Any, sample_rate: Any) -> float:
    """The sampling rate q from exactly one of ``expected_batch_size`` and ``sample_rate``."""
    if (expected_batch_size is None) == (sample_rate is None):
        raise ValueError(f"{fn}: give exactly one of `expected_batch_size` and `sample_rate`")
    name, given = (
        ("sample_rate", sample_rate)
        if sample_rate is not None
        else ("expected_batch_size", expected_batch_size)
    )
    value = check_number(fn, name, given, low=None)
    q = value if name == "sample_rate" else value / dataset_size
    if not 0.0 < q <= 1.0:
        where = "" if name == "sample_rate" else f" for dataset_size={dataset_size} (rate {q:g})"
        raise ValueError(f"{fn}: the sampling rate must be in (0, 1], got {name}={given!r}{where}")
    return q


def overflow_probability(
    dataset_size: int, sample_rate: float, max_batch_size: int, steps: int
) -> float:
    """The probability that at least one of ``steps`` Poisson batches exceeds ``max_batch_size``.

    .. math:: 1 - \\big(1 - P(\\mathrm{Binomial}(n, q) > m)\\big)^T

    from the exact binomial survival function (steps are independent).

    Args:
      dataset_size: :math:`n \\ge 1`.
      sample_rate: :math:`q \\in (0, 1]`.
      max_batch_size: :math:`m \\ge 0`.
      steps: :math:`T \\ge 0`.

    Returns:
      A probability (Python float).

    Example:
      >>> from gradclip_jax.dp.sampling import overflow_probability
      >>> overflow_probability(1000, 0.1, 1000, 50)  # the whole data set always fits
      0.0
      >>> 0.4 < overflow_probability(1000, 0.1, 100, 1) < 0.5  # about half the draws exceed the mean
      True
    """
    from scipy.stats import binom

    p_step = float(binom.sf(max_batch_size, dataset_size, sample_rate))
    if p_step <= 0.0 or steps == 0:
        return 0.0
    return float(-math.expm1(steps * math.log1p(-min(p_step, 1.0)))) if p_step < 1.0 else 1.0


def max_batch_size_for(
    dataset_size: int, sample_rate: float, steps: int, bound: float = 1e-9, multiple_of: int = 1
) -> int:
    """The smallest multiple of ``multiple_of`` whose per-run overflow probability is ``<= bound``.

    Args:
      dataset_size: :math:`n \\ge 1`.
      sample_rate: :math:`q \\in (0, 1]`.
      steps: :math:`T \\ge 1`.
      bound: the largest acceptable :func:`overflow_probability` (default 1e-9).
      multiple_of: round up to a multiple of this (e.g. the number of processes
        or devices the batch is split over); capped at ``dataset_size`` rounded
        up.

    Returns:
      :math:`m` (a Python int).

    Example:
      >>> from gradclip_jax.dp.sampling import max_batch_size_for
      >>> max_batch_size_for(60000, 256 / 60000, steps=10000)  # about 256 + 7.9 std
      382
    """
    from scipy.stats import binom

    # per-step tail bound: 1 - (1 - p)^T <= bound  <=>  p <= 1 - (1 - bound)^(1/T)
    per_step = -math.expm1(math.log1p(-bound) / max(steps, 1))
    m = int(binom.isf(per_step, dataset_size, sample_rate))
    while m < dataset_size and overflow_probability(dataset_size, sample_rate, m, steps) > bound:
        m += 1
    m = min(m, dataset_size)
    return int(math.ceil(max(m, 1) / multiple_of) * multiple_of)


class Schedule(NamedTuple):
    """A Poisson sampler's run, checked: its steps, the batch bound and this process's place."""

    steps: int
    max_size: int
    process_index: int
    process_count: int


def checked_schedule(
    fn: str,
    units: int,
    sample_rate: float,
    steps: Any,
    overflow_bound: Any,
    max_size: int | None,
    process_index: int | None,
    process_count: int | None,
) -> Schedule:
    """The checked ``steps`` and processes of a Poisson sampler over ``units`` (examples or users),
    and its batch bound: ``max_size``, else the smallest that overflows a run with probability at
    most ``overflow_bound`` (:func:`max_batch_size_for`, a multiple of the processes)."""
    index, count = processes(fn, process_index, process_count)
    t = check_int(fn, "steps", steps, 0)
    check_number(
        fn,
        "overflow_bound",
        overflow_bound,
        low=0.0,
        high=1.0,
        low_inclusive=False,
        high_inclusive=False,
    )
    if max_size is None:
        max_size = max_batch_size_for(units, sample_rate, max(t, 1), overflow_bound, count)
    return Schedule(t, max_size, index, count)


def _buckets(fn: str, bucket_sizes: Sequence[int] | None, m: int, count: int) -> tuple[int, ...]:
    """The padded sizes, increasing, ending with ``max_batch_size`` ``m``."""
    buckets = sorted(check_int(fn, "bucket_sizes", b) for b in (bucket_sizes or ()))
    for b in buckets:
        if not 0 < b < m or b % count:
            raise ValueError(
                f"{fn}: every entry of `bucket_sizes` must be a positive multiple of "
                f"process_count ({count}) below max_batch_size ({m}), got {b}"
            )
    return (*dict.fromkeys(buckets), m)


class PoissonSampler(IndexSampler):
    """Poisson-sampled batches padded to fixed shapes (see the module docstring).

    Iterate over it (``for batch in sampler``: ``steps`` :class:`PoissonBatch`\\ es)
    or ask for one step (``sampler.batch(t)``).

    Args:
      dataset_size: :math:`n`, the number of examples.
      steps: :math:`T`, the number of steps of the run (used for the default
        ``max_batch_size`` and by iteration).
      expected_batch_size: :math:`qn` (give this or ``sample_rate``).
      sample_rate: :math:`q \\in (0, 1]` (give this or ``expected_batch_size``).
      seed: an int; step :math:`t` draws from ``numpy.random.default_rng([seed, t])``.
      max_batch_size: the padded size :math:`m` of the global batch (a multiple
        of ``process_count``, at least the expected batch size); default
        :func:`max_batch_size_for` with ``overflow_bound``.
      overflow_bound: the per-run overflow probability the default
        ``max_batch_size`` is chosen for (default 1e-9).
      on_overflow: ``'raise'`` (default) or ``'truncate'`` (accounted; see the
        module docstring).
      bucket_sizes: optional increasing padded sizes smaller than
        ``max_batch_size`` (multiples of ``process_count``): a batch is padded to
        the smallest one it fits, so the step compiles at most
        ``len(bucket_sizes) + 1`` times and pads less.
      process_index, process_count: which piece of the global batch this
        process gets, and into how many pieces it is cut; default
        ``jax.process_index()`` and ``jax.process_count()``.

    Attributes:
      sample_rate: :math:`q`.
      expected_batch_size: :math:`qn`.
      max_batch_size: :math:`m` (global).
      local_batch_size: ``max_batch_size // process_count`` (the piece's size,
        without buckets).
      overflow_probability: the probability that some step of the run draws
        more than ``max_batch_size`` examples.
      truncated_batch_size: ``max_batch_size`` with ``on_overflow='truncate'``,
        else ``None``.

    Raises:
      ValueError: naming the argument, for a rate outside (0, 1], a
        ``max_batch_size`` below the expected batch size or not a multiple of
        ``process_count``, bad buckets or a bad ``on_overflow``.

    Example:
      >>> from gradclip_jax import PoissonSampler
      >>> sampler = PoissonSampler(1000, steps=3, expected_batch_size=50, seed=0,
      ...                          process_index=0, process_count=1)
      >>> sampler.max_batch_size, f"{sampler.overflow_probability:.1e}"
      (98, '5.4e-10')
      >>> for batch in sampler:
      ...     assert batch.indices.shape == batch.mask.shape == (98,)
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        steps: int,
        expected_batch_size: float | None = None,
        sample_rate: float | None = None,
        seed: int = 0,
        max_batch_size: int | None = None,
        overflow_bound: float = 1e-9,
        on_overflow: str = "raise",
        bucket_sizes: Sequence[int] | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        fn = "PoissonSampler"
        n = check_int(fn, "dataset_size", dataset_size, 1)
        self.sample_rate = poisson_rate(fn, n, expected_batch_size, sample_rate)
        self.expected_batch_size = self.sample_rate * n
        if on_overflow not in _ON_OVERFLOW:
            raise ValueError(
                f"{fn}: `on_overflow` must be one of {_ON_OVERFLOW}, got {on_overflow!r}"
            )
        self.on_overflow = on_overflow
        run = checked_schedule(
            fn,
            n,
            self.sample_rate,
            steps,
            overflow_bound,
            max_batch_size,
            process_index,
            process_count,
        )
        super().__init__(
            n,
            steps=run.steps,
            max_batch_size=run.max_size,
            seed=seed,
            process_index=run.process_index,
            process_count=run.process_count,
        )
        m = self.max_batch_size
        if m < self.expected_batch_size:
            raise ValueError(
                f"{fn}: `max_batch_size` ({m}) is below the expected batch size "
                f"({self.expected_batch_size:g}): most steps would overflow"
            )
        self.overflow_probability = overflow_probability(n, self.sample_rate, m, self.steps)
        self.truncated_batch_size = m if on_overflow == "truncate" else None
        self.bucket_sizes = _buckets(fn, bucket_sizes, m, run.process_count)

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(dataset_size={self.dataset_size}, sample_rate={self.sample_rate:g}, "
            f"steps={self.steps}, max_batch_size={self.max_batch_size}, "
            f"overflow_probability={self.overflow_probability:.2e}, on_overflow={self.on_overflow!r}, "
            f"process {self.process_index}/{self.process_count})"
        )

    def draw(self, step: int) -> np.ndarray:
        """The sorted global indices drawn at ``step`` (after truncation; unpadded).

        Raises:
          BatchOverflowError: with ``on_overflow='raise'`` when the draw exceeds
            ``max_batch_size``.
        """
        t = check_int("PoissonSampler.draw", "step", step, 0)
        rng = np.random.default_rng([self.seed, t])
        # Poisson sampling = a Binomial(n, q) size, then a uniform subset of that size.
        size = int(rng.binomial(self.dataset_size, self.sample_rate))
        chosen = (
            rng.choice(self.dataset_size, size, replace=False) if size else np.zeros(0, np.int64)
        )
        if size > self.max_batch_size:
            if self.on_overflow == "raise":
                raise BatchOverflowError(
                    f"step {t}: the Poisson draw has {size} examples, more than max_batch_size="
                    f"{self.max_batch_size} (probability {self.overflow_probability:.1e} per run). "
                    "Nothing was released for this step. Use a larger max_batch_size (or the default), "
                    "or on_overflow='truncate' (accounted as truncated Poisson sampling)."
                )
            chosen = rng.choice(chosen, self.max_batch_size, replace=False)
        return np.sort(chosen).astype(np.int32)

    def accounting(self) -> dict[str, Any]:
        """What the accountant needs about the sampling of one step.

        Returns:
          ``{'sample_rate': q, 'truncated_batch_size': m or None, 'dataset_size': n}``,
          the keyword arguments of :meth:`gradclip_jax.PrivacyAccountant.step`
          besides the noise multiplier.
        """
        return {
            "sample_rate": self.sample_rate,
            "truncated_batch_size": self.truncated_batch_size,
            "dataset_size": self.dataset_size,
        }

    def dp_event(self, noise_multiplier: float) -> Any:
        """One step's ``dp_accounting.DpEvent`` at noise multiplier :math:`z`.

        ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, or with truncation
        ``TruncatedSubsampledGaussianDpEvent(n, q, m, z)`` (what
        :class:`gradclip_jax.PrivacyAccountant` records for
        :meth:`accounting`'s arguments: one function builds both).
        """
        from gradclip_jax.dp.accounting import sampled_gaussian_event

        return sampled_gaussian_event(noise_multiplier, **self.accounting())

    def plan(self) -> dict[str, Any]:
        """``max_batch_size``, ``on_overflow`` and ``seed``: with the rate and size, the whole sampling."""
        return {
            "max_batch_size": self.max_batch_size,
            "on_overflow": self.on_overflow,
            "seed": self.seed,
        }
