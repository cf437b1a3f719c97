"""gradclip_jax: Optax-style gradient clipping transformations for JAX.

Every transform is an :class:`optax.GradientTransformation` that composes with
``optax.chain``; every norm comes from one engine (:mod:`gradclip_jax.norms`).

Example:
  >>> import jax.numpy as jnp, optax
  >>> import gradclip_jax as gcx
  >>> tx = optax.chain(gcx.clip_by_global_norm(1.0), optax.adam(1e-3))
  >>> state = tx.init({'w': jnp.zeros(3)})
"""

from gradclip_jax import norms
from gradclip_jax.clipping import (
    AdaptiveGradClipState,
    CentralizeState,
    ClipByBlockRmsState,
    ClipByGlobalNormState,
    ClipByNormState,
    ClipByValueState,
    NormalizeState,
    adaptive_grad_clip,
    centralize,
    clip,
    clip_by_block_rms,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    normalize,
    unit_axes,
)
from gradclip_jax.functional import clip_grad_norm, clip_grad_value, normalize_grads
from gradclip_jax.hyperparams import inject_hyperparams
from gradclip_jax.norms import NormSpec, leaf_norms, parse_ord, tree_norm

__version__ = "0.1.0"

__all__ = [
    "AdaptiveGradClipState",
    "CentralizeState",
    "ClipByBlockRmsState",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipByValueState",
    "NormSpec",
    "NormalizeState",
    "adaptive_grad_clip",
    "centralize",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_grad_norm",
    "clip_grad_value",
    "inject_hyperparams",
    "leaf_norms",
    "normalize",
    "normalize_grads",
    "norms",
    "parse_ord",
    "tree_norm",
    "unit_axes",
]
