"""Differentially private aggregation transforms (DP-SGD).

Every transform here takes **per-example** gradients (each leaf with the batch on
axis 0, e.g. from ``jax.vmap(jax.grad(loss))``), except :func:`dp_noise`, which
takes a sum of already clipped gradients (e.g. from
:func:`gradclip_jax.per_example.clipped_grad`). They must come first in an
``optax.chain``.

Privacy rules followed by every transform:

* each example's contribution is clipped to L2 norm :math:`C` by the
  overflow-safe norm engine, so the sum has L2 sensitivity :math:`C`
  (add/remove one example);
* the clipped sum and the Gaussian noise are accumulated in float32 at least
  (float64 for float64 gradients), and rounded to each leaf's dtype only after
  the noise is added and the result divided by the batch size;
* an example whose gradient is NaN or inf contributes zero (``nan_safe=True``),
  so non-finite data cannot break the sensitivity bound;
* states are ``NamedTuple``\\ s of fixed structure that hold only what may be
  released: the PRNG key, a step count and, for the adaptive transform, the clip
  norm (a function of noised quantities only). No pre-clip norm or clip count of
  a batch is ever stored.

Account for the privacy spent with :mod:`gradclip_jax.privacy`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    as_scalar,
    increment,
    poison,
)
from gradclip_jax._core.numerics import count0 as _count0
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import (
    check_int,
    check_mask,
    check_scalar,
    clip_norm_arg,
    is_traced,
    static_value,
)
from gradclip_jax.dp._guards import refuse_update_averaging
from gradclip_jax.dp.noise import noised_leaves
from gradclip_jax.per_example.internal import (
    as_rows,
    batch_flatten,
    clip_and_sum,
    clip_factors,
    match_batch_sharding,
    unrow,
)

__all__ = [
    "DPAggregateState",
    "DPNoiseState",
    "DPQuantileAggregateState",
    "dp_aggregate",
    "dp_noise",
    "dp_quantile_aggregate",
    "dpsgd",
    "noise_multiplier_for_gradient",
]


@register_state
class DPAggregateState(NamedTuple):
    """State of :func:`dp_aggregate` and :func:`dp_noise`.

    Attributes:
      rng_key: the PRNG key the next noise is drawn from (a typed key).
      count: number of updates so far (int32); drives scheduled hyperparameters.
    """

    rng_key: jax.Array
    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax


DPNoiseState = DPAggregateState


@register_state
class DPQuantileAggregateState(NamedTuple):
    """State of :func:`dp_quantile_aggregate`.

    Attributes:
      rng_key: the PRNG key the next noise is drawn from.
      clip_norm: the clip norm :math:`C_t` the next update will use. It is
        computed from the noised unclipped fraction only, so it may be released
        (logged) without further privacy cost.
      count: number of updates so far (int32).
    """

    rng_key: jax.Array
    clip_norm: jax.Array
    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax


def _key(seed: Any, fn: str) -> jax.Array:
    """A typed PRNG key from an int seed, a typed key or a raw uint32 key."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    if isinstance(seed, (jax.Array, np.ndarray)) and seed.shape == (2,) and seed.dtype == np.uint32:
        return jax.random.wrap_key_data(jnp.asarray(seed))
    if not isinstance(seed, (jax.Array, np.ndarray)):
        seed = check_int(fn, "seed", seed)  # not a key: an int seed (never a bool)
    return jax.random.key(seed)



def _divisor(batch_size: Any, actual: int, dtype: Any) -> jax.Array:
    """The public constant the noised sum is divided by (``batch_size``: resolved, or ``None``)."""
    if batch_size is None:
        return jnp.asarray(max(actual, 1), dtype)
    return as_scalar(batch_size, dtype)


def _lowest(arrays: list[jax.Array]) -> np.dtype:
    """The leaf dtype with the least precision (the clip factors' rounding margin is for it)."""
    return min((np.dtype(x.dtype) for x in arrays), key=lambda d: jnp.finfo(d).nmant)


