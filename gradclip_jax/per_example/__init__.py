"""Per-example gradient clipping: the building block of DP-SGD.

Two families of functions live here:

* :func:`~gradclip_jax.per_example_global_norm_clip` and :func:`~gradclip_jax.per_example_layer_norm_clip`
  take *materialized* per-example gradients (every leaf carries the batch on axis
  0) and return the sum of the clipped gradients, exactly like their optax
  namesakes, but NaN-free at zero norms, overflow-safe, accumulating 16-bit
  gradients in float32, and working when the batch axis is explicitly sharded.
* :func:`~gradclip_jax.clipped_grad` turns a loss of per-example losses into a function that
  computes the **sum of clipped per-example gradients** directly: per-example
  gradients come from ``jax.vmap(jax.grad(...))``, each is materialized once
  (as one row per example), measured, and the clip and the sum are a single
  ``dot_general`` of the clip factors with the rows; ``microbatch_size`` bounds
  memory without changing the result.

For a batch :math:`\\{x_i\\}` with per-example gradients :math:`g_i` and clip
norm :math:`C`, every function computes

.. math:: \\sum_i g_i \\cdot \\min\\Big(1, \\frac{C}{\\|g_i\\|_2}\\Big)

where :math:`\\|g_i\\|_2` is the global L2 norm over all leaves of example
:math:`i` (measured by :mod:`gradclip_jax.norms`). A zero-norm example is left
unchanged (multiplier 1, never NaN). Every clipped contribution has norm at most
:math:`C`, rounding included (a factor below 1 is lowered by a few units in the
last place of the output dtype), so adding or removing one example moves the
sum by at most :math:`C` (the L2 sensitivity). That holds at the edges of the
float range too: an example whose norm does not fit in the accumulation dtype
(finite elements, norm above ~3.4e38 in float32) is reported with norm ``inf``
and scaled by :math:`C / (\\sqrt{D} \\max_j |g_{ij}|)`, an upper bound of its
norm (:math:`D` elements); when that factor is below the smallest normal float
it flushes to zero and the example contributes nothing.
"""

from gradclip_jax._core.deprecations import top_level_getattr
from gradclip_jax.per_example._products import PRODUCT_PRECISION

#: The everyday API this package used to show; ``gradclip_jax`` is their home (one release).
_TOP_LEVEL = (
    "ClippedGradFn",
    "ClippedGradInfo",
    "clipped_grad",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
    "per_example_norms",
)
__getattr__ = top_level_getattr(__name__, _TOP_LEVEL)

__all__ = [
    "PRODUCT_PRECISION",
]
