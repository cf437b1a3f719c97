r"""The optax gradient transforms: one module per family, its state beside it.

* :mod:`~gradclip_jax.transforms.norm`: :func:`clip_by_global_norm`, :func:`clip_by_norm`,
  :func:`normalize`;
* :mod:`~gradclip_jax.transforms.value`: :func:`clip_by_value`, :func:`clip`,
  :func:`clip_by_block_rms`;
* :mod:`~gradclip_jax.transforms.agc`: :func:`adaptive_grad_clip` (AGC);
* :mod:`~gradclip_jax.transforms.centralize`: :func:`centralize`;
* :mod:`~gradclip_jax.transforms.ema`: :func:`clip_norm_by_ema`, :func:`normalize_by_ema`,
  :func:`clip_value_by_ema`;
* :mod:`~gradclip_jax.transforms.growth`: :func:`clip_norm_growth`, :func:`clip_value_growth`;
* the adaptive clippers, whose threshold follows the history of gradient norms:
  :mod:`~gradclip_jax.transforms.autoclip`, :mod:`~gradclip_jax.transforms.zclip`,
  :mod:`~gradclip_jax.transforms.adagc`, :mod:`~gradclip_jax.transforms.quantile`
  (:func:`quantile_clip`) and :mod:`~gradclip_jax.transforms.spike` (:func:`skip_on_spike`).

The stateful ones share :mod:`gradclip_jax.transforms._stateful`; every ``update``
checks its state first (:mod:`gradclip_jax.transforms._state_checks`).

**Stateless clippers.** Each factory returns an :class:`optax.GradientTransformation`. The states are
small ``NamedTuple``s of fixed structure: a step ``count`` (used when a
hyperparameter is a schedule) and, for norm-based transforms, the pre-clip
``norm`` they measured (log it with :func:`gradclip_jax.norms_from_state`) and,
for the clippers, whether they ``clipped`` (what :func:`gradclip_jax.skip_on_spike`
reads). Like optax's stateless transforms, ``update`` accepts ``state=None``
("no state yet") and returns a proper state.

House rules shared by the stateless clippers (and kept by the others):

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

**Adaptive clippers.** * :func:`autoclip`: AutoClip (Seetharaman et al. 2020), clip to a percentile of
  all past norms (a fixed-size ring buffer);
* :func:`zclip`: ZClip (Kumar et al. 2025), z-score spike detection on EMA
  statistics of the norm;
* :func:`adagc`: AdaGC (Wang et al. 2025), per-tensor thresholds from an EMA of
  each leaf's clipped norm;
* :func:`quantile_clip`: the non-private form of Andrew et al. (2021), a clip
  norm that tracks a quantile of the norms by geometric updates;
* :func:`skip_on_spike`: a wrapper that turns a detected spike into a skipped
  step (zero updates), the "skip the batch" pattern large-model trainers write
  by hand.

Shared rules (shared spec: ``adaptive-methods.md`` §0, §10):

* Place them first in the chain, on the raw gradients: every statistic is of the
  pre-clip norm of this transform's input, measured by the norm engine (any
  ``ord``; ``axis_name`` for leaves sharded by hand in ``shard_map``/``pmap``).
* Clipping is exact: the update is scaled by ``threshold / norm`` when
  ``norm > threshold`` and left unchanged otherwise (the PyTorch references add
  ``1e-6`` to the norm; results differ by about ``1e-6`` relative).
* ``skip_nonfinite`` (default on): when the measured norm is not finite, the
  update passes through unchanged and the statistics and ``count`` are left as
  they were, as if the step had not happened (``optax.apply_if_finite`` is the
  companion that also skips the step). The monitoring fields report that step:
  ``norm`` holds the non-finite value and ``clipped`` is False.
* States are ``NamedTuple``\ s of fixed shapes with ``count``, ``norm`` (the
  pre-clip norm), ``clip_norm`` (the threshold in force) and ``clipped``.
"""

from gradclip_jax._core.deprecations import top_level_getattr

# Four families share their name with their function: importing the module binds the
# module here (``transforms.zclip``), and ``from gradclip_jax.transforms import zclip``
# returned the function before the top level became its home. These names stay bound
# to the functions (a plain attribute cannot warn); their states and every other
# transform warn below.
from gradclip_jax.transforms.adagc import adagc as adagc
from gradclip_jax.transforms.autoclip import autoclip as autoclip
from gradclip_jax.transforms.centralize import centralize as centralize
from gradclip_jax.transforms.zclip import zclip as zclip

#: The transforms this package used to show; ``gradclip_jax`` is their home (one release).
_TOP_LEVEL = (
    "AdaGCState",
    "AdaptiveGradClipState",
    "AutoClipState",
    "CentralizeState",
    "ClipByBlockRmsState",
    "ClipByGlobalNormState",
    "ClipByNormState",
    "ClipByValueState",
    "ClipNormGrowthState",
    "ClipValueByEMAState",
    "ClipValueGrowthState",
    "NormByEMAState",
    "NormalizeState",
    "QuantileClipState",
    "SkipOnSpikeState",
    "ZClipState",
    "adaptive_grad_clip",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_norm_by_ema",
    "clip_norm_growth",
    "clip_value_by_ema",
    "clip_value_growth",
    "normalize",
    "normalize_by_ema",
    "quantile_clip",
    "skip_on_spike",
    "unit_axes",
)
__getattr__ = top_level_getattr(__name__, _TOP_LEVEL)

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")
