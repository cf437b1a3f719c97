"""Clipping by an exponential moving average of past updates (torchzero's EMA clippers).

Three transforms port torchzero 0.4.4's ``ClipNormByEMA``, ``NormalizeByEMA`` and
``ClipValueByEMA`` (shared spec: ``reference-semantics.md`` §2.8-2.10), with the
same math step by step, plus what the references lack:

* every ``ord`` of the norm engine works in both tensorwise and global mode
  (torchzero rejects string ords when ``tensorwise=True``);
* ``skip_nonfinite`` (default on): an update with a non-finite norm (or element,
  for :func:`clip_value_by_ema`) passes through unchanged and leaves the
  statistics and ``count`` as they were, so one bad batch does not poison the EMA
  for good;
* an update whose norm is zero, negative or non-finite is never rescaled (no NaN);
* fixed-structure ``NamedTuple`` states that record the measured ``norm``, the
  bound in force (``clip_norm``) and whether the update was ``clipped``.

Like torchzero, the statistics come from the transform's *input*; with ``inner``
given, the rescaling is applied to ``inner``'s output instead of the input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import clip_factor, normalize_factor, overflow_safe
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    counts,
    increment,
    mark_static,
    poison,
    resolve,
)
from gradclip_jax._core.norms import OrdLike
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_bool, check_state, check_transform
from gradclip_jax.transforms import _stateful as _st
from gradclip_jax.transforms._state_checks import check_tree

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class NormByEMAState(NamedTuple):
    """State of :func:`clip_norm_by_ema` and :func:`normalize_by_ema`.

    Per-leaf fields are trees shaped like the parameters (``None`` at leaves that
    are not measured) when ``tensorwise=True``, and scalars otherwise.

    Attributes:
      count: number of updates absorbed so far (int32; updates skipped by
        ``skip_nonfinite`` do not count). Drives schedules.
      exp_avg: the EMA of the update vectors themselves (a tree like the
        parameters; float32 for 16-bit leaves), after the growth limit.
      prev_ema_norm: the EMA's norm after the last step's growth limit
        (per leaf or scalar), the base of the next growth limit.
      norm: the norm of the last update before rescaling (per leaf or scalar).
      clip_norm: the EMA norm in force at the last update: the bound
        (:func:`clip_norm_by_ema`) or the target (:func:`normalize_by_ema`).
      clipped: whether the last update was rescaled (per leaf or scalar bool).
      inner_state: the state of ``inner`` (:class:`optax.EmptyState` without one).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    exp_avg: Any
    prev_ema_norm: Any
    norm: Any
    clip_norm: Any
    clipped: Any
    inner_state: Any


