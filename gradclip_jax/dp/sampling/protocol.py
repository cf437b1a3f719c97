"""The sampler protocol: which examples each DP-SGD step uses, and what that costs in privacy.

A DP-SGD run is a composition of sampled Gaussian mechanisms, and its privacy
depends on **how** each step's batch is drawn as much as on the noise: Poisson
sampling at rate :math:`q` is amplified by :math:`q`, a truncated Poisson draw
differently, shuffled fixed-size batches differently again. So a sampler does
two jobs, and :class:`BatchSampler` names both:

* **the batches**: :meth:`~BatchSampler.batch` gives step :math:`t`'s
  :class:`SampledBatch`, the global indices of this process's piece padded to
  fixed shapes, and the mask of the real rows (so ``jax.jit`` compiles once);
* **the accounting**: :meth:`~BatchSampler.dp_event` gives the
  ``dp_accounting.DpEvent`` of one step whose Gaussian noise has multiplier
  :math:`z` (standard deviation over the sensitivity of the sum under the
  sampler's ``neighboring`` relation): what :func:`gradclip_jax.make_private`
  calibrates the noise with and what
  :class:`gradclip_jax.PrivacyAccountant` composes, step by step.

Behind the protocol: :class:`gradclip_jax.PoissonSampler` (Poisson sampling,
and truncated Poisson sampling with ``on_overflow='truncate'``). A new scheme
(fixed-size batches with honest accounting, user-level sampling) is one file: a
subclass of :class:`IndexSampler` that draws the indices of a step
(:meth:`IndexSampler.draw`) and states the event of a step
(:meth:`IndexSampler.dp_event`); padding, splitting over processes, iteration
and the accountant's record come with the base class. Pass it to
``make_private(..., sampler=...)``.

Example:
  A fixed-size batch of :math:`b` examples drawn without replacement, accounted
  as such under replace-one neighbours (the standard analysis of that scheme,
  Wang et al. 2019, in ``dp_accounting``'s RDP accountant):

  >>> import dp_accounting, numpy as np
  >>> from gradclip_jax.dp import IndexSampler
  >>> class FixedSizeSampler(IndexSampler):
  ...     neighboring = 'replace'
  ...     def __init__(self, dataset_size, batch_size, *, steps, seed=0):
  ...         super().__init__(dataset_size, steps=steps, max_batch_size=batch_size, seed=seed,
  ...                          process_index=0, process_count=1)
  ...         self.batch_size = self.expected_batch_size = batch_size
  ...     def draw(self, step):
  ...         rng = np.random.default_rng([self.seed, step])
  ...         return np.sort(rng.choice(self.dataset_size, self.batch_size, replace=False))
  ...     def dp_event(self, noise_multiplier):
  ...         return dp_accounting.SampledWithoutReplacementDpEvent(
  ...             self.dataset_size, self.batch_size, dp_accounting.GaussianDpEvent(noise_multiplier))
  ...     def plan(self):
  ...         return {'sampler': 'fixed_size', 'batch_size': self.batch_size, 'seed': self.seed}
  >>> s = FixedSizeSampler(100, 10, steps=3)
  >>> b = s.batch(0)
  >>> b.indices.shape, int(b.mask.sum()), isinstance(s, BatchSampler)
  ((10,), 10, True)
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from gradclip_jax._core.validation import check_choice, check_int

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")

# dp_accounting's two neighbouring relations, by the names clipped_grad's sensitivity() uses
NEIGHBORING = ("add_or_remove", "replace")


class SampledBatch(NamedTuple):
    """One step's batch from a sampler (this process's piece).

    Attributes:
      indices: int32 array of shape ``(size,)``: the examples of this process's
        piece, in increasing order, then padding (index 0).
      mask: bool array of shape ``(size,)``: ``True`` for real examples, ``False``
        for padding. Pass it as ``mask=`` to :func:`gradclip_jax.clipped_grad`.
      step: the step number :math:`t` (0-based).
      example_mask: ``None`` (one example per row), or, for a sampler whose
        unit is a group of examples (:class:`gradclip_jax.dp.UserPoissonSampler`:
        a user), a bool array of shape ``(size, k)`` marking each row's real
        examples; then ``indices`` has shape ``(size, k)`` and ``mask`` marks
        the real rows (units).

    The number of real examples (``mask.sum()``) depends on the data set's
    membership under Poisson sampling: it is not private. Do not log it.
    """

    indices: np.ndarray
    mask: np.ndarray
    step: int
    example_mask: np.ndarray | None = None  # last and optional: 3-field construction still works


@runtime_checkable
class BatchSampler(Protocol):
    """What :func:`gradclip_jax.make_private` needs of a sampler (see the module docstring).

    Attributes:
      dataset_size: :math:`n`, the examples the indices are drawn from.
      steps: the number of steps of the run (``make_private`` plans this many).
      expected_batch_size: the public constant the noised sum is divided by
        (:math:`qn` for Poisson sampling, :math:`b` for fixed-size batches).
      max_batch_size: the padded size of the global batch.
      neighboring: ``'add_or_remove'`` or ``'replace'``: the neighbouring
        relation :meth:`dp_event` is stated for. The noise standard deviation is
        :math:`z` times the clipped sum's sensitivity under that relation
        (:math:`C` and :math:`2C`), and the accountant uses that relation.
    """

    dataset_size: int
    steps: int
    expected_batch_size: float
    max_batch_size: int
    neighboring: str

    def batch(self, step: int) -> SampledBatch:
        """This process's piece of step ``step``'s padded batch; a function of ``(seed, step)``."""
        ...

    def dp_event(self, noise_multiplier: float) -> Any:
        """The ``dp_accounting.DpEvent`` of one step at noise multiplier :math:`z`."""
        ...

    def accounting(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`gradclip_jax.PrivacyAccountant.step`
        (besides the noise multiplier) that record one step of this sampling."""
        ...

    def plan(self) -> dict[str, Any]:
        """Plain values (ints, floats, strings) that identify the sampling: checked on resume."""
        ...


