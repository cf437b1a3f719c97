"""DP-SGD at a given clip norm: :func:`dp_aggregate` (clip per-example gradients, sum, noise,
divide), the :func:`dpsgd` optimizer on it, and :func:`dp_noise` for sums clipped already."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.hyperparam_rules import Hyperparam, Hyperparams, increment, poison
from gradclip_jax._core.numerics import count0 as _count0, lowest_precision
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_state, clip_norm_arg, static_value
from gradclip_jax.dp._guards import refuse_update_averaging
from gradclip_jax.dp.aggregate._shared import batch_divisor, clip_sum_rows, seed_key
from gradclip_jax.dp.noise import noised_leaves, split_stored
from gradclip_jax.per_example.internal import batch_flatten


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
        skips the step when it wraps what comes after this transform
        (``optax.chain(dp_aggregate(...), optax.apply_if_finite(optax.sgd(lr), 3))``;
        wrapped around this transform, optax's skipped step returns zeros shaped
        like the per-example input, which ``lax.cond`` cannot match with the
        summed output: a ``TypeError``).
      seed: an int seed or a ``jax.random`` key. The privacy guarantee assumes
        the noise is secret: in production draw the seed from a secure source
        (``gradclip_jax.dp.hardened.os_key()``, or ``secrets.randbits(64)``: an int
        seed keeps all its bits, also without 64-bit mode) and do not log it.
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
      :class:`DPAggregateState`, called as
      ``update(per_example_grads, state, params=None, mask=None)``:
      ``mask`` (shape ``(B,)``, bool) marks real examples; padding
      rows contribute nothing (still divided by ``batch_size``).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from gradclip_jax import dp_aggregate
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
    hps.add(
        "batch_size", batch_size, low=0.0, low_inclusive=False, allow_inf=False, allow_none=True
    )
    nan_safe = bool(static_value(fn, "nan_safe", nan_safe))
    key0 = seed_key(seed, fn)

    def init_fn(params: Any) -> DPAggregateState:
        del params
        return DPAggregateState(rng_key=key0, count=_count0())

    def update_fn(
        updates: Any, state: DPAggregateState, params: Any = None, *, mask: Any = None, **extra: Any
    ) -> tuple:
        del params, extra
        check_state(fn, state, DPAggregateState)
        refuse_update_averaging(fn)
        flat, batch = batch_flatten(updates, fn)
        arrays = flat.arrays
        new_key, *keys = split_stored(state.rng_key, len(arrays) + 1)
        if not arrays or batch is None:
            return updates, DPAggregateState(rng_key=new_key, count=increment(state.count))
        acc = _norms.tree_acc_dtype(arrays)
        v, invalid = hps.at(state.count, acc)
        clip, z = v[clip_norm.name], v["noise_multiplier"]
        sums, _, _ = clip_sum_rows(
            arrays, clip, nan_safe, mask, fn, batch, store=lowest_precision(x.dtype for x in arrays)
        )
        out = noised_leaves(sums, keys, clip * z, batch_divisor(v["batch_size"], batch, acc), fn=fn)
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
      >>> from gradclip_jax import dpsgd
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
        optax.trace(decay=momentum, nesterov=nesterov)
        if momentum is not None
        else optax.identity(),
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

    The privatizer to put after :func:`gradclip_jax.clipped_grad`:
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
        noise once per logical step instead (:func:`gradclip_jax.make_private`
        with ``physical_batch_size``, or its ``clipped_sum``/``noisy_update``).

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import dp_noise
      >>> tx = dp_noise(stddev=0.0, seed=0, normalize_by=4)
      >>> tx.update({'w': jnp.array([2.0])}, tx.init(None))[0]
      {'w': Array([0.5], dtype=float32)}
    """
    fn = "dp_noise"
    hps = Hyperparams(fn)
    hps.add("stddev", stddev)
    hps.add("normalize_by", normalize_by, low=0.0, low_inclusive=False, allow_inf=False)
    key0 = seed_key(seed, fn)

    def init_fn(params: Any) -> DPAggregateState:
        del params
        return DPAggregateState(rng_key=key0, count=_count0())

    def update_fn(updates: Any, state: DPAggregateState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, DPAggregateState)
        refuse_update_averaging(fn)
        flat = _norms.flatten(updates, fn)
        arrays = flat.arrays
        new_key, *keys = split_stored(state.rng_key, len(arrays) + 1)
        if arrays:
            acc = _norms.tree_acc_dtype(arrays)
            v, invalid = hps.at(state.count, acc)
            sums = [x.astype(jnp.result_type(_norms.sum_dtype(x.dtype), acc)) for x in arrays]
            out = noised_leaves(sums, keys, v["stddev"], v["normalize_by"], fn=fn)
            # an invalid traced value (a negative stddev negates the noise) gives NaN
            updates = flat.rebuild(
                [poison(o, invalid).astype(x.dtype) for o, x in zip(out, arrays, strict=True)]
            )
        return updates, DPAggregateState(rng_key=new_key, count=increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)
