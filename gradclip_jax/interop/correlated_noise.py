"""Correlated (matrix-factorization) noise in a private run: jax-privacy's BandMF, our clipping.

jax-privacy 2.0's ``BandMFExecutionPlanConfig``
(``jax_privacy.experimental.execution_plan``) builds a whole DP-BandMF mechanism
(https://arxiv.org/abs/2306.08153): the examples are split into ``num_bands``
groups and each step Poisson-samples (probability ``sampling_prob``) from one
group in turn (``CyclicPoissonSampling``); the strategy matrix :math:`C` is a
banded Toeplitz matrix with ``num_bands`` bands; the noise multiplier is
calibrated by dp-accounting for the target epsilon (the ``amplified_bandmf_event``:
:math:`\\lceil T / b \\rceil` Poisson-sampled Gaussian releases, as each example
takes part at most once per cycle of ``num_bands`` steps); and an optax-style
transformation (``noise_addition.matrix_factorization_privatizer``) adds the
correlated noise :math:`C^{-1} Z` to the stream of clipped sums, :math:`Z` i.i.d.
Gaussian of standard deviation ``noise_multiplier * sensitivity * ||coef||``.
With ``num_bands=1`` it is DP-SGD.

This module puts gradclip_jax's clipped sums inside that plan:

* :func:`with_gradclip`: a jax-privacy plan whose ``clipped_grad`` is
  :func:`gradclip_jax.interop.jax_privacy.clipped_grad` (ghost clipping where it
  applies) with the plan's clip norm, ``normalize_by``, ``rescale_to_unit_norm``
  and dtype; batches, noise and ``dp_event`` stay jax-privacy's.
* :func:`bandmf_plan`: the recipe from an expected batch size and a target
  epsilon: an :class:`MFPlan` (a ``DPExecutionPlan``) that also carries the
  calibrated noise multiplier and the epsilon dp-accounting gives its event.

Importing this module needs jax-privacy: ``pip install 'gradclip_jax[jax-privacy]'``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import numpy as np

try:
    import dp_accounting
    from jax_privacy import batch_selection
    from jax_privacy.experimental import execution_plan
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "gradclip_jax.interop.correlated_noise needs jax-privacy 2.0: "
        "pip install 'gradclip_jax[jax-privacy]'"
    ) from err

from gradclip_jax.interop import jax_privacy as _dropin

__all__ = ["MFPlan", "bandmf_plan", "with_gradclip"]

_REL = dp_accounting.NeighboringRelation
# our relation names -> (dp-accounting's relation, the partition jax-privacy's plan accepts with it)
_RELATIONS = {
    "add_or_remove": (_REL.ADD_OR_REMOVE_ONE, batch_selection.PartitionType.INDEPENDENT),
    "zero_out": (_REL.REPLACE_SPECIAL, batch_selection.PartitionType.EQUAL_SPLIT),
}
_METHODS = ("auto", "ghost", "vmap")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MFPlan(execution_plan.DPExecutionPlan):
    """A jax-privacy ``DPExecutionPlan`` with gradclip_jax's clipping, and what calibrated it.

    Attributes:
      clipped_grad: ``clipped_grad(loss_fn, **kwargs)``: jax-privacy's signature
        (``batch_argnums``, ``keep_batch_dim``, ...), the plan's clip norm,
        normalisation and dtype filled in; backed by gradclip_jax.
      batch_selection_strategy: jax-privacy's ``CyclicPoissonSampling``:
        ``batch_iterator(num_examples, rng)`` yields each step's indices.
      noise_addition_transform: the optax ``GradientTransformation`` adding the
        correlated noise to each step's clipped sum (``init(params)``, then
        ``update(clipped_sum, state)``).
      dp_event: the ``dp_accounting.DpEvent`` of the whole run.
      noise_multiplier: the calibrated noise multiplier of ``dp_event``.
      epsilon: what a fresh dp-accounting PLD accountant gives ``dp_event`` at ``delta``.
      delta: the target delta.
      sampling_prob: each eligible example's probability of being in a step's batch.
      strategy: the Toeplitz coefficients of :math:`C` (``num_bands`` of them).
      neighboring_relation: the dp-accounting relation of ``epsilon``.
    """

    noise_multiplier: float
    epsilon: float
    delta: float
    sampling_prob: float
    strategy: np.ndarray
    neighboring_relation: Any


def with_gradclip(
    config: execution_plan.BandMFExecutionPlanConfig, method: str = "auto"
) -> execution_plan.DPExecutionPlan:
    """jax-privacy's BandMF plan for ``config`` with gradclip_jax's ``clipped_grad`` inside.

    The batch selection, the noise transformation and the ``dp_event`` are
    ``config.plan``'s; only ``clipped_grad`` changes, to
    :func:`gradclip_jax.interop.jax_privacy.clipped_grad` with the same
    ``l2_clip_norm``, ``normalize_by``, ``rescale_to_unit_norm`` and ``dtype``, and
    it is checked to have the sensitivity the noise was scaled to.

    Args:
      config: a ``jax_privacy.experimental.execution_plan.BandMFExecutionPlanConfig``.
      method: ``'auto'`` (ghost clipping where it applies), ``'ghost'`` or ``'vmap'``.

    Returns:
      A ``DPExecutionPlan``.

    Raises:
      ValueError: ``method`` not one of the three; TypeError: ``config`` of another type.

    Example:
      >>> from jax_privacy.experimental.execution_plan import BandMFExecutionPlanConfig
      >>> config = BandMFExecutionPlanConfig(
      ...     strategy=[0.8, 0.6], iterations=8, noise_multiplier=1.0, epsilon=None,
      ...     delta=None, sampling_prob=0.5, noise_seed=0)
      >>> plan = with_gradclip(config, method='vmap')
      >>> plan.clipped_grad(lambda p, x: (p * x).sum(), batch_argnums=1).sensitivity()
      1.0
    """
    if not isinstance(config, execution_plan.BandMFExecutionPlanConfig):
        raise TypeError(f"with_gradclip: `config` must be a BandMFExecutionPlanConfig, got {type(config).__name__}")
    if method not in _METHODS:
        raise ValueError(f"with_gradclip: `method` must be one of {_METHODS}, got {method!r}")
    plan = config.plan
    fixed: dict[str, Any] = {"l2_clip_norm": config.l2_clip_norm, "normalize_by": config.normalize_by,
             "rescale_to_unit_norm": config.rescale_to_unit_norm, "dtype": config.dtype, "method": method}

    def clipped_grad(fun: Any, *args: Any, **kwargs: Any) -> Any:
        taken = sorted(set(kwargs) & set(fixed))
        if taken:
            raise TypeError(f"clipped_grad: the plan sets {taken}; build the plan with other values instead")
        return _dropin.clipped_grad(fun, *args, **{**kwargs, **fixed})

    relation = config.accountant.neighboring_relation
    ours, theirs = clipped_grad(lambda: None), plan.clipped_grad(lambda: None)
    if ours.sensitivity(relation) != theirs.sensitivity(relation):  # pragma: no cover - a broken drop-in
        raise AssertionError("with_gradclip: the clipped sum's sensitivity differs from jax-privacy's")
    return dataclasses.replace(plan, clipped_grad=clipped_grad)


def _noise_multiplier(event: Any) -> float:
    """The noise multiplier of the Gaussian inside a (composed, sampled) ``DpEvent``."""
    while not hasattr(event, "noise_multiplier"):
        event = event.event
    return float(event.noise_multiplier)


def _real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _check(num_examples: int, expected_batch_size: int, iterations: int, num_bands: int,
           epsilon: float, delta: float, l2_clip_norm: float, method: str, neighboring_relation: str) -> None:
    """Raises ValueError naming the first bad argument of :func:`bandmf_plan`."""
    for name, value in (("num_examples", num_examples), ("expected_batch_size", expected_batch_size),
                        ("iterations", iterations), ("num_bands", num_bands)):
        if not (_real(value) and isinstance(value, (int, np.integer)) and value >= 1):
            raise ValueError(f"bandmf_plan: `{name}` must be a positive int, got {value!r}")
    if num_bands > iterations:
        raise ValueError(f"bandmf_plan: `num_bands` ({num_bands}) must be at most `iterations` ({iterations})")
    if expected_batch_size * num_bands > num_examples:
        raise ValueError(f"bandmf_plan: `expected_batch_size` * `num_bands` ({expected_batch_size} * {num_bands}) "
                         f"must be at most `num_examples` ({num_examples}): each band's group feeds one batch")
    bounds: tuple[tuple[str, Any, float], ...] = (
        ("epsilon", epsilon, math.inf), ("delta", delta, 1.0), ("l2_clip_norm", l2_clip_norm, math.inf))
    for name, value, high in bounds:
        if not (_real(value) and 0 < value < high):
            raise ValueError(f"bandmf_plan: `{name}` must be a number in (0, {high}), got {value!r}")
    if method not in _METHODS:
        raise ValueError(f"bandmf_plan: `method` must be one of {_METHODS}, got {method!r}")
    if neighboring_relation not in _RELATIONS:
        raise ValueError(f"bandmf_plan: `neighboring_relation` must be one of {tuple(_RELATIONS)}, "
                         f"got {neighboring_relation!r}")


def bandmf_plan(
    *,
    num_examples: int,
    expected_batch_size: int,
    iterations: int,
    num_bands: int,
    epsilon: float,
    delta: float,
    l2_clip_norm: float = 1.0,
    method: str = "auto",
    neighboring_relation: str = "add_or_remove",
    noise_seed: int | None = None,
    strategy_optimization_steps: int = 250,
) -> MFPlan:
    """A DP-BandMF run at ``epsilon`` with gradclip_jax's clipped sums (``num_bands=1``: DP-SGD).

    The strategy is jax-privacy's RMSE-optimal banded Toeplitz one
    (``toeplitz.optimize_banded_toeplitz``, unit norm); ``sampling_prob`` is
    ``expected_batch_size * num_bands / num_examples``, so each step's batch has
    ``expected_batch_size`` examples on average; the clipped sum is divided by
    ``expected_batch_size`` (``normalize_by``) before the noise, which is scaled to
    that sensitivity. The noise multiplier is calibrated by
    ``dp_accounting.calibrate_dp_mechanism`` with a PLD accountant of
    ``neighboring_relation``, and ``epsilon`` of the result is that accountant's
    epsilon of the plan's ``dp_event`` (at most the target).

    Args:
      num_examples: the data set size :math:`n` (the batch iterator's ``num_examples``).
      expected_batch_size: the expected number of examples per step.
      iterations: the number of steps :math:`T`.
      num_bands: the bands :math:`b` of :math:`C`; at most ``iterations`` and
        ``num_examples // expected_batch_size``. A divisor of ``iterations`` is best.
      epsilon, delta: the target :math:`(\\varepsilon, \\delta)`.
      l2_clip_norm: the per-example clip norm :math:`C`.
      method: :func:`gradclip_jax.clipped_grad`'s ``'auto'``, ``'ghost'`` or ``'vmap'``.
      neighboring_relation: ``'add_or_remove'`` (as :func:`gradclip_jax.dp.make_private`;
        the groups are an independent random partition) or ``'zero_out'``
        (jax-privacy's default; groups of equal size, ``n mod b`` examples unused).
      noise_seed: the seed of the noise (``None``: a fresh random one).
      strategy_optimization_steps: L-BFGS steps optimizing the strategy.

    Returns:
      An :class:`MFPlan`.

    Raises:
      ValueError: naming the argument at fault.

    Example:
      >>> plan = bandmf_plan(num_examples=1000, expected_batch_size=50, iterations=40,
      ...                    num_bands=4, epsilon=2.0, delta=1e-5, noise_seed=0)
      >>> plan.sampling_prob, plan.epsilon <= 2.0, plan.strategy.shape
      (0.2, True, (4,))
    """
    _check(num_examples, expected_batch_size, iterations, num_bands, epsilon, delta, l2_clip_norm, method,
           neighboring_relation)
    relation, partition = _RELATIONS[neighboring_relation]
    sampling_prob = expected_batch_size * num_bands / num_examples
    config = execution_plan.BandMFExecutionPlanConfig.default(
        num_bands=num_bands, iterations=iterations, strategy_optimization_steps=strategy_optimization_steps,
        epsilon=epsilon, delta=delta, l2_clip_norm=l2_clip_norm, rescale_to_unit_norm=False,
        normalize_by=float(expected_batch_size), sampling_prob=sampling_prob, partition_type=partition,
        accountant=dp_accounting.pld.PLDAccountant(relation), noise_seed=noise_seed)
    plan = with_gradclip(config, method)
    spent = copy.deepcopy(config.accountant).compose(plan.dp_event).get_epsilon(delta)
    return MFPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)},
                  noise_multiplier=_noise_multiplier(plan.dp_event), epsilon=float(spent), delta=delta,
                  sampling_prob=sampling_prob, strategy=np.asarray(config.strategy),
                  neighboring_relation=relation)