def _clip_sum(
    arrays: list[jax.Array], clip: jax.Array, nan_safe: bool, mask: Any, fn: str, batch: int, store: Any = None
) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Clipped per-example sums (accumulation dtype), per-example norms and the kept rows.

    ``store``: the dtype the result is finally rounded to (for the clip factors' rounding margin).
    """
    valid = check_mask(fn, mask, batch)
    sums, w = clip_and_sum([as_rows(x) for x in arrays], clip, valid=valid, nan_safe=nan_safe,
                           factor_fn=lambda n, c: clip_factors(n, c, store))
    keep = jnp.ones((batch,), bool) if w.keep is None else w.keep
    return unrow(sums, arrays), w.norms, keep


def dp_aggregate(
    l2_norm_clip: Hyperparam | None = None,
    noise_multiplier: Hyperparam | None = None,
    seed: Any = None,
    *,
    batch_size: Hyperparam | None = None,
    nan_safe: bool = True,
    l2_clip_norm: Hyperparam | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Clips per-example gradients, sums them, adds Gaussian noise, averages.

    With per-example gradients :math:`g_i` (row :math:`i` of every leaf),

    .. math::
        \\tilde g = \\frac{1}{B} \\Big( \\sum_i g_i \\min\\big(1, \\tfrac{C}{\\|g_i\\|_2}\\big)
        + \\mathcal{N}(0, \\sigma^2 I) \\Big), \\qquad \\sigma = z\\, C

    (Abadi et al. 2016). The same result as
    :func:`optax.contrib.differentially_private_aggregate` (same key splitting:
    one key per leaf from ``jax.random.split(key, num_leaves + 1)``, so with float32
    gradients the noise is the same draw for the same seed), and in addition:
    sums and noise are float32 for 16-bit gradients (the output is rounded to the
    leaf dtype only at the end), the batch axis may be explicitly sharded, non-finite
    examples are dropped (``nan_safe``), padding examples can be masked out, and
    :math:`B` may be a public constant such as the expected batch size of Poisson
    sampling.

    Args:
      l2_norm_clip: :math:`C \\ge 0`: number, array or schedule (optax's name
        and position; the keyword ``l2_clip_norm`` is the same argument).
      noise_multiplier: :math:`z \\ge 0`: number, array or schedule. The noise
        standard deviation is :math:`zC`. A traced or scheduled clip norm,
        ``noise_multiplier`` or ``batch_size`` that is invalid at run time
        (negative, NaN) makes the update NaN, so :func:`optax.apply_if_finite`
        skips the step.
      seed: an int seed or a ``jax.random`` key. The privacy guarantee assumes
        the noise is secret: in production draw the seed from a secure source
        (e.g. ``secrets.randbits(63)``) and do not log it.
      batch_size: the divisor :math:`B`. ``None`` (default, optax's behaviour)
        divides by the number of rows in the update; with Poisson sampling pass
        the *expected* batch size, since the actual size is private.
      nan_safe: drop (zero) examples whose gradient is not finite (default True).
      l2_clip_norm: the clip norm under its canonical spelling (jax-privacy's
        and the rest of the DP API's), accepted without a warning: give it or
        ``l2_norm_clip``, not both.

    Each clipped contribution, as stored in the leaf dtype, has norm at most
    :math:`C`, rounding included. Inside :class:`optax.MultiSteps` it raises
    ``ValueError`` (MultiSteps would average the clipped rows of several steps
    before the noise, see :func:`dp_noise`).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with state
      :class:`DPAggregateState`. ``update(per_example_grads, state, params=None,
      mask=None)``: ``mask`` (shape ``(B,)``, bool) marks real examples; padding
      rows contribute nothing (still divided by ``batch_size``).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradclip_jax.dp import dp_aggregate
      >>> tx = dp_aggregate(l2_clip_norm=1.0, noise_multiplier=0.0, seed=0)
      >>> per_example = {'w': jnp.array([[3.0, 4.0], [0.3, 0.4]])}
      >>> updates, state = tx.update(per_example, tx.init({'w': jnp.zeros(2)}))
      >>> [round(float(u), 4) for u in updates['w']]  # ((0.6, 0.8) + (0.3, 0.4)) / 2
      [0.45, 0.6]
    """
    fn = "dp_aggregate"
    clip = _Clip(_clip_name(l2_clip_norm), clip_norm_arg(fn, l2_clip_norm, l2_norm_clip))
    return _aggregate(fn, clip, noise_multiplier, seed, batch_size, nan_safe)


def _required(fn: str, **kwargs: Any) -> None:
    for name, value in kwargs.items():
        if value is None:
            raise TypeError(f"{fn}: missing the required argument `{name}`")


class _Clip(NamedTuple):
    """The clip norm and the spelling the user gave it under (which its errors name)."""

    name: str
    value: Hyperparam


def _clip_name(l2_clip_norm: Any) -> str:
    return "l2_norm_clip" if l2_clip_norm is None else "l2_clip_norm"


def _aggregate(
    fn: str, clip_norm: _Clip, noise_multiplier: Any, seed: Any, batch_size: Any, nan_safe: Any
) -> optax.GradientTransformationExtraArgs:
    """:func:`dp_aggregate`, its errors naming ``fn`` (the function the user called)."""
    _required(fn, noise_multiplier=noise_multiplier, seed=seed)
    hps = Hyperparams(fn)
    hps.add(clip_norm.name, clip_norm.value)
    hps.add("noise_multiplier", noise_multiplier)
    hps.add("batch_size", batch_size, low=0.0, low_inclusive=False, allow_inf=False, allow_none=True)
    nan_safe = bool(static_value(fn, "nan_safe", nan_safe))
    key0 = _key(seed, fn)

    def init_fn(params: Any) -> DPAggregateState:
        del params
        return DPAggregateState(rng_key=key0, count=_count0())

    def update_fn(
        updates: Any, state: DPAggregateState, params: Any = None, *, mask: Any = None, **extra: Any
    ) -> tuple:
        del params, extra
        refuse_update_averaging(fn)
        flat, batch = batch_flatten(updates, fn)
        arrays = flat.arrays
        new_key, *keys = jax.random.split(state.rng_key, len(arrays) + 1)
        if not arrays or batch is None:
            return updates, DPAggregateState(rng_key=new_key, count=increment(state.count))
        acc = _norms.tree_acc_dtype(arrays)
        v, invalid = hps.at(state.count, acc)
        clip, z = v[clip_norm.name], v["noise_multiplier"]
        sums, _, _ = _clip_sum(arrays, clip, nan_safe, mask, fn, batch, store=_lowest(arrays))
        out = noised_leaves(sums, keys, clip * z, _divisor(v["batch_size"], batch, acc), fn=fn)
        # an invalid traced value (a negative z negates the noise) gives NaN, never a finite update
        out = [poison(o, invalid).astype(x.dtype) for o, x in zip(out, arrays, strict=True)]
        return flat.rebuild(out), DPAggregateState(rng_key=new_key, count=increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def dpsgd(
    learning_rate: optax.ScalarOrSchedule | None = None,
    l2_norm_clip: Hyperparam | None = None,
    noise_multiplier: Hyperparam | None = None,
    seed: Any = None,
    momentum: float | None = None,
    nesterov: bool = False,
    *,
    batch_size: Hyperparam | None = None,
    nan_safe: bool = True,
    l2_clip_norm: Hyperparam | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The DP-SGD optimizer (Abadi et al. 2016), as :func:`optax.contrib.dpsgd`.

    .. math:: \\theta \\leftarrow \\theta - \\eta\\, \\mathrm{trace}_{\\mu}(\\tilde g)

    with :math:`\\tilde g` from :func:`dp_aggregate` and optional (Nesterov)
    momentum :math:`\\mu` (``optax.trace``).

    Args:
      learning_rate: :math:`\\eta \\ge 0`, a number or a schedule.
      l2_norm_clip: :math:`C` (optax's name and position).
      noise_multiplier: :math:`z`.
      seed: an int seed or a ``jax.random`` key.
      momentum: :math:`\\mu \\in [0, 1)`, or ``None`` for none (default).
      nesterov: use Nesterov momentum.
      batch_size, nan_safe: as in :func:`dp_aggregate`.
      l2_clip_norm: the clip norm under its canonical spelling, accepted
        without a warning: give it or ``l2_norm_clip``, not both.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` taking per-example
      gradients; its state is that of the ``optax.chain`` of
      :func:`dp_aggregate`, ``optax.trace`` (or ``optax.identity``) and
      ``optax.scale_by_learning_rate``, as in optax.

    Raises:
      ValueError: for a negative or NaN ``learning_rate`` or a ``momentum``
        outside [0, 1) (and the errors of :func:`dp_aggregate`). A traced or
        scheduled value that is invalid only at run time makes the update NaN,
        so :func:`optax.apply_if_finite` skips the step: never gradient ascent.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from gradclip_jax.dp import dpsgd
      >>> tx = dpsgd(learning_rate=0.1, l2_clip_norm=1.0, noise_multiplier=1.1, seed=0)
      >>> params = {'w': jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({'w': jnp.ones((8, 2))}, state, params)
      >>> params = optax.apply_updates(params, updates)
    """
    fn = "dpsgd"
    clip = _Clip(_clip_name(l2_clip_norm), clip_norm_arg(fn, l2_clip_norm, l2_norm_clip))
    _required(fn, learning_rate=learning_rate)
    # A negative learning rate would turn the step into gradient ascent: checked like every
    # hyperparameter (ValueError now; NaN updates for a traced or scheduled invalid value).
    hps = Hyperparams(fn)
    hps.add("learning_rate", learning_rate)
    hps.add("momentum", momentum, high=1.0, high_inclusive=False, allow_none=True)
    inner = optax.chain(
        _aggregate(fn, clip, noise_multiplier, seed, batch_size, nan_safe),
        optax.trace(decay=momentum, nesterov=nesterov) if momentum is not None else optax.identity(),
        optax.scale_by_learning_rate(learning_rate),
    )

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple:
        out, new_state = inner.update(updates, state, params, **extra)
        # state[0] is dp_aggregate's: its count is the step the learning-rate schedule was evaluated at
        _, invalid = hps.at(state[0].count, _norms.tree_acc_dtype(jax.tree_util.tree_leaves(out)))
        return poison(out, invalid), new_state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def dp_noise(
    stddev: Hyperparam, seed: Any, *, normalize_by: Hyperparam = 1.0
) -> optax.GradientTransformation:
    """Adds Gaussian noise to an already clipped gradient sum, then divides.

    .. math:: u \\leftarrow \\big(u + \\mathcal{N}(0, \\sigma^2 I)\\big) / N

    The privatizer to put after :func:`gradclip_jax.per_example.clipped_grad`:
    with ``grad_fn = clipped_grad(loss, C)``, ``stddev = z * grad_fn.sensitivity()``
    gives noise multiplier ``z``; ``normalize_by`` is the public (expected) batch
    size. Noise is drawn and added in float32 at least; the output is rounded to
    each leaf's dtype afterwards.

    Args:
      stddev: :math:`\\sigma \\ge 0`: number, array or schedule; a traced or
        scheduled value that is negative or NaN makes the update NaN.
      seed: an int seed or a ``jax.random`` key.
      normalize_by: :math:`N > 0`, a public constant (default 1: keep the sum).

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`DPNoiseState`.

    Raises:
      ValueError: when its update runs inside ``optax.MultiSteps`` (gradient
        accumulation): MultiSteps averages the clipped sums of its pieces, which
        divides the signal but not the noise. Accumulate the clipped sums and
        noise once per logical step instead (:func:`gradclip_jax.dp.make_private`
        with ``physical_batch_size``, or its ``clipped_sum``/``noisy_update``).

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.dp import dp_noise
      >>> tx = dp_noise(stddev=0.0, seed=0, normalize_by=4)
      >>> tx.update({'w': jnp.array([2.0])}, tx.init(None))[0]
      {'w': Array([0.5], dtype=float32)}
    """
    fn = "dp_noise"
    hps = Hyperparams(fn)
    hps.add("stddev", stddev)
    hps.add("normalize_by", normalize_by, low=0.0, low_inclusive=False, allow_inf=False)
    key0 = _key(seed, fn)

    def init_fn(params: Any) -> DPAggregateState:
        del params
        return DPAggregateState(rng_key=key0, count=_count0())

    def update_fn(updates: Any, state: DPAggregateState, params: Any = None) -> tuple:
        del params
        refuse_update_averaging(fn)
        flat = _norms.flatten(updates, fn)
        arrays = flat.arrays
        new_key, *keys = jax.random.split(state.rng_key, len(arrays) + 1)
        if arrays:
            acc = _norms.tree_acc_dtype(arrays)
            v, invalid = hps.at(state.count, acc)
            sums = [x.astype(jnp.result_type(_norms.sum_dtype(x.dtype), acc)) for x in arrays]
            out = noised_leaves(sums, keys, v["stddev"], v["normalize_by"], fn=fn)
            # an invalid traced value (a negative stddev negates the noise) gives NaN
            updates = flat.rebuild([poison(o, invalid).astype(x.dtype) for o, x in zip(out, arrays, strict=True)])
        return updates, DPAggregateState(rng_key=new_key, count=increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def noise_multiplier_for_gradient(noise_multiplier: Any, count_noise_std: Any) -> Any:
    """The gradient's noise multiplier :math:`z_\\Delta` when a count is also released.

    .. math:: z_\\Delta = \\big(z^{-2} - (2\\sigma_b)^{-2}\\big)^{-1/2}

    (Andrew et al. 2021, Theorem 1): releasing the noised count of unclipped
    examples (sensitivity 1/2, noise :math:`\\sigma_b`) and the gradient sum
    (noise :math:`z_\\Delta C`) together costs the same as one Gaussian mechanism
    with noise multiplier :math:`z`, so account with :math:`z`. ``z = 0`` gives 0
    (no privacy). Requires :math:`\\sigma_b > z/2`.

    Args:
      noise_multiplier: :math:`z \\ge 0`.
      count_noise_std: :math:`\\sigma_b`.

    Returns:
      :math:`z_\\Delta` (a float for Python inputs, an array otherwise).

    Raises:
      ValueError: for concrete inputs with :math:`0 < z` and :math:`\\sigma_b \\le z/2`.

    Example:
      >>> from gradclip_jax.dp import noise_multiplier_for_gradient
      >>> round(noise_multiplier_for_gradient(1.0, 6.4), 4)
      1.0031
    """
    if not (is_traced(noise_multiplier) or is_traced(count_noise_std)):
        z = float(np.asarray(noise_multiplier))
        sb = float(np.asarray(count_noise_std))
        if z == 0.0:
            return 0.0
        if not sb > z / 2:
            raise ValueError(
                f"count_noise_std ({sb}) must exceed noise_multiplier / 2 ({z / 2}): the count "
                "would use the whole privacy budget"
            )
        return float((z**-2 - (2 * sb) ** -2) ** -0.5)
    zt = jnp.asarray(noise_multiplier, jnp.float32)
    sbt = jnp.asarray(count_noise_std, jnp.float32)
    safe_z = jnp.where(zt > 0, zt, 1.0)
    inner = safe_z**-2 - (2 * sbt) ** -2
    return jnp.where(zt > 0, jnp.where(inner > 0, inner, jnp.nan) ** -0.5, 0.0)


def dp_quantile_aggregate(
    noise_multiplier: float,
    seed: Any,
    *,
    initial_l2_norm_clip: float = 0.1,
    target_unclipped_quantile: float = 0.5,
    clip_learning_rate: float = 0.2,
    expected_batch_size: float | None = None,
    count_noise_std: float | None = None,
    geometric_update: bool = True,
    min_l2_norm_clip: float = 0.0,
    max_l2_norm_clip: float = float("inf"),
    nan_safe: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """DP-SGD aggregation with a clip norm that tracks a quantile of the norms, privately.

    Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
    Adaptive Clipping" (NeurIPS 2021), in TF-Privacy's form
    (``QuantileAdaptiveClipSumQuery``). At step :math:`t`, with clip norm
    :math:`C_t`, per-example gradients :math:`g_i`, expected batch size
    :math:`m`:

    .. math::
        u_i = \\mathbb{1}[\\|g_i\\|_2 \\le C_t], \\qquad
        \\tilde b = \\mathrm{clip}_{[0,1]}\\Big(\\frac{\\sum_i (u_i - \\tfrac12)
            + \\mathcal{N}(0, \\sigma_b^2)}{m} + \\tfrac12\\Big)

    .. math::
        \\tilde g = \\frac{1}{m}\\Big(\\sum_i g_i \\min(1, C_t/\\|g_i\\|_2)
            + \\mathcal{N}(0, (z_\\Delta C_t)^2 I)\\Big), \\qquad
        z_\\Delta = \\big(z^{-2} - (2\\sigma_b)^{-2}\\big)^{-1/2}

    .. math::
        C_{t+1} = C_t\\, e^{-\\eta (\\tilde b - \\gamma)} \\ \\text{(geometric)}
        \\quad\\text{or}\\quad C_t - \\eta(\\tilde b - \\gamma) \\ \\text{(arithmetic)},

    clamped to ``[min_l2_norm_clip, max_l2_norm_clip]``. The count has
    sensitivity 1/2 after recentring, and the split :math:`z_\\Delta` makes the
    pair of releases cost exactly one Gaussian mechanism with multiplier
    :math:`z`: **account with** ``noise_multiplier`` (:math:`z`). The state holds
    only the key, :math:`C_{t+1}` and the step count.

    Args:
      noise_multiplier: :math:`z \\ge 0`, the overall noise multiplier to
        account with (a Python number: it decides :math:`z_\\Delta`).
      seed: an int seed or a ``jax.random`` key.
      initial_l2_norm_clip: :math:`C_0 > 0` (default 0.1, the paper's).
      target_unclipped_quantile: :math:`\\gamma \\in [0, 1]` (default 0.5: the
        median norm).
      clip_learning_rate: :math:`\\eta \\ge 0` (default 0.2).
      expected_batch_size: :math:`m`, the public expected number of examples per
        step (Poisson sampling: ``sample_rate * dataset_size``). ``None`` uses the
        number of rows of the update, which is public only for fixed-size batches.
      count_noise_std: :math:`\\sigma_b`; default :math:`m/20` (the paper's);
        must exceed :math:`z/2`. Required when ``expected_batch_size`` is
        ``None`` and ``z > 0``.
      geometric_update: geometric (default) or arithmetic update of :math:`C`.
      min_l2_norm_clip, max_l2_norm_clip: clamp of :math:`C` (defaults 0, inf).
      nan_safe: drop examples with non-finite gradients (they count as clipped).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with state
      :class:`DPQuantileAggregateState`; ``update(per_example_grads, state,
      params=None, mask=None)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.dp import dp_quantile_aggregate
      >>> tx = dp_quantile_aggregate(1.0, seed=0, expected_batch_size=100)
      >>> state = tx.init({'w': jnp.zeros(3)})
      >>> updates, state = tx.update({'w': jnp.ones((100, 3))}, state)
      >>> bool(state.clip_norm < 0.1)  # every norm (1.73) > 0.1: C must grow
      False
    """
    fn = "dp_quantile_aggregate"
    check_scalar(fn, "noise_multiplier", noise_multiplier)
    check_scalar(fn, "initial_l2_norm_clip", initial_l2_norm_clip, low=0.0, low_inclusive=False)
    check_scalar(fn, "target_unclipped_quantile", target_unclipped_quantile, high=1.0)
    check_scalar(fn, "clip_learning_rate", clip_learning_rate)
    check_scalar(fn, "min_l2_norm_clip", min_l2_norm_clip)
    check_scalar(fn, "max_l2_norm_clip", max_l2_norm_clip)
    if float(np.asarray(min_l2_norm_clip)) > float(np.asarray(max_l2_norm_clip)):
        raise ValueError(f"{fn}: min_l2_norm_clip must not exceed max_l2_norm_clip")
    if expected_batch_size is not None:
        check_scalar(fn, "expected_batch_size", expected_batch_size, low=0.0, low_inclusive=False, allow_inf=False)
    if count_noise_std is None:
        if expected_batch_size is None:
            if float(np.asarray(noise_multiplier)) > 0:
                raise ValueError(
                    f"{fn}: give count_noise_std (the paper suggests expected_batch_size / 20), "
                    "or expected_batch_size"
                )
            count_noise_std = 0.0
        else:
            count_noise_std = float(np.asarray(expected_batch_size)) / 20.0
    check_scalar(fn, "count_noise_std", count_noise_std)
    z_grad = noise_multiplier_for_gradient(noise_multiplier, count_noise_std)
    geometric_update = bool(static_value(fn, "geometric_update", geometric_update))
    nan_safe = bool(static_value(fn, "nan_safe", nan_safe))
    key0 = _key(seed, fn)

    def init_fn(params: Any) -> DPQuantileAggregateState:
        dtype = _norms.tree_acc_dtype(jax.tree_util.tree_leaves(params))
        return DPQuantileAggregateState(
            rng_key=key0, clip_norm=jnp.asarray(initial_l2_norm_clip, dtype), count=_count0()
        )

    def update_fn(
        updates: Any,
        state: DPQuantileAggregateState,
        params: Any = None,
        *,
        mask: Any = None,
        **extra: Any,
    ) -> tuple:
        del params, extra
        refuse_update_averaging(fn)
        flat, batch = batch_flatten(updates, fn)
        arrays = flat.arrays
        new_key, count_key, *keys = jax.random.split(state.rng_key, len(arrays) + 2)
        if not arrays or batch is None:
            return updates, state._replace(rng_key=new_key, count=increment(state.count))
        acc = np.dtype(jnp.result_type(_norms.tree_acc_dtype(arrays), state.clip_norm.dtype))
        clip = state.clip_norm.astype(acc)
        sums, n, keep = _clip_sum(arrays, clip, nan_safe, mask, fn, batch, store=_lowest(arrays))
        m = _divisor(expected_batch_size, batch, acc)
        out = noised_leaves(sums, keys, clip * jnp.asarray(z_grad, acc), m, fn=fn)
        out = [o.astype(x.dtype) for o, x in zip(out, arrays, strict=True)]

        # Noised, recentred fraction of unclipped examples (TF-Privacy form).
        checked = None if mask is None else check_mask(fn, mask, batch)
        real = jnp.ones((batch,), bool) if checked is None else checked
        real = match_batch_sharding(real, n)
        keep = match_batch_sharding(keep, n)
        unclipped = (n <= clip) & keep & real
        centred = jnp.sum(jnp.where(real, unclipped.astype(acc) - 0.5, jnp.zeros((), acc)))
        noisy = centred + jnp.asarray(count_noise_std, acc) * jax.random.normal(count_key, (), acc)
        frac = jnp.clip(noisy / m + 0.5, 0.0, 1.0)
        err = frac - jnp.asarray(target_unclipped_quantile, acc)
        lr = jnp.asarray(clip_learning_rate, acc)
        new_clip = clip * jnp.exp(-lr * err) if geometric_update else clip - lr * err
        new_clip = jnp.clip(
            new_clip, jnp.asarray(min_l2_norm_clip, acc), jnp.asarray(max_l2_norm_clip, acc)
        )
        new_state = DPQuantileAggregateState(
            rng_key=new_key,
            clip_norm=new_clip.astype(state.clip_norm.dtype),
            count=increment(state.count),
        )
        return flat.rebuild(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
