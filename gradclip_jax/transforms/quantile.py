"""Quantile clipping: a threshold that tracks a quantile of the norms by stochastic approximation."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    mark_static,
    poison,
    resolve,
)
from gradclip_jax._core.norms import OrdLike
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_bool, check_scalar, check_state
from gradclip_jax.transforms import _stateful as _st
from gradclip_jax.transforms._stateful import finish

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class QuantileClipState(NamedTuple):
    """State of :func:`quantile_clip`.

    Attributes:
      count: number of updates absorbed so far (int32).
      estimate: the clip norm :math:`C` for the next update.
      norm: the global norm of the last update before clipping.
      clip_norm: the clip norm used at the last update (``initial_norm`` before
        the first).
      clipped: whether the last update was clipped.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    estimate: jax.Array
    norm: jax.Array
    clip_norm: jax.Array
    clipped: jax.Array


@mark_static("ord", "axis_name")
def quantile_clip(
    target_quantile: Hyperparam = 0.5,
    learning_rate: Hyperparam = 0.2,
    initial_norm: Hyperparam = 0.1,
    *,
    ord: OrdLike = 2,  # noqa: A002
    skip_nonfinite: bool = True,
    axis_name: Any = None,
) -> optax.GradientTransformation:
    """Clips to a norm that tracks a quantile of the gradient norms (non-private Andrew et al.).

    Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
    Adaptive Clipping", NeurIPS 2021, without the noise (TF-Privacy's
    ``NoPrivacyQuantileEstimatorQuery`` with the geometric update). With
    :math:`n_t` the global norm and :math:`\\gamma` the target quantile:

    .. math::

        g_t &\\leftarrow g_t \\cdot \\min(1, C_t / n_t) \\\\
        C_{t+1} &= C_t \\cdot \\exp\\big(-\\eta\\,(\\mathbb 1[n_t \\le C_t] - \\gamma)\\big)

    so :math:`C` settles where a fraction :math:`\\gamma` of the norms is at most
    :math:`C` (about :math:`1-\\gamma` of the steps are clipped). One step changes
    :math:`C` by at most a factor :math:`e^{\\eta}`; :math:`C` stays positive.
    A cheap streaming alternative to :func:`autoclip`'s sorted history.

    Args:
      target_quantile: :math:`\\gamma` in [0, 1] (default 0.5, the median).
      learning_rate: :math:`\\eta` >= 0 (default 0.2).
      initial_norm: :math:`C_0` > 0 (default 0.1).
      ord: the norm (default 2), any ``ord`` of the engine.
      skip_nonfinite: when the norm is not finite, pass the update through
        unchanged and keep the state (default True).
      axis_name: for leaves sharded by hand inside ``shard_map``/``pmap``.

    Returns:
      An :class:`optax.GradientTransformation` with state
      :class:`QuantileClipState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import quantile_clip
      >>> tx = quantile_clip(initial_norm=1.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> out, state = tx.update(jnp.array([3.0, 4.0]), state)  # clipped to C = 1
      >>> out.round(6)  # a clipped result sits a few ulp inside the bound
      Array([0.6, 0.8], dtype=float32)
      >>> round(float(state.estimate), 6)  # exp(0.2 * 0.5): C grows
      1.105171
    """
    fn = "quantile_clip"
    spec = _norms.parse_ord(ord, fn)
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = Hyperparams(fn)
    hps.add("target_quantile", target_quantile, low=0.0, high=1.0)
    hps.add("learning_rate", learning_rate, low=0.0, allow_inf=False)
    check_scalar(fn, "initial_norm", initial_norm, low=0.0, low_inclusive=False, allow_inf=False)

    def init_fn(params: Any) -> QuantileClipState:
        dt = _st.scalar_dtype(params)
        count = _st.count0()
        c0 = jnp.asarray(resolve(initial_norm, count), dt).reshape(())
        # a run-time C_0 <= 0 (or NaN): NaN, not a clip norm of 0 forever
        c0 = poison(c0, ~(c0 > 0))
        return QuantileClipState(
            count=count,
            estimate=c0,
            norm=jnp.zeros((), dt),
            clip_norm=jnp.array(c0),  # a copy: donatable
            clipped=jnp.zeros((), bool),
        )

    def update_fn(updates: Any, state: QuantileClipState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, QuantileClipState)
        flat = _st.measured(updates, spec, fn)
        dt = state.norm.dtype
        v, invalid = hps.at(state.count, dt)
        c = state.estimate
        n, over = _norms.global_norm_and_overflow(flat.arrays, spec, axis_name, dt)
        unclipped = (n <= c).astype(dt)
        nxt = c * jnp.exp(-v["learning_rate"] * (unclipped - v["target_quantile"]))
        out, ok, fields = finish(flat, n, over, c, state, skip, invalid)
        return out, QuantileClipState(estimate=jnp.where(ok, nxt, c), **fields)

    return optax.GradientTransformation(init_fn, update_fn)