def gathered(data: Any, indices: np.ndarray, keep: np.ndarray) -> Any:
    """``data[indices]`` (host arrays, examples on axis 0) with the rows that ``keep`` leaves out
    set to zero: a padding row would otherwise be a copy of the example its index 0 names, which
    a loop that forgets the mask counts once per padding row."""
    import jax  # only here: the samplers run on the host, before anything is compiled

    def one(x: Any) -> np.ndarray:
        rows = np.asarray(x)[indices]
        rows[~np.asarray(keep, bool)] = 0
        return rows

    return jax.tree.map(one, data)


def check_sampler(fn: str, sampler: Any) -> BatchSampler:
    """``sampler`` if it has the members of :class:`BatchSampler`; ``TypeError`` naming the missing ones."""
    members = (
        "dataset_size",
        "steps",
        "expected_batch_size",
        "max_batch_size",
        "neighboring",
        "batch",
        "dp_event",
        "accounting",
        "plan",
    )
    missing = [m for m in members if not hasattr(sampler, m)]
    if missing:
        raise TypeError(
            f"{fn}: `sampler` must follow the gradclip_jax.dp.BatchSampler protocol; "
            f"{type(sampler).__name__} lacks {', '.join(missing)}"
        )
    check_choice(fn, "sampler.neighboring", sampler.neighboring, NEIGHBORING)
    return sampler  # type: ignore[no-any-return]