@register_state
class ClipValueByEMAState(NamedTuple):
    """State of :func:`clip_value_by_ema`.

    Attributes:
      count: number of updates absorbed so far (int32).
      exp_avg: the EMA of the elementwise magnitudes ``|u|`` (a tree like the
        parameters, real, float32 for 16-bit leaves). Never changed by
        ``exp_avg_tfm``.
      clipped: per leaf, whether any element of the last update was clipped.
      inner_state: the state of ``inner`` (:class:`optax.EmptyState` without one).
      exp_avg_tfm_state: the state of ``exp_avg_tfm`` (:class:`optax.EmptyState`
        without one).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    exp_avg: Any
    clipped: Any
    inner_state: Any
    exp_avg_tfm_state: Any


def _lerp(e: jax.Array, x: jax.Array, beta: jax.Array) -> jax.Array:
    """``e + (1 - beta) (x - e)`` in ``e``'s dtype (torch's ``lerp_(x, 1 - beta)``)."""
    b = beta.astype(_norms.acc_dtype(e.dtype))
    return e + (1 - b) * (x.astype(e.dtype) - e)


def _ema_hyperparams(
    fn: str, beta: Any, max_ema_growth: Any, init: Any, min_norm: Any
) -> Hyperparams:
    hps = Hyperparams(fn)
    hps.add("beta", beta, low=0.0, high=1.0, high_inclusive=False)
    hps.add("max_ema_growth", max_ema_growth, low=0.0, allow_none=True)
    hps.add("init", init, low=None, allow_inf=False)
    hps.add("min_norm", min_norm, low=0.0)
    return hps


def _init_norm_by_ema(
    params: Any, fn: str, tensorwise: bool, init: Any, inner: Any
) -> NormByEMAState:
    count = _st.count0()
    fill = resolve(init, count)
    exp_avg = _st.per_leaf(
        params, fn, lambda x: jnp.full(x.shape, jnp.asarray(fill).real, _st.array_dtype(x))
    )
    prev, norm, cap, no = _st.zero_norms(params, fn, tensorwise, slots=3)
    return NormByEMAState(
        count=count,
        exp_avg=exp_avg,
        prev_ema_norm=prev,
        norm=norm,
        clip_norm=cap,
        clipped=no,
        inner_state=_st.init_inner(inner, params),
    )


def _measure(
    ema: list[jax.Array],
    state: NormByEMAState,
    spec: _norms.NormSpec,
    tensorwise: bool,
    fn: str,
    dt: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(e, prev, old_clip)``: the EMA's norms and the stored ones, stacked.

    One entry per leaf (``tensorwise``) or a single global entry, so the per-leaf
    arithmetic that follows is one fused op for all leaves.
    """
    n = len(ema)
    if tensorwise:
        e_list = _st.whole_leaf_norms(ema, spec)
        prev_list = _st.leaves_of(state.prev_ema_norm, n, fn, "prev_ema_norm")
        old_list = _st.leaves_of(state.clip_norm, n, fn, "clip_norm")
    else:
        e_list = [_norms.global_norm(ema, spec, dtype=state.norm.dtype)]
        prev_list, old_list = [state.prev_ema_norm], [state.clip_norm]
    return _st.stack(e_list, dt), _st.stack(prev_list, dt), _st.stack(old_list, dt)


