"""PyTorch-style functional API: pure functions that return new gradients.

These mirror ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` and
torchzero's ``normalize_grads_`` but return new trees instead of writing in
place. They measure with the same norm engine as the transforms.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.deprecations import top_level_getattr
from gradclip_jax._core.factors import (
    normalize_factor,
    rescale_tree,
    scale_leaves,
    validate_shape_args,
)
from gradclip_jax._core.hyperparam_rules import Hyperparams, poison
from gradclip_jax._core.norms import DimLike, OrdLike
from gradclip_jax._core.validation import check_scalar
from gradclip_jax.transforms.value import clip_value_tree

# The norms this module used to show; ``gradclip_jax`` is their home (one release).
__getattr__ = top_level_getattr(__name__, ("leaf_norms", "tree_norm"))

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")


def clip_grad_norm(
    grads: Any,
    max_norm: float | jax.Array,
    ord: OrdLike = 2,  # noqa: A002
    eps: float | jax.Array = 1e-6,
) -> tuple[Any, jax.Array]:
    """Clips the global norm of ``grads`` with PyTorch's semantics.

    .. math:: c = \\min\\Big(1, \\frac{\\text{max\\_norm}}{n + \\epsilon}\\Big), \\quad g \\leftarrow c\\, g

    where :math:`n` is the global ``ord``-norm of all leaves. This is
    ``torch.nn.utils.clip_grad_norm_`` (and PPOxFamily's ``grad_clip_norm_``): the
    epsilon is added to the norm, so a gradient whose norm equals ``max_norm`` is
    still scaled by ``max_norm / (max_norm + eps)``. A NaN norm makes every
    gradient NaN, as in torch. For the exact, epsilon-free rule use
    :func:`gradclip_jax.clip_by_global_norm`.

    Unlike PPOxFamily, ``ord=0`` counts non-zero elements (not non-zero tensors)
    and an empty tree returns itself with norm 0.

    Args:
      grads: a pytree of floating-point arrays.
      max_norm: the bound (>= 0).
      ord: which norm (default 2; any ``ord`` of the engine).
      eps: added to the norm in the coefficient's denominator (default 1e-6).

    Returns:
      ``(clipped, total_norm)``: the clipped tree and the norm *before* clipping.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> g, n = gcx.clip_grad_norm([jnp.array([3.0, 4.0])], 1.0)
      >>> float(n), [round(float(v), 6) for v in g[0]]
      (5.0, [0.6, 0.8])
    """
    fn = "clip_grad_norm"
    hps = Hyperparams(fn)
    hps.add("max_norm", max_norm)
    hps.add("eps", eps)
    spec = _norms.parse_ord(ord, fn)
    flat = _norms.flatten(grads, fn)
    _norms.check_complex(fn, flat, spec)
    total = _norms.global_norm(flat.arrays, spec)
    v, invalid = hps.at(jnp.zeros((), jnp.int32), total.dtype)
    coef = jnp.minimum(v["max_norm"] / (total + v["eps"]), 1.0)
    # a norm <= 0 (ord='sum' of a negative sum) leaves the tree unchanged (a negative
    # coefficient flipped its signs, and scaled it up below max_norm)
    coef = poison(jnp.where((total > 0) | jnp.isnan(total), coef, jnp.ones_like(coef)), invalid)
    return flat.rebuild(scale_leaves(flat.arrays, [coef] * len(flat.arrays))), total


def clip_grad_value(grads: Any, clip_value: float | jax.Array) -> Any:
    """Clamps every element to ``[-clip_value, clip_value]``.

    ``torch.nn.utils.clip_grad_value_`` as a pure function. Complex elements
    have their magnitude clipped. Integer leaves follow JAX's type promotion
    with the bound (as :func:`gradclip_jax.clip_by_value`): an integer
    ``clip_value`` keeps their dtype, a fractional one gives a float result, so
    the bound is never truncated. An invalid traced ``clip_value`` (negative,
    NaN) makes every floating-point element NaN.

    Args:
      grads: a pytree of arrays.
      clip_value: the bound (>= 0).

    Returns:
      The clipped tree.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> gcx.clip_grad_value({'a': jnp.array([-2.0, 0.5])}, 1.0)
      {'a': Array([-1. ,  0.5], dtype=float32)}
    """
    fn = "clip_grad_value"
    hps = Hyperparams(fn)
    hps.add("clip_value", clip_value)
    v, invalid = hps.at(
        jnp.zeros((), jnp.int32), _norms.tree_acc_dtype(jax.tree_util.tree_leaves(grads))
    )
    return clip_value_tree(grads, v["clip_value"], fn, invalid, raw_bound=clip_value)


def normalize_grads(
    grads: Any,
    norm_value: float | jax.Array,
    ord: OrdLike = 2,  # noqa: A002
    dim: DimLike = None,
    inverse_dims: bool = False,
    min_size: int = 1,
) -> Any:
    """Rescales each leaf / slice (or the whole tree) to norm ``norm_value``.

    The functional form of :func:`gradclip_jax.normalize` (torchzero's
    ``normalize_grads_``). Slices with norm 0 are left unchanged.

    Args:
      grads: a pytree of floating-point arrays.
      norm_value: the target norm (>= 0).
      ord, dim, inverse_dims, min_size: as in :func:`gradclip_jax.clip_by_norm`.

    Returns:
      The normalized tree.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> [x.round(6) for x in gcx.normalize_grads([jnp.array([3.0, 4.0])], 1.0)]
      [Array([0.6, 0.8], dtype=float32)]
    """
    fn = "normalize_grads"
    check_scalar(fn, "norm_value", norm_value)
    spec, d, inv, ms = validate_shape_args(fn, ord, dim, inverse_dims, min_size)
    out, _, _ = rescale_tree(
        grads,
        lambda n: normalize_factor(n, jnp.asarray(norm_value, n.dtype)),
        fn=fn,
        ord=spec,
        dim=d,
        inverse_dims=inv,
        min_size=ms,
    )
    return out
