"""gradclip_jax: Optax-style gradient clipping transformations for JAX.

Every transform is an :class:`optax.GradientTransformation` that composes with
``optax.chain``; every norm comes from one engine (:mod:`gradclip_jax.norms`).

Example:
  >>> import jax.numpy as jnp, optax
  >>> import gradclip_jax as gcx
  >>> tx = optax.chain(gcx.clip_by_global_norm(1.0), optax.adam(1e-3))
  >>> state = tx.init({'w': jnp.zeros(3)})
"""

import importlib
from typing import Any

from gradclip_jax import dp, interop, norms, per_example
from gradclip_jax.dp.accounting import PrivacyAccountant
from gradclip_jax.dp.aggregate import (
    DPAggregateState,
    DPNoiseState,
    DPQuantileAggregateState,
    dp_aggregate,
    dp_noise,
    dp_quantile_aggregate,
    dpsgd,
    noise_multiplier_for_gradient,
)
from gradclip_jax.dp.private_step import (
    PrivacyBudgetError,
    PrivacyBudgetWarning,
    PrivateStepMetrics,
    PrivateTraining,
    make_private,
)
from gradclip_jax.dp.sampling.poisson import BatchOverflowError, PoissonBatch, PoissonSampler
from gradclip_jax.functional import clip_grad_norm, clip_grad_value, normalize_grads
from gradclip_jax.hyperparams import inject_hyperparams
from gradclip_jax.monitor import norms_from_state
from gradclip_jax.norms import NormSpec, leaf_norms, parse_ord, tree_norm
from gradclip_jax.per_example.activation_sharding import batch_sharding, with_sharding_constraint
from gradclip_jax.per_example.api import (
    ClippedGradFn,
    ClippedGradInfo,
    clipped_grad,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
    per_example_norms,
)
from gradclip_jax.per_example.internal import GhostFallbackWarning, GhostReport, ghost_report
from gradclip_jax.transforms.adagc import AdaGCState, adagc
from gradclip_jax.transforms.agc import AdaptiveGradClipState, adaptive_grad_clip, unit_axes
from gradclip_jax.transforms.autoclip import AutoClipState, autoclip
from gradclip_jax.transforms.centralize import CentralizeState, centralize
from gradclip_jax.transforms.ema import (
    ClipValueByEMAState,
    NormByEMAState,
    clip_norm_by_ema,
    clip_value_by_ema,
    normalize_by_ema,
)
from gradclip_jax.transforms.growth import (
    ClipNormGrowthState,
    ClipValueGrowthState,
    clip_norm_growth,
    clip_value_growth,
)
from gradclip_jax.transforms.norm import (
    ClipByGlobalNormState,
    ClipByNormState,
    NormalizeState,
    clip_by_global_norm,
    clip_by_norm,
    normalize,
)
from gradclip_jax.transforms.quantile import QuantileClipState, quantile_clip
from gradclip_jax.transforms.spike import SkipOnSpikeState, skip_on_spike
from gradclip_jax.transforms.value import (
    ClipByBlockRmsState,
    ClipByValueState,
    clip,
    clip_by_block_rms,
    clip_by_value,
)
from gradclip_jax.transforms.zclip import ZClipState, zclip

__version__ = "0.1.0"

_MOVED_MODULES = ("ghost", "privacy")  # deprecation shims for one release (CHANGELOG.md)


def __getattr__(name: str) -> Any:
    """``gcx.ghost`` and ``gcx.privacy``: the deprecated modules, imported (and warning) when read."""
    if name in _MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    # stateless transforms
    "adaptive_grad_clip",
    "centralize",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "normalize",
    "AdaptiveGradClipState",
    "CentralizeState",
    "ClipByBlockRmsState",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipByValueState",
    "NormalizeState",
    # stateful and adaptive transforms
    "adagc",
    "autoclip",
    "clip_norm_by_ema",
    "clip_norm_growth",
    "clip_value_by_ema",
    "clip_value_growth",
    "normalize_by_ema",
    "quantile_clip",
    "skip_on_spike",
    "zclip",
    "AdaGCState",
    "AutoClipState",
    "ClipNormGrowthState",
    "ClipValueByEMAState",
    "ClipValueGrowthState",
    "NormByEMAState",
    "QuantileClipState",
    "SkipOnSpikeState",
    "ZClipState",
    # functional API and the norm engine
    "clip_grad_norm",
    "clip_grad_value",
    "normalize_grads",
    "leaf_norms",
    "tree_norm",
    "parse_ord",
    "NormSpec",
    "unit_axes",
    "norms",
    # per-example and differential privacy
    "clipped_grad",
    "with_sharding_constraint",
    "batch_sharding",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "per_example_norms",
    "ClippedGradFn",
    "ClippedGradInfo",
    "ghost_report",
    "GhostReport",
    "per_example",
    "GhostFallbackWarning",
    "dp_aggregate",
    "dp_noise",
    "dp_quantile_aggregate",
    "dpsgd",
    "noise_multiplier_for_gradient",
    "DPAggregateState",
    "DPNoiseState",
    "DPQuantileAggregateState",
    "dp",
    # adapters to other libraries' interfaces (interop.jax_privacy needs the jax-privacy extra)
    "interop",
    # private training: Poisson batches, the accountant, the one-call private step
    "PoissonSampler",
    "PoissonBatch",
    "BatchOverflowError",
    "PrivacyAccountant",
    "make_private",
    "PrivateTraining",
    "PrivateStepMetrics",
    "PrivacyBudgetError",
    "PrivacyBudgetWarning",
    # hyperparameters and logging
    "inject_hyperparams",
    "norms_from_state",
]