def _growth_limit(
    e: jax.Array, prev: jax.Array, first: jax.Array, growth: jax.Array, floor: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(c, e / c)``: the factor ``c >= 1`` that limits the EMA norm's growth, and the limited norm.

    The EMA's norm may grow by at most ``growth`` per step, with an allowance of at
    least ``floor`` (so an EMA that starts at zero can grow).
    """
    p = jnp.where(first, e, prev)
    allowed = jnp.maximum(growth * p, floor)
    over = e > allowed
    c = _st.safe_div(e, allowed, over)  # max(e / allowed, 1)
    return c, jnp.where(over, allowed, e)


def _limit_ema_growth(
    ema: list[jax.Array],
    e: jax.Array,
    prev: jax.Array,
    first: jax.Array,
    v: dict,
    dt: Any,
    tensorwise: bool,
    ok: jax.Array,
) -> tuple[list[jax.Array], jax.Array]:
    """The growth limit: ``(ema, e)`` with each EMA norm ``e`` grown by at most ``max_ema_growth``
    over ``prev`` (floored at ``min_norm``), the stored EMA rescaled where the limit acted."""
    c, e = _growth_limit(e, prev, first, v["max_ema_growth"].astype(dt), v["min_norm"].astype(dt))
    cs = _st.unstack(c) if tensorwise else [c[0]] * len(ema)
    limited = jnp.any(c > 1) & ok

    def rescale(xs: list[jax.Array]) -> list[jax.Array]:
        return [(x / ck.astype(x.dtype)).astype(x.dtype) for x, ck in zip(xs, cs, strict=True)]

    return _st.unless_rare(limited, ema, rescale), e


def _rescaling(
    a: jax.Array,
    e: jax.Array,
    dt: Any,
    normalize: bool,
    ok: jax.Array,
    invalid: jax.Array | None,
    over: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(factors, flags)`` of the update's rescaling, ``a / max(e, eps)`` clamped (torchzero's
    denominator): 1 on a step that does not count unless ``a`` overflowed (:func:`overflow_safe`
    clips it), NaN where a hyperparameter is invalid."""
    bound = jnp.maximum(e, 2 * float(np.finfo(dt).tiny))
    factor = normalize_factor if normalize else clip_factor
    f = overflow_safe(lambda n: factor(n, bound), a, over)
    factors, applied = _st.applied_factors(f, ok, over, invalid)
    return factors, ((f != 1) if normalize else (f < 1)) & applied


def _norm_by_ema(
    fn: str,
    normalize: bool,
    beta: Hyperparam,
    ord: OrdLike,  # noqa: A002
    tensorwise: bool,
    max_ema_growth: Hyperparam | None,
    init: Hyperparam,
    min_norm: Hyperparam,
    inner: optax.GradientTransformation | None,
    skip_nonfinite: bool,
) -> optax.GradientTransformation:
    spec = _norms.parse_ord(ord, fn)
    tensorwise = check_bool(fn, "tensorwise", tensorwise)
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = _ema_hyperparams(fn, beta, max_ema_growth, init, min_norm)
    check_transform(fn, "inner", inner)

    def init_fn(params: Any) -> NormByEMAState:
        return _init_norm_by_ema(params, fn, tensorwise, init, inner)

    def update_fn(updates: Any, state: NormByEMAState, params: Any = None) -> tuple:
        check_state(fn, state, NormByEMAState)
        check_tree(fn, "exp_avg", state.exp_avg, updates, shapes=True)
        flat = _st.measured(updates, spec, fn)
        arrays = flat.arrays
        count = state.count
        first = count == 0
        old_ema = _st.leaves_of(state.exp_avg, len(arrays), fn, "exp_avg")
        v, invalid = hps.at(count, _norms.tree_acc_dtype(arrays))
        a, over = _st.norms_and_overflow(
            arrays, spec, tensorwise, None if tensorwise else state.norm.dtype
        )
        dt = a.dtype
        # Whether the step counts is known before the EMA is formed, so the kept EMA is written
        # in the same elementwise pass as the new one. The stored EMA is then read by that pass
        # only, and a donated state is updated in place (no copy kept for a skipped step).
        ok = (_st.all_finite([a]) if skip else jnp.ones((), bool)) & counts(invalid)
        ema = [
            jnp.where(ok, _lerp(o, u, v["beta"]), o) for o, u in zip(old_ema, arrays, strict=True)
        ]
        e, prev, old_clip = _measure(ema, state, spec, tensorwise, fn, dt)

        if max_ema_growth is not None:
            ema, e = _limit_ema_growth(ema, e, prev, first, v, dt, tensorwise, ok)
        f, flags = _rescaling(a, e, dt, normalize, ok, invalid, over)
        out_flat, inner_state = _st.run_inner(inner, updates, flat, state.inner_state, params, fn)
        out = _st.scale_all(out_flat, _st.unstack(f) if tensorwise else f[0])

        new_state = NormByEMAState(
            count=jnp.where(ok, increment(count), count),
            exp_avg=_st.like(state.exp_avg, ema),
            prev_ema_norm=_st.pack(tensorwise, state.prev_ema_norm, jnp.where(ok, e, prev)),
            norm=_st.pack(tensorwise, state.norm, a),
            clip_norm=_st.pack(tensorwise, state.clip_norm, jnp.where(ok, e, old_clip)),
            clipped=_st.pack(tensorwise, state.clipped, flags),
            inner_state=inner_state,
        )
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)


