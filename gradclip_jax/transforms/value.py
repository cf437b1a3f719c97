"""Elementwise value clipping (``clip_by_value``, optax's ``clip``) and ``clip_by_block_rms``."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import (
    clip_factor,
    like_state,
    norm_template,
    rescale_tree,
    tree_dtype,
)
from gradclip_jax._core.hyperparam_rules import Hyperparam, Hyperparams, increment, poison, resolve
from gradclip_jax._core.numerics import count0 as _count0
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_state
from gradclip_jax.transforms._state_checks import check_tree

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
class ClipByValueState(NamedTuple):
    """State of :func:`clip_by_value` / :func:`clip`.

    Attributes:
      count: number of updates so far (int32); drives a scheduled bound.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax


@register_state
class ClipByBlockRmsState(NamedTuple):
    """State of :func:`clip_by_block_rms`.

    Attributes:
      count: number of updates so far (int32).
      norm: tree of each leaf's root-mean-square before clipping.
      clipped: tree of bools, whether each leaf was scaled down.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any
    clipped: Any


def clip_value_tree(
    tree: Any,
    bound: Any,
    fn: str,
    invalid: Any = None,
    *,
    raw_bound: Any = None,
    bools: bool = False,
) -> Any:
    """Clamps every element to ``[-bound, bound]`` (complex: the magnitude).

    Floating-point leaves keep their dtype (``bound`` is a 0-d array, applied in
    each leaf's accumulation dtype). Integer leaves, and bool leaves with
    ``bools`` (optax's ``clip`` accepts them; otherwise they raise
    ``TypeError``), are clipped as ``jnp.clip(x, -raw_bound, raw_bound)``, the
    computation of :func:`optax.clip`: JAX's type promotion with the bound as
    given (``raw_bound``, default ``bound``) decides the result's dtype, so an
    integer bound keeps an int leaf's dtype and a fractional bound gives a float
    result; the bound is never truncated. NaN stays NaN. Where ``invalid`` is
    true (a hyperparameter found invalid at run time) every floating-point
    element is NaN and every integer one 0.
    """
    raw = bound if raw_bound is None else raw_bound
    if getattr(raw, "ndim", 0):  # shape (1,) is accepted as a scalar; keep leaves' shapes
        raw = jnp.reshape(raw, ())

    def one(path: Any, x: Any) -> Any:
        if getattr(x, "dtype", None) == jax.dtypes.float0:
            return x
        y = _clip_one(path, jnp.asarray(x))
        if invalid is None:
            return y
        fill = jnp.nan if jnp.issubdtype(y.dtype, jnp.inexact) else 0
        return jnp.where(invalid, jnp.full_like(y, fill), y)

    def _clip_one(path: Any, x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_ and not bools:
            raise TypeError(f"{fn}: leaf {jax.tree_util.keystr(path)} is bool; cannot clip it")
        if jnp.iscomplexobj(x):
            acc = _norms.acc_dtype(x.dtype)
            b = jnp.asarray(bound, acc)
            mag = jnp.abs(x).astype(acc)
            factor = jnp.where(mag > b, b / jnp.where(mag > b, mag, 1), 1)
            return (x * factor).astype(x.dtype)
        if not jnp.issubdtype(x.dtype, jnp.inexact):  # integer or bool: optax's promotion
            return jnp.clip(x, -raw, raw)
        acc = _norms.acc_dtype(x.dtype)
        b = jnp.asarray(bound, acc)
        return jnp.clip(x.astype(acc), -b, b).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)


def clip_by_value(max_value: Hyperparam) -> optax.GradientTransformation:
    """Clips every element of the updates to ``[-max_value, max_value]``.

    Complex elements keep their phase and have their magnitude clipped. NaN
    elements stay NaN. Floating-point leaves keep their dtype. Integer leaves
    follow JAX's type promotion with the bound, as :func:`optax.clip` does: an
    integer ``max_value`` keeps their dtype, a fractional one gives a float
    result (``clip_by_value(1.5)`` maps the int32 ``3`` to the float32 ``1.5``),
    so the bound is never truncated. Bool leaves raise ``TypeError``.

    Args:
      max_value: the bound (>= 0): number, array or schedule.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByValueState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip_by_value(1.0)
      >>> tx.update(jnp.array([-3.0, 0.5, 2.0]), tx.init(jnp.zeros(3)))[0]
      Array([-1. ,  0.5,  1. ], dtype=float32)
    """
    return _clip_value("clip_by_value", "max_value", max_value, bools=False)


def clip(max_delta: Hyperparam) -> optax.GradientTransformation:
    """:func:`optax.clip`: :func:`clip_by_value` with optax's argument name.

    Accepts what :func:`optax.clip` accepts and returns what it returns on
    integer and bool leaves too (``jnp.clip`` with the bound as given, so
    ``clip(1.5)`` turns an int32 leaf into float32 and ``clip(2)`` keeps it
    int32).

    Args:
      max_delta: the bound (>= 0): number, array or schedule.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByValueState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip(0.5)
      >>> tx.update(jnp.array([-3.0, 0.25]), tx.init(jnp.zeros(2)))[0]
      Array([-0.5 ,  0.25], dtype=float32)
    """
    return _clip_value("clip", "max_delta", max_delta, bools=True)


def _clip_value(fn: str, name: str, bound: Hyperparam, bools: bool) -> optax.GradientTransformation:
    hps = Hyperparams(fn)
    hps.add(name, bound)

    def init_fn(params: Any) -> ClipByValueState:
        del params
        return ClipByValueState(count=_count0())

    def update_fn(updates: Any, state: ClipByValueState | None, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, ClipByValueState)
        v, invalid = hps.at(state.count, tree_dtype(updates))
        out = clip_value_tree(
            updates, v[name], fn, invalid, raw_bound=resolve(bound, state.count), bools=bools
        )
        return out, ClipByValueState(count=increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def clip_by_block_rms(threshold: Hyperparam) -> optax.GradientTransformation:
    """Clips each leaf so its root mean square is at most ``threshold``.

    .. math:: u \\leftarrow u / \\max(1, \\mathrm{rms}(u) / \\text{threshold})

    The same result as :func:`optax.clip_by_block_rms`, without its NaN at
    ``threshold=0`` on zero updates, with float32 accumulation for 16-bit leaves,
    and with each leaf's RMS recorded in the state. Integer and bool leaves are
    accepted, as optax accepts them, and come out in the default float dtype
    (float32; float64 under x64).

    Args:
      threshold: the bound on each leaf's RMS (>= 0): number, array or schedule.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`ClipByBlockRmsState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> tx = gcx.clip_by_block_rms(1.0)
      >>> tx.update({'w': jnp.full(4, 2.0)}, tx.init({'w': jnp.zeros(4)}))[0]
      {'w': Array([1., 1., 1., 1.], dtype=float32)}
    """
    fn = "clip_by_block_rms"
    hps = Hyperparams(fn)
    hps.add("threshold", threshold)
    rms = _norms.parse_ord("rms", fn)

    def init_fn(params: Any) -> ClipByBlockRmsState:
        params = _norms.promote_ints(params, bools=True)
        return ClipByBlockRmsState(
            count=_count0(),
            norm=norm_template(params, fn, None, False, 1),
            clipped=norm_template(params, fn, None, False, 1, flags=True),
        )

    def update_fn(updates: Any, state: ClipByBlockRmsState | None, params: Any = None) -> tuple:
        del params
        state = init_fn(updates) if state is None else state
        check_state(fn, state, ClipByBlockRmsState)
        check_tree(fn, "norm", state.norm, updates)
        updates = _norms.promote_ints(
            updates, bools=True
        )  # optax parity: computed in the default float dtype
        v, invalid = hps.at(state.count, tree_dtype(updates))
        out, nrm, clipped = rescale_tree(
            updates,
            lambda n: poison(clip_factor(n, v["threshold"].astype(n.dtype)), invalid),
            fn=fn,
            ord=rms,
            bound=hps.exact("threshold", v),
        )
        return out, ClipByBlockRmsState(
            count=increment(state.count), norm=like_state(nrm, state.norm), clipped=clipped
        )

    return optax.GradientTransformation(init_fn, update_fn)
