"""skip_on_spike: a detected spike becomes a skipped step (zero updates)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core.hyperparam_rules import increment
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_state, check_transform, static_value
from gradclip_jax.transforms import _stateful as _st

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class SkipOnSpikeState(NamedTuple):
    """State of :func:`skip_on_spike`.

    Attributes:
      inner_state: the wrapped transformation's state.
      skipped: whether the last update was replaced by zeros.
      num_skipped: how many updates have been replaced by zeros (int32).
    """

    inner_state: Any
    skipped: jax.Array
    num_skipped: jax.Array


def skip_on_spike(
    inner: optax.GradientTransformation, field: str = "spike"
) -> optax.GradientTransformationExtraArgs:
    """Replaces the update by zeros when the wrapped clipper flags a spike.

    Large-model trainers often skip a batch whose gradient spikes instead of
    clipping it. This wrapper runs ``inner`` (a clipper, or a chain holding one),
    reads the boolean ``field`` of its new state with
    :func:`optax.tree_utils.tree_get` (``any`` over its leaves for per-leaf flags),
    and when it is true returns zeros of the updates' shapes and dtypes. The
    inner state advances as ``inner`` decided (ZClip, for example, still feeds
    its threshold into the statistics; pass ``skip_stats_on_spike=True`` to
    :func:`zclip` to leave them alone as well).

    Put it *before* the optimizer in the chain, like any clipper: a zero
    gradient still moves momentum-based optimizers by their momentum and still
    advances their step counts. To make the optimizer skip the step entirely,
    wrap the whole chain instead (``skip_on_spike(optax.chain(zclip(), adam))``):
    the zero update then leaves the parameters unchanged, though the optimizer's
    state has still absorbed the spiky gradient's clipped value.

    Args:
      inner: the transformation to wrap; its state must hold exactly one field
        named ``field``.
      field: the flag to read (default ``'spike'``, set by :func:`zclip`; use
        ``'clipped'`` to skip whenever another clipper clips). ``'clipped'`` is
        recorded by every norm-based clipper: the stateless
        :func:`clip_by_global_norm`, :func:`clip_by_norm`,
        :func:`clip_by_block_rms` and :func:`adaptive_grad_clip` as well as the
        stateful and adaptive ones. :func:`clip_by_value` / :func:`clip`,
        :func:`normalize` and :func:`centralize` record no flag and cannot be
        wrapped this way. The EMA clippers (:func:`clip_norm_by_ema`,
        :func:`normalize_by_ema`, :func:`clip_value_by_ema`) flag ``'clipped'``
        whenever the update exceeds its running average: on every step while
        they warm up from ``init=0``, and on many steps after, so skipping on
        them skips most steps. To skip spikes, wrap :func:`zclip` (``'spike'``,
        nothing flagged during its warm-up) or a growth clipper
        (:func:`clip_norm_growth`, :func:`clip_value_growth`: flagged only when
        the update grows more than ``mul`` times).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with state
      :class:`SkipOnSpikeState`.

    Raises:
      ValueError: at ``init``, when the inner state has no field ``field`` or
        more than one.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import skip_on_spike, zclip
      >>> tx = skip_on_spike(zclip(z_thresh=2.0, warmup_steps=2))
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in (0.5, 1.5, 3.0):  # the third norm is a spike
      ...     out, state = tx.update(jnp.array([g]), state)
      >>> out, int(state.num_skipped)
      (Array([0.], dtype=float32), 1)
    """
    fn = "skip_on_spike"
    field = static_value(fn, "field", field)
    if not isinstance(field, str):
        raise TypeError(f"{fn}: `field` must be a string, got {field!r}")
    check_transform(fn, "inner", inner)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> SkipOnSpikeState:
        inner_state = inner.init(params)
        found = optax.tree_utils.tree_get_all_with_path(inner_state, field)
        if len(found) != 1:
            what = "no field" if not found else f"{len(found)} fields"
            raise ValueError(
                f"{fn}: the inner state has {what} named {field!r}; wrap a transformation "
                f"whose state has exactly one (zclip sets 'spike'; every norm-based clipper sets "
                "'clipped'; clip_by_value, normalize and centralize set none)"
            )
        return SkipOnSpikeState(
            inner_state=inner_state, skipped=jnp.zeros((), bool), num_skipped=_st.count0()
        )

    def update_fn(updates: Any, state: SkipOnSpikeState, params: Any = None, **extra: Any) -> tuple:
        check_state(fn, state, SkipOnSpikeState)
        out, inner_state = inner.update(updates, state.inner_state, params, **extra)
        flag = optax.tree_utils.tree_get(inner_state, field)
        spike = _st.any_true(jax.tree_util.tree_leaves(flag))

        def zero(x: Any) -> Any:
            if getattr(x, "dtype", None) == jax.dtypes.float0:
                return x
            return jnp.where(spike, jnp.zeros_like(x), x)

        out = jax.tree_util.tree_map(zero, out)
        return out, SkipOnSpikeState(
            inner_state=inner_state,
            skipped=spike,
            num_skipped=jnp.where(spike, increment(state.num_skipped), state.num_skipped),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
