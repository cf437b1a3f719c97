"""AdaGC: per-tensor thresholds from an EMA of each leaf's clipped norm."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.control import cond
from gradclip_jax._core.factors import clip_factor as _clip_factor, overflow_safe
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    counts,
    increment,
    mark_static,
)
from gradclip_jax._core.norms import OrdLike
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_bool, check_int, check_state
from gradclip_jax.transforms import _stateful as _st
from gradclip_jax.transforms._state_checks import check_tree

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
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


def _warmup_step(
    arrays: list[jax.Array],
    spec: _norms.NormSpec,
    n: jax.Array,
    gamma: jax.Array,
    in_warmup: jax.Array,
    v: dict,
    sdt: Any,
    global_warmup: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(factor, bound, gamma, overflowed)`` of a warm-up step: global clipping at
    ``warmup_max_norm`` (the global norm is only computed during warm-up; none without
    ``global_warmup``), each leaf's ``gamma`` the smallest positive post-clip norm seen, and
    whether the global norm overflowed (:func:`~gradclip_jax._core.factors.overflow_safe`)."""
    if global_warmup:
        total, over = cond(
            in_warmup,
            lambda: _norms.global_norm_and_overflow(arrays, spec, dtype=sdt),
            lambda: (jnp.zeros((), sdt), jnp.zeros((), bool)),
        )
        bound_w = v["warmup_max_norm"]
        fg = overflow_safe(lambda m: _clip_factor(m, bound_w), total, over)
    else:
        bound_w = jnp.full((), jnp.inf, sdt)
        fg, over = jnp.ones((), sdt), jnp.zeros((), bool)
    post = n * fg
    return fg, bound_w, jnp.where(post > 0, jnp.minimum(gamma, post), gamma), over


def _adaptive_step(
    n: jax.Array, gamma: jax.Array, v: dict, over: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(factors, bounds, gamma)`` after warm-up: each leaf clipped at ``clip_ratio * gamma``, and
    ``gamma`` an EMA of the clipped norm (``over``: where a leaf's norm overflowed)."""
    base = jnp.maximum(jnp.where(jnp.isinf(gamma), n, gamma), v["min_gamma"])
    bound = v["clip_ratio"] * base
    f = overflow_safe(lambda m: _clip_factor(m, bound), n, over)
    b = v["beta"]
    return f, bound, jnp.where(n > 0, b * base + (1 - b) * (n * f), gamma)


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
      >>> from gradclip_jax import adagc
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
    warm = check_int(fn, "warmup_steps", warmup_steps, 0)
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = _adagc_hyperparams(clip_ratio, beta, warmup_max_norm, min_gamma)

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
        n, over = _st.norms_and_overflow(arrays, spec, True, None)
        n = n.astype(sdt)

        global_warmup = warmup_max_norm is not None and warm > 0
        fg, bound_w, gamma_w, over_w = _warmup_step(
            arrays, spec, n, gamma, in_warmup, v, sdt, global_warmup
        )
        f, bound, gamma_a = _adaptive_step(n, gamma, v, over)

        ok = (_st.all_finite([n]) if skip else jnp.ones((), bool)) & counts(invalid)
        factors, applied = _st.applied_factors(
            jnp.where(in_warmup, fg, f), ok, jnp.where(in_warmup, over_w, over), invalid
        )
        out = _st.scale_all(flat, _st.unstack(factors))
        return out, AdaGCState(
            count=jnp.where(ok, increment(count), count),
            gamma=_st.pack(
                True, state.gamma, jnp.where(ok, jnp.where(in_warmup, gamma_w, gamma_a), gamma)
            ),
            norm=_st.pack(True, state.norm, n),
            clip_norm=_st.pack(
                True, state.clip_norm, jnp.where(ok, jnp.where(in_warmup, bound_w, bound), old)
            ),
            clipped=_st.pack(True, state.clipped, applied & jnp.where(in_warmup, fg < 1, f < 1)),
        )

    return optax.GradientTransformation(_adagc_init, update_fn)


def _adagc_hyperparams(
    clip_ratio: Hyperparam,
    beta: Hyperparam,
    warmup_max_norm: Hyperparam | None,
    min_gamma: Hyperparam,
) -> Hyperparams:
    """AdaGC's checked hyperparameters (numbers, arrays or schedules)."""
    hps = Hyperparams("adagc")
    hps.add("clip_ratio", clip_ratio, low=0.0, low_inclusive=False, allow_inf=False)
    hps.add("beta", beta, low=0.0, high=1.0, high_inclusive=False)
    hps.add("warmup_max_norm", warmup_max_norm, low=0.0, allow_none=True)
    hps.add("min_gamma", min_gamma, low=0.0, allow_inf=False)
    return hps


def _adagc_init(params: Any) -> AdaGCState:
    """AdaGC's first state: per leaf, an infinite ``gamma`` and zero norms."""

    def scalar(value: Any) -> Any:
        return _st.per_leaf(
            params, "adagc", lambda x: jnp.full((), value, _norms.acc_dtype(x.dtype))
        )

    return AdaGCState(
        count=_st.count0(),
        gamma=scalar(jnp.inf),
        norm=scalar(0.0),
        clip_norm=scalar(0.0),
        clipped=_st.per_leaf(params, "adagc", lambda x: jnp.zeros((), bool)),
    )
