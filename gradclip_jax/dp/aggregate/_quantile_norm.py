"""Adaptive clipping (Andrew et al. 2021): :func:`dp_quantile_aggregate`, whose clip norm
follows a quantile of the per-example norms through a noised count, and the split of the
noise between that count and the gradient sum (:func:`noise_multiplier_for_gradient`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.hyperparam_rules import increment
from gradclip_jax._core.numerics import count0 as _count0, lowest_precision
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import (
    check_mask,
    check_scalar,
    check_state,
    either_spelling,
    is_traced,
    static_value,
)
from gradclip_jax.dp._guards import refuse_update_averaging
from gradclip_jax.dp.aggregate._shared import batch_divisor, clip_sum_rows, seed_key
from gradclip_jax.dp.noise import noised_leaves, split_stored
from gradclip_jax.per_example.internal import batch_flatten, match_batch_sharding


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
      >>> from gradclip_jax import noise_multiplier_for_gradient
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


def _clip_norm_arguments(
    initial: Any, low: Any, high: Any, initial_alias: Any, low_alias: Any, high_alias: Any
) -> tuple[Any, Any, Any]:
    """The clip norm's start and clamp, each under its DP-API name (``initial_l2_clip_norm``, ...)
    or optax's spelling (``initial_l2_norm_clip``, ...), without a warning; the defaults 0.1, 0, inf."""
    fn = "dp_quantile_aggregate"
    values = [
        either_spelling(fn, f"{name}_l2_clip_norm", f"{name}_l2_norm_clip", value, alias)
        for name, value, alias in (
            ("initial", initial, initial_alias),
            ("min", low, low_alias),
            ("max", high, high_alias),
        )
    ]
    initial, low, high = (
        d if v is None else v for v, d in zip(values, (0.1, 0.0, float("inf")), strict=True)
    )
    return initial, low, high


def dp_quantile_aggregate(
    noise_multiplier: float,
    seed: Any,
    *,
    initial_l2_clip_norm: float | None = None,
    target_unclipped_quantile: float = 0.5,
    clip_learning_rate: float = 0.2,
    expected_batch_size: float | None = None,
    count_noise_std: float | None = None,
    geometric_update: bool = True,
    min_l2_clip_norm: float | None = None,
    max_l2_clip_norm: float | None = None,
    nan_safe: bool = True,
    initial_l2_norm_clip: float | None = None,
    min_l2_norm_clip: float | None = None,
    max_l2_norm_clip: float | None = None,
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
      initial_l2_clip_norm: :math:`C_0 > 0` (default 0.1, the paper's).
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
      min_l2_clip_norm, max_l2_clip_norm: clamp of :math:`C` (defaults 0, inf).
      nan_safe: drop examples with non-finite gradients (they count as clipped).
      initial_l2_norm_clip, min_l2_norm_clip, max_l2_norm_clip: the same three under optax's
        spelling (``l2_norm_clip``), accepted without a warning; giving both spellings of one
        raises ``TypeError``.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with state
      :class:`DPQuantileAggregateState`, called as
      ``update(per_example_grads, state, params=None, mask=None)``. ``mask``, ``(B,)``
      booleans, marks the real examples: **pass it for padded batches** (Poisson
      batches padded to a fixed size). An unmasked row counts in the quantile's count
      even when it is all zeros (as an unclipped example), so an example taking a
      padding row's place would move the count by up to 1 instead of the 1/2 its
      accounting assumes. (The gradient sum is not affected: a zero row adds nothing.)

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import dp_quantile_aggregate
      >>> tx = dp_quantile_aggregate(1.0, seed=0, expected_batch_size=100)
      >>> state = tx.init({'w': jnp.zeros(3)})
      >>> updates, state = tx.update({'w': jnp.ones((100, 3))}, state)
      >>> bool(state.clip_norm < 0.1)  # every norm (1.73) > 0.1: C must grow
      False
    """
    fn = "dp_quantile_aggregate"
    initial_l2_norm_clip, min_l2_norm_clip, max_l2_norm_clip = _clip_norm_arguments(
        initial_l2_clip_norm,
        min_l2_clip_norm,
        max_l2_clip_norm,
        initial_l2_norm_clip,
        min_l2_norm_clip,
        max_l2_norm_clip,
    )
    check_scalar(fn, "noise_multiplier", noise_multiplier)
    check_scalar(fn, "initial_l2_norm_clip", initial_l2_norm_clip, low=0.0, low_inclusive=False)
    check_scalar(fn, "target_unclipped_quantile", target_unclipped_quantile, high=1.0)
    check_scalar(fn, "clip_learning_rate", clip_learning_rate)
    check_scalar(fn, "min_l2_norm_clip", min_l2_norm_clip)
    check_scalar(fn, "max_l2_norm_clip", max_l2_norm_clip)
    if float(np.asarray(min_l2_norm_clip)) > float(np.asarray(max_l2_norm_clip)):
        raise ValueError(f"{fn}: min_l2_norm_clip must not exceed max_l2_norm_clip")
    if expected_batch_size is not None:
        check_scalar(
            fn,
            "expected_batch_size",
            expected_batch_size,
            low=0.0,
            low_inclusive=False,
            allow_inf=False,
        )
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
    key0 = seed_key(seed, fn)

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
        check_state(fn, state, DPQuantileAggregateState)
        refuse_update_averaging(fn)
        flat, batch = batch_flatten(updates, fn)
        arrays = flat.arrays
        new_key, count_key, *keys = split_stored(state.rng_key, len(arrays) + 2)
        if not arrays or batch is None:
            return updates, state._replace(rng_key=new_key, count=increment(state.count))
        acc = np.dtype(jnp.result_type(_norms.tree_acc_dtype(arrays), state.clip_norm.dtype))
        clip = state.clip_norm.astype(acc)
        sums, n, keep = clip_sum_rows(
            arrays, clip, nan_safe, mask, fn, batch, store=lowest_precision(x.dtype for x in arrays)
        )
        m = batch_divisor(expected_batch_size, batch, acc)
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
