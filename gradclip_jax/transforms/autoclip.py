"""AutoClip: clip to a percentile of all past gradient norms (a fixed-size ring buffer)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.hyperparam_rules import Hyperparam, Hyperparams, counts, mark_static
from gradclip_jax._core.norms import OrdLike
from gradclip_jax._core.state_registry import register_state
from gradclip_jax._core.validation import check_bool, check_int, check_state, renamed_kwarg
from gradclip_jax.transforms import _stateful as _st
from gradclip_jax.transforms._stateful import finish

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


@register_state
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


def _min_norm_given(min_norm: Any, min_clip_norm: Any) -> Any:
    """``min_norm`` if the user gave it beside ``min_clip_norm`` (an error), else ``None``.

    Under :func:`optax.inject_hyperparams` both arrive as arrays, ``min_norm`` holding its
    default: both floors then apply (the larger wins, 0.0 changes nothing).
    """
    injected = all(isinstance(v, jax.Array) for v in (min_norm, min_clip_norm))
    default = (
        isinstance(min_norm, (int, float)) and not isinstance(min_norm, bool) and min_norm == 0.0
    )
    return None if injected or default else min_norm


@mark_static("history_size", "ord", "axis_name")
def autoclip(
    percentile: Hyperparam = 10.0,
    history_size: int = 1000,
    *,
    min_norm: Hyperparam = 0.0,
    ord: OrdLike = 2,  # noqa: A002
    skip_nonfinite: bool = True,
    axis_name: Any = None,
    min_clip_norm: Hyperparam | None = None,
) -> optax.GradientTransformation:
    """AutoClip: clips to a percentile of the history of gradient norms.

    Seetharaman, Wichern, Pardo, Le Roux, "AutoClip: Adaptive Gradient Clipping
    for Source Separation Networks", MLSP 2020. At every step, with :math:`n_t`
    the global norm:

    .. math::

        H_t &= H_{t-1} \\cup \\{n_t\\} \\quad \\text{(the last } \\texttt{history\\_size} \\text{ recorded norms)} \\\\
        \\eta_t &= \\max(\\operatorname{percentile}_p(H_t), \\text{min\\_norm}) \\\\
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
      min_norm: floor of the threshold (default 0.0, none): number, array or schedule.
      ord: the norm (default 2), any ``ord`` of the engine.
      skip_nonfinite: when the norm is not finite, pass the update through
        unchanged and keep the state, ``count`` included (default True). The
        norm is never recorded either way.
      axis_name: for leaves sharded by hand inside ``shard_map``/``pmap``.
      min_clip_norm: deprecated spelling of ``min_norm`` (a ``DeprecationWarning``; giving
        both is a ``TypeError``). Under :func:`optax.inject_hyperparams` it stays a
        hyperparameter of that name beside ``min_norm`` (0.0 by default): the floor is the
        larger of the two.

    Returns:
      An :class:`optax.GradientTransformation` with state :class:`AutoClipState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import autoclip
      >>> tx = autoclip(percentile=50.0, history_size=4)
      >>> state = tx.init(jnp.zeros(2))
      >>> for scale in (1.0, 3.0):  # norms 5 and 15: median 10
      ...     out, state = tx.update(scale * jnp.array([3.0, 4.0]), state)
      >>> out, float(state.clip_norm)
      (Array([6., 8.], dtype=float32), 10.0)
    """
    fn = "autoclip"
    spec = _norms.parse_ord(ord, fn)
    size = check_int(fn, "history_size", history_size, 1)
    skip = check_bool(fn, "skip_nonfinite", skip_nonfinite)
    hps = Hyperparams(fn)
    hps.add("percentile", percentile, low=0.0, high=100.0)
    hps.add("min_norm", min_norm, low=0.0)
    if min_clip_norm is not None:
        given = _min_norm_given(min_norm, min_clip_norm)
        renamed_kwarg(fn, "min_clip_norm", "min_norm", min_clip_norm, given)  # warns at the caller
        hps.add("min_clip_norm", min_clip_norm, low=0.0)

    def floor(v: dict[str, Any]) -> Any:
        return (
            jnp.maximum(v["min_norm"], v["min_clip_norm"])
            if "min_clip_norm" in v
            else v["min_norm"]
        )

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
        n, over = _norms.global_norm_and_overflow(flat.arrays, spec, axis_name, dt)
        # an invalid traced hyperparameter leaves the statistics as they were (house rule)
        record = jnp.isfinite(n) & (n > 0) & counts(invalid)
        history = state.history.at[state.head].set(jnp.where(record, n, state.history[state.head]))
        head = jnp.where(record, (state.head + 1) % size, state.head)
        filled = jnp.where(record, jnp.minimum(state.filled + 1, size), state.filled)
        thr = jnp.maximum(_percentile(history, filled, v["percentile"] / 100), floor(v))
        out, _, fields = finish(flat, n, over, thr, state, skip, invalid)
        return out, AutoClipState(history=history, head=head, filled=filled, **fields)

    return optax.GradientTransformation(init_fn, update_fn)
