"""Clipping the growth of updates from one step to the next (torchzero's growth clippers).

:func:`clip_norm_growth` and :func:`clip_value_growth` port torchzero 0.4.4's
``ClipNormGrowth`` and ``ClipValueGrowth`` (shared spec:
``reference-semantics.md`` §2.11-2.12) with the same math, except for two
reference bugs that are not copied:

* ``add=None, mul=None`` is the identity with the usual state (torchzero's
  ``ClipNormGrowth`` crashes on step 2);
* ``min_value`` floors only the *tracked* norm. torchzero also floors the divisor
  of every update at ``min_value``, so with ``min_value > 1`` every update after
  the first is divided by at least ``min_value``.

Both also take any ``ord`` of the norm engine, in tensorwise and global mode,
and skip non-finite updates (``skip_nonfinite``, default on): such an update
passes through unchanged and leaves the state and ``count`` as they were.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import clip_factor, overflow_safe
from gradclip_jax._core.hyperparam_rules import (
    Hyperparam,
    Hyperparams,
    counts,
    increment,
    mark_static,
    poison,
)
from gradclip_jax._core.norms import OrdLike
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_bool, check_state
from gradclip_jax.transforms import _stateful as _st
from gradclip_jax.transforms._state_checks import check_tree

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class ClipNormGrowthState(NamedTuple):
    """State of :func:`clip_norm_growth`.

    Per-leaf fields are trees shaped like the parameters (``None`` at leaves that
    are not measured) when ``tensorwise=True``, and scalars otherwise.

    Attributes:
      count: number of updates absorbed so far (int32; skipped non-finite updates
        do not count). The first absorbed update only sets ``prev_norm``.
      prev_norm: the tracked norm :math:`N` (the last clipped norm, limited in
        its decay and floored at ``min_value``).
      norm: the norm of the last update before clipping.
      clip_norm: the bound in force at the last update, ``min(N + add, N * mul)``
        (``inf`` on the first step or when neither ``add`` nor ``mul`` is set).
      clipped: whether the last update was clipped.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    prev_norm: Any
    norm: Any
    clip_norm: Any
    clipped: Any


