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
* :func:`blt_plan`: the same with jax-privacy's BLT (buffered linear Toeplitz)
  strategy (https://arxiv.org/abs/2404.16706, https://arxiv.org/abs/2408.08868):
  a lower-triangular Toeplitz :math:`C` whose inverse is applied to the noise
  stream with a few buffers of memory. Its columns never end, so the accounting
  takes no amplification: each example is in every ``cycle_length``-th step
  (jax-privacy's ``CyclicPoissonSampling`` with probability 1), and the run is one
  Gaussian mechanism whose sensitivity is :math:`C`'s under that min-separated
  participation (``toeplitz.minsep_sensitivity_squared``).

Importing this module needs jax-privacy: ``pip install 'gradclip_jax[jax-privacy]'``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    import dp_accounting
    from jax_privacy import batch_selection, noise_addition
    from jax_privacy.experimental import execution_plan
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "gradclip_jax.interop.correlated_noise needs jax-privacy 2.0: "
        "pip install 'gradclip_jax[jax-privacy]'"
    ) from err

from gradclip_jax._core.hyperparam_rules import poison
from gradclip_jax._core.validation import clip_norm_arg
from gradclip_jax.interop import jax_privacy as _dropin

__all__ = ["MFPlan", "PlanNoiseState", "bandmf_plan", "blt_plan", "with_gradclip"]

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
        ``update(clipped_sum, state)``), its state a :class:`PlanNoiseState`. The
        state carries the noise stream: checkpoint it with the parameters and
        restore it on resume. Initialized again, it replays the first steps' noise,
        and the same noise on other sums leaves their differences noise-free. Past
        the plan's ``iterations`` steps its updates are NaN.
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


class PlanNoiseState(NamedTuple):
    """The state of an :class:`MFPlan`'s ``noise_addition_transform``.

    Attributes:
      steps: the steps noised so far (int32 scalar).
      inner: jax-privacy's privatizer state (its key and the noise buffers).
    """

    steps: jax.Array
    inner: Any


def _counted(noise: Any, iterations: int) -> optax.GradientTransformation:
    """``noise`` (jax-privacy's privatizer) counting its steps: past ``iterations`` every
    update is NaN. The run's epsilon is for ``iterations`` steps (the plan's ``dp_event``), and
    a step beyond them (a second pass of ``batch_iterator``) would release noise the accounting
    never saw; the NaN is what ``optax.apply_if_finite`` catches, and the parameters show it."""

    def init_fn(params: Any) -> PlanNoiseState:
        return PlanNoiseState(jnp.zeros((), jnp.int32), noise.init(params))

    def update_fn(updates: Any, state: PlanNoiseState, params: Any = None) -> tuple:
        out, inner = noise.update(updates, state.inner, params)
        return poison(out, state.steps >= iterations), PlanNoiseState(state.steps + 1, inner)

    return optax.GradientTransformation(init_fn, update_fn)


def _plan_clipped_grad(fixed: dict[str, Any]) -> Any:
    """The drop-in ``clipped_grad`` with the plan's clip norm, normalisation, dtype and method fixed."""

    def clipped_grad(fun: Any, *args: Any, **kwargs: Any) -> Any:
        taken = sorted(set(kwargs) & set(fixed))
        if taken:
            raise TypeError(
                f"clipped_grad: the plan sets {taken}; build the plan with other values instead"
            )
        return _dropin.clipped_grad(fun, *args, **{**kwargs, **fixed})

    return clipped_grad


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
        raise TypeError(
            f"with_gradclip: `config` must be a BandMFExecutionPlanConfig, got {type(config).__name__}"
        )
    if method not in _METHODS:
        raise ValueError(f"with_gradclip: `method` must be one of {_METHODS}, got {method!r}")
    plan = config.plan
    clipped_grad = _plan_clipped_grad(
        {
            "l2_clip_norm": config.l2_clip_norm,
            "normalize_by": config.normalize_by,
            "rescale_to_unit_norm": config.rescale_to_unit_norm,
            "dtype": config.dtype,
            "method": method,
        }
    )
    relation = config.accountant.neighboring_relation
    ours, theirs = clipped_grad(lambda: None), plan.clipped_grad(lambda: None)
    if ours.sensitivity(relation) != theirs.sensitivity(
        relation
    ):  # pragma: no cover - a broken drop-in
        raise AssertionError(
            "with_gradclip: the clipped sum's sensitivity differs from jax-privacy's"
        )
    return dataclasses.replace(plan, clipped_grad=clipped_grad)


