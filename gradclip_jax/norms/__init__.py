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

from gradclip_jax.norms._api import leaf_norms, tree_norm
from gradclip_jax.norms._axes import check_axes_exist as check_axes_exist
from gradclip_jax.norms._axes import check_dim as check_dim
from gradclip_jax.norms._axes import reduction_axes as reduction_axes
from gradclip_jax.norms._engine import SUMSQ_STRATEGY as SUMSQ_STRATEGY
from gradclip_jax.norms._engine import check_complex as check_complex
from gradclip_jax.norms._engine import global_norm as global_norm
from gradclip_jax.norms._engine import slice_norms as slice_norms
from gradclip_jax.norms._reduce import GLOBAL_PACK_MAX_SIZE as GLOBAL_PACK_MAX_SIZE
from gradclip_jax.norms._reduce import PACK_MAX_SIZE as PACK_MAX_SIZE
from gradclip_jax.norms._spec import Axes as Axes
from gradclip_jax.norms._spec import DimLike, NormSpec, OrdLike, parse_ord
from gradclip_jax.norms._trees import FlatTree as FlatTree
from gradclip_jax.norms._trees import acc_dtype as acc_dtype
from gradclip_jax.norms._trees import check_float_leaf as check_float_leaf
from gradclip_jax.norms._trees import flatten as flatten
from gradclip_jax.norms._trees import is_numeric_leaf as is_numeric_leaf
from gradclip_jax.norms._trees import promote_ints as promote_ints
from gradclip_jax.norms._trees import sum_dtype as sum_dtype
from gradclip_jax.norms._trees import tree_acc_dtype as tree_acc_dtype

__all__ = ["NormSpec", "OrdLike", "DimLike", "parse_ord", "tree_norm", "leaf_norms"]
