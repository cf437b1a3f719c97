"""Shared machinery of the stateful clippers (private to :mod:`gradclip_jax.transforms`).

The stateful transforms (:mod:`~gradclip_jax.transforms.ema`, :mod:`~gradclip_jax.transforms.growth`
and the adaptive clippers) keep per-leaf statistics in trees shaped like the
parameters: the measured (floating-point) leaves hold arrays, every other leaf
holds ``None``. These helpers build such trees at ``init``, read them back as flat
lists aligned with :attr:`gradclip_jax._core.norms.FlatTree.arrays` at ``update``, and
write them again with the structure fixed at ``init`` (so the state never
changes structure: safe in ``lax.scan``, ``vmap`` and checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.control import cond
from gradclip_jax._core.factors import clip_factor, overflow_safe, scale_leaves
from gradclip_jax._core.hyperparam_rules import counts, increment, poison
from gradclip_jax._core.numerics import count0 as count0


def scalar_dtype(params: Any) -> np.dtype:
    """The dtype of scalar statistics: the engine's accumulation dtype of ``params``."""
    return _norms.tree_acc_dtype(jax.tree_util.tree_leaves(params))


def array_dtype(x: Any) -> np.dtype:
    """The dtype of a parameter-shaped statistic of leaf ``x``.

    16-bit leaves keep float32 statistics; float32/float64/complex keep their own
    dtype.
    """
    return np.dtype(jnp.promote_types(x.dtype, jnp.float32))


def real_array_dtype(x: Any) -> np.dtype:
    """Like :func:`array_dtype` but real (for statistics of ``|x|``)."""
    return _norms.acc_dtype(array_dtype(x))


def per_leaf(params: Any, fn: str, make: Callable[[Any], Any]) -> Any:
    """A tree shaped like ``params`` with ``make(leaf)`` at each measured leaf, ``None`` elsewhere."""
    flat = _norms.flatten(params, fn)
    return flat.rebuild([make(x) for x in flat.arrays], fill=None)


def zero_norms(params: Any, fn: str, tensorwise: bool, slots: int = 1) -> tuple[Any, ...]:
    """``slots`` norm slots at zero and one ``clipped`` slot at False: one entry per measured
    leaf (``tensorwise``, in that leaf's accumulation dtype) or one scalar for the whole tree.

    Every slot is a distinct array: a state whose leaves share a buffer cannot be donated to a
    jitted step (``donate_argnums`` rejects a buffer passed twice).
    """
    if tensorwise:
        norms = [
            per_leaf(params, fn, lambda x: jnp.zeros((), _norms.acc_dtype(x.dtype)))
            for _ in range(slots)
        ]
        return (*norms, per_leaf(params, fn, lambda x: jnp.zeros((), bool)))
    dt = scalar_dtype(params)
    return (*(jnp.zeros((), dt) for _ in range(slots)), jnp.zeros((), bool))


def leaves_of(tree: Any, n: int, fn: str, what: str) -> list[Any]:
    """The per-leaf statistics of a state tree, checked against ``n`` measured leaves.

    (The tree itself is checked against the updates by
    :func:`gradclip_jax.transforms._state_checks.check_tree` first; this catches a transformation
    such as ``exp_avg_tfm`` that changes the number of leaves.)
    """
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != n:
        raise ValueError(
            f"{fn}: the updates have {n} floating-point leaves but `{what}` has "
            f"{len(leaves)}; pass updates with the structure of the params given to init"
        )
    return leaves


def like(tree: Any, leaves: Sequence[Any]) -> Any:
    """``leaves`` put back into ``tree``'s structure, each cast to the old leaf's dtype."""
    old, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(
        treedef,
        [jnp.asarray(n).astype(o.dtype).reshape(o.shape) for n, o in zip(leaves, old, strict=True)],
    )


def whole_leaf_norms(arrays: Sequence[jax.Array], spec: _norms.NormSpec) -> list[jax.Array]:
    """One norm per array (over all its axes) from the engine, as 0-d arrays.

    All arrays go through a single :func:`gradclip_jax._core.norms.slice_norms` call, so
    one overflow-fallback ``lax.cond`` covers them all.
    """
    out = _norms.slice_norms(arrays, [tuple(range(x.ndim)) for x in arrays], spec)
    return [n.reshape(()) for n in out]


def norms_and_overflow(
    arrays: Sequence[jax.Array], spec: _norms.NormSpec, tensorwise: bool, dtype: Any
) -> tuple[jax.Array, jax.Array]:
    """The update's norms, one per leaf (``tensorwise``) or the global one (in ``dtype``), stacked
    in the norms' dtype, and where each overflowed (finite elements, a norm past the dtype's range:
    :func:`~gradclip_jax._core.factors.overflow_safe`)."""
    if tensorwise:
        pairs = _norms.slice_norms(
            arrays, [tuple(range(x.ndim)) for x in arrays], spec, then=lambda n, over: over
        )
        norms, overs = [n.reshape(()) for n, _ in pairs], [o.reshape(()) for _, o in pairs]
    else:
        n, o = _norms.global_norm_and_overflow(arrays, spec, dtype=dtype)
        norms, overs = [n], [o]
    dt = _norms.tree_acc_dtype(norms)
    return stack(norms, dt), jnp.stack(overs) if overs else jnp.zeros((0,), bool)


