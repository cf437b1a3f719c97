"""The frozen configuration of a :func:`~gradclip_jax.clipped_grad` call,
and the type of the function it returns (which knows its sensitivity)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import clip_factor
from gradclip_jax._core.hyperparam_rules import poison
from gradclip_jax._core.numerics import divide_or_zero, rounding_margin
from gradclip_jax._core.validation import is_traced
from gradclip_jax.per_example._products import product_margin


class Method(enum.Enum):
    """How per-example norms are measured."""

    VMAP = "vmap"
    GHOST = "ghost"
    AUTO = "auto"


class LayerMode(enum.Enum):
    """One clip norm per example (``GLOBAL``) or one per leaf and example."""

    GLOBAL = "global"
    UNIFORM = "uniform"  # C / sqrt(K) per leaf
    SIZE = "size"  # C sqrt(D_l / D) per leaf
    TREE = "tree"  # a pytree of per-leaf clip norms


class GhostSum(enum.Enum):
    """How the ghost path forms the clipped sum once the norms are known."""

    AUTO = "auto"
    BACKWARD = "backward"
    BOOKKEEPING = "bookkeeping"


def clip_factors(n: jax.Array, c: Any, store: Any = None) -> jax.Array:
    """``min(1, c' / n)`` (1 for a zero or non-finite norm), ``c'`` the clip norm ``c`` lowered by
    the rounding margin of ``store`` (default: the norms' dtype, the accumulation dtype).

    So each example's clipped contribution, formed in the accumulation dtype and stored in
    ``store``, has norm at most ``c``, rounding included; and an example is left unscaled
    only when its measured norm is at most ``c'``: a norm measured a few units below the
    exact one (float32 sums of squares round small entries away) cannot carry an exact norm
    above ``c`` through unclipped. With reduced-pass products (``PRODUCT_PRECISION``) ``c``
    is first lowered by their error bound.
    """
    return clip_factor(n, _stored_clip(c, n.dtype, n.dtype if store is None else store))


def plain_clip_factors(n: jax.Array, c: Any) -> jax.Array:
    """:func:`clip_factors` before the rounding margin (for an exact check of the stored bound)."""
    return clip_factor(n, _margined(c, n.dtype))


def _stored_clip(c: Any, dtype: Any, store: Any) -> jax.Array:
    """``c`` (:func:`_margined`) lowered by the rounding margin of storing in ``store`` values
    formed in ``dtype``: the clip norm every per-example factor divides."""
    return _margined(c, dtype) * jnp.asarray(rounding_margin(np.dtype(store), dtype), dtype)


def _margined(c: Any, dtype: Any) -> jax.Array:
    """``c`` as a scalar of ``dtype``, lowered by the margin of reduced-pass products
    (:func:`~gradclip_jax.per_example._products.product_margin`; 1 by default)."""
    c = jnp.asarray(c, dtype).reshape(())
    m = product_margin(dtype)
    return c if m == 1.0 else c * jnp.asarray(m, dtype)


class Origin:
    """The identity of one :func:`clipped_grad` function, kept by every copy of its
    configuration (a per-call copy too): what it has told its user once is not repeated."""


@dataclass(frozen=True, eq=False)
class ClipConfig:
    """Everything :func:`clipped_grad` validated, in one immutable object."""

    loss_fn: Callable[..., Any]
    l2_clip_norm: Any
    layer_mode: LayerMode = LayerMode.GLOBAL
    method: Method = Method.AUTO
    ghost_sum: GhostSum = GhostSum.AUTO
    normalize: bool = False
    gamma: Any = 0.01
    has_aux: bool = False
    microbatch_size: int | None = None
    nan_safe: bool = True
    spmd_axis_name: Any = None
    fn: str = "clipped_grad"
    prng_argnum: int | None = None
    pre_clipping_transform: Callable[[Any], Any] | None = None
    rescale_to_unit_norm: bool = False
    dtype: Any = (
        None  # accumulation/output dtype of the sums (None: each leaf's accumulation dtype)
    )
    origin: Origin = field(default_factory=Origin)

    @property
    def per_layer(self) -> bool:
        return self.layer_mode is not LayerMode.GLOBAL

    def factors(self, n: jax.Array, c: Any) -> jax.Array:
        """Per-example factors from norms ``n`` and clip norm ``c``: clip, or normalize.

        ``c`` is lowered by the rounding margin of the output dtype (``dtype``, else the
        norms' dtype): a single clipped (or normalized, even scaled up) contribution, as
        stored, has norm at most ``c``.
        """
        store = n.dtype if self.dtype is None else self.dtype
        if not self.normalize:
            return clip_factors(n, c, store)
        c, gamma = _stored_clip(c, n.dtype, store), jnp.asarray(self.gamma, n.dtype)
        # a run-time gamma or clip norm that is negative or NaN: NaN factors, as clip_factors gives
        # (gamma = -0.59 scaled an example of norm 0.6 to 60 with C = 1; a negative C flips signs)
        invalid = jnp.isnan(c) | (c < 0) | jnp.isnan(gamma) | (gamma < 0)
        return poison(divide_or_zero(c, n + gamma), invalid)

    def acc_dtype(self, leaf_dtype: Any) -> np.dtype:
        """The dtype a leaf's clipped sum is accumulated across chunks and returned in."""
        if self.dtype is not None:
            out = np.dtype(self.dtype)
            if np.issubdtype(leaf_dtype, np.complexfloating) and not np.issubdtype(
                out, np.complexfloating
            ):
                out = np.dtype(
                    jnp.promote_types(out, np.complex64)
                )  # a complex sum keeps its imaginary part
            return out
        return _norms.sum_dtype(leaf_dtype)

    def sensitivity(self) -> Any:
        """The add/remove sensitivity of the returned sum: 1 with ``rescale_to_unit_norm``, else
        :meth:`clip_norm`."""
        if self.rescale_to_unit_norm:
            return 1.0
        return self.clip_norm()

    def clip_norm(self) -> Any:
        """The clip norm of a whole example: ``C``, or ``sqrt(sum_l C_l**2)`` for a tree."""
        if self.layer_mode is LayerMode.TREE:
            leaves = jax.tree_util.tree_leaves(self.l2_clip_norm)
            if any(is_traced(c) for c in leaves):
                return jnp.sqrt(sum(jnp.square(jnp.asarray(c, jnp.float32)) for c in leaves))
            return math.sqrt(sum(float(np.asarray(c)) ** 2 for c in leaves))
        if is_traced(self.l2_clip_norm):  # a negative run-time clip norm (NaN sums): NaN too
            c = jnp.asarray(self.l2_clip_norm, jnp.float32).reshape(())
            return poison(c, c < 0)
        return float(np.asarray(self.l2_clip_norm).reshape(()))


class ClippedGradInfo(NamedTuple):
    """What :func:`clipped_grad`'s function reports besides the gradient sum.

    None of these fields is privatized: they depend on individual examples. Do not
    release them under DP without a mechanism of your own.

    Attributes:
      num_clipped: int32 number of (unmasked) examples whose gradient was scaled
        down (``factor < 1``); with per-layer clipping, a tree of per-leaf counts.
      norms: per-example global L2 norms of the gradients before clipping, shape
        ``(B,)`` (float32 for 16-bit params; 0 for masked examples); with
        per-layer clipping, a tree of per-leaf ``(B,)`` norms (per clip norm, in
        the clip tree's structure, when it is a prefix of params).
      values: the per-example losses, shape ``(B,)``.
      aux: with ``has_aux=True``, the auxiliary output of each example, stacked
        over the batch (see :func:`clipped_grad`); otherwise ``None``.
    """

    num_clipped: Any
    norms: Any
    values: jax.Array
    aux: Any = None


_RELATIONS = {
    "add_or_remove": 1.0,
    "add_or_remove_one": 1.0,
    "add_remove": 1.0,
    "replace_special": 1.0,
    "zero_out": 1.0,
    "replace": 2.0,
    "replace_one": 2.0,
    "substitute": 2.0,
}


def sensitivity_factor(relation: Any, fn: str) -> float:
    """1 for add/remove (and zero-out) neighbours, 2 for replace-one neighbours."""
    name = getattr(relation, "name", relation)
    key = str(name).strip().lower()
    if key not in _RELATIONS:
        raise ValueError(
            f"{fn}: unknown neighbouring relation {relation!r}; expected 'add_or_remove', "
            "'replace' or 'zero_out' (or a dp_accounting.NeighboringRelation)"
        )
    return _RELATIONS[key]


class ClippedGradFn:
    """The function :func:`clipped_grad` returns.

    Call it as ``grad_fn(params, batch, *args, mask=None)`` to get
    ``(grads, info)``; ``grad_fn.sensitivity(relation)`` gives the L2 sensitivity
    of ``grads``.
    """

    def __init__(self, impl: Callable[..., Any], doc: str, config: ClipConfig):
        self._impl = impl
        self.__doc__ = doc
        self.config = config  # what clipped_grad validated (read by gradclip_jax's own modules)

    def __call__(
        self, params: Any, batch: Any, *args: Any, mask: Any = None
    ) -> tuple[Any, ClippedGradInfo]:
        return self._impl(params, batch, *args, mask=mask)  # type: ignore[no-any-return]

    def sensitivity(self, relation: Any = "add_or_remove") -> Any:
        """The L2 sensitivity of the clipped sum to one example.

        .. math:: \\Delta = \\begin{cases} C & \\text{add or remove one example (also zero-out)} \\\\ 2C & \\text{replace one example} \\end{cases}

        where :math:`C` is the clip norm (:math:`\\sqrt{\\sum_l C_l^2}` with per-layer
        norms :math:`C_l`). Masked (padding) examples contribute nothing, so they
        do not count as neighbours. Gaussian noise of standard deviation
        ``z * grad_fn.sensitivity()`` gives the noise multiplier ``z``.

        Args:
          relation: ``'add_or_remove'`` (default), ``'replace'`` or
            ``'zero_out'``, or a ``dp_accounting.NeighboringRelation``.

        Returns:
          A Python float (a JAX scalar when the clip norm is traced).
        """
        return self.config.sensitivity() * sensitivity_factor(relation, "sensitivity")