def processes(fn: str, process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """``(process_index, process_count)``, checked; ``None`` means jax's for this process."""
    if process_index is None or process_count is None:
        import jax  # only here: the samplers run on the host, before anything is compiled

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    count = check_int(fn, "process_count", process_count, 1)
    index = check_int(fn, "process_index", process_index, 0)
    if index >= count:
        raise ValueError(f"{fn}: `process_index` ({index}) must be below process_count ({count})")
    return index, count


class IndexSampler(abc.ABC):
    """A sampler from a draw of indices per step: padding, process pieces, iteration, accounting record.

    Subclasses implement :meth:`draw` and :meth:`dp_event` (and set
    ``expected_batch_size``; ``neighboring`` defaults to ``'add_or_remove'``);
    they get :class:`BatchSampler`'s other members.

    Args:
      dataset_size: :math:`n \\ge 1`.
      steps: :math:`T \\ge 0`.
      max_batch_size: the padded size :math:`m` of the global batch (a multiple
        of ``process_count``).
      seed: an int :math:`\\ge 0`.
      process_index, process_count: which piece of the global batch this process
        gets, and into how many pieces it is cut; default ``jax.process_index()``
        and ``jax.process_count()``.
    """

    neighboring: str = "add_or_remove"
    expected_batch_size: float
    bucket_sizes: tuple[int, ...]

    def __init__(
        self,
        dataset_size: int,
        *,
        steps: int,
        max_batch_size: int,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        fn = type(self).__name__
        self.dataset_size = check_int(fn, "dataset_size", dataset_size, 1)
        self.steps = check_int(fn, "steps", steps, 0)
        self.seed = check_int(fn, "seed", seed, 0)
        self.process_index, self.process_count = processes(fn, process_index, process_count)
        self.max_batch_size = check_int(fn, "max_batch_size", max_batch_size, 1)
        if self.max_batch_size % self.process_count:
            raise ValueError(
                f"{fn}: `max_batch_size` ({self.max_batch_size}) must be a multiple of process_count "
                f"({self.process_count})"
            )
        self.local_batch_size = self.max_batch_size // self.process_count
        self.bucket_sizes = (self.max_batch_size,)

    @abc.abstractmethod
    def draw(self, step: int) -> np.ndarray:
        """The sorted global indices of step ``step`` (unpadded, at most ``max_batch_size``)."""

    @abc.abstractmethod
    def dp_event(self, noise_multiplier: float) -> Any:
        """The ``dp_accounting.DpEvent`` of one step at noise multiplier :math:`z`."""

    def plan(self) -> dict[str, Any]:
        """The sampling's identity for resume checks: the class, sizes and seed."""
        return {
            "sampler": type(self).__name__,
            "max_batch_size": self.max_batch_size,
            "seed": self.seed,
        }

    def accounting(self) -> dict[str, Any]:
        """``{'sampler': self}``: the accountant records this sampler's :meth:`dp_event`."""
        return {"sampler": self}

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[SampledBatch]:
        for t in range(self.steps):
            yield self.batch(t)

    def gather(self, data: Any, batch: SampledBatch) -> tuple[Any, np.ndarray]:
        """``(data[indices], mask)``: the step's input from host data (examples on axis 0).

        :meth:`gradclip_jax.dp.PrivateTraining.batches` calls this; a sampler
        whose rows are groups of examples lays them out here. Padding rows are
        zeros (:func:`gathered`), not copies of an example.
        """
        return gathered(data, batch.indices, batch.mask), batch.mask

    def padded_size(self, num_examples: int) -> int:
        """The global padded size for a draw of ``num_examples`` (the smallest bucket it fits)."""
        for b in self.bucket_sizes:
            if num_examples <= b:
                return b
        return self.max_batch_size

    def global_batch(self, step: int) -> SampledBatch:
        """The whole padded batch of ``step`` (every process's piece, in process order)."""
        chosen = np.asarray(self.draw(step), np.int32)
        if len(chosen) > self.max_batch_size:
            raise ValueError(
                f"{type(self).__name__}.draw: step {step} drew {len(chosen)} indices, more than "
                f"max_batch_size={self.max_batch_size}"
            )
        size = self.padded_size(len(chosen))
        indices = np.zeros(size, np.int32)
        indices[: len(chosen)] = chosen
        mask = np.zeros(size, bool)
        mask[: len(chosen)] = True
        return SampledBatch(indices=indices, mask=mask, step=int(step))

    def batch(self, step: int) -> SampledBatch:
        """This process's piece of the padded batch of ``step`` (rows of ``example_mask`` too, if any)."""
        full = self.global_batch(check_int(f"{type(self).__name__}.batch", "step", step, 0))
        piece = len(full.indices) // self.process_count
        sl = slice(self.process_index * piece, (self.process_index + 1) * piece)
        example_mask = None if full.example_mask is None else full.example_mask[sl]
        return SampledBatch(
            indices=full.indices[sl], mask=full.mask[sl], step=full.step, example_mask=example_mask
        )
