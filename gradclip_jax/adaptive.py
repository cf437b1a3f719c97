"""Adaptive clippers: the clip threshold follows the history of gradient norms.

* :func:`autoclip`: AutoClip (Seetharaman et al. 2020), clip to a percentile of
  all past norms (a fixed-size ring buffer);
* :func:`zclip`: ZClip (Kumar et al. 2025), z-score spike detection on EMA
  statistics of the norm;
* :func:`adagc`: AdaGC (Wang et al. 2025), per-tensor thresholds from an EMA of
  each leaf's clipped norm;
* :func:`quantile_clip`: the non-private form of Andrew et al. (2021), a clip
  norm that tracks a quantile of the norms by geometric updates;
* :func:`skip_on_spike`: a wrapper that turns a detected spike into a skipped
  step (zero updates), the "skip the batch" pattern large-model trainers write
  by hand.

Shared rules (shared spec: ``adaptive-methods.md`` §0, §10):

* Place them first in the chain, on the raw gradients: every statistic is of the
  pre-clip norm of this transform's input, measured by the norm engine (any
  ``ord``; ``axis_name`` for leaves sharded by hand in ``shard_map``/``pmap``).
* Clipping is exact: the update is scaled by ``threshold / norm`` when
  ``norm > threshold`` and left unchanged otherwise (the PyTorch references add
  ``1e-6`` to the norm; results differ by about ``1e-6`` relative).
* ``skip_nonfinite`` (default on): when the measured norm is not finite, the
  update passes through unchanged and the statistics and ``count`` are left as
  they were, as if the step had not happened (``optax.apply_if_finite`` is the
  companion that also skips the step). The monitoring fields report that step:
  ``norm`` holds the non-finite value and ``clipped`` is False.
* States are ``NamedTuple``\\ s of fixed shapes with ``count``, ``norm`` (the
  pre-clip norm), ``clip_norm`` (the threshold in force) and ``clipped``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradclip_jax import _stateful as _st
from gradclip_jax import norms as _norms
from gradclip_jax._states import check_state, check_tree
from gradclip_jax.clipping import clip_factor as _clip_factor
from gradclip_jax.hyperparams import (
    Hyperparam,
    Hyperparams,
    check_scalar,
    counts,
    increment,
    mark_static,
    poison,
    resolve,
    static_value,
)
from gradclip_jax.norms import OrdLike

__all__ = [
    "AutoClipState",
    "ZClipState",
    "AdaGCState",
    "QuantileClipState",
    "SkipOnSpikeState",
    "autoclip",
    "zclip",
    "adagc",
    "quantile_clip",
    "skip_on_spike",
]


def _finish(
    flat: _norms.FlatTree, f: jax.Array, n: jax.Array, thr: jax.Array, state: Any, skip: bool,
    invalid: jax.Array | None,
) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """The shared ending of the global-norm clippers (autoclip, zclip, quantile_clip).

    Scales the update by ``f`` (by 1 when ``skip`` and the norm ``n`` is not
    finite; NaN when a hyperparameter is ``invalid``) and returns
    ``(out, ok, fields)``: ``ok`` says whether the step counts, and ``fields`` are
    the state's monitoring fields ``count``, ``norm``, ``clip_norm`` (``thr``, or
    the previous one on a skipped step) and ``clipped``.
    """
    ok = (jnp.isfinite(n) if skip else jnp.ones((), bool)) & counts(invalid)
    out = _st.scale_all(flat, poison(jnp.where(ok, f, jnp.ones_like(f)), invalid))
    fields = {
        "count": jnp.where(ok, increment(state.count), state.count),
        "norm": n,
        "clip_norm": jnp.where(ok, thr, state.clip_norm),
        "clipped": ok & (f < 1),
    }
    return out, ok, fields


# ----------------------------------------------------------------------------
# AutoClip
# ----------------------------------------------------------------------------


class AutoClipState(NamedTuple):
    """State of :func:`autoclip`.

    Attributes:
      count: number of updates absorbed so far (int32; drives schedules).
      history: ring buffer of the last ``history_size`` recorded norms (only the
        first ``filled`` slots are meaningful; order does not matter).
      head: the slot the next recorded norm goes to (int32).
      filled: how many slots hold a recorded norm (int32, at most
        ``history_size``).
      norm: the global norm of the last update before clipping.
      clip_norm: the threshold in force at the last update (``inf`` while
        nothing has been recorded).
      clipped: whether the last update was clipped.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    history: jax.Array
    head: jax.Array
    filled: jax.Array
    norm: jax.Array
    clip_norm: jax.Array
    clipped: jax.Array


