"""The norm engine (internal API): every norm of the package is measured here.

The public face is :mod:`gradclip_jax.norms`; the names below are the engine's API
for the other packages.
"""

from typing import TYPE_CHECKING

from gradclip_jax._core.norms import _reduce
from gradclip_jax._core.norms._api import leaf_norms, tree_norm
from gradclip_jax._core.norms._axes import (
    check_axes_exist as check_axes_exist,
    check_dim as check_dim,
    reduction_axes as reduction_axes,
)
from gradclip_jax._core.norms._blue import (
    careful_row_norms as careful_row_norms,
    joint_row_norms as joint_row_norms,
)
from gradclip_jax._core.norms._engine import (
    SUMSQ_STRATEGY as SUMSQ_STRATEGY,
    check_complex as check_complex,
    global_norm as global_norm,
    global_norm_and_overflow as global_norm_and_overflow,
    row_sums_of_squares as row_sums_of_squares,
    slice_norms as slice_norms,
)
from gradclip_jax._core.norms._reduce import (
    GLOBAL_PACK_MAX_SIZE as GLOBAL_PACK_MAX_SIZE,
    power_of_two as power_of_two,
)
from gradclip_jax._core.norms._spec import Axes as Axes, DimLike, NormSpec, OrdLike, parse_ord
from gradclip_jax._core.norms._trees import (
    FlatTree as FlatTree,
    acc_dtype as acc_dtype,
    check_float_leaf as check_float_leaf,
    flatten as flatten,
    is_numeric_leaf as is_numeric_leaf,
    promote_ints as promote_ints,
    sum_dtype as sum_dtype,
    tree_acc_dtype as tree_acc_dtype,
)
from gradclip_jax._core.settings import forward_settings

if TYPE_CHECKING:  # at run time forwarded: assigning them here assigns the ones the engine reads
    from gradclip_jax._core.norms._reduce import (
        PACK_MAX_SIZE as PACK_MAX_SIZE,
        SLICE_PACK_MAX_SIZE as SLICE_PACK_MAX_SIZE,
    )

__all__ = ["NormSpec", "OrdLike", "DimLike", "parse_ord", "tree_norm", "leaf_norms"]

forward_settings(__name__, _reduce, ("PACK_MAX_SIZE", "SLICE_PACK_MAX_SIZE"))