@mark_static("ord", "tensorwise", "inner")
def clip_norm_by_ema(
    beta: Hyperparam = 0.99,
    ord: OrdLike = 2,  # noqa: A002
    tensorwise: bool = True,
    max_ema_growth: Hyperparam | None = 1.5,
    init: Hyperparam = 0.0,
    min_norm: Hyperparam = 1e-6,
    *,
    inner: optax.GradientTransformation | None = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    """Clips the update's norm to the norm of an EMA of past updates (torchzero ``ClipNormByEMA``).

    The EMA is of the update *vectors* (not of their norms), with no bias
    correction. For each leaf (``tensorwise=True``) or for all leaves together,
    with :math:`u_t` the incoming update and :math:`\\gamma` = ``max_ema_growth``:

    .. math::

        E_t &= E_{t-1} + (1-\\beta)(u_t - E_{t-1}), \\qquad E_0 = \\text{init} \\\\
        A_t &= \\max(\\gamma P_{t-1}, \\text{min\\_norm}), \\quad P_0 = \\|E_1\\| \\\\
        E_t &\\leftarrow E_t / \\max(\\|E_t\\| / A_t, 1), \\qquad P_t = \\|E_t\\| \\\\
        u_t &\\leftarrow u_t \\cdot \\min\\Big(1, \\frac{\\max(\\|E_t\\|, \\epsilon)}{\\|u_t\\|}\\Big)

    where :math:`\\epsilon` is twice the smallest normal number of the norm's
    dtype. The update can only shrink, to the (growth-limited) EMA's norm. With
    the defaults (``beta=0.99``, ``init=0``) the first output has 1% of the first
    update's norm. An update with a zero or non-finite norm is never rescaled.

    Args:
      beta: EMA decay in [0, 1) (default 0.99): number, array or schedule.
      ord: the norm (default 2); every ``ord`` of the engine, string ords
        included, works in both modes.
      tensorwise: one EMA norm per leaf (default) or one over all leaves.
      max_ema_growth: the EMA's norm may grow by at most this factor per step
        (default 1.5; ``None`` disables the limit). The limit rescales the stored
        EMA.
      init: the constant the EMA starts from (default 0.0).
      min_norm: floor of the growth limit's allowance (default 1e-6), so an EMA
        that starts at zero can grow.
      inner: optional transformation applied to the update first; the statistics
        still come from this transform's input and the rescaling applies to
        ``inner``'s output (torchzero's ``inner``).
      skip_nonfinite: when the update's norm is not finite, pass the update
        through unchanged and keep the statistics and ``count`` (default True).
        With False the EMA absorbs the non-finite values as in torchzero.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`NormByEMAState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.transforms.ema import clip_norm_by_ema
      >>> tx = clip_norm_by_ema(beta=0.5, tensorwise=False)
      >>> g = {'w': jnp.array([3.0, 4.0])}
      >>> state = tx.init(g)
      >>> out, state = tx.update(g, state)  # the EMA is 0.5 g, so the norm is halved
      >>> out['w'].round(5)  # a clipped result sits a few ulp inside the bound
      Array([1.5, 2. ], dtype=float32)
      >>> float(state.norm), float(state.clip_norm)
      (5.0, 2.5)
    """
    return _norm_by_ema(
        "clip_norm_by_ema",
        False,
        beta,
        ord,
        tensorwise,
        max_ema_growth,
        init,
        min_norm,
        inner,
        skip_nonfinite,
    )


@mark_static("ord", "tensorwise", "inner")
def normalize_by_ema(
    beta: Hyperparam = 0.99,
    ord: OrdLike = 2,  # noqa: A002
    tensorwise: bool = True,
    max_ema_growth: Hyperparam | None = 1.5,
    init: Hyperparam = 0.0,
    min_norm: Hyperparam = 1e-6,
    *,
    inner: optax.GradientTransformation | None = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    """Rescales the update to the norm of an EMA of past updates (torchzero ``NormalizeByEMA``).

    The same EMA and growth limit as :func:`clip_norm_by_ema`; the final
    rescaling goes both ways:

    .. math:: u_t \\leftarrow u_t \\cdot \\frac{\\max(\\|E_t\\|, \\epsilon)}{\\|u_t\\|} \\quad (\\|u_t\\| > 0)

    An update with a zero, negative (``ord='sum'``) or non-finite norm is left
    unchanged (torchzero divides by ``eps`` instead, giving huge values for a
    negative signed sum).

    Args:
      beta: EMA decay in [0, 1) (default 0.99).
      ord: the norm (default 2), any ``ord`` of the engine.
      tensorwise: one EMA norm per leaf (default) or one over all leaves.
      max_ema_growth: per-step growth limit of the EMA's norm (default 1.5;
        ``None`` disables it).
      init: the constant the EMA starts from (default 0.0).
      min_norm: floor of the growth limit's allowance (default 1e-6).
      inner: optional transformation whose output is rescaled (statistics come
        from this transform's input).
      skip_nonfinite: pass updates with a non-finite norm through unchanged and
        keep the state (default True).

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`NormByEMAState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.transforms.ema import normalize_by_ema
      >>> tx = normalize_by_ema(beta=0.5, tensorwise=False, max_ema_growth=None)
      >>> state = tx.init(jnp.zeros(2))
      >>> out, state = tx.update(jnp.array([3.0, 4.0]), state)  # EMA norm 2.5
      >>> out, state = tx.update(jnp.array([0.3, 0.4]), state)  # EMA norm 1.5
      >>> [round(float(v), 6) for v in out]
      [0.9, 1.2]
    """
    return _norm_by_ema(
        "normalize_by_ema",
        True,
        beta,
        ord,
        tensorwise,
        max_ema_growth,
        init,
        min_norm,
        inner,
        skip_nonfinite,
    )


def _exceeds(w: jax.Array, bound: jax.Array) -> jax.Array:
    """Where :func:`_clamp` changes ``w``: ``|w| > bound`` elementwise (NaN: nowhere)."""
    if jnp.iscomplexobj(w):
        return jnp.abs(w).astype(bound.dtype) > bound
    w = w.astype(bound.dtype)
    return (w > bound) | (w < -bound)


def _clamp(w: jax.Array, bound: jax.Array) -> jax.Array:
    """``w`` clamped elementwise to ``[-bound, bound]`` (complex: the magnitude)."""
    if jnp.iscomplexobj(w):
        mag = jnp.abs(w).astype(bound.dtype)
        over = mag > bound
        return (w * _st.safe_div(bound, mag, over)).astype(w.dtype)
    return jnp.clip(w.astype(bound.dtype), -bound, bound).astype(w.dtype)


def _value_ema(u: jax.Array, e: jax.Array, count: jax.Array, v: dict) -> jax.Array:
    """The EMA of ``|u|`` after this step, from ``e`` (from ``init * |u|`` on the first step)."""
    mag = jnp.abs(u).astype(e.dtype)
    start = jnp.where(count == 0, v["init"].astype(e.dtype) * mag, e)
    return _lerp(start, mag, v["beta"])


def _screen_value_step(
    arrays: list[jax.Array],
    old: list[jax.Array],
    count: jax.Array,
    v: dict,
    plain: bool,
    skip: bool,
    ok: jax.Array,
) -> tuple[jax.Array, list[jax.Array] | None]:
    """``(ok, hits)``: whether the step counts, and (``plain``: no ``inner``, no ``exp_avg_tfm``)
    where each leaf clips, else ``None``.

    When the bound is the new EMA, one read-only pass per leaf finds both whether
    the update is finite and whether it clips anything, so the step then makes two
    more passes (new EMA, output), not three.
    """
    if not plain:
        return (_st.all_finite(arrays) & ok if skip else ok), None
    screens = [
        _st.screen(lambda x, e: _exceeds(x, _value_ema(x, e, count, v)), u, e)
        for u, e in zip(arrays, old, strict=True)
    ]
    if skip:
        ok = _st.every([f for f, _ in screens]) & ok
    return ok, [h for _, h in screens]


def _value_bounds(
    exp_avg_tfm: optax.GradientTransformation | None,
    bound_tree: Any,
    ema: list[jax.Array],
    tfm_state: Any,
    params: Any,
    fn: str,
) -> tuple[list[jax.Array], Any]:
    """``(bounds, tfm_state)``: each leaf's clip bound, the kept EMA (``bound_tree``) passed through
    ``exp_avg_tfm`` when given, in the EMA's dtype."""
    if exp_avg_tfm is not None:
        bound_tree, tfm_state = exp_avg_tfm.update(bound_tree, tfm_state, params)
    bounds = [
        jnp.asarray(b).astype(e.dtype)
        for b, e in zip(
            _st.leaves_of(bound_tree, len(ema), fn, "exp_avg_tfm output"), ema, strict=True
        )
    ]
    return bounds, tfm_state


@mark_static("inner", "exp_avg_tfm")
def clip_value_by_ema(
    beta: Hyperparam = 0.99,
    init: Hyperparam = 0.0,
    *,
    inner: optax.GradientTransformation | None = None,
    exp_avg_tfm: optax.GradientTransformation | None = None,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    """Clips each element to the EMA of past magnitudes (torchzero ``ClipValueByEMA``).

    Elementwise, with :math:`u_1` the first update:

    .. math::

        E_0 &= \\text{init} \\cdot |u_1| \\\\
        E_t &= E_{t-1} + (1-\\beta)(|u_t| - E_{t-1}) \\\\
        u_t &\\leftarrow \\operatorname{clip}(u_t, -B_t, B_t), \\qquad B_t = \\text{exp\\_avg\\_tfm}(E_t) \\text{ or } E_t

    The EMA tracks the *unclipped* magnitudes. Note that ``init`` multiplies the
    first update's magnitudes here (``init=1`` leaves the first update
    unchanged), unlike :func:`clip_norm_by_ema`'s constant fill. Complex elements
    keep their phase and have their magnitude clipped.

    Args:
      beta: EMA decay in [0, 1) (default 0.99).
      init: multiplier of the first update's magnitudes that starts the EMA
        (default 0.0, so the first output is ``(1 - beta) * u``).
      inner: optional transformation whose output is clipped (the EMA still
        tracks this transform's input).
      exp_avg_tfm: optional transformation applied to a copy of the EMA to give
        the bound; the stored EMA is never changed by it.
      skip_nonfinite: when any element of the update is not finite, pass the
        update through unchanged and keep the EMA and ``count`` (default True).
        With False, a NaN element stays NaN in the EMA for good, as in torchzero.

    Returns:
      An :class:`optax.GradientTransformation` with state
      :class:`ClipValueByEMAState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.transforms.ema import clip_value_by_ema
      >>> tx = clip_value_by_ema(beta=0.5, init=1.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> out, state = tx.update(jnp.array([1.0, -2.0]), state)  # E = |u|
      >>> out, state = tx.update(jnp.array([3.0, -1.0]), state)  # E = [2, 1.5]
      >>> out
      Array([ 2., -1.], dtype=float32)
    """
    fn = "clip_value_by_ema"
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = Hyperparams(fn)
    hps.add("beta", beta, low=0.0, high=1.0, high_inclusive=False)
    hps.add("init", init, low=0.0, allow_inf=False)
    check_transform(fn, "inner", inner)
    check_transform(fn, "exp_avg_tfm", exp_avg_tfm)

    def init_fn(params: Any) -> ClipValueByEMAState:
        exp_avg = _st.per_leaf(params, fn, lambda x: jnp.zeros(x.shape, _st.real_array_dtype(x)))
        return ClipValueByEMAState(
            count=_st.count0(),
            exp_avg=exp_avg,
            clipped=_st.per_leaf(params, fn, lambda x: jnp.zeros((), bool)),
            inner_state=_st.init_inner(inner, params),
            exp_avg_tfm_state=_st.init_inner(exp_avg_tfm, exp_avg),
        )

    def update_fn(updates: Any, state: ClipValueByEMAState, params: Any = None) -> tuple:
        check_state(fn, state, ClipValueByEMAState)
        check_tree(fn, "exp_avg", state.exp_avg, updates, shapes=True)
        flat = _st.measured(updates, None, fn)
        arrays = flat.arrays
        n = len(arrays)
        count = state.count
        old = _st.leaves_of(state.exp_avg, n, fn, "exp_avg")
        v, invalid = hps.at(count, _norms.tree_acc_dtype(arrays))

        plain = inner is None and exp_avg_tfm is None
        ok, hits = _screen_value_step(arrays, old, count, v, plain, skip, counts(invalid))
        # The kept EMA is computed in one pass and is both the new state and the
        # bound's source (a skipped step's output ignores the bound), so every
        # element of the state is read and written once.
        ema = [
            jnp.where(ok, _value_ema(u, e, count, v), e) for e, u in zip(old, arrays, strict=True)
        ]
        bounds, tfm_state = _value_bounds(
            exp_avg_tfm, _st.like(state.exp_avg, ema), ema, state.exp_avg_tfm_state, params, fn
        )

        out_flat, inner_state = _st.run_inner(inner, updates, flat, state.inner_state, params, fn)
        outs, flags = [], []
        for i, (w, b) in enumerate(zip(out_flat.arrays, bounds, strict=True)):
            outs.append(poison(jnp.where(ok, _clamp(w, b), w), invalid))
            flags.append(ok & (_st.any_exceeds(w, b) if hits is None else hits[i]))

        new_state = ClipValueByEMAState(
            count=jnp.where(ok, increment(count), count),
            exp_avg=_st.like(state.exp_avg, ema),
            clipped=_st.like(state.clipped, flags),
            inner_state=inner_state,
            exp_avg_tfm_state=tfm_state,
        )
        return out_flat.rebuild(outs), new_state

    return optax.GradientTransformation(init_fn, update_fn)