def _percentile(history: jax.Array, filled: jax.Array, q: jax.Array) -> jax.Array:
    """NumPy's ``'linear'`` percentile (``q`` in [0, 1]) of ``history[:filled]``; inf if empty."""
    size = history.shape[0]
    dt = history.dtype
    valid = jnp.arange(size) < filled
    vals = jnp.sort(jnp.where(valid, history, jnp.inf))
    vals = jnp.where(filled > 0, vals, jnp.zeros_like(vals))
    h = q * (filled.astype(dt) - 1)
    lo = jnp.floor(h)
    t = h - lo
    i = jnp.clip(lo.astype(jnp.int32), 0, size - 1)
    j = jnp.clip(i + 1, 0, jnp.maximum(filled - 1, 0))
    a, b = vals[i], vals[j]
    diff = b - a
    res = jnp.where(t >= 0.5, b - diff * (1 - t), a + diff * t)  # numpy's _lerp
    return jnp.where(filled > 0, res, jnp.full_like(res, jnp.inf))


@mark_static("history_size", "ord", "axis_name")
def autoclip(
    percentile: Hyperparam = 10.0,
    history_size: int = 1000,
    *,
    min_clip_norm: Hyperparam = 0.0,
    ord: OrdLike = 2,  # noqa: A002
    skip_nonfinite: bool = True,
    axis_name: Any = None,
) -> optax.GradientTransformation:
    """AutoClip: clips to a percentile of the history of gradient norms.

    Seetharaman, Wichern, Pardo, Le Roux, "AutoClip: Adaptive Gradient Clipping
    for Source Separation Networks", MLSP 2020. At every step, with :math:`n_t`
    the global norm:

    .. math::

        H_t &= H_{t-1} \\cup \\{n_t\\} \\quad \\text{(the last ``history_size`` recorded norms)} \\\\
        \\eta_t &= \\max(\\operatorname{percentile}_p(H_t), \\text{min\\_clip\\_norm}) \\\\
        g_t &\\leftarrow g_t \\cdot \\min(1, \\eta_t / n_t)

    The history includes the current step, as in the paper (so the first step is
    never clipped), and the percentile is NumPy's default ``'linear'``
    interpolation over the recorded norms. The paper's history is unbounded; here
    it is a ring buffer of ``history_size`` norms (the TensorFlow port's design).

    Norms that are not finite, and zero norms, are never recorded: a zero in the
    history could make the threshold 0 and zero every later update. With the
    paper's ``p = 10`` about 90% of steps are clipped; ``p = 100`` never clips.

    Args:
      percentile: :math:`p` in [0, 100] (default 10): number, array or schedule.
      history_size: how many past norms to keep (default 1000; >= 1).
      min_clip_norm: floor of the threshold (default 0.0, none).
      ord: the norm (default 2), any ``ord`` of the engine.
      skip_nonfinite: when the norm is not finite, pass the update through
        unchanged and keep the state, ``count`` included (default True). The
        norm is never recorded either way.
      axis_name: for leaves sharded by hand inside ``shard_map``/``pmap``.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`AutoClipState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.adaptive import autoclip
      >>> tx = autoclip(percentile=50.0, history_size=4)
      >>> state = tx.init(jnp.zeros(2))
      >>> for scale in (1.0, 3.0):  # norms 5 and 15: median 10
      ...     out, state = tx.update(scale * jnp.array([3.0, 4.0]), state)
      >>> out, float(state.clip_norm)
      (Array([6., 8.], dtype=float32), 10.0)
    """
    fn = "autoclip"
    spec = _norms.parse_ord(ord, fn)
    size = _st.check_int(fn, "history_size", history_size, 1)
    skip = _st.check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = Hyperparams(fn)
    hps.add("percentile", percentile, low=0.0, high=100.0)
    hps.add("min_clip_norm", min_clip_norm, low=0.0)

    def init_fn(params: Any) -> AutoClipState:
        dt = _st.scalar_dtype(params)
        zero = jnp.zeros((), dt)
        return AutoClipState(
            count=_st.count0(),
            history=jnp.zeros((size,), dt),
            head=_st.count0(),
            filled=_st.count0(),
            norm=zero,
            clip_norm=jnp.full((), jnp.inf, dt),
            clipped=jnp.zeros((), bool),
        )

    def update_fn(updates: Any, state: AutoClipState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, AutoClipState)
        flat = _st.measured(updates, spec, fn)
        dt = state.norm.dtype
        v, invalid = hps.at(state.count, dt)
        n = _norms.global_norm(flat.arrays, spec, axis_name, dtype=dt)
        finite = jnp.isfinite(n)
        record = finite & (n > 0)
        history = state.history.at[state.head].set(
            jnp.where(record, n, state.history[state.head])
        )
        head = jnp.where(record, (state.head + 1) % size, state.head)
        filled = jnp.where(record, jnp.minimum(state.filled + 1, size), state.filled)
        thr = jnp.maximum(_percentile(history, filled, v["percentile"] / 100), v["min_clip_norm"])
        out, _, fields = _finish(flat, _clip_factor(n, thr), n, thr, state, skip, invalid)
        return out, AutoClipState(history=history, head=head, filled=filled, **fields)

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# ZClip
# ----------------------------------------------------------------------------


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
              \\text{(``'adaptive_scaling'``; ``'mean'``: } \\tau = \\mu) \\\\
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
      >>> from gradclip_jax.adaptive import zclip
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
    warm = _st.check_int(fn, "warmup_steps", warmup_steps, 1)
    md = _st.check_choice(fn, "mode", mode, ("zscore", "percentile"))
    opt = _st.check_choice(fn, "clip_option", clip_option, ("adaptive_scaling", "mean"))
    skip = _st.check_bool(fn, "skip_nonfinite", skip_nonfinite)
    skip_stats = _st.check_bool(fn, "skip_stats_on_spike", skip_stats_on_spike)
    hps = Hyperparams(fn)
    hps.add("alpha", alpha, low=0.0, high=1.0, high_inclusive=False)
    hps.add("z_thresh", z_thresh, low=0.0, low_inclusive=False, allow_inf=False)
    hps.add("max_grad_norm", max_grad_norm, low=0.0, allow_none=True)
    hps.add("clip_factor", clip_factor, low=0.0, low_inclusive=False, allow_inf=False)
    hps.add("eps", eps, low=0.0)
    hps.add("rel_std_floor", rel_std_floor, low=0.0, allow_inf=False)

    def init_fn(params: Any) -> ZClipState:
        zero = jnp.zeros((), _st.scalar_dtype(params))
        no = jnp.zeros((), bool)
        return ZClipState(
            count=_st.count0(), mean=zero, var=zero, norm=zero, clip_norm=zero, clipped=no, spike=no
        )

    def update_fn(updates: Any, state: ZClipState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, ZClipState)
        flat = _st.measured(updates, spec, fn)
        dt = state.norm.dtype
        v, invalid = hps.at(state.count, dt)
        n = _norms.global_norm(flat.arrays, spec, axis_name, dtype=dt)
        in_warmup = state.count < warm
        tau, spike = _zclip_threshold(n, state.mean, state.var, ~in_warmup, v, md, opt)
        cap = jnp.where(spike, tau, n)
        if max_grad_norm is not None:
            cap = jnp.minimum(cap, v["max_grad_norm"])
        out, ok, fields = _finish(flat, _clip_factor(n, cap), n, cap, state, skip, invalid)
        mean, var = _zclip_statistics(n, state, in_warmup, jnp.where(spike, tau, n), spike & skip_stats, v)
        return out, ZClipState(
            mean=jnp.where(ok, mean, state.mean),
            var=jnp.where(ok, var, state.var),
            spike=ok & spike,
            **fields,
        )

    return optax.GradientTransformation(init_fn, update_fn)


