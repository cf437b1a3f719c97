"""The documented ``NamedTuple`` states of the stateless clippers."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from gradclip_jax._core.state_registry import register_state


@register_state
class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      count: number of updates so far (int32); drives schedules.
      norm: the global norm of the last update before clipping (a scalar in the
        accumulation dtype, 0 before the first update).
      clipped: whether the last update was scaled down (what
        :func:`gradclip_jax.skip_on_spike` reads with ``field='clipped'``).
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: jax.Array
    clipped: jax.Array


@register_state
class ClipByNormState(NamedTuple):
    """State of :func:`clip_by_norm`.

    Attributes:
      count: number of updates so far (int32).
      norm: the pre-clip norms of the last update: a tree with one array of
        per-slice norms per leaf (``None`` for leaves left alone), or a scalar when
        ``dim='global'``.
      clipped: whether the last update was scaled down: one bool per leaf (any
        of its slices; ``None`` for leaves left alone), or a scalar when
        ``dim='global'``.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any
    clipped: Any


@register_state
class NormalizeState(NamedTuple):
    """State of :func:`normalize` (fields as in :class:`ClipByNormState`)."""

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any


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


@register_state
class CentralizeState(NamedTuple):
    """State of :func:`centralize` (it measures no norm)."""


@register_state
class AdaptiveGradClipState(NamedTuple):
    """State of :func:`adaptive_grad_clip`.

    Attributes:
      count: number of updates so far (int32).
      norm: tree of per-unit gradient norms before clipping (one per output unit).
      clipped: tree of bools, whether any unit of each leaf was scaled down.
    """

    count: jax.Array  # type: ignore[assignment]  # NamedTuple field named like tuple.count, as in optax
    norm: Any
    clipped: Any