def stack(scalars: Sequence[jax.Array], dtype: Any) -> jax.Array:
    """Per-leaf scalars as one vector, so per-leaf arithmetic is one fused op, not one per leaf."""
    if not scalars:
        return jnp.zeros((0,), dtype)
    return jnp.stack([jnp.asarray(x).astype(dtype).reshape(()) for x in scalars])


def unstack(vector: jax.Array) -> list[jax.Array]:
    """The entries of a vector from :func:`stack`, as 0-d arrays."""
    return [vector[i] for i in range(vector.shape[0])]


def pack(tensorwise: bool, template: Any, vector: jax.Array) -> Any:
    """A stacked statistic written back as the state field ``template`` holds it.

    Per-leaf fields (``tensorwise``) become a tree like ``template``; a global
    field is the single entry, in ``template``'s dtype.
    """
    if tensorwise:
        return like(template, unstack(vector))
    return vector[0].astype(template.dtype)


def all_finite(values: Sequence[jax.Array]) -> jax.Array:
    """True when every element of every array in ``values`` is finite (a 0-d bool)."""
    # sum(v - v) is NaN exactly when some element is NaN or infinite (inf - inf is
    # NaN): one read-only reduction per array. (max|v| made the CPU backend write
    # |v| to a temporary first, a pass as costly as the clip itself.)
    return every([jnp.isfinite(jnp.sum(v - v)) for v in values])


# Reducers of the variadic reductions below, defined once: ``lax.reduce`` caches
# its traced reducer by function, so a closure made per call would be traced and
# compiled again on every eager call.
def _or_or(a: tuple, b: tuple) -> tuple:
    return a[0] | b[0], a[1] | b[1]


def _max_and_min(x: tuple, y: tuple) -> tuple:
    return jnp.maximum(x[0], y[0]), jnp.minimum(x[1], y[1])