def _zclip_threshold(
    n: jax.Array, mean: jax.Array, var: jax.Array, active: jax.Array, v: dict, mode: str, option: str
) -> tuple[jax.Array, jax.Array]:
    """ZClip's adaptive threshold ``tau`` and spike flag against the previous statistics."""
    zt = v["z_thresh"]
    std = jnp.sqrt(jnp.maximum(var, 0))
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


# ----------------------------------------------------------------------------
# AdaGC
# ----------------------------------------------------------------------------


class AdaGCState(NamedTuple):
    """State of :func:`adagc`. Per-leaf fields are trees shaped like the parameters.

    Attributes:
      count: number of updates absorbed so far (int32).
      gamma: :math:`\\gamma_i`, each leaf's reference norm: during warm-up the
        minimum of its positive post-global-clip norms, then the EMA of its
        clipped norms; ``inf`` until the leaf has had a non-zero gradient.
      norm: each leaf's norm in the last update, before clipping.
      clip_norm: the bound in force at the last update: :math:`\\lambda\\gamma_i`
        after warm-up; during warm-up the global bound ``warmup_max_norm``
        (``inf`` without one), which applies to the global norm.
      clipped: per leaf, whether it was scaled down at the last update.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    gamma: Any
    norm: Any
    clip_norm: Any
    clipped: Any


@mark_static("warmup_steps", "ord")
def adagc(
    clip_ratio: Hyperparam = 1.04,
    beta: Hyperparam = 0.99,
    warmup_steps: int = 100,
    warmup_max_norm: Hyperparam | None = 1.0,
    *,
    min_gamma: Hyperparam = 1e-6,
    ord: OrdLike = 2,  # noqa: A002
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    """AdaGC: per-tensor adaptive clipping against an EMA of each tensor's clipped norm.

    Wang et al., "AdaGC: Improving Training Stability for Large Language Model
    Pretraining", arXiv 2502.11034 (reference: lishuai-97/AdaGC). A "tensor" is
    a pytree leaf. With :math:`n_i` the norm of leaf :math:`i`:

    *Warm-up* (the first ``warmup_steps`` steps): ordinary global-norm clipping at
    ``warmup_max_norm`` (:math:`\\lambda_{abs}`), and

    .. math:: \\gamma_i = \\min_{t \\le T_w} \\hat n_{t,i} \\quad (\\hat n_{t,i} > 0 \\text{: the post-clip norms})

    *Afterwards*, with :math:`\\lambda` = ``clip_ratio`` and
    :math:`\\gamma'_i = \\max(\\gamma_i, \\text{min\\_gamma})`:

    .. math::

        g_i &\\leftarrow g_i \\cdot \\min(1, \\lambda\\gamma'_i / n_i) \\\\
        \\gamma_i &\\leftarrow \\beta\\gamma'_i + (1-\\beta)\\min(n_i, \\lambda\\gamma'_i)

    The EMA tracks the *clipped* norm, as the reference code does.

    Guards against the reference's zero trap (a tensor with a zero gradient at
    one warm-up step gets :math:`\\gamma = 0` and is frozen for good): zero norms
    never update :math:`\\gamma` (a leaf that had no gradient keeps its
    statistics, and one that never had one starts from its first non-zero norm,
    as the reference does with ``warmup_steps=0``), and :math:`\\gamma` is floored
    at ``min_gamma`` when used.

    Args:
      clip_ratio: :math:`\\lambda_{rel}` > 0 (default 1.04): a tensor's norm may
        exceed its reference by this factor.
      beta: EMA decay in [0, 1) (default 0.99).
      warmup_steps: :math:`T_w` (default 100; 0 starts adaptive at once).
      warmup_max_norm: :math:`\\lambda_{abs}` for global clipping during warm-up
        (default 1.0, the reference script's ``--clip-grad``; ``None`` for none).
      min_gamma: floor on :math:`\\gamma` (default 1e-6).
      ord: the norm (default 2), any ``ord`` of the engine.
      skip_nonfinite: when any leaf's norm is not finite, pass the update through
        unchanged and keep the state (default True).

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`AdaGCState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.adaptive import adagc
      >>> tx = adagc(clip_ratio=2.0, beta=0.5, warmup_steps=1, warmup_max_norm=None)
      >>> params = {'a': jnp.zeros(2), 'b': jnp.zeros(1)}
      >>> state = tx.init(params)
      >>> _, state = tx.update({'a': jnp.array([3.0, 4.0]), 'b': jnp.array([1.0])}, state)
      >>> out, state = tx.update({'a': jnp.array([30.0, 40.0]), 'b': jnp.array([1.5])}, state)
      >>> out['a'], out['b']  # 'a' is clipped to 2 * 5
      (Array([6., 8.], dtype=float32), Array([1.5], dtype=float32))
      >>> float(state.gamma['a']), float(state.gamma['b'])
      (7.5, 1.25)
    """
    fn = "adagc"
    spec = _norms.parse_ord(ord, fn)
    warm = _st.check_int(fn, "warmup_steps", warmup_steps, 0)
    skip = _st.check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = Hyperparams(fn)
    hps.add("clip_ratio", clip_ratio, low=0.0, low_inclusive=False, allow_inf=False)
    hps.add("beta", beta, low=0.0, high=1.0, high_inclusive=False)
    hps.add("warmup_max_norm", warmup_max_norm, low=0.0, allow_none=True)
    hps.add("min_gamma", min_gamma, low=0.0, allow_inf=False)

    def init_fn(params: Any) -> AdaGCState:
        def scalar(value: Any) -> Any:
            return _st.per_leaf(params, fn, lambda x: jnp.full((), value, _norms.acc_dtype(x.dtype)))

        return AdaGCState(
            count=_st.count0(),
            gamma=scalar(jnp.inf),
            norm=scalar(0.0),
            clip_norm=scalar(0.0),
            clipped=_st.per_leaf(params, fn, lambda x: jnp.zeros((), bool)),
        )

    def update_fn(updates: Any, state: AdaGCState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, AdaGCState)
        check_tree(fn, "gamma", state.gamma, updates)
        flat = _st.measured(updates, spec, fn)
        arrays = flat.arrays
        k = len(arrays)
        count = state.count
        in_warmup = count < warm
        # Per-leaf arithmetic on stacked vectors (one fused op for all leaves).
        sdt = _norms.tree_acc_dtype(arrays)
        v, invalid = hps.at(count, sdt)
        gamma = _st.stack(_st.leaves_of(state.gamma, k, fn, "gamma"), sdt)
        old = _st.stack(_st.leaves_of(state.clip_norm, k, fn, "clip_norm"), sdt)
        n = _st.stack(_st.whole_leaf_norms(arrays, spec), sdt)

        # Warm-up: global clipping (the global norm is only computed during warm-up).
        if warmup_max_norm is not None and warm > 0:
            total = lax.cond(
                in_warmup,
                lambda: _norms.global_norm(arrays, spec, dtype=sdt),
                lambda: jnp.zeros((), sdt),
            )
            bound_w = v["warmup_max_norm"]
            fg = _clip_factor(total, bound_w)
        else:
            bound_w = jnp.full((), jnp.inf, sdt)
            fg = jnp.ones((), sdt)
        post = n * fg
        gamma_w = jnp.where(post > 0, jnp.minimum(gamma, post), gamma)

        # Adaptive: clip each leaf at clip_ratio * gamma; the EMA tracks the clipped norm.
        base = jnp.maximum(jnp.where(jnp.isinf(gamma), n, gamma), v["min_gamma"])
        bound = v["clip_ratio"] * base
        f = _clip_factor(n, bound)
        b = v["beta"]
        gamma_a = jnp.where(n > 0, b * base + (1 - b) * (n * f), gamma)

        ok = (_st.all_finite([n]) if skip else jnp.ones((), bool)) & counts(invalid)
        factors = poison(jnp.where(ok, jnp.where(in_warmup, fg, f), 1), invalid)
        out = _st.scale_all(flat, _st.unstack(factors))
        return out, AdaGCState(
            count=jnp.where(ok, increment(count), count),
            gamma=_st.pack(True, state.gamma, jnp.where(ok, jnp.where(in_warmup, gamma_w, gamma_a), gamma)),
            norm=_st.pack(True, state.norm, n),
            clip_norm=_st.pack(True, state.clip_norm, jnp.where(ok, jnp.where(in_warmup, bound_w, bound), old)),
            clipped=_st.pack(True, state.clipped, ok & jnp.where(in_warmup, fg < 1, f < 1)),
        )

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# Quantile tracking (non-private Andrew et al.)
# ----------------------------------------------------------------------------


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
      >>> from gradclip_jax.adaptive import quantile_clip
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
    skip = _st.check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = Hyperparams(fn)
    hps.add("target_quantile", target_quantile, low=0.0, high=1.0)
    hps.add("learning_rate", learning_rate, low=0.0, allow_inf=False)
    check_scalar(fn, "initial_norm", initial_norm, low=0.0, low_inclusive=False, allow_inf=False)

    def init_fn(params: Any) -> QuantileClipState:
        dt = _st.scalar_dtype(params)
        count = _st.count0()
        c0 = jnp.asarray(resolve(initial_norm, count), dt).reshape(())
        return QuantileClipState(
            count=count, estimate=c0, norm=jnp.zeros((), dt), clip_norm=c0, clipped=jnp.zeros((), bool)
        )

    def update_fn(updates: Any, state: QuantileClipState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, QuantileClipState)
        flat = _st.measured(updates, spec, fn)
        dt = state.norm.dtype
        v, invalid = hps.at(state.count, dt)
        c = state.estimate
        n = _norms.global_norm(flat.arrays, spec, axis_name, dtype=dt)
        unclipped = (n <= c).astype(dt)
        nxt = c * jnp.exp(-v["learning_rate"] * (unclipped - v["target_quantile"]))
        out, ok, fields = _finish(flat, _clip_factor(n, c), n, c, state, skip, invalid)
        return out, QuantileClipState(estimate=jnp.where(ok, nxt, c), **fields)

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# Skipping a step on a spike
# ----------------------------------------------------------------------------


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
        wrapped this way.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs` with state
      :class:`SkipOnSpikeState`.

    Raises:
      ValueError: at ``init``, when the inner state has no field ``field`` or
        more than one.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.adaptive import skip_on_spike, zclip
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
    _st.check_transform(fn, "inner", inner)
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
