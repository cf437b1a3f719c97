"""Differentially private aggregation transforms (DP-SGD).

Every transform here takes **per-example** gradients (each leaf with the batch on
axis 0, e.g. from ``jax.vmap(jax.grad(loss))``), except :func:`dp_noise`, which
takes a sum of already clipped gradients (e.g. from
:func:`gradclip_jax.clipped_grad`). They must come first in an
``optax.chain``.

Privacy rules followed by every transform:

* each example's contribution is clipped to L2 norm :math:`C` by the
  overflow-safe norm engine, so the sum has L2 sensitivity :math:`C`
  (add/remove one example);
* the clipped sum and the Gaussian noise are accumulated in float32 at least
  (float64 for float64 gradients), and rounded to each leaf's dtype only after
  the noise is added and the result divided by the batch size;
* an example whose gradient is NaN or inf contributes zero (``nan_safe=True``),
  so non-finite data cannot break the sensitivity bound;
* states are ``NamedTuple``\\ s of fixed structure that hold only what may be
  released: the PRNG key, a step count and, for the adaptive transform, the clip
  norm (a function of noised quantities only). No pre-clip norm or clip count of
  a batch is ever stored.

Account for the privacy spent with :mod:`gradclip_jax.dp.accounting`.
"""

# _fixed_norm: dp_aggregate, dpsgd and dp_noise (a given clip norm); _quantile_norm:
# dp_quantile_aggregate (adaptive clipping); _shared: the key, clipped sum and divisor they share
from gradclip_jax.dp.aggregate._fixed_norm import (
    DPAggregateState as DPAggregateState,
    DPNoiseState as DPNoiseState,
    dp_aggregate as dp_aggregate,
    dp_noise as dp_noise,
    dpsgd as dpsgd,
)
from gradclip_jax.dp.aggregate._quantile_norm import (
    DPQuantileAggregateState as DPQuantileAggregateState,
    dp_quantile_aggregate as dp_quantile_aggregate,
    noise_multiplier_for_gradient as noise_multiplier_for_gradient,
)

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")