@register_state
class ClipValueGrowthState(NamedTuple):
    """State of :func:`clip_value_growth`.

    Attributes:
      count: number of updates absorbed so far (int32).
      prev: the tracked signed values :math:`R` (a tree like the parameters,
        float32 for 16-bit leaves): the last clipped update, limited in its
        decay.
      clipped: per leaf, whether any element of the last update was clipped.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    prev: Any
    clipped: Any


def _fixed_product(*values: Any) -> float:
    """The product of hyperparameters given as plain numbers; NaN when any is not one
    (a schedule, an array or a traced value)."""
    out = 1.0
    for x in values:
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
            return float("nan")
        out *= float(x)
    return out


def _hyperparams(fn: str, add: Any, mul: Any, min_value: Any, max_decay: Any) -> Hyperparams:
    hps = Hyperparams(fn)
    hps.add("add", add, low=0.0, allow_none=True)
    hps.add("mul", mul, low=0.0, allow_none=True)
    hps.add("min_value", min_value, low=0.0, allow_none=True)
    hps.add("max_decay", max_decay, low=0.0, low_inclusive=False, allow_none=True)
    return hps


@dataclasses.dataclass(frozen=True)
class _GrowthSteps:
    """The growth limits of :func:`clip_norm_growth` (on norms) and :func:`clip_value_growth`
    (elementwise): which steps are on is known when the transform is built, their values
    (``v``, the resolved hyperparameters) at each update."""

    has_add: bool
    has_mul: bool
    has_min: bool
    has_decay: bool

    def norm_step(
        self, nrm: jax.Array, prev: jax.Array, first: jax.Array, v: dict, over: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(factors, bounds, tracked)`` of :func:`clip_norm_growth` for the norms ``nrm`` given
        the tracked ones ``prev``: each norm is clipped to ``prev + add`` and ``mul * prev``,
        and the tracked norm follows the clipped one, decaying by at most ``max_decay`` and
        floored at ``min_value`` (the first step tracks the norm itself). ``over``: where a
        norm overflowed (:func:`~gradclip_jax._core.factors.overflow_safe`)."""
        bound = jnp.full_like(nrm, jnp.inf)
        if self.has_add:
            bound = jnp.minimum(bound, prev + v["add"])
        if self.has_mul:
            bound = jnp.minimum(bound, prev * v["mul"])
        # first step, or a NaN tracked norm (absorbed with skip_nonfinite=False): no
        # bound, so the tracked norm recovers at the next finite update
        bound = jnp.where(first | jnp.isnan(bound), jnp.inf, bound)
        f = overflow_safe(lambda n: clip_factor(n, bound), nrm, over)
        new = nrm * f  # the clipped norm, min(n, bound)
        if self.has_decay:
            md = v["max_decay"]
            nonzero = prev != 0
            ratio = nrm / jnp.where(nonzero, prev, jnp.ones_like(prev))
            new = jnp.where(nonzero & (ratio < 1 / md), prev / md, new)
        if self.has_min:
            new = jnp.maximum(new, v["min_value"])
        return f, bound, jnp.where(first, nrm, new)

    def by_add(self, r: jax.Array, v: dict) -> jax.Array:
        """The additive step's cap on ``|x|``, ``|r| + add``, in the state's dtype."""
        return jnp.abs(r) + v["add"].astype(_norms.acc_dtype(r.dtype))

    def limits(self, r: jax.Array, v: dict) -> tuple[jax.Array, jax.Array | None]:
        """``(m, bound)`` for one leaf, in the state's dtype: the tracked magnitude with its
        floor, and the magnitude bound on the update (``None`` when nothing bounds it).

        The two bounds compose into one magnitude bound: the additive step caps
        ``|x|`` at ``|r| + add`` and the multiplicative one then caps it at
        ``mul * m``, so the output is ``x`` with its magnitude capped at the
        smaller of the two. A NaN bound (a NaN in ``r``) clips nothing.
        """
        dt = _norms.acc_dtype(r.dtype)
        ar = jnp.abs(r)
        m = ar if not self.has_min else jnp.maximum(ar, v["min_value"].astype(dt))
        bound = None
        if self.has_add:
            bound = self.by_add(r, v)
        if self.has_mul:
            by_mul = v["mul"].astype(dt) * m
            bound = by_mul if bound is None else jnp.minimum(bound, by_mul)
        return m, bound

    def clip(self, x: jax.Array, r: jax.Array, v: dict) -> jax.Array:
        """The clipped value of one leaf, in the state's dtype."""
        x = x.astype(r.dtype)
        bound = self.limits(r, v)[1]
        return x if bound is None else jnp.where(jnp.abs(x) > bound, jnp.sign(x) * bound, x)

    def hits(self, x: jax.Array, r: jax.Array, v: dict) -> jax.Array:
        """Where :meth:`clip` changes ``x``: ``|x| > bound`` elementwise."""
        bound = self.limits(r, v)[1]
        if bound is None:
            return jnp.zeros(x.shape, bool)
        return jnp.abs(x.astype(r.dtype)) > bound

    def decays(self, a: jax.Array, r: jax.Array, v: dict) -> jax.Array:
        """Where the tracked value decays to ``r / max_decay`` instead of following the
        output, from ``a = |x|`` after the additive step: ``max(a / m, 1e-8) < 1 / max_decay``,
        without dividing by ``m`` (it may be 0)."""
        dt = _norms.acc_dtype(r.dtype)
        md = v["max_decay"].astype(dt)
        return (a < self.limits(r, v)[0] / md) & (md * 1e-8 < 1)

    def after_add(self, x: jax.Array, r: jax.Array, v: dict) -> jax.Array:
        """``|x|`` after the additive step, in the state's dtype."""
        ax = jnp.abs(x.astype(r.dtype))
        return ax if not self.has_add else jnp.minimum(ax, self.by_add(r, v))