def _noise_multiplier(event: Any) -> float:
    """The noise multiplier of the Gaussian inside a (composed, sampled) ``DpEvent``."""
    while not hasattr(event, "noise_multiplier"):
        event = event.event
    return float(event.noise_multiplier)


def _real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _check(
    num_examples: int,
    expected_batch_size: int,
    iterations: int,
    num_bands: int,
    epsilon: float,
    delta: float,
    l2_clip_norm: float,
    method: str,
    neighboring_relation: str,
) -> None:
    """Raises ValueError naming the first bad argument of :func:`bandmf_plan`."""
    for name, value in (
        ("num_examples", num_examples),
        ("expected_batch_size", expected_batch_size),
        ("iterations", iterations),
        ("num_bands", num_bands),
    ):
        if not (_real(value) and isinstance(value, (int, np.integer)) and value >= 1):
            raise ValueError(f"bandmf_plan: `{name}` must be a positive int, got {value!r}")
    if num_bands > iterations:
        raise ValueError(
            f"bandmf_plan: `num_bands` ({num_bands}) must be at most `iterations` ({iterations})"
        )
    if expected_batch_size * num_bands > num_examples:
        raise ValueError(
            f"bandmf_plan: `expected_batch_size` * `num_bands` ({expected_batch_size} * {num_bands}) "
            f"must be at most `num_examples` ({num_examples}): each band's group feeds one batch"
        )
    bounds: tuple[tuple[str, Any, float], ...] = (
        ("epsilon", epsilon, math.inf),
        ("delta", delta, 1.0),
        ("l2_clip_norm", l2_clip_norm, math.inf),
    )
    for name, value, high in bounds:
        if not (_real(value) and 0 < value < high):
            raise ValueError(
                f"bandmf_plan: `{name}` must be a number in (0, {high}), got {value!r}"
            )
    if method not in _METHODS:
        raise ValueError(f"bandmf_plan: `method` must be one of {_METHODS}, got {method!r}")
    if neighboring_relation not in _RELATIONS:
        raise ValueError(
            f"bandmf_plan: `neighboring_relation` must be one of {tuple(_RELATIONS)}, "
            f"got {neighboring_relation!r}"
        )


