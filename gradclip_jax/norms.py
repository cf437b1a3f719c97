"""The norm engine: the single source of every norm in gradclip_jax.

Every transform, function and per-example clipper in the package measures through
this module, so a global norm always equals the norm of the concatenated leaves,
for every ``ord``, and every norm has the same numerical guarantees:

* **Accumulation.** 16-bit leaves (float16, bfloat16) accumulate in float32,
  float32 in float32 and float64 (under x64) in float64. Complex leaves use
  ``|x|`` and accumulate in their real dtype.
* **No overflow or underflow.** The fast path sums powers directly. When the
  sum is not finite or is so small that elements may have underflowed, one
  ``lax.cond`` recomputes with every element divided by ``max|x|`` (``min|x|``
  for negative ``p``), so fp16 values of 300 or float32 values of 1e30 give the
  right, finite norm. The predicate is a scalar, so the common case pays nothing.
  For 2-norms and ``'rms'`` a backend may instead use Blue's branch-free
  algorithm (three sums of squares scaled by fixed powers of two, one pass, no
  conditional): :data:`SUMSQ_STRATEGY` picks per backend; both give the same
  guarantees. float16 leaves need neither: their squares cannot over- or
  underflow float32.
* **Finite derivatives.** Roots and powers use the double-``where`` trick, so the
  gradient of a norm at zero is zero, never NaN.
* **Leaves.** ``None`` and :class:`optax.MaskedNode` are empty subtrees and count
  for nothing; ``float0`` leaves are skipped; integer and bool leaves raise a
  ``TypeError`` naming their path.

Supported ``ord`` values (see :func:`parse_ord`): any float ``p`` as
``torch.linalg.vector_norm`` defines it (``p != 0``: ``(sum |x|^p)^(1/p)``, negative
``p`` too; ``inf``: max|x|; ``-inf``: min|x|; ``0``: number of non-zeros), and the
strings ``'l0' 'l1' 'l2' 'l3' 'l4' 'linf'``, ``'mad'`` (mean |x|), ``'rms'``,
``'std'`` / ``'var'`` (unbiased; a one-element slice gives 0) and ``'sum'`` (signed).
"""

from gradclip_jax._core.norms import (
    DimLike,
    NormSpec as NormSpec,
    OrdLike,
    leaf_norms as leaf_norms,
    parse_ord as parse_ord,
    tree_norm as tree_norm,
)

__all__ = [
    "OrdLike",
    "DimLike",
]
