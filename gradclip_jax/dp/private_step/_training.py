"""A private run on the host: its batches, each step recorded in the accountant before it is
released (within the planned steps), its progress, plan and state for checkpoints."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax

from gradclip_jax.dp.accounting import PrivacyAccountant
from gradclip_jax.dp.hardened import BitGenerator, os_key
from gradclip_jax.dp.private_step._releases import ReleaseLog
from gradclip_jax.dp.private_step._resume import STATE_FORMAT, run_plan
from gradclip_jax.dp.private_step._step import PrivateStepMetrics
from gradclip_jax.dp.sampling.protocol import BatchSampler, gathered
from gradclip_jax.per_example.api import ClippedGradFn, ClippedGradInfo


class PrivacyBudgetError(RuntimeError):
    """A step was to be recorded beyond the run :func:`make_private` calibrated: it would spend
    more than the target epsilon (pass ``allow_beyond_plan=True`` to record it anyway); or more
    noisy updates ran than steps were recorded, or a noise key was used twice: then no epsilon
    the accountant gives is the guarantee of what ran."""


class PrivacyBudgetWarning(UserWarning):
    """A step was recorded beyond the planned run (``allow_beyond_plan=True``); says the epsilon spent."""


@dataclasses.dataclass(frozen=True)
class PrivateTraining:
    """A private training setup from :func:`make_private` (see the module docstring).

    Attributes:
      noise_multiplier: the calibrated :math:`z`.
      l2_clip_norm: :math:`C`.
      sample_rate: :math:`q`.
      expected_batch_size: :math:`qn` (the divisor of the noised sum).
      steps: the number of (logical) steps the run was calibrated for.
      target_epsilon, delta: the privacy target.
      planned_epsilon: the :math:`\\varepsilon` at ``delta`` of ``steps`` steps
        at ``noise_multiplier`` (at most ``target_epsilon``).
      sampler: the :class:`gradclip_jax.dp.BatchSampler` (by default a
        :class:`gradclip_jax.PoissonSampler`).
      accountant: the :class:`gradclip_jax.PrivacyAccountant`
        (:meth:`batches` records into it).
      optimizer: the optax optimizer applied to the privatized gradient.
      grad_fn: the :func:`gradclip_jax.clipped_grad` function.
      init: ``init(params) -> opt_state``.
      step: ``step(params, opt_state, batch, mask, key) -> (params, opt_state,
        metrics)``, with ``metrics`` a :class:`PrivateStepMetrics`. Jitted: call it
        directly (compiled on the first call, without a host callback, so JAX's
        persistent cache keeps it), or inside your own transformations;
        ``step.lower(...).compile()`` compiles it ahead.
      clipped_sum: ``clipped_sum(params, batch, mask) -> (sum, info)``: the
        clipped sum of a (piece of a) batch, for host-side accumulation.
      noisy_update: ``noisy_update(params, opt_state, summed, key) ->
        (params, opt_state, grad_norm)``: noise once, divide by the expected
        batch size, apply the optimizer (jitted, as ``step``).
      allow_beyond_plan: record steps beyond ``steps`` with a
        :class:`PrivacyBudgetWarning` instead of a :class:`PrivacyBudgetError`.
      hardened: ``None``, or the hardened mode (``'sum_of_normals'``, ``'discrete'``).
      rng: a hardened run's generator (``None``: the OS's entropy), read by :meth:`noise_key`.
      grid_scale: ``hardened='discrete'``'s grid scale (else ``None``).
      releases: the host's count of the executed ``noisy_update`` calls (and ``step`` calls) and
        their keys (:mod:`gradclip_jax.dp.private_step._releases`): :meth:`epsilon`,
        :meth:`state_dict` and :meth:`batches` refuse to go on when more ran than were recorded,
        or a key was used twice (``None``: not checked).
      recorded_before: the steps the accountant held when the run was built (a resumed run's:
        they ran before).
    """

    noise_multiplier: float
    l2_clip_norm: float
    sample_rate: float
    expected_batch_size: float
    steps: int
    target_epsilon: float
    delta: float
    planned_epsilon: float
    sampler: BatchSampler
    accountant: PrivacyAccountant
    optimizer: optax.GradientTransformation
    grad_fn: ClippedGradFn
    init: Callable[[Any], Any]
    step: Callable[..., tuple[Any, Any, PrivateStepMetrics]]
    clipped_sum: Callable[..., tuple[Any, ClippedGradInfo]]
    noisy_update: Callable[..., tuple[Any, Any, jax.Array]]
    allow_beyond_plan: bool = False
    hardened: str | None = None
    rng: BitGenerator | None = None
    grid_scale: float | None = None
    releases: ReleaseLog | None = None
    recorded_before: int = 0

    def noise_key(self) -> jax.Array:
        """A fresh noise key for one ``step``, its bits from the OS's entropy (or the run's ``rng``).

        Call it on the host once per step (outside ``jax.jit``) and pass it as ``step``'s ``key``:
        the noise is then never derived from an integer anyone chose.

        Example:
          >>> import jax.numpy as jnp, optax
          >>> from gradclip_jax import make_private
          >>> priv = make_private(lambda w, b: (b @ w) ** 2, optax.sgd(0.1), dataset_size=100,
          ...                     expected_batch_size=10, steps=2, target_epsilon=8.0, delta=1e-3,
          ...                     l2_clip_norm=1.0, hardened=True, process_index=0, process_count=1)
          >>> key = priv.noise_key()
          >>> priv.plan()['hardened'], priv.plan()['seed'] != 0
          ('sum_of_normals', True)
        """
        return os_key(self.rng)

    def record_step(self) -> None:
        """Records one step in the accountant (:meth:`batches` calls it for you).

        Raises:
          PrivacyBudgetError: when the planned ``steps`` are all recorded already (the run
            was calibrated for that many), unless ``allow_beyond_plan``: then the step is
            recorded with a :class:`PrivacyBudgetWarning` stating the epsilon spent; as
            :meth:`check_releases` (without waiting for the updates in flight).
        """
        self.check_releases(wait=False)
        done = self.accountant.steps
        if done >= self.steps and not self.allow_beyond_plan:
            raise PrivacyBudgetError(
                f"make_private: step {done + 1} would go beyond the planned {self.steps} steps, calibrated "
                f"for epsilon={self.target_epsilon:g} at delta={self.delta:g}: recording it would spend more. "
                "Build a new run for more steps, or pass allow_beyond_plan=True to make_private to "
                "record it anyway (then a warning reports the epsilon spent)"
            )
        self.accountant.step(self.noise_multiplier, **self.sampler.accounting())
        if done >= self.steps:
            warnings.warn(
                f"make_private: {done + 1} steps recorded, beyond the planned {self.steps}: epsilon spent "
                f"{self.epsilon():.4g} at delta={self.delta:g} (target {self.target_epsilon:g})",
                PrivacyBudgetWarning,
                stacklevel=2,
            )

    def batches(
        self, data: Any = None, *, progress: bool = False, noise_key: jax.Array | None = None
    ) -> Iterator[Any]:
        """The run's batches; records each step in the accountant as it is drawn.

        A step is recorded **before** its batch is yielded, so the accountant
        never reports less than what was released (a batch drawn but not used
        is counted: conservative). The batches start after the steps the
        accountant holds already and end with the planned ``steps``: iterating
        again goes on where the last iteration stopped, and a spent plan yields
        nothing.

        Args:
          data: ``None``, or a pytree of host arrays with the examples on axis 0
            (indexed by the sampler's global indices): every leaf has
            ``dataset_size`` rows.
          progress: show a ``tqdm`` progress bar of the planned steps with the
            epsilon spent so far (refreshed every 1% of the planned steps, so it
            is never more than that behind, and when the iteration ends).
          noise_key: the run's noise key (a ``jax.random`` key): each item
            then ends with its step's key, :meth:`step_key` of its step. The
            keys are a function of the step's number, so a run resumed at
            step ``k`` (``resume_from``) draws the noise of the uninterrupted
            run. Pass the same key after a restart.

        Yields:
          With ``data``: ``(batch, mask)``, numpy pytrees of this process's
          piece (the sampler's ``gather(data, batch)`` where it has one: a
          :class:`gradclip_jax.dp.UserPoissonSampler` gives a
          :class:`gradclip_jax.dp.UserBatch` and the mask of its users). Without: the
          sampler's :class:`gradclip_jax.dp.SampledBatch`\\ es. With ``noise_key``:
          ``(batch, mask, key)``, or ``(sampled_batch, key)`` without ``data``.

        Raises:
          ValueError: naming ``dataset_size`` and the leaf, when a leaf of ``data``
            has another number of rows (rows past ``dataset_size`` would never be
            sampled; fewer rows would fail at an index).
          ImportError: with ``progress=True`` when ``tqdm`` is not installed.
        """
        if data is not None:
            _check_rows(data, self.sampler.dataset_size)
        if noise_key is not None:
            self._check_caller_key()  # before a step is recorded
        bar = _EpsilonBar(self) if progress else None
        try:
            for t in range(self.accountant.steps, self.steps):
                self.record_step()
                b = self.sampler.batch(t)
                item = b if data is None else _gather(self.sampler, data, b)
                if noise_key is not None:
                    key = self.step_key(noise_key, t)
                    item = (item, key) if data is None else (*item, key)
                yield item
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()

    def _check_caller_key(self) -> None:
        if self.hardened is not None:
            raise ValueError(
                "PrivateTraining: a hardened run's noise keys come from the OS: call "
                "priv.noise_key() for each step instead of passing `noise_key`"
            )

    def step_key(self, noise_key: jax.Array, step: int | None = None) -> jax.Array:
        """The noise key of ``step`` (default: the step last recorded, whose batch is in use).

        ``jax.random.fold_in(noise_key, step)``: a function of the step's number
        only, so the same after a resume. :meth:`batches` gives it with each
        batch when passed ``noise_key``; this is the same key as the older idiom
        ``fold_in(noise_key, priv.accountant.steps - 1)`` inside the loop.

        Raises:
          ValueError: without ``step`` before any step is recorded; in a hardened
            run, whose keys come from the OS (:meth:`noise_key`), not from a
            key the caller chose.
        """
        self._check_caller_key()
        if step is None:
            if self.accountant.steps == 0:
                raise ValueError(
                    "PrivateTraining.step_key: no step recorded yet; pass `step`, or call it "
                    "inside the loop over batches()"
                )
            step = self.accountant.steps - 1
        return jax.random.fold_in(noise_key, step)

    def plan(self) -> dict[str, Any]:
        """The run's plan: what :func:`make_private` was given and calibrated (plain Python values).

        ``dataset_size``, ``sample_rate``, ``steps``, ``target_epsilon``,
        ``delta``, ``l2_clip_norm``, ``accountant``, the sampler's ``plan()``
        (a :class:`gradclip_jax.PoissonSampler`'s: ``max_batch_size``,
        ``on_overflow``, ``seed``) and the calibrated ``noise_multiplier``.
        """
        plan = run_plan(
            self.sampler,
            self.steps,
            self.target_epsilon,
            self.delta,
            self.l2_clip_norm,
            self.accountant.accountant,
            self.hardened,
            self.grid_scale,
        )
        return {**plan, "noise_multiplier": float(self.noise_multiplier)}

    def state_dict(self) -> dict[str, Any]:
        """Everything besides ``params`` and ``opt_state`` needed to continue the run.

        A dict of plain Python ints, floats, strings, lists and ``None``:

        * ``'plan'``: :meth:`plan` (checked on resume: the same arguments give
          the same calibrated noise multiplier);
        * ``'accountant'``: the accountant's record
          (:meth:`gradclip_jax.PrivacyAccountant.state_dict`: its phases);
        * ``'sampler'``: ``{'seed': ..., 'steps_taken': ...}`` (step ``t``'s
          batch is a function of ``(seed, t)``, so this is all of the sampler's
          state);
        * ``'noise_keys'``: the noise keys the run's updates used (hex strings):
          the resumed run refuses one used again (``PrivacyBudgetError``), as one
          process does.

        It round-trips exactly through ``pickle`` and through JSON: save it with
        ``orbax.checkpoint.args.JsonSave`` next to ``StandardSave(params,
        opt_state)`` in a ``Composite`` (Python floats are written with all
        their digits, so every float comes back bit for bit). Continue with
        ``make_private(..., resume_from=state)``.

        Example:
          >>> import jax.numpy as jnp, optax, pickle
          >>> from gradclip_jax import make_private
          >>> def loss_fn(w, batch):
          ...     return (batch @ w) ** 2
          >>> kw = dict(dataset_size=100, expected_batch_size=10, steps=4, target_epsilon=8.0,
          ...           delta=1e-3, l2_clip_norm=1.0, process_index=0, process_count=1)
          >>> priv = make_private(loss_fn, optax.sgd(0.1), **kw)
          >>> for batch in priv.batches():
          ...     if priv.accountant.steps == 2:
          ...         break
          >>> state = pickle.loads(pickle.dumps(priv.state_dict()))
          >>> resumed = make_private(loss_fn, optax.sgd(0.1), **kw, resume_from=state)
          >>> [b.step for b in resumed.batches()], resumed.epsilon() == priv.planned_epsilon
          ([2, 3], True)
        """
        self.check_releases()
        return {
            "format": STATE_FORMAT,
            "plan": self.plan(),
            "accountant": self.accountant.state_dict(),
            "sampler": {
                "seed": self.sampler.plan().get("seed"),
                "steps_taken": int(self.accountant.steps),
            },
            # the noise keys used so far: a resumed run that uses one again is refused, as a run
            # that does so in one process is
            "noise_keys": [] if self.releases is None else self.releases.saved(),
        }

    def epsilon(self, delta: float | None = None) -> float:
        """The :math:`\\varepsilon` spent so far (recorded steps) at ``delta`` (default: the target's).

        Raises:
          PrivacyBudgetError: as :meth:`check_releases`: the recorded steps do not cover what ran.
        """
        self.check_releases(warn_unreleased=True)
        return self.accountant.epsilon(self.delta if delta is None else delta)

    def check_releases(self, wait: bool = True, warn_unreleased: bool = False) -> None:
        """Checks that the accountant covers every noisy update that ran (``step`` or
        ``noisy_update``, however jitted): no more of them than recorded steps, and no noise key
        used twice. ``wait``: for the updates dispatched to run first. ``warn_unreleased``
        (:meth:`epsilon`): warn once when two or more drawn batches have had no update.

        Raises:
          PrivacyBudgetError: naming the counts, or the reused key.
        """
        if self.releases is None:
            return
        ran, reused = self.releases.counts(wait)
        recorded = self.accountant.steps - self.recorded_before
        if reused:
            raise PrivacyBudgetError(
                "PrivateTraining: a noise key was used by more than one noisy update that ran: the "
                "same noise added to two sums leaves their difference noise-free, so no epsilon holds "
                "for this run. Give each step a fresh key: batches(noise_key=key) yields each step's "
                "(or priv.step_key(key), priv.noise_key())"
            )
        if warn_unreleased and wait and recorded - ran >= 2 and not self.releases.warned_unreleased:
            self.releases.warned_unreleased = True
            warnings.warn(
                f"PrivateTraining: {recorded - ran} batches drawn from priv.batches() have had no "
                f"noisy update ({recorded} steps recorded, {ran} updates ran). If an update added the "
                "clipped sums of several batches, it released another mechanism than the epsilon "
                "accounts (an example in two of them moves it by 2C; two merged batches per update "
                "gave epsilon 4.71 where 3.00 was reported): make one noisy_update per batch. If the "
                "batches were skipped, the epsilon counts each as released (safe).",
                PrivacyBudgetWarning,
                stacklevel=3,
            )
        if ran > recorded:
            raise PrivacyBudgetError(
                f"PrivateTraining: {ran} noisy updates (step or noisy_update) ran, but the accountant "
                f"recorded {recorded} steps (the batches drawn from priv.batches(), or "
                "priv.record_step()): its epsilon does not cover what ran. A batch used twice (a "
                "cached list of batches trained over again) or a step on a batch not drawn from this "
                "run releases more than a recorded step. Run each step once, on a batch from "
                "priv.batches(); to compile the step without running it, "
                "priv.step.lower(...).compile()"
            )


def _gather(sampler: BatchSampler, data: Any, b: Any) -> tuple[Any, Any]:
    """The sampler's layout of a step (``gather``), else ``data[indices]`` with zero padding rows
    (a protocol sampler without one)."""
    gather = getattr(sampler, "gather", None)
    if gather is not None:
        return gather(data, b)  # type: ignore[no-any-return]
    return gathered(data, b.indices, b.mask), b.mask


class _EpsilonBar:
    """A tqdm bar over the planned steps of a run, with the epsilon spent as its postfix."""

    def __init__(self, priv: PrivateTraining):
        try:
            from tqdm.auto import tqdm
        except ImportError as err:
            raise ImportError(
                "PrivateTraining.batches: `progress=True` needs tqdm: pip install tqdm "
                '(or pip install "gradclip_jax[demo]"); or leave progress=False'
            ) from err
        self.priv = priv
        self.bar = tqdm(total=priv.steps, initial=priv.accountant.steps, desc="private steps")
        # the epsilon shown is at most 1% of the planned steps behind: the accountant extends its
        # composition by the new steps (milliseconds), so this costs about 100 epsilons a run
        self.lag = max(1, priv.steps // 100)
        self.shown_at = -1
        self._show()

    def _show(self) -> None:
        eps = self.priv.epsilon()
        self.shown_at = self.priv.accountant.steps
        self.bar.set_postfix_str(f"epsilon {eps:.3g} of {self.priv.target_epsilon:g}")

    def update(self) -> None:
        self.bar.update(1)
        if self.priv.accountant.steps - self.shown_at >= self.lag:
            self._show()

    def close(self) -> None:
        self._show()
        self.bar.close()


def _check_rows(data: Any, n: int) -> None:
    """ValueError naming ``dataset_size`` and the leaf when a leaf of ``data`` has other than ``n`` rows."""
    for path, x in jax.tree_util.tree_leaves_with_path(data):
        rows = int(np.shape(x)[0]) if np.ndim(x) >= 1 else None
        if rows != n:
            raise ValueError(
                f"make_private: `dataset_size`={n}, but leaf {jax.tree_util.keystr(path) or '(root)'} of "
                f"`data` has {'no batch axis' if rows is None else f'{rows} rows'}: every leaf needs "
                f"dataset_size rows on axis 0 (the sampler draws from indices 0..{n - 1}, and the "
                "accounting assumes exactly those examples)"
            )
