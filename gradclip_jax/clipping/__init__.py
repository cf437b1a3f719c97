"""Stateless clipping and normalization transforms.

Each factory returns an :class:`optax.GradientTransformation`. The states are
small ``NamedTuple``s of fixed structure: a step ``count`` (used when a
hyperparameter is a schedule) and, for norm-based transforms, the pre-clip
``norm`` they measured (log it with :func:`gradclip_jax.norms_from_state`) and,
for the clippers, whether they ``clipped`` (what :func:`gradclip_jax.skip_on_spike`
reads). Like optax's stateless transforms, ``update`` accepts ``state=None``
("no state yet") and returns a proper state.

House rules shared by every transform here:

* a slice whose norm is ``<= 0`` (or not finite) is left unchanged: no NaN, no
  epsilon; clipping scales by ``max_norm / norm`` when ``norm > max_norm``, lowered
  by a few units in the last place of the leaf's dtype so the stored result's norm
  is at most ``max_norm``, rounding included (an unclipped leaf is returned exactly);
* outputs keep each leaf's dtype; the scale is applied in the leaf's accumulation
  dtype (float32 for 16-bit leaves) and rounded once;
* ``None``, :class:`optax.MaskedNode` and ``float0`` leaves pass through;
* a hyperparameter that is invalid only at run time (a traced or scheduled
  ``max_norm`` that is negative or NaN, ...) makes the whole update NaN, so
  :func:`optax.apply_if_finite` skips the step: never a sign flip, never
  clipping switched off.
"""

from gradclip_jax.clipping._agc import adaptive_grad_clip, unit_axes
from gradclip_jax.clipping._centralize import centralize
from gradclip_jax.clipping._norm import clip_by_global_norm, clip_by_norm, normalize
from gradclip_jax.clipping._states import (
    AdaptiveGradClipState,
    CentralizeState,
    ClipByBlockRmsState,
    ClipByGlobalNormState,
    ClipByNormState,
    ClipByValueState,
    NormalizeState,
)
from gradclip_jax.clipping._value import clip, clip_by_block_rms, clip_by_value

__all__ = [
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipByValueState",
    "ClipByBlockRmsState",
    "NormalizeState",
    "CentralizeState",
    "AdaptiveGradClipState",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip",
    "clip_by_block_rms",
    "normalize",
    "centralize",
    "adaptive_grad_clip",
    "unit_axes",
]
