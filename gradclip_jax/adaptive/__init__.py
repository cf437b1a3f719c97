"""Adaptive clippers: the clip threshold follows the history of gradient norms.

* :func:`autoclip`: AutoClip (Seetharaman et al. 2020), clip to a percentile of
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
* States are ``NamedTuple``\\ s of fixed shapes with ``count``, ``norm`` (the
  pre-clip norm), ``clip_norm`` (the threshold in force) and ``clipped``.
"""

from gradclip_jax.adaptive._adagc import AdaGCState, adagc
from gradclip_jax.adaptive._autoclip import AutoClipState, autoclip
from gradclip_jax.adaptive._quantile import QuantileClipState, quantile_clip
from gradclip_jax.adaptive._spike import SkipOnSpikeState, skip_on_spike
from gradclip_jax.adaptive._zclip import ZClipState, zclip

__all__ = [
    "AutoClipState",
    "ZClipState",
    "AdaGCState",
    "QuantileClipState",
    "SkipOnSpikeState",
    "autoclip",
    "zclip",
    "adagc",
    "quantile_clip",
    "skip_on_spike",
]
