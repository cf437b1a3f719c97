"""Private training in one call: calibrated noise, Poisson batches, an accountant, a jit-able step.

:func:`make_private` is the JAX counterpart of Opacus'
``PrivacyEngine.make_private_with_epsilon``: from the per-example loss, an optax
optimizer and the run's shape (data set size, expected batch size, steps or
epochs) and privacy target (:math:`\\varepsilon`, :math:`\\delta`, clip norm
:math:`C`), it returns a :class:`PrivateTraining` holding

* ``noise_multiplier``: the smallest :math:`z` whose run spends at most the
  target (:func:`gradclip_jax.privacy.calibrate_noise_multiplier`, PLD);
* ``sampler``: a :class:`gradclip_jax.dp.PoissonSampler` (fixed shapes), or
  the :class:`gradclip_jax.dp.BatchSampler` you pass as ``sampler=``: the
  noise is calibrated for, and the accountant records, its ``dp_event``;
* ``accountant``: a :class:`gradclip_jax.privacy.PrivacyAccountant` that
  :meth:`PrivateTraining.batches` fills one step per batch;
* ``step(params, opt_state, batch, mask, key) -> (params, opt_state, metrics)``:
  one DP-SGD step, pure and jit-compatible:

  .. math:: \\tilde g = \\frac{1}{qn}\\Big(\\sum_{i:\\ \\text{mask}_i} g_i
      \\min\\big(1, \\tfrac{C}{\\|g_i\\|_2}\\big) + \\mathcal{N}(0, z^2C^2 I)\\Big),
      \\qquad (u, s) = \\text{optimizer.update}(\\tilde g, s, \\theta),
      \\qquad \\theta \\leftarrow \\theta + u

  with the clipped sum from :func:`gradclip_jax.clipped_grad` (``method='auto'``
  by default) and the noise from :func:`gradclip_jax.privacy.add_gaussian_noise`.
  The sum is divided by the **expected** batch size :math:`qn`, a public
  constant (the actual batch size is not public under Poisson sampling); the
  noise's :math:`C` is the sum's sensitivity under the sampler's neighbouring
  relation (:math:`2C` for ``'replace'``).

**Large logical batches.** With ``physical_batch_size=p``, the step still takes
the whole padded logical batch, but computes the clipped sum ``p`` examples at a
time (a sequential ``lax.scan`` inside :func:`gradclip_jax.clipped_grad`), so peak
memory scales with ``p``, and adds the noise **once** to the sum of all pieces.
When even the logical batch's data cannot be on the device at once, accumulate
on the host: add the ``clipped_sum(params, piece, piece_mask)`` of the pieces
(tree sums) and call ``noisy_update`` once per logical step. Do **not** wrap a
noising transform in ``optax.MultiSteps``: it averages the updates it is given,
which divides the signal by the number of pieces but not the noise;
:func:`gradclip_jax.dp.dp_noise` raises inside it.

**Several devices and processes.** Under ``jax.jit`` with the batch sharded over
devices (one global array, e.g. from ``jax.make_array_from_process_local_data``
with the pieces the sampler gives each process) every example is clipped on the
device that holds it, the cross-device sum comes after, and the noise is drawn
once from the (replicated) ``key``: every device and process adds the same
noise, as in a single-process run.

Nothing is hidden: the step's state is ``params`` and ``opt_state`` (pytrees)
and the ``key`` you pass; the accountant is a host-side record.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.validation import check_int, check_mask, check_number, clip_norm_arg
from gradclip_jax.dp.accounting import PrivacyAccountant, calibrate
from gradclip_jax.dp.accounting._accountants import _dp_accounting
from gradclip_jax.dp.batch_selection import BatchSampler, check_sampler
from gradclip_jax.dp.noise import add_gaussian_noise
from gradclip_jax.dp.sampling import PoissonSampler, _rate
from gradclip_jax.per_example import ClippedGradFn, ClippedGradInfo, clipped_grad
from gradclip_jax.per_example.internal import Method

__all__ = ["PrivacyBudgetError", "PrivacyBudgetWarning", "PrivateStepMetrics", "PrivateTraining", "make_private"]


class PrivacyBudgetError(RuntimeError):
    """A step was to be recorded beyond the run :func:`make_private` calibrated: it would spend
    more than the target epsilon. Pass ``allow_beyond_plan=True`` to record it anyway."""


class PrivacyBudgetWarning(UserWarning):
    """A step was recorded beyond the planned run (``allow_beyond_plan=True``); says the epsilon spent."""


_STATE_FORMAT = "gradclip_jax.make_private/1"
# the arguments of make_private that build its default PoissonSampler
_POISSON_ARGS = ("dataset_size", "expected_batch_size", "sample_rate", "steps", "epochs", "seed",
                 "max_batch_size", "on_overflow", "accountant", "process_index", "process_count")


class PrivateStepMetrics(NamedTuple):
    """What the private step reports. **Not privatized**: do not release these.

    Attributes:
      loss: mean loss over the real (unmasked) examples of the batch.
      num_clipped: the number of real examples whose gradient was clipped.
      grad_norm: the L2 norm of the noised, averaged gradient (a function of
        the released gradient only: this one may be released).
    """

    loss: jax.Array
    num_clipped: jax.Array
    grad_norm: jax.Array


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
        :class:`gradclip_jax.dp.PoissonSampler`).
      accountant: the :class:`gradclip_jax.privacy.PrivacyAccountant`
        (:meth:`batches` records into it).
      optimizer: the optax optimizer applied to the privatized gradient.
      grad_fn: the :func:`gradclip_jax.clipped_grad` function.
      init: ``init(params) -> opt_state``.
      step: ``step(params, opt_state, batch, mask, key) -> (params, opt_state,
        metrics)``, with ``metrics`` a :class:`PrivateStepMetrics`.
      clipped_sum: ``clipped_sum(params, batch, mask) -> (sum, info)``: the
        clipped sum of a (piece of a) batch, for host-side accumulation.
      noisy_update: ``noisy_update(params, opt_state, summed, key) ->
        (params, opt_state, grad_norm)``: noise once, divide by the expected
        batch size, apply the optimizer.
      allow_beyond_plan: record steps beyond ``steps`` with a
        :class:`PrivacyBudgetWarning` instead of a :class:`PrivacyBudgetError`.
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

    def record_step(self) -> None:
        """Records one step in the accountant (:meth:`batches` calls it for you).

        Raises:
          PrivacyBudgetError: when the planned ``steps`` are all recorded already (the run
            was calibrated for that many), unless ``allow_beyond_plan``: then the step is
            recorded with a :class:`PrivacyBudgetWarning` stating the epsilon spent.
        """
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
                PrivacyBudgetWarning, stacklevel=2,
            )

    def batches(self, data: Any = None, *, progress: bool = False) -> Iterator[Any]:
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
            epsilon spent so far (refreshed at most once a second, when that
            costs at most a tenth of the time between refreshes, and when the
            iteration ends).

        Yields:
          With ``data``: ``(batch, mask)``, numpy pytrees of this process's
          piece (the sampler's ``gather(data, batch)`` where it has one: a
          :class:`gradclip_jax.dp.UserPoissonSampler` gives a
          :class:`gradclip_jax.dp.UserBatch` and the mask of its users). Without: the sampler's :class:`gradclip_jax.dp.SampledBatch`\\ es.

        Raises:
          ValueError: naming ``dataset_size`` and the leaf, when a leaf of ``data``
            has another number of rows (rows past ``dataset_size`` would never be
            sampled; fewer rows would fail at an index).
          ImportError: with ``progress=True`` when ``tqdm`` is not installed.
        """
        if data is not None:
            _check_rows(data, self.sampler.dataset_size)
        bar = _EpsilonBar(self) if progress else None
        try:
            for t in range(self.accountant.steps, self.steps):
                self.record_step()
                b = self.sampler.batch(t)
                if data is None:
                    yield b
                else:
                    yield _gather(self.sampler, data, b)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()

    def plan(self) -> dict[str, Any]:
        """The run's plan: what :func:`make_private` was given and calibrated (plain Python values).

        ``dataset_size``, ``sample_rate``, ``steps``, ``target_epsilon``,
        ``delta``, ``l2_clip_norm``, ``accountant``, the sampler's ``plan()``
        (a :class:`gradclip_jax.dp.PoissonSampler`'s: ``max_batch_size``,
        ``on_overflow``, ``seed``) and the calibrated ``noise_multiplier``.
        """
        plan = _plan(self.sampler, self.steps, self.target_epsilon, self.delta, self.l2_clip_norm,
                     self.accountant.accountant)
        return {**plan, "noise_multiplier": float(self.noise_multiplier)}

    def state_dict(self) -> dict[str, Any]:
        """Everything besides ``params`` and ``opt_state`` needed to continue the run.

        A dict of plain Python ints, floats, strings, lists and ``None``:

        * ``'plan'``: :meth:`plan` (checked on resume: the same arguments give
          the same calibrated noise multiplier);
        * ``'accountant'``: the accountant's record
          (:meth:`gradclip_jax.privacy.PrivacyAccountant.state_dict`: its phases);
        * ``'sampler'``: ``{'seed': ..., 'steps_taken': ...}`` (step ``t``'s
          batch is a function of ``(seed, t)``, so this is all of the sampler's
          state).

        It round-trips exactly through ``pickle`` and through JSON: save it with
        ``orbax.checkpoint.args.JsonSave`` next to ``StandardSave(params,
        opt_state)`` in a ``Composite`` (Python floats are written with all
        their digits, so every float comes back bit for bit). Continue with
        ``make_private(..., resume_from=state)``.

        Example:
          >>> import jax.numpy as jnp, optax, pickle
          >>> from gradclip_jax.dp import make_private
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
        return {
            "format": _STATE_FORMAT,
            "plan": self.plan(),
            "accountant": self.accountant.state_dict(),
            "sampler": {"seed": self.sampler.plan().get("seed"), "steps_taken": int(self.accountant.steps)},
        }

    def epsilon(self, delta: float | None = None) -> float:
        """The :math:`\\varepsilon` spent so far (recorded steps) at ``delta`` (default: the target's)."""
        return self.accountant.epsilon(self.delta if delta is None else delta)


def _gather(sampler: BatchSampler, data: Any, b: Any) -> tuple[Any, Any]:
    """The sampler's layout of a step (``gather``), else ``data[indices]`` (a protocol sampler without one)."""
    gather = getattr(sampler, "gather", None)
    if gather is not None:
        return gather(data, b)  # type: ignore[no-any-return]
    return jax.tree.map(lambda x: np.asarray(x)[b.indices], data), b.mask


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
        self.cost, self.last = 0.0, time.perf_counter()
        self._show()

    def _show(self) -> None:
        t0 = time.perf_counter()
        eps = self.priv.epsilon()
        self.last = time.perf_counter()
        self.cost = self.last - t0
        self.bar.set_postfix_str(f"epsilon {eps:.3g} of {self.priv.target_epsilon:g}")

    def update(self) -> None:
        self.bar.update(1)
        # the accountant's epsilon can take a fraction of a second: refreshed at most once a
        # second and at most ~10% of the run's time; the last one when the bar closes
        if time.perf_counter() - self.last >= max(1.0, 10 * self.cost):
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


def _check_resume(state: Any, plan: dict[str, Any]) -> None:
    """ValueError naming ``resume_from`` and the field, when ``state`` is not a state_dict of this plan.

    ``plan`` may lack ``noise_multiplier`` (checked after calibration).
    """
    fn = "make_private"
    keys = ("format", "plan", "accountant", "sampler")
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise ValueError(
            f"{fn}: `resume_from` must be a dict from PrivateTraining.state_dict() (keys {keys}), "
            f"got {type(state).__name__}"
        )
    if state["format"] != _STATE_FORMAT:
        raise ValueError(f"{fn}: `resume_from` has format {state['format']!r}, expected {_STATE_FORMAT!r}")
    saved = state["plan"]
    for name, value in plan.items():
        if name not in saved:
            raise ValueError(f"{fn}: `resume_from` has no plan field {name!r}")
        old = saved[name]
        numeric = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
        same = (not isinstance(old, (str, bool)) and isinstance(old, (int, float, np.integer, np.floating))
                and float(old) == float(value)) if numeric else old == value
        if not same:
            raise ValueError(
                f"{fn}: `resume_from` was saved by another plan: {name}={old!r} there, {value!r} in this "
                f"call. Resume with the arguments of the interrupted run (the same arguments calibrate "
                "the same noise multiplier and draw the same batches)"
            )
    taken = state["sampler"].get("steps_taken") if isinstance(state["sampler"], dict) else None
    recorded = sum(int(p[2]) for p in state["accountant"].get("phases", ()))
    if taken != recorded or taken > plan["steps"]:
        raise ValueError(
            f"{fn}: `resume_from` is inconsistent: the sampler took {taken!r} steps, the accountant "
            f"recorded {recorded} (plan: {plan['steps']} steps)"
        )


def _plan(sampler: BatchSampler, steps: int, target_epsilon: float, delta: float, clip: float,
          accountant: str) -> dict[str, Any]:
    """The run's plan (plain values) without the noise multiplier: checked on resume."""
    return {
        "dataset_size": int(sampler.dataset_size), "sample_rate": _sample_rate(sampler), "steps": int(steps),
        "target_epsilon": float(target_epsilon), "delta": float(delta), "l2_clip_norm": float(clip),
        "accountant": str(accountant).lower(), **sampler.plan(),
    }


def _sample_rate(sampler: BatchSampler) -> float:
    """The sampler's rate: a Poisson sampler's own (exact, as saved in plans), else expected size / n."""
    q = getattr(sampler, "sample_rate", None)
    return float(sampler.expected_batch_size) / sampler.dataset_size if q is None else float(q)


def _poisson_sampler(fn: str, a: dict[str, Any]) -> PoissonSampler:
    """make_private's default sampler, from its Poisson arguments ``a`` (by name)."""
    n = check_int(fn, "dataset_size", a["dataset_size"], 1)
    q = _rate(fn, n, a["expected_batch_size"], a["sample_rate"])
    if (a["steps"] is None) == (a["epochs"] is None):
        raise ValueError(f"{fn}: give exactly one of `steps` and `epochs`")
    if a["steps"] is not None:
        t = check_int(fn, "steps", a["steps"], 1)
    else:
        e = check_number(fn, "epochs", a["epochs"], low=0.0, low_inclusive=False, allow_inf=False)
        t = max(1, math.ceil(e / q - 1e-9))
    if a["on_overflow"] == "truncate" and str(a["accountant"]).lower() != "pld":
        raise ValueError(
            f"{fn}: on_overflow='truncate' needs accountant='pld' (dp-accounting has no RDP bound for "
            f"truncated Poisson sampling), got accountant={a['accountant']!r}"
        )
    return PoissonSampler(
        n, steps=t, sample_rate=q, seed=a["seed"], max_batch_size=a["max_batch_size"],
        on_overflow=a["on_overflow"], process_index=a["process_index"], process_count=a["process_count"],
    )


def _given_sampler(fn: str, sampler: Any, a: dict[str, Any]) -> BatchSampler:
    """A ``sampler=`` checked against the Poisson arguments, which it replaces."""
    check_sampler(fn, sampler)
    defaults = {"expected_batch_size": None, "sample_rate": None, "epochs": None, "max_batch_size": None,
                "process_index": None, "process_count": None, "on_overflow": "raise", "seed": 0}
    clash = [k for k, v in defaults.items() if a[k] != v]
    if clash:
        raise ValueError(f"{fn}: with `sampler`, leave {', '.join(f'`{k}`' for k in clash)} out: the sampler "
                         "decides its rate, size, seed and processes")
    for name in ("dataset_size", "steps"):
        if a[name] is not None and a[name] != getattr(sampler, name):
            raise ValueError(f"{fn}: `{name}`={a[name]!r}, but the sampler's is {getattr(sampler, name)!r}")
    check_int(fn, "sampler.steps", sampler.steps, 1)
    return sampler  # type: ignore[no-any-return]


def _batch_rows(batch: Any) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves or not all(getattr(x, "ndim", 0) >= 1 for x in leaves):
        raise ValueError("make_private step: every leaf of `batch` needs a leading batch axis")
    return int(leaves[0].shape[0])


class _StepFunctions(NamedTuple):
    init: Callable[[Any], Any]
    step: Callable[..., tuple[Any, Any, PrivateStepMetrics]]
    clipped_sum: Callable[..., tuple[Any, ClippedGradInfo]]
    noisy_update: Callable[..., tuple[Any, Any, jax.Array]]


def _step_functions(grad_fn: ClippedGradFn, optimizer: optax.GradientTransformation, std: float,
                    divisor: float) -> _StepFunctions:
    """The pure, jit-able functions of a run: noise of standard deviation ``std``, sum over ``divisor``."""

    def init(params: Any) -> Any:
        return optimizer.init(params)

    def clipped_sum(params: Any, batch: Any, mask: Any) -> tuple[Any, ClippedGradInfo]:
        if mask is None:  # the sampler's padding mask: a step without one would count padding rows
            raise TypeError("make_private step: `mask` is required (the mask of the sampler's batch)")
        mask = check_mask("make_private step", mask, _batch_rows(batch))
        return grad_fn(params, batch, mask=mask)

    def noisy_update(params: Any, opt_state: Any, summed: Any, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        noised = add_gaussian_noise(summed, std, key)
        grads = jax.tree.map(
            lambda g, p: (g / jnp.asarray(divisor, g.dtype)).astype(jnp.asarray(p).dtype), noised, params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, _norms.tree_norm(grads)

    def step(params: Any, opt_state: Any, batch: Any, mask: Any, key: jax.Array) -> tuple[Any, Any, PrivateStepMetrics]:
        summed, info = clipped_sum(params, batch, mask)
        params, opt_state, gnorm = noisy_update(params, opt_state, summed, key)
        m = jnp.asarray(mask)
        real = jnp.maximum(jnp.sum(m), 1)
        loss = jnp.sum(jnp.where(m, info.values, 0)) / real
        return params, opt_state, PrivateStepMetrics(loss=loss, num_clipped=info.num_clipped, grad_norm=gnorm)

    return _StepFunctions(init, step, clipped_sum, noisy_update)


def make_private(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    dataset_size: int | None = None,
    target_epsilon: float,
    delta: float,
    l2_clip_norm: float | None = None,
    expected_batch_size: float | None = None,
    sample_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    seed: int = 0,
    max_batch_size: int | None = None,
    physical_batch_size: int | None = None,
    on_overflow: str = "raise",
    accountant: str = "pld",
    method: str = "auto",
    process_index: int | None = None,
    process_count: int | None = None,
    l2_norm_clip: float | None = None,
    allow_beyond_plan: bool = False,
    resume_from: dict[str, Any] | None = None,
    sampler: BatchSampler | None = None,
) -> PrivateTraining:
    """Calibrates and builds a private training run (see the module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch) -> (B,)`` per-example losses (as
        :func:`gradclip_jax.clipped_grad`).
      optimizer: an optax ``GradientTransformation`` applied to the privatized
        (noised, averaged) gradient: post-processing, so any optimizer is fine.
      dataset_size: :math:`n` (with ``sampler``: optional, the sampler's).
      target_epsilon: :math:`\\varepsilon > 0` for the whole run.
      delta: :math:`\\delta \\in (0, 1)`; a warning when :math:`\\delta \\ge 1/n`.
      l2_clip_norm: :math:`C > 0`.
      expected_batch_size: :math:`qn` (give this or ``sample_rate``).
      sample_rate: :math:`q \\in (0, 1]` (give this or ``expected_batch_size``).
      steps: the number of logical steps :math:`T` (give this or ``epochs``;
        with ``sampler``: optional, the sampler's ``steps``).
      epochs: passes over the data set, :math:`T = \\lceil \\text{epochs}/q \\rceil`.
      seed: the sampler's seed (the noise key is an argument of ``step``).
      max_batch_size, on_overflow: the padded size and overflow rule of the
        :class:`gradclip_jax.dp.PoissonSampler` (default: the overflow
        probability of the whole run is at most 1e-9, and an overflow raises).
      physical_batch_size: compute the clipped sum this many examples at a time
        (``clipped_grad``'s ``microbatch_size``); the noise is still added once
        per logical step.
      accountant: ``'pld'`` (default) or ``'rdp'``: used for calibration and by
        the returned accountant.
      method: ``clipped_grad``'s method (default ``'auto'``).
      process_index, process_count: passed to the sampler (defaults from jax).
      l2_norm_clip: optax's spelling of ``l2_clip_norm`` (the canonical one),
        accepted without a warning, as everywhere in the DP API; give one of the two.
      allow_beyond_plan: let :meth:`PrivateTraining.record_step` record steps
        beyond ``steps`` (each with a :class:`PrivacyBudgetWarning` stating the
        epsilon spent); by default such a step is a :class:`PrivacyBudgetError`.
      resume_from: a :meth:`PrivateTraining.state_dict` of an interrupted run:
        its plan must equal this call's (a ``ValueError`` names the differing
        field), its accountant record is restored, and
        :meth:`PrivateTraining.batches` goes on with the next step. With the
        saved ``params`` and ``opt_state`` (and the same noise keys per step),
        the resumed run is the uninterrupted one.
      sampler: ``None`` (default: a :class:`gradclip_jax.dp.PoissonSampler`
        from the arguments above), or any :class:`gradclip_jax.dp.BatchSampler`:
        the noise is calibrated for ``steps`` of its ``dp_event``, the
        accountant records its steps, the noised sum is divided by its
        ``expected_batch_size`` and the noise scales with the sensitivity
        under its ``neighboring`` relation. It replaces ``expected_batch_size``,
        ``sample_rate``, ``epochs``, ``max_batch_size``, ``on_overflow``,
        ``seed`` and the process arguments (a ``ValueError`` names any given).

    Returns:
      A :class:`PrivateTraining`.

    Raises:
      ValueError: naming the argument: a ``resume_from`` of another plan, a rate outside (0, 1], a
        ``max_batch_size`` below the expected batch size, an unreachable
        ``target_epsilon``, both or neither of ``steps``/``epochs``, a bad clip
        norm; the step raises for a ``mask`` of the wrong shape.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from gradclip_jax.dp import make_private
      >>> x = np.random.default_rng(0).normal(size=(1000, 3)).astype(np.float32)
      >>> data = {'x': x, 'y': x @ np.array([1.0, -2.0, 0.5], np.float32)}
      >>> def loss_fn(w, batch):
      ...     return 0.5 * (batch['x'] @ w - batch['y']) ** 2
      >>> priv = make_private(loss_fn, optax.sgd(0.5), dataset_size=1000, expected_batch_size=100,
      ...                     steps=50, target_epsilon=2.0, delta=1e-4, l2_clip_norm=1.0,
      ...                     process_index=0, process_count=1)
      >>> step = jax.jit(priv.step)
      >>> w, state, key = jnp.zeros(3), priv.init(jnp.zeros(3)), jax.random.key(0)
      >>> for batch, mask in priv.batches(data):
      ...     key, sub = jax.random.split(key)
      ...     w, state, metrics = step(w, state, batch, mask, sub)
      >>> priv.accountant.steps, priv.epsilon() <= 2.0
      (50, True)
    """
    fn = "make_private"
    l2_clip_norm = clip_norm_arg(fn, l2_clip_norm, l2_norm_clip)
    if not callable(loss_fn):
        raise TypeError(f"{fn}: `loss_fn` must be callable, got {loss_fn!r}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"{fn}: `optimizer` must be an optax GradientTransformation, got {optimizer!r}")
    methods = tuple(m.value for m in Method)
    if method not in methods:  # before the calibration, which can take seconds
        raise ValueError(f"{fn}: `method` must be one of {methods}, got {method!r}")
    args = {k: v for k, v in locals().items() if k in _POISSON_ARGS}
    sampler = _poisson_sampler(fn, args) if sampler is None else _given_sampler(fn, sampler, args)
    n, t, divisor = sampler.dataset_size, sampler.steps, float(sampler.expected_batch_size)
    for name, v in (("target_epsilon", target_epsilon), ("l2_clip_norm", l2_clip_norm)):
        check_number(fn, name, v, low=0.0, low_inclusive=False, allow_inf=False)
    check_number(fn, "delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    # the protected units: users under user-level DP (a sampler with num_users), else examples
    users = getattr(sampler, "num_users", None)
    what, units = ("dataset_size", n) if users is None else ("num_users", int(users))
    if delta >= 1.0 / units:
        warnings.warn(
            f"{fn}: `delta`={delta:g} >= 1/{what}={1.0 / units:g}: a mechanism that publishes one "
            "random unit (example, or user) outright meets such a delta; use delta well below 1/n",
            UserWarning,
            stacklevel=2,
        )
    if physical_batch_size is not None:
        physical_batch_size = check_int(fn, "physical_batch_size", physical_batch_size, 1)
    plan = _plan(sampler, t, target_epsilon, delta, l2_clip_norm, accountant)
    if resume_from is not None:
        _check_resume(resume_from, plan)  # before the calibration, which can take seconds

    compose = _dp_accounting().SelfComposedDpEvent

    def event(z: float) -> Any:  # the whole run: the sampler's step, T times
        return compose(sampler.dp_event(z), t)

    rel = sampler.neighboring
    z = calibrate(event, float(target_epsilon), float(delta), accountant, fn=fn, neighboring=rel)
    planned = PrivacyAccountant(accountant, rel)
    planned.step(z, **sampler.accounting(), steps=t)
    planned_eps = planned.epsilon(delta)
    acc = PrivacyAccountant(accountant, rel)
    if resume_from is not None:
        _check_resume(resume_from, {**plan, "noise_multiplier": z})
        acc.load_state_dict(resume_from["accountant"], sampler=sampler)

    grad_fn = clipped_grad(loss_fn, l2_clip_norm, microbatch_size=physical_batch_size, method=method)
    std = z * float(grad_fn.sensitivity(rel))

    init, step, clipped_sum, noisy_update = _step_functions(grad_fn, optimizer, std, divisor)

    return PrivateTraining(
        noise_multiplier=z, l2_clip_norm=float(l2_clip_norm), sample_rate=_sample_rate(sampler),
        expected_batch_size=divisor,
        steps=t, target_epsilon=float(target_epsilon), delta=float(delta), planned_epsilon=planned_eps,
        sampler=sampler, accountant=acc, optimizer=optimizer, grad_fn=grad_fn,
        init=init, step=step, clipped_sum=clipped_sum, noisy_update=noisy_update,
        allow_beyond_plan=bool(allow_beyond_plan),
    )
