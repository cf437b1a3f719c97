"""ZClip: z-score spike detection on EMA statistics of the gradient norm."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.hyperparam_rules import Hyperparam, Hyperparams, mark_static
from gradclip_jax._core.norms import OrdLike
from gradclip_jax._core.numerics import sqrt_safe
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_bool, check_choice, check_int, check_state
from gradclip_jax.transforms import _stateful as _st
from gradclip_jax.transforms._stateful import finish

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class ZClipState(NamedTuple):
    """State of :func:`zclip`.

    Attributes:
      count: number of updates absorbed so far (int32); ZClip is active once it
        reaches ``warmup_steps``.
      mean: :math:`\\mu`, during warm-up the running mean of the norms, then
        their EMA.
      var: :math:`v = \\sigma^2`, during warm-up the running *population*
        variance (Welford), then the EMA variance.
      norm: the global norm of the last update before clipping.
      clip_norm: the threshold in force at the last update: the adaptive
        threshold on a spike, else the norm itself, capped by
        ``max_grad_norm`` (the reference's "effective clip").
      clipped: whether the last update was clipped.
      spike: whether the last update was detected as a spike (what
        :func:`skip_on_spike` reads).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    mean: jax.Array
    var: jax.Array
    norm: jax.Array
    clip_norm: jax.Array
    clipped: jax.Array
    spike: jax.Array


@mark_static("warmup_steps", "mode", "clip_option", "ord", "axis_name")
def zclip(
    alpha: Hyperparam = 0.97,
    z_thresh: Hyperparam = 2.5,
    warmup_steps: int = 25,
    mode: str = "zscore",
    clip_option: str = "adaptive_scaling",
    max_grad_norm: Hyperparam | None = None,
    clip_factor: Hyperparam = 1.0,
    *,
    eps: Hyperparam = 1e-6,
    rel_std_floor: Hyperparam = 1e-3,
    skip_stats_on_spike: bool = False,
    ord: OrdLike = 2,  # noqa: A002
    skip_nonfinite: bool = True,
    axis_name: Any = None,
) -> optax.GradientTransformation:
    """ZClip: z-score spike detection on EMA statistics of the gradient norm.

    Kumar, Owen, Roy Chowdhury, Güra, "ZClip: Adaptive Spike Mitigation for LLM
    Pre-Training", 2025 (reference code: bluorion-com/ZClip). With :math:`n` the
    global norm of this step and :math:`\\mu`, :math:`\\sigma^2` the statistics of
    the previous steps:

    *Warm-up* (the first ``warmup_steps`` steps): no z-clipping (only
    ``max_grad_norm``, if set); the norms are accumulated, and at the end of the
    warm-up :math:`\\mu` is their mean and :math:`\\sigma^2` their population
    variance (divide by N).

    *Afterwards*, with :math:`\\sigma' = \\max(\\sigma, \\text{rel\\_std\\_floor} \\cdot \\mu)`:

    .. math::

        z &= (n - \\mu) / (\\sigma' + \\text{eps}), \\qquad \\text{spike} = z > z_{thr} \\\\
        \\tau &= \\text{clip\\_factor} \\cdot (\\mu + z_{thr}^2 \\sigma' / z) \\quad
              \\text{(}\\texttt{'adaptive\\_scaling'}\\text{; }\\texttt{'mean'}\\text{: } \\tau = \\mu) \\\\
        \\tau_{eff} &= \\min(\\tau \\text{ if spike else } n,\\; \\text{max\\_grad\\_norm}) \\\\
        g &\\leftarrow g \\cdot \\min(1, \\tau_{eff} / n) \\\\
        x &= \\tau \\text{ if spike else } n, \\quad
        \\mu \\leftarrow \\alpha\\mu + (1-\\alpha)x, \\quad
        \\sigma^2 \\leftarrow \\alpha\\sigma^2 + (1-\\alpha)(x - \\mu_{new})^2

    The variance update uses the already-updated mean, as the reference code
    does. ``mode='percentile'`` (the reference's name; not a true percentile)
    uses :math:`\\tau = \\mu + z_{thr}\\sigma'` and spike :math:`= n > \\tau`.

    Guards the reference lacks: ``rel_std_floor`` keeps :math:`\\sigma'` from
    being 0 when the warm-up norms are all equal (otherwise the update is capped
    at :math:`\\mu` for good); a spike is only detected when :math:`\\mu > 0`, so
    all-zero warm-up norms cannot zero later updates; non-finite norms are
    skipped (``skip_nonfinite``).

    Note ``max_grad_norm`` defaults to ``None`` (pure ZClip); the reference's
    default is 1.0, i.e. ZClip combined with fixed clipping at 1.0.

    Args:
      alpha: EMA decay of the statistics in [0, 1) (default 0.97).
      z_thresh: :math:`z_{thr}` > 0 (default 2.5).
      warmup_steps: steps of statistics collection before ZClip acts
        (default 25; >= 1).
      mode: ``'zscore'`` (default) or ``'percentile'``.
      clip_option: with ``mode='zscore'``: ``'adaptive_scaling'`` (default) or
        ``'mean'``.
      max_grad_norm: optional fixed cap on the global norm, at every step
        (warm-up included).
      clip_factor: multiplies the adaptive threshold (default 1.0; the README
        suggests 0.5-0.9 for more aggressive clipping).
      eps: added to :math:`\\sigma'` in the z-score (default 1e-6, as the
        reference).
      rel_std_floor: floor on :math:`\\sigma` relative to :math:`\\mu` (default
        1e-3; 0 gives the reference's behaviour).
      skip_stats_on_spike: do not update the statistics on a spike (the
        reference's ``skip_update_on_spike``; default False). To skip the
        *optimizer step* on a spike instead, wrap with :func:`skip_on_spike`.
      ord: the norm (default 2), any ``ord`` of the engine.
      skip_nonfinite: pass updates with a non-finite norm through unchanged and
        keep the state (default True).
      axis_name: for leaves sharded by hand inside ``shard_map``/``pmap``.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ZClipState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import zclip
      >>> tx = zclip(z_thresh=2.0, warmup_steps=2)
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in (0.5, 1.5):  # warm-up: mean 1, std 0.5
      ...     out, state = tx.update(jnp.array([g]), state)
      >>> out, state = tx.update(jnp.array([3.0]), state)  # z = 4: clip to 1 + 4 * 0.5 / 4
      >>> round(float(out[0]), 4), bool(state.spike)
      (1.5, True)
    """
    fn = "zclip"
    spec = _norms.parse_ord(ord, fn)
    warm = check_int(fn, "warmup_steps", warmup_steps, 1)
    md = check_choice(fn, "mode", mode, ("zscore", "percentile"))
    opt = check_choice(fn, "clip_option", clip_option, ("adaptive_scaling", "mean"))
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    skip_stats = check_bool(fn, "skip_stats_on_spike", skip_stats_on_spike)
    hps = _zclip_hyperparams(alpha, z_thresh, max_grad_norm, clip_factor, eps, rel_std_floor)

    def update_fn(updates: Any, state: ZClipState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, ZClipState)
        flat = _st.measured(updates, spec, fn)
        dt = state.norm.dtype
        v, invalid = hps.at(state.count, dt)
        n, over = _norms.global_norm_and_overflow(flat.arrays, spec, axis_name, dt)
        in_warmup = state.count < warm
        tau, spike = _zclip_threshold(n, state.mean, state.var, ~in_warmup, v, md, opt)
        cap = jnp.where(spike, tau, n)
        if max_grad_norm is not None:
            cap = jnp.minimum(cap, v["max_grad_norm"])
        out, ok, fields = finish(flat, n, over, cap, state, skip, invalid)
        mean, var = _zclip_statistics(
            n, state, in_warmup, jnp.where(spike, tau, n), spike & skip_stats, v
        )
        return out, ZClipState(
            mean=jnp.where(ok, mean, state.mean),
            var=jnp.where(ok, var, state.var),
            spike=ok & spike,
            **fields,
        )

    return optax.GradientTransformation(_zclip_init, update_fn)


def _zclip_hyperparams(
    alpha: Hyperparam,
    z_thresh: Hyperparam,
    max_grad_norm: Hyperparam | None,
    clip_factor: Hyperparam,
    eps: Hyperparam,
    rel_std_floor: Hyperparam,
) -> Hyperparams:
    """ZClip's checked hyperparameters (numbers, arrays or schedules)."""
    hps = Hyperparams("zclip")
    hps.add("alpha", alpha, low=0.0, high=1.0, high_inclusive=False)
    hps.add("z_thresh", z_thresh, low=0.0, low_inclusive=False, allow_inf=False)
    hps.add("max_grad_norm", max_grad_norm, low=0.0, allow_none=True)
    hps.add("clip_factor", clip_factor, low=0.0, low_inclusive=False, allow_inf=False)
    hps.add("eps", eps, low=0.0)
    hps.add("rel_std_floor", rel_std_floor, low=0.0, allow_inf=False)
    return hps


def _zclip_init(params: Any) -> ZClipState:
    """ZClip's first state: zero statistics in the dtype of ``params``' scalars."""
    dt = _st.scalar_dtype(params)
    mean, var, norm, cap = (jnp.zeros((), dt) for _ in range(4))  # distinct buffers: donatable
    return ZClipState(
        count=_st.count0(),
        mean=mean,
        var=var,
        norm=norm,
        clip_norm=cap,
        clipped=jnp.zeros((), bool),
        spike=jnp.zeros((), bool),
    )


def _zclip_threshold(
    n: jax.Array,
    mean: jax.Array,
    var: jax.Array,
    active: jax.Array,
    v: dict,
    mode: str,
    option: str,
) -> tuple[jax.Array, jax.Array]:
    """ZClip's adaptive threshold ``tau`` and spike flag against the previous statistics."""
    zt = v["z_thresh"]
    std = sqrt_safe(var)  # (a zero derivative at var = 0: jnp.sqrt's is inf, and grads were NaN)
    std = jnp.maximum(std, v["rel_std_floor"] * mean)
    live = active & (mean > 0)
    if mode == "percentile":
        tau = mean + zt * std
        return tau, live & (n > tau)
    z = (n - mean) / (std + v["eps"])
    spike = live & (z > zt)
    if option == "adaptive_scaling":
        eta = _st.safe_div(z, zt, spike)  # z / z_thresh on a spike
        tau = (mean + zt * std / eta) * v["clip_factor"]
    else:
        tau = mean
    return tau, spike


def _zclip_statistics(
    n: jax.Array, state: ZClipState, in_warmup: jax.Array, x: jax.Array, frozen: jax.Array, v: dict
) -> tuple[jax.Array, jax.Array]:
    """The next ``(mean, var)``: Welford during warm-up, then the EMA of ``x`` (unless ``frozen``)."""
    mean, var = state.mean, state.var
    k = (state.count + 1).astype(mean.dtype)
    delta = n - mean
    mean_w = mean + delta / k
    var_w = var + (delta * (n - mean_w) - var) / k
    a = v["alpha"]
    mean_a = a * mean + (1 - a) * x
    var_a = a * var + (1 - a) * (x - mean_a) ** 2
    mean_a = jnp.where(frozen, mean, mean_a)
    var_a = jnp.where(frozen, var, var_a)
    return jnp.where(in_warmup, mean_w, mean_a), jnp.where(in_warmup, var_w, var_a)