def bandmf_plan(
    *,
    num_examples: int,
    expected_batch_size: int,
    iterations: int,
    num_bands: int,
    epsilon: float,
    delta: float,
    l2_clip_norm: float | None = None,
    method: str = "auto",
    neighboring_relation: str = "add_or_remove",
    noise_seed: int | None = None,
    strategy_optimization_steps: int = 250,
    l2_norm_clip: float | None = None,
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
      l2_clip_norm: the per-example clip norm :math:`C` (default 1.0); ``l2_norm_clip``,
        optax's spelling, is accepted too (give one of the two).
      method: :func:`gradclip_jax.clipped_grad`'s ``'auto'``, ``'ghost'`` or ``'vmap'``.
      neighboring_relation: ``'add_or_remove'`` (as :func:`gradclip_jax.make_private`;
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
    l2_clip_norm = clip_norm_arg("bandmf_plan", l2_clip_norm, l2_norm_clip, default=1.0)
    _check(
        num_examples,
        expected_batch_size,
        iterations,
        num_bands,
        epsilon,
        delta,
        l2_clip_norm,
        method,
        neighboring_relation,
    )
    relation, partition = _RELATIONS[neighboring_relation]
    sampling_prob = expected_batch_size * num_bands / num_examples
    config = execution_plan.BandMFExecutionPlanConfig.default(
        num_bands=num_bands,
        iterations=iterations,
        strategy_optimization_steps=strategy_optimization_steps,
        epsilon=epsilon,
        delta=delta,
        l2_clip_norm=l2_clip_norm,
        rescale_to_unit_norm=False,
        normalize_by=float(expected_batch_size),
        sampling_prob=sampling_prob,
        partition_type=partition,
        accountant=dp_accounting.pld.PLDAccountant(relation),
        noise_seed=noise_seed,
    )
    plan = with_gradclip(config, method)
    spent = copy.deepcopy(config.accountant).compose(plan.dp_event).get_epsilon(delta)
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    fields["noise_addition_transform"] = _counted(plan.noise_addition_transform, iterations)
    return MFPlan(
        **fields,
        noise_multiplier=_noise_multiplier(plan.dp_event),
        epsilon=float(spent),
        delta=delta,
        sampling_prob=sampling_prob,
        strategy=np.asarray(config.strategy),
        neighboring_relation=relation,
    )


def _blt_inverse(
    iterations: int, cycle_length: int, participations: int, num_buffers: int, optimize: bool
) -> Any:
    """:math:`C^{-1}` as a float32 BLT, :math:`C` the rational approximation of the optimal max-error
    Toeplitz strategy or jax-privacy's optimized one for this min-separated participation.

    The strategy and its inverse are computed in float64 (jax-privacy's BLT inverse is not
    reliable in float32), then the inverse's parameters are rounded to float32: the noise is made
    with those, and the sensitivity is computed for the inverse of exactly those.
    """
    if not (
        _real(num_buffers) and isinstance(num_buffers, (int, np.integer)) and 1 <= num_buffers <= 10
    ):
        raise ValueError(f"blt_plan: `num_buffers` must be an int in [1, 10], got {num_buffers!r}")
    num_buffers = int(num_buffers)
    with jax.enable_x64(True):
        if optimize:
            blt = buffered_toeplitz.optimize(
                n=iterations,
                min_sep=cycle_length,
                max_participations=participations,
                max_buffers=num_buffers,
            )
        else:
            blt = buffered_toeplitz.BufferedToeplitz.from_rational_approx_to_sqrt_x(num_buffers)
        inv = blt.inverse()
        decay, scale = np.asarray(inv.buf_decay), np.asarray(inv.output_scale)
    return buffered_toeplitz.BufferedToeplitz.build(decay, scale, dtype=jnp.float32)


def _strategy_and_sensitivity(
    inverse: Any, iterations: int, cycle_length: int, participations: int
) -> tuple[np.ndarray, float]:
    """The Toeplitz coefficients of the :math:`C` whose inverse makes the noise, and :math:`C`'s
    sensitivity (in units of one participation's) under participations ``cycle_length`` apart.

    Computed in float64 from the float32 inverse that generates the noise, so the bound is the one
    of the matrix actually used. ``minsep_sensitivity_squared`` checks that the coefficients are
    non-negative and non-increasing, where its bound is exact (arXiv:2405.13763, Theorem 2).
    """
    with jax.enable_x64(True):
        inv = jnp.asarray(np.asarray(inverse.toeplitz_coefs(iterations), np.float64))
        coefs = toeplitz.inverse_coef(inv)
        sens2 = toeplitz.minsep_sensitivity_squared(
            coefs, min_sep=cycle_length, max_participations=participations
        )
        return np.asarray(coefs), float(np.sqrt(float(sens2)))


def _gaussian_calibration(
    relation: Any, epsilon: float, delta: float
) -> tuple[Callable[[], Any], float]:
    """A fresh PLD accountant's factory for ``relation``, and the Gaussian noise multiplier that
    spends ``(epsilon, delta)`` in one release (the participations are in the sensitivity)."""

    def fresh() -> Any:
        return dp_accounting.pld.PLDAccountant(relation)

    z = float(
        dp_accounting.calibrate_dp_mechanism(
            make_fresh_accountant=fresh,
            make_event_from_param=dp_accounting.GaussianDpEvent,
            target_epsilon=epsilon,
            target_delta=delta,
        )
    )
    return fresh, z


def _mean_clipped_grad(l2_clip_norm: float, expected_batch_size: int, method: str) -> Any:
    """jax-privacy's ``clipped_grad`` over ours: clip at ``l2_clip_norm``, divide by the batch size."""
    return _plan_clipped_grad(
        {
            "l2_clip_norm": l2_clip_norm,
            "normalize_by": float(expected_batch_size),
            "rescale_to_unit_norm": False,
            "dtype": None,
            "method": method,
        }
    )


def blt_plan(
    *,
    num_examples: int,
    expected_batch_size: int,
    iterations: int,
    epsilon: float,
    delta: float,
    l2_clip_norm: float | None = None,
    num_buffers: int = 3,
    optimize: bool = False,
    method: str = "auto",
    neighboring_relation: str = "add_or_remove",
    noise_seed: int | None = None,
    l2_norm_clip: float | None = None,
) -> MFPlan:
    """A DP run with BLT (buffered linear Toeplitz) correlated noise and gradclip_jax's clipped sums.

    The examples are split into ``b = num_examples // expected_batch_size``
    groups, and step :math:`t` takes all of group :math:`t \\bmod b`
    (jax-privacy's ``CyclicPoissonSampling`` with ``sampling_prob=1``): each
    example takes part in at most :math:`k = \\lceil T / b \\rceil` steps, ``b``
    apart. The noise added to step :math:`t`'s clipped sum is row :math:`t` of
    :math:`C^{-1} Z`, :math:`Z` i.i.d. Gaussian of standard deviation
    :math:`z \\cdot (C_{\\text{clip}} / B) \\cdot \\Delta`, with :math:`C` the
    lower-triangular Toeplitz BLT strategy and
    :math:`\\Delta = \\max \\|C \\mathbf{1}_P\\|` over participation patterns
    :math:`P` of at most :math:`k` steps at least :math:`b` apart. The run is a
    post-processing of :math:`C G + Z`, one Gaussian mechanism of noise
    multiplier :math:`z` (``dp_event = GaussianDpEvent(z)``): no amplification by
    sampling is claimed, as BLT's columns never end. :math:`z` is calibrated by
    dp-accounting's PLD accountant of ``neighboring_relation`` for ``epsilon``.

    Args:
      num_examples: the data set size :math:`n`.
      expected_batch_size: :math:`B`, the examples per step (the clipped sum is
        divided by it before the noise); ``num_examples // expected_batch_size``
        is the cycle length.
      iterations: the steps :math:`T`.
      epsilon, delta: the target :math:`(\\varepsilon, \\delta)`.
      l2_clip_norm: the per-example clip norm :math:`C_{\\text{clip}}` (default 1.0);
        ``l2_norm_clip``, optax's spelling, is accepted too (give one of the two).
      num_buffers: the BLT's buffers (memory: that many copies of the model).
      optimize: ``False`` (default): the rational approximation of the
        optimal max-error Toeplitz strategy (``from_rational_approx_to_sqrt_x``,
        instant); ``True``: jax-privacy's ``buffered_toeplitz.optimize`` for this
        participation, with up to ``num_buffers`` buffers (a minute or more on a CPU).
      method: :func:`gradclip_jax.clipped_grad`'s ``'auto'``, ``'ghost'`` or ``'vmap'``.
      neighboring_relation: ``'add_or_remove'`` (an independent random partition
        into groups) or ``'zero_out'`` (groups of equal size, ``n mod b`` unused).
      noise_seed: the seed of the noise (``None``: a fresh random one).

    Returns:
      An :class:`MFPlan` (``sampling_prob`` 1, ``strategy`` the first
      ``iterations`` Toeplitz coefficients of :math:`C`).

    Raises:
      ValueError: naming the argument at fault.

    Example:
      >>> plan = blt_plan(num_examples=1000, expected_batch_size=100, iterations=30,
      ...                 epsilon=4.0, delta=1e-5, noise_seed=0)
      >>> plan.sampling_prob, plan.epsilon <= 4.0, plan.strategy.shape
      (1.0, True, (30,))
    """
    l2_clip_norm = clip_norm_arg("blt_plan", l2_clip_norm, l2_norm_clip, default=1.0)
    _check(
        num_examples,
        expected_batch_size,
        iterations,
        1,
        epsilon,
        delta,
        l2_clip_norm,
        method,
        neighboring_relation,
    )
    relation, partition = _RELATIONS[neighboring_relation]
    cycle = num_examples // expected_batch_size
    participations = -(-iterations // cycle)
    inverse = _blt_inverse(iterations, cycle, participations, num_buffers, bool(optimize))
    coefs, sens = _strategy_and_sensitivity(inverse, iterations, cycle, participations)
    fresh, z = _gaussian_calibration(relation, epsilon, delta)
    event = dp_accounting.GaussianDpEvent(z)
    clipped_grad = _mean_clipped_grad(l2_clip_norm, expected_batch_size, method)
    query = float(clipped_grad(lambda: None).sensitivity(relation))
    privatizer = noise_addition.matrix_factorization_privatizer(
        inverse.as_streaming_matrix(), stddev=z * query * sens, prng_key=noise_seed
    )
    sampling = batch_selection.CyclicPoissonSampling(
        sampling_prob=1.0, iterations=iterations, cycle_length=cycle, partition_type=partition
    )
    return MFPlan(
        clipped_grad=clipped_grad,
        batch_selection_strategy=sampling,
        noise_addition_transform=_counted(privatizer, iterations),
        dp_event=event,
        noise_multiplier=z,
        epsilon=float(fresh().compose(event).get_epsilon(delta)),
        delta=delta,
        sampling_prob=1.0,
        strategy=coefs,
        neighboring_relation=relation,
    )