@mark_static("ord", "tensorwise")
def clip_norm_growth(
    add: Hyperparam | None = None,
    mul: Hyperparam | None = 1.5,
    min_value: Hyperparam | None = 1e-4,
    max_decay: Hyperparam | None = 2.0,
    ord: OrdLike = 2,  # noqa: A002
    tensorwise: bool = True,
    *,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    """Limits how fast the update's norm may grow from step to step (torchzero ``ClipNormGrowth``).

    For each leaf (``tensorwise=True``) or all leaves together, with :math:`n_t`
    the update's norm and :math:`N` the tracked norm:

    .. math::

        N_1 &= n_1 \\quad \\text{(the first update passes unchanged)} \\\\
        b_t &= \\min(N_{t-1} + \\text{add},\\; N_{t-1} \\cdot \\text{mul}) \\\\
        u_t &\\leftarrow u_t \\cdot \\min(1, b_t / n_t) \\\\
        N_t &= \\max\\Big(\\begin{cases} N_{t-1} / \\text{max\\_decay} & n_t / N_{t-1} < 1 / \\text{max\\_decay} \\\\ \\min(n_t, b_t) & \\text{otherwise} \\end{cases},\\; \\text{min\\_value}\\Big)

    (a term whose hyperparameter is ``None`` is left out). The tracked norm
    follows the *clipped* norm but shrinks by at most ``max_decay`` per step, and
    ``min_value`` keeps it from collapsing to 0.

    As in torchzero, the first tracked norm is not floored: after an all-zero
    first update the second update is clipped to zero, then growth resumes from
    ``min_value`` (with ``min_value=None`` every later update stays zero; keep a
    positive ``min_value``). Unlike torchzero, ``min_value`` never divides the
    updates themselves, and ``add=mul=None`` is the identity.

    Args:
      add: additive allowance: the norm may grow by at most ``add`` per step
        (default ``None``, off).
      mul: multiplicative allowance (default 1.5).
      min_value: floor of the tracked norm (default 1e-4; ``None`` for none).
      max_decay: the tracked norm shrinks by at most this factor per step
        (default 2.0; ``None`` for no limit).
      ord: the norm (default 2), any ``ord`` of the engine.
      tensorwise: one tracked norm per leaf (default) or one over all leaves.
      skip_nonfinite: pass updates with a non-finite norm through unchanged and
        keep the state (default True).

    Returns:
      An :class:`optax.GradientTransformation` with state
      :class:`ClipNormGrowthState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.transforms.growth import clip_norm_growth
      >>> tx = clip_norm_growth(mul=2.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> out, state = tx.update(jnp.array([0.3, 0.4]), state)  # norm 0.5: tracked
      >>> out, state = tx.update(jnp.array([3.0, 4.0]), state)  # norm 5 > 2 * 0.5
      >>> out.round(6)  # a clipped result sits a few ulp inside the bound
      Array([0.6, 0.8], dtype=float32)
      >>> float(state.prev_norm)
      1.0
    """
    fn = "clip_norm_growth"
    spec = _norms.parse_ord(ord, fn)
    tensorwise = check_bool(fn, "tensorwise", tensorwise)
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = _hyperparams(fn, add, mul, min_value, max_decay)

    def init_fn(params: Any) -> ClipNormGrowthState:
        prev, norm, cap, no = _st.zero_norms(params, fn, tensorwise, slots=3)
        return ClipNormGrowthState(
            count=_st.count0(), prev_norm=prev, norm=norm, clip_norm=cap, clipped=no
        )

    steps = _GrowthSteps(
        add is not None, mul is not None, min_value is not None, max_decay is not None
    )

    def update_fn(updates: Any, state: ClipNormGrowthState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, ClipNormGrowthState)
        if tensorwise:
            check_tree(fn, "prev_norm", state.prev_norm, updates)
        flat = _st.measured(updates, spec, fn)
        arrays = flat.arrays
        count = state.count
        first = count == 0
        # One entry per leaf (tensorwise) or a single global entry; the arithmetic
        # below runs on these vectors, one fused op for all leaves.
        if tensorwise:
            k = len(arrays)
            prev_list = _st.leaves_of(state.prev_norm, k, fn, "prev_norm")
            old_list = _st.leaves_of(state.clip_norm, k, fn, "clip_norm")
        else:
            prev_list, old_list = [state.prev_norm], [state.clip_norm]
        nrm, over = _st.norms_and_overflow(
            arrays, spec, tensorwise, None if tensorwise else state.norm.dtype
        )
        dt = nrm.dtype
        prev = _st.stack(prev_list, dt)
        v, invalid = hps.at(count, dt)

        f, bound, tracked = steps.norm_step(nrm, prev, first, v, over)

        ok = (_st.all_finite([nrm]) if skip else jnp.ones((), bool)) & counts(invalid)
        f, applied = _st.applied_factors(f, ok, over, invalid)
        out = _st.scale_all(flat, _st.unstack(f) if tensorwise else f[0])
        new_state = ClipNormGrowthState(
            count=jnp.where(ok, increment(count), count),
            prev_norm=_st.pack(tensorwise, state.prev_norm, jnp.where(ok, tracked, prev)),
            norm=_st.pack(tensorwise, state.norm, nrm),
            clip_norm=_st.pack(
                tensorwise, state.clip_norm, jnp.where(ok, bound, _st.stack(old_list, dt))
            ),
            clipped=_st.pack(tensorwise, state.clipped, (f < 1) & applied),
        )
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def clip_value_growth(
    add: Hyperparam | None = None,
    mul: Hyperparam | None = 1.5,
    min_value: Hyperparam | None = 1e-4,
    max_decay: Hyperparam | None = 2.0,
    *,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformation:
    """Limits how fast each element's magnitude may grow (torchzero ``ClipValueGrowth``).

    Elementwise, with :math:`x` the incoming value and :math:`r` the tracked
    (signed) previous value; the first update passes unchanged and sets
    :math:`r = x`. Afterwards:

    1. additive (``add`` set): where :math:`|x| - |r| > \\text{add}`, shrink
       :math:`x` to magnitude :math:`|r| + \\text{add}` (same sign);
    2. multiplicative (``mul`` set): with :math:`m = \\max(|r|, \\text{min\\_value})`
       and :math:`\\rho = \\max(|x| / m, 10^{-8})`, where :math:`\\rho > \\text{mul}`
       scale :math:`x` to magnitude :math:`\\text{mul} \\cdot m`;
    3. tracking: :math:`r \\leftarrow r / \\text{max\\_decay}` where
       :math:`\\rho < 1/\\text{max\\_decay}` (:math:`\\rho` from the value after
       step 1), else :math:`r \\leftarrow x` (the clipped value).

    With ``min_value=None`` an element whose tracked value is 0 is clipped to 0
    for good (as in torchzero); the default ``min_value=1e-4`` lets it grow back
    from 1.5e-4. ``add=mul=None`` is the identity. Complex elements keep their
    phase.

    Args:
      add: additive allowance per step (default ``None``, off).
      mul: multiplicative allowance (default 1.5).
      min_value: floor of the tracked magnitude used by the multiplicative bound
        (default 1e-4; ``None`` for none).
      max_decay: the tracked value shrinks by at most this factor per step
        (default 2.0; ``None`` tracks the clipped value as is).
      skip_nonfinite: when any element is not finite, pass the update through
        unchanged and keep the state (default True).

    Returns:
      An :class:`optax.GradientTransformation` with state
      :class:`ClipValueGrowthState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.transforms.growth import clip_value_growth
      >>> tx = clip_value_growth(mul=2.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> out, state = tx.update(jnp.array([1.0, -1.0]), state)
      >>> out, state = tx.update(jnp.array([5.0, -1.5]), state)
      >>> out
      Array([ 2. , -1.5], dtype=float32)
    """
    fn = "clip_value_growth"
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = _hyperparams(fn, add, mul, min_value, max_decay)

    def init_fn(params: Any) -> ClipValueGrowthState:
        return ClipValueGrowthState(
            count=_st.count0(),
            prev=_st.per_leaf(params, fn, lambda x: jnp.zeros(x.shape, _st.array_dtype(x))),
            clipped=_st.per_leaf(params, fn, lambda x: jnp.zeros((), bool)),
        )

    # Where the multiplicative cap is at least the decay threshold (mul * max_decay >= 1, or
    # no multiplicative step), |output| equals |x| after the additive step wherever the
    # decay test can pass, so the test reads the output instead of the input: the pass
    # that writes the new state then reads two parameter-sized arrays, not three. Known
    # only for fixed numbers; schedules and injected values take the general test.
    decay_from_output = max_decay is not None and (
        mul is None or _fixed_product(mul, max_decay) >= 1
    )

    bounds = _GrowthSteps(
        add is not None, mul is not None, min_value is not None, max_decay is not None
    )

    def update_fn(updates: Any, state: ClipValueGrowthState, params: Any = None) -> tuple:
        del params
        check_state(fn, state, ClipValueGrowthState)
        check_tree(fn, "prev", state.prev, updates, shapes=True)
        flat = _st.measured(updates, None, fn)
        arrays = flat.arrays
        count = state.count
        first = count == 0
        prevs = _st.leaves_of(state.prev, len(arrays), fn, "prev")
        v, invalid = hps.at(count, _norms.tree_acc_dtype(arrays))
        # One read-only pass per leaf finds whether the update is finite and whether it
        # clips anything, before the output and the new state are written.
        screens = [
            _st.screen(lambda x, r: bounds.hits(x, r, v), u, r)
            for u, r in zip(arrays, prevs, strict=True)
        ]
        finite = _st.every([f for f, _ in screens])
        ok = (finite if skip else jnp.ones((), bool)) & counts(invalid)
        outs, new_prev, flags = [], [], []
        for u, r, (_, hit) in zip(arrays, prevs, screens, strict=True):
            y = bounds.clip(u, r, v)
            out = jnp.where(first | ~ok, u, y.astype(u.dtype))
            same = u.dtype == r.dtype
            outs.append(poison(out, invalid))
            # On a counted step the tracked value is the output (u on the first step, y after)
            # unless it decays. Read from `out` when that holds it exactly: the new state then
            # depends on the output, so XLA computes the output first and can write the state
            # over a donated `r` in place (else it copies `r`, two extra passes).
            tracked = out if same else jnp.where(first, u.astype(r.dtype), y)
            if max_decay is not None:
                a = jnp.abs(out) if same and decay_from_output else bounds.after_add(u, r, v)
                tracked = jnp.where(
                    bounds.decays(a, r, v) & ~first, r / v["max_decay"].astype(r.dtype), tracked
                )
            new_prev.append(jnp.where(ok, tracked, r))
            flags.append(hit & ok & ~first)
        new_state = ClipValueGrowthState(
            count=jnp.where(ok, increment(count), count),
            prev=_st.like(state.prev, new_prev),
            clipped=_st.like(state.clipped, flags),
        )
        return flat.rebuild(outs), new_state

    return optax.GradientTransformation(init_fn, update_fn)