def screen(
    hits: Callable[..., jax.Array], x: jax.Array, *state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(every element of x finite, any element of hits(x, *state) true)``, two 0-d bools.

    For an elementwise clipper that decides from one leaf ``x`` and its
    parameter-shaped ``state`` whether the step counts (no non-finite element)
    and whether it clips anything. Both come from one read-only pass (a variadic
    reduction of ``x - x``, NaN exactly at a non-finite element, and of the hit
    flags), before the state is written. The inputs go through an optimization
    barrier so the reduction recomputes ``hits`` from them: otherwise XLA shares
    the subexpressions ``hits`` has in common with the elementwise pass that
    writes the new state, and writes them to a parameter-sized temporary first
    (on the CPU a pass as costly as the clip).
    """
    x, *state = lax.optimization_barrier((x, *state))
    hit = hits(x, *state)
    no = jnp.zeros((), bool)
    bad, any_hit = lax.reduce((~jnp.isfinite(x), hit), (no, no), _or_or, tuple(range(x.ndim)))
    return ~bad, any_hit


def any_exceeds(w: jax.Array, bound: jax.Array) -> jax.Array:
    """Whether any ``|w|`` exceeds its (non-negative) ``bound``, a 0-d bool.

    For real ``w`` this is ``max(w - bound) > 0 or min(w + bound) < 0``, both
    taken in one read-only pass (a variadic reduction), with no temporary ``|w|``
    (see :func:`all_finite`). A NaN in ``w`` or ``bound`` exceeds nothing.
    """
    if jnp.iscomplexobj(w):
        return jnp.max(jnp.abs(w).astype(bound.dtype) - bound, initial=-jnp.inf) > 0
    w = w.astype(bound.dtype)
    hi, lo = _max_min(w - bound, w + bound)
    return (hi > 0) | (lo < 0)


def _max_min(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(max(a), min(b))`` over every element, in one pass over both (-inf / inf when empty)."""
    inf = jnp.asarray(jnp.inf, a.dtype)
    return lax.reduce((a, b), (-inf, inf), _max_and_min, tuple(range(a.ndim)))  # type: ignore[no-any-return]


def any_changed(new: jax.Array, old: jax.Array) -> jax.Array:
    """Whether any element of ``new`` differs from ``old`` (same shape and dtype), a 0-d bool.

    One read-only pass for ``max(new - old) > 0 or min(new - old) < 0``: the
    difference is 0 exactly when the elements are equal (up to a subnormal
    difference on backends that flush subnormals to zero, as XLA's CPU backend
    does); NaN differences count as unchanged.
    """
    if jnp.iscomplexobj(new):
        return jnp.max(jnp.abs(new - old), initial=-jnp.inf) > 0
    hi, lo = _max_min(new - old, new - old)
    return (hi > 0) | (lo < 0)


def every(flags: Sequence[jax.Array]) -> jax.Array:
    """True when every 0-d bool in ``flags`` is true (also when there are none)."""
    if not flags:
        return jnp.ones((), bool)
    return jnp.all(jnp.stack(flags))


def any_true(values: Sequence[jax.Array]) -> jax.Array:
    """True when any element of any array in ``values`` is true (a 0-d bool)."""
    flags = [jnp.any(v) for v in values]
    if not flags:
        return jnp.zeros((), bool)
    return jnp.any(jnp.stack(flags))


def unless_rare(
    rare: jax.Array, values: list[jax.Array], fix: Callable[[list[jax.Array]], list[jax.Array]]
) -> list[jax.Array]:
    """``fix(values)`` when ``rare`` (a 0-d bool) is true, else ``values`` as they are.

    For a pass over parameter-sized state that only some steps need (a growth
    limit that engages, a skipped non-finite update): inside a ``lax.cond`` the
    common step stores the buffers it just computed, without reading and writing
    every element once more (on the CPU that pass cost as much as the clip).
    Under ``vmap`` with a batched predicate both branches run, as a select.
    """
    return cond(rare, fix, lambda v: v, values)  # type: ignore[no-any-return]


def safe_div(num: jax.Array, den: jax.Array, use: jax.Array) -> jax.Array:
    """``num / den`` where ``use``, else 1: the double-``where`` (finite derivatives)."""
    one = jnp.ones_like(den)
    return jnp.where(use, num / jnp.where(use, den, one), one)


def scale_all(flat: _norms.FlatTree, factors: Sequence[jax.Array] | jax.Array) -> Any:
    """Every measured leaf of ``flat`` times its factor (one multiply per leaf)."""
    arrays = flat.arrays
    per_leaf: list[jax.Array] = (
        list(factors) if isinstance(factors, (list, tuple)) else [factors] * len(arrays)  # type: ignore[list-item]
    )
    return flat.rebuild(scale_leaves(arrays, per_leaf))


def measured(updates: Any, spec: _norms.NormSpec | None, fn: str) -> _norms.FlatTree:
    """Flattens and validates ``updates`` for the engine (complex ``'sum'`` is rejected)."""
    flat = _norms.flatten(updates, fn)
    if spec is not None:
        _norms.check_complex(fn, flat, spec)
    return flat


def run_inner(
    inner: optax.GradientTransformation | None,
    updates: Any,
    flat: _norms.FlatTree,
    state: Any,
    params: Any,
    fn: str,
) -> tuple[_norms.FlatTree, Any]:
    """Runs an optional child transformation; returns its output (flattened) and state.

    Without a child the output is ``flat``, the already-flattened ``updates``. The
    child must keep the number of measured leaves.
    """
    if inner is None:
        return flat, state
    out, new_state = inner.update(updates, state, params)
    out_flat = _norms.flatten(out, fn)
    if len(out_flat.arrays) != len(flat.arrays):
        raise ValueError(f"{fn}: `inner` changed the number of floating-point leaves")
    return out_flat, new_state


def init_inner(inner: optax.GradientTransformation | None, params: Any) -> Any:
    """The child's initial state, or :class:`optax.EmptyState` without a child."""
    return optax.EmptyState() if inner is None else inner.init(params)


def applied_factors(
    f: jax.Array, ok: jax.Array, overflowed: jax.Array, invalid: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """``(factors, applied)``: the factors a step of a stateful clipper applies.

    ``f`` where the step counts (``ok``) or its norm ``overflowed`` (finite elements: the
    update is clipped, but the step is not absorbed into the statistics), else 1 (a skipped
    non-finite step passes unchanged); NaN wherever a hyperparameter is ``invalid``.
    ``applied`` says where ``f`` was used.
    """
    applied = ok | overflowed
    return poison(jnp.where(applied, f, jnp.ones_like(f)), invalid), applied


def finish(
    flat: _norms.FlatTree,
    n: jax.Array,
    overflowed: jax.Array,
    thr: jax.Array,
    state: Any,
    skip: bool,
    invalid: jax.Array | None,
) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """The shared ending of the global-norm clippers (autoclip, zclip, quantile_clip).

    Clips the update of norm ``n`` at ``thr`` (not when ``skip`` and the norm is
    not finite, unless it ``overflowed``: finite elements, clipped as
    :func:`~gradclip_jax._core.factors.overflow_safe` says; NaN when a
    hyperparameter is ``invalid``) and returns ``(out, ok, fields)``: ``ok`` says
    whether the step counts, and ``fields`` are the state's monitoring fields
    ``count``, ``norm``, ``clip_norm`` (``thr``, or the previous one on a skipped
    step) and ``clipped``.
    """
    f = overflow_safe(lambda m: clip_factor(m, thr), n, overflowed)
    ok = (jnp.isfinite(n) if skip else jnp.ones((), bool)) & counts(invalid)
    factor, applied = applied_factors(f, ok, overflowed, invalid)
    out = scale_all(flat, factor)
    fields = {
        "count": jnp.where(ok, increment(state.count), state.count),
        "norm": n,
        "clip_norm": jnp.where(ok, thr, state.clip_norm),
        "clipped": applied & (f < 1),
    }
    return out, ok, fields
