"""jax-privacy 2.0's clipping API (``jax_privacy.clipping``), backed by gradclip_jax.

A drop-in module: replace ``from jax_privacy import clipping`` by
``from gradclip_jax.interop import jax_privacy as clipping`` and
``clipping.clipped_grad``, ``clipping.clipped_fun`` and ``clipping.clip_pytree``
keep jax-privacy 2.0's signatures, return types
(:class:`jax_privacy.clipping.BoundedSensitivityCallable`,
:class:`jax_privacy.clipping.AuxiliaryOutput`) and semantics: ``argnums``,
``batch_argnums``, ``keep_batch_dim``, ``return_values``, ``return_grad_norms``,
``normalize_by``, padding examples (``is_padding_example=``), ``prng_argnum``,
``pre_clipping_transform``, ``rescale_to_unit_norm``, ``dtype``,
``spmd_axis_name`` and ``sensitivity(neighboring_relation)``. The sums of clipped
gradients come from :func:`gradclip_jax.clipped_grad`, by default with
``method='auto'`` (ghost clipping, which never forms per-example gradients, where it
applies); ``clipped_grad(..., method='vmap' | 'ghost')`` picks the method.

Where the results differ from jax-privacy 2.0's (each keeps the sensitivity bound):

* ``nan_safe=True`` (default): an example whose gradient has a NaN or inf
  contributes zero; jax-privacy zeroes only its non-finite elements and clips the rest.
* padding examples get ``grad_norms`` 0 (jax-privacy reports their norms).
* with ``pre_clipping_transform``, ``grad_norms`` are the norms of the transformed
  gradients, the ones clipped (jax-privacy reports the untransformed norms).
* the sums are accumulated in float32 for 16-bit gradients, then cast to their dtype
  (or ``dtype``); ``microbatch_size`` need not divide the batch size.
* arguments are checked when the function is made (or called, for what depends on
  the arguments), and each error names the argument at fault.
* ``clip_pytree`` (and so ``clipped_fun``) stores every output within its bound
  (``clip_norm``, or 1 with ``rescale_to_unit_norm``) in exact arithmetic, rounding
  included: jax-privacy's factor where an exact check proves that it stores within
  the bound (the same bits as jax-privacy's, about half the clipped float32 trees), else
  that factor lowered by the measured excess or a rounding margin. jax-privacy's
  outputs land a few units in the last place above the bound in about half the
  clipped trees, and in rescaled trees whose norm is just below ``clip_norm``. So
  jax-privacy's ``test_clip_pytree_clip_norm_zero_rescale`` fails here: it asks a
  global norm of 1 to 7 places for ``{a: [3, 0], b: [0, 4]}`` divided by its norm,
  which every float32 factor stores either above 1 (0.2, whose 0.6 and 0.8 round up:
  exact norm 1 + 2.4e-8) or at most 0.99999994 (ours: 0.9999998).

Importing this module needs jax-privacy: ``pip install 'gradclip_jax[jax-privacy]'``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

try:
    from jax_privacy.clipping import AuxiliaryOutput, BoundedSensitivityCallable
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "gradclip_jax.interop.jax_privacy needs jax-privacy 2.0: "
        "pip install 'gradclip_jax[jax-privacy]'"
    ) from err

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.factors import clip_factor
from gradclip_jax._core.numerics import bounded_factor, divide_or_zero
from gradclip_jax._core.stored import certified_factors, stored_scale
from gradclip_jax._core.validation import check_mask, check_scalar, is_int, is_traced, static_value
from gradclip_jax.per_example.api import clipped_grad as _clipped_grad
from gradclip_jax.per_example.internal import batch_size_of, example_keys

__all__ = ["AuxiliaryOutput", "BoundedSensitivityCallable", "clip_pytree", "clipped_fun", "clipped_grad"]

PyTree = Any


# ----------------------------------------------------------------------------
# clip_pytree
# ----------------------------------------------------------------------------


def _finite_or_zero(x: Any) -> Any:
    return jnp.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _scale_factor(norm: jax.Array, clip_norm: Any, rescale: bool) -> jax.Array:
    """jax-privacy's scale (its edge-case table), before the stored bound is checked."""
    # a negative (traced) clip norm zeroes the output, as in jax-privacy
    c = jnp.maximum(jnp.asarray(clip_norm, norm.dtype), 0.0)
    f = clip_factor(norm, c)  # min(1, c / n), exactly 1 at a zero norm, finite derivatives
    if rescale:  # c = 0: the limit c -> 0, x / |x|
        f = jnp.where(c > 0, f / jnp.where(c > 0, c, 1.0), divide_or_zero(1.0, norm))
    # a NaN or inf norm (nan_safe=False), or a NaN clip norm: scale 0, as jax-privacy
    f = jnp.where(jnp.isfinite(norm), f, 0.0)
    return jnp.nan_to_num(f, nan=0.0, posinf=0.0)


def _stored_factors(leaves: list[jax.Array], f: jax.Array, bound: Any, rescale: bool) -> list[jax.Array]:
    """Each leaf's factor to store with: ``f`` itself where the stored tree provably has norm
    ``<= bound`` (:func:`gradclip_jax._core.stored.certified_factors`, exact arithmetic), else ``f``
    lowered by the measured excess, else by the rounding margin.

    Without ``rescale`` a factor of 1 (nothing clipped) stores the input as it is. With it, the
    output ``x / C`` of an unclipped tree can land on the unit bound too (a norm just below ``C``),
    with a factor above 1, which ``certified_factors`` reads as "not clipped" and leaves unchecked:
    so a factor ``f >= 1`` is checked as ``g = f / 2**e < 1`` on the leaves times ``2**e``, which
    stores the same values (a power of two scales exactly, and the stored output, of norm about 1,
    bounds the scaled leaves: they cannot overflow).

    A tree with a 16-bit leaf takes the margin (:func:`gradclip_jax._core.numerics.bounded_factor`)
    and no exact check: such a tree's norm is commonly measured in 16-bit arithmetic
    (``optax.global_norm``, jax-privacy's own tests), whose rounding (``2**-11`` relative in
    float16) exceeds the few units of float32 the check saves, and the margin keeps that
    measurement within the bound too.
    """
    e = jnp.zeros((), jnp.int32)
    if rescale:
        _, exp = jnp.frexp(lax.stop_gradient(f))  # f = m 2**exp, m in [0.5, 1)
        e = jnp.where(f >= 1, exp, 0)
    up = jnp.ldexp(jnp.ones((), f.dtype), e)
    g = f / up  # exact: a power of two
    if any(jnp.finfo(x.dtype).bits < 32 for x in leaves):
        return [bounded_factor(g, x.dtype) * up for x in leaves]
    # scaled in the product's dtype, stored in the leaf's
    arrays = [x.astype(jnp.promote_types(x.dtype, f.dtype)) * up for x in leaves]
    factors = certified_factors(arrays, [g] * len(arrays), [tuple(range(x.ndim)) for x in arrays], bound,
                                combine=True, stores=[x.dtype for x in leaves])
    return [fa * up for fa in factors]


def clip_pytree(
    pytree: PyTree,
    clip_norm: float,
    rescale_to_unit_norm: bool = False,
    nan_safe: bool = True,
    return_zero: bool = False,
) -> tuple[PyTree, jax.Array]:
    """Clips a pytree to global L2 norm ``clip_norm``: ``jax_privacy.clipping.clip_pytree``.

    The norm comes from :func:`gradclip_jax.tree_norm` (float32 accumulation for
    16-bit leaves, no overflow for finite elements). The output's norm, as stored and
    measured exactly, is at most the bound (``clip_norm``, or 1 with
    ``rescale_to_unit_norm``): jax-privacy's scale is kept where the exact check of
    :func:`gradclip_jax._core.stored.certified_factors` proves that, else lowered by the
    measured excess, else by a few units in the last place (always so for a tree
    with 16-bit leaves).

    ======================= ==================== =================================
    Case                    rescale_to_unit_norm Output
    ======================= ==================== =================================
    clip_norm = 0           False                Zero
    clip_norm = 0           True                 Input / norm
    clip_norm = inf         False                Unchanged
    clip_norm = inf         True                 Zero
    clip_norm < 0 (static)  -                    Raises ValueError
    clip_norm < 0 (traced)  -                    Zero
    pytree norm = 0         -                    Unchanged
    ======================= ==================== =================================

    Args:
      pytree: a pytree of floating-point arrays.
      clip_norm: the largest L2 norm of the output (a number or traced scalar).
      rescale_to_unit_norm: also divide by ``clip_norm`` (output norm at most 1).
        A Python bool.
      nan_safe: set NaN and +-inf elements to 0 first (the bound then holds for any
        input). With False, NaNs stay and infs become NaN. A Python bool.
      return_zero: return zeros of the same structure (a bool, traced too), as
        jax-privacy does for padding examples.

    Returns:
      ``(clipped, norm)``: the clipped pytree (same structure and dtypes) and the
      float32 L2 norm of the input (after ``nan_safe``).

    Raises:
      ValueError: a negative or NaN static ``clip_norm``.
      TypeError: a ``clip_norm`` that is not a number, a traced
        ``rescale_to_unit_norm`` or ``nan_safe``, integer leaves.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.interop.jax_privacy import clip_pytree
      >>> clipped, norm = clip_pytree({'a': jnp.array([3.0]), 'b': jnp.array([4.0])}, 1.0)
      >>> norm
      Array(5., dtype=float32)
      >>> clipped['a'] <= 0.6, clipped['b'] <= 0.8
      (Array([ True], dtype=bool), Array([ True], dtype=bool))
    """
    fn = "clip_pytree"
    check_scalar(fn, "clip_norm", clip_norm)
    rescale = bool(static_value(fn, "rescale_to_unit_norm", rescale_to_unit_norm))
    if static_value(fn, "nan_safe", nan_safe):
        pytree = jax.tree.map(_finite_or_zero, pytree)
    flat = _norms.flatten(pytree, fn)
    leaves = flat.arrays
    norm = _norms.global_norm(leaves, _norms.parse_ord(2))
    f = _scale_factor(norm, clip_norm, rescale)
    bound = 1.0 if rescale else jnp.maximum(jnp.asarray(clip_norm, norm.dtype), 0.0)
    factors = _stored_factors(leaves, f, bound, rescale)
    out = [jnp.where(return_zero, jnp.zeros_like(x), stored_scale(x, fx)) for x, fx in zip(leaves, factors, strict=True)]
    return flat.rebuild(out), norm.astype(jnp.float32)


# ----------------------------------------------------------------------------
# Arguments shared by clipped_fun and clipped_grad
# ----------------------------------------------------------------------------


def _argnums(fn: str, name: str, value: Any) -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints) as a tuple of distinct non-negative ints."""
    nums = (value,) if is_int(value) else value
    if not isinstance(nums, Sequence) or not all(is_int(n) for n in nums):
        raise TypeError(f"{fn}: `{name}` must be an int or a sequence of ints, got {value!r}")
    nums = tuple(int(n) for n in nums)
    if not nums:
        raise ValueError(f"{fn}: `{name}` must not be empty: name at least one argument")
    if min(nums) < 0:
        raise ValueError(f"{fn}: `{name}`={value!r} must be >= 0 (positions of the arguments)")
    if len(set(nums)) != len(nums):
        raise ValueError(f"{fn}: `{name}`={value!r} names an argument twice")
    return nums


def _prng_argnum(fn: str, value: Any, taken: dict[str, tuple[int, ...]]) -> int | None:
    """``prng_argnum`` checked: None, or a non-negative int naming no argument in ``taken``."""
    value = static_value(fn, "prng_argnum", value)
    if value is None:
        return None
    if not is_int(value):
        raise TypeError(f"{fn}: `prng_argnum` must be None or an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{fn}: `prng_argnum`={value} must be >= 0 (the position of the key argument)")
    for name, nums in taken.items():
        if value in nums:
            raise ValueError(f"{fn}: prng_argnum={value} is also in {name}={nums}; the key argument is split "
                             "into one key per example and must be neither differentiated nor batched")
    return int(value)


def _check_called(fn: str, args: Sequence[Any], **named: Any) -> None:
    """ValueError when an argument position named at construction is beyond the call's arguments."""
    for name, nums in named.items():
        top = max(nums) if isinstance(nums, tuple) else nums
        if top is not None and top >= len(args):
            raise ValueError(f"{fn}: {name}={nums} names argument {top}, but the function was called with "
                             f"{len(args)} positional argument(s)")


def _batch_size(fn: str, batch_argnums: tuple[int, ...], args: Sequence[Any]) -> int:
    """The common size of axis 0 of the batch arguments; ValueError naming them when they differ."""
    sizes = {i: batch_size_of(args[i], f"{fn}: argument {i} (in batch_argnums)") for i in batch_argnums}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"argument {i}: {s}" for i, s in sizes.items())
        raise ValueError(f"{fn}: Batch axis sizes differ ({listed}); every argument in "
                         f"batch_argnums={batch_argnums} must have the same size on axis 0")
    return sizes[batch_argnums[0]]


def _padding(fn: str, is_padding_example: Any, bsize: int) -> jax.Array:
    """``is_padding_example`` as a ``(B,)`` bool array (all False when None)."""
    if is_padding_example is None:
        return jnp.zeros((bsize,), jnp.bool_)
    shape = tuple(np.shape(is_padding_example))
    if shape != (bsize,):
        raise ValueError(f"{fn}: `is_padding_example` must have shape (B,) = ({bsize},) (the batch size of "
                         f"the batch arguments), got {shape}")
    return check_mask(fn, is_padding_example, bsize)  # type: ignore[return-value]


def _example_keys(fn: str, key_arg: Any, bsize: int, prng_argnum: int) -> Any:
    """Each key of the ``prng_argnum`` argument split into ``bsize`` keys, one per example."""
    return jax.tree.map(lambda k: example_keys(k, bsize, prng_argnum, fn), key_arg)


def _squeeze_axis_1(x: Any) -> Any:
    """Drops axis 1 when it has size 1: with ``keep_batch_dim`` a per-example aux of shape
    ``(1, ...)`` is stacked to ``(B, 1, ...)``; jax-privacy returns ``(B, ...)``."""
    if hasattr(x, "shape") and len(x.shape) >= 2 and x.shape[1] == 1:
        return jnp.squeeze(x, axis=1)
    return x


def _expand(x: Any) -> Any:
    return jax.tree.map(lambda a: jnp.expand_dims(a, 0), x)


def _check_callable(fn: str, name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{fn}: `{name}` must be callable, got {value!r}")


def _norm_bound(fn: str, l2_clip_norm: Any, rescale: bool, normalize_by: Any) -> Any:
    """The add/remove sensitivity ``(1 or C) / normalize_by``, with both checked."""
    check_scalar(fn, "l2_clip_norm", l2_clip_norm)
    check_scalar(fn, "normalize_by", normalize_by, low_inclusive=False)
    return (1.0 if rescale else l2_clip_norm) / normalize_by


# ----------------------------------------------------------------------------
# clipped_fun
# ----------------------------------------------------------------------------


def _one_group(fun: Callable[..., Any], has_aux: bool, batch_argnums: tuple[int, ...], keep_batch_dim: bool,
               clip: Callable[..., tuple]) -> Callable[..., tuple]:
    """``fun`` on one example (or group): its output clipped, its aux and output norm."""

    def one(*args: Any, is_padding_example: Any, **kwargs: Any) -> tuple:
        if keep_batch_dim:
            args = tuple(_expand(a) if i in batch_argnums else a for i, a in enumerate(args))
        out = fun(*args, **kwargs)
        value, aux = out if has_aux else (out, ())
        clipped, norm = clip(value, return_zero=is_padding_example)
        return clipped, aux, norm

    return one


def clipped_fun(
    fun: Callable[..., Any],
    has_aux: bool = False,
    *,
    batch_argnums: int | Sequence[int] = 0,
    keep_batch_dim: bool = True,
    l2_clip_norm: float = 1.0,
    rescale_to_unit_norm: bool = False,
    normalize_by: float = 1.0,
    return_norms: bool = False,
    microbatch_size: int | None = None,
    nan_safe: bool = True,
    dtype: Any = None,
    prng_argnum: int | None = None,
    spmd_axis_name: str | None = None,
) -> BoundedSensitivityCallable:
    """Clips ``fun``'s output per example and sums it: ``jax_privacy.clipping.clipped_fun``.

    Each example (slice of axis 0 of the ``batch_argnums`` arguments) goes through
    ``fun`` alone, its output is clipped by :func:`clip_pytree` and the clipped
    outputs are summed, so the sum's L2 sensitivity is ``l2_clip_norm`` (1 with
    ``rescale_to_unit_norm``), divided by ``normalize_by``, for add/remove
    neighbours, twice that for replace-one. The returned function takes ``fun``'s
    arguments and an optional ``is_padding_example=`` ``(B,)`` bool array (padding
    examples contribute zero); other keyword arguments are split over the batch.

    Args:
      fun: the function of one example (or of a batch of one with
        ``keep_batch_dim``).
      has_aux: ``fun`` returns ``(value, aux)``; only ``value`` is clipped, ``aux``
        is returned per example.
      batch_argnums: the argument(s) carrying the batch on axis 0.
      keep_batch_dim: pass each example with a leading axis of size 1 (True) or
        without it (False: ``fun`` of one example or, for a batch of groups, of one group).
      l2_clip_norm: the clip norm.
      rescale_to_unit_norm: divide each clipped output by ``l2_clip_norm``.
      normalize_by: divide the sum by this (> 0).
      return_norms: also return the per-example norms before clipping.
      microbatch_size: examples per sequential chunk (must divide the batch size).
      nan_safe: see :func:`clip_pytree`.
      dtype: cast ``fun``'s output to this dtype before clipping and summing.
      prng_argnum: the position of a PRNG key (or pytree of keys) split into one
        key per example.
      spmd_axis_name: passed to ``jax.vmap``.

    Returns:
      A :class:`~jax_privacy.clipping.BoundedSensitivityCallable` returning
      ``value``; ``(value, aux)`` with ``has_aux``; ``(value, (aux, norms))`` with
      both; with ``return_norms`` alone ``(value, ((), norms))``, as jax-privacy
      2.0.0 returns it (its docstring says ``(value, norms)``).

    Raises:
      TypeError: a non-callable ``fun``, non-int argument positions.
      ValueError: naming the argument, for an empty or negative ``batch_argnums``,
        a negative or NaN ``l2_clip_norm``, ``normalize_by <= 0``, a bad
        ``microbatch_size``; at call time, batch arguments of different sizes or a
        bad ``is_padding_example``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.interop.jax_privacy import clipped_fun
      >>> clipped_sum = clipped_fun(jnp.mean, l2_clip_norm=1.0)
      >>> clipped_sum(jnp.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]))  # 0 + 1 + 1 + 1 + 1 + 1
      Array(5., dtype=float32)
      >>> clipped_sum.sensitivity()
      1.0
    """
    fn = "clipped_fun"
    _check_callable(fn, "fun", fun)
    batch = _argnums(fn, "batch_argnums", batch_argnums)
    prng = _prng_argnum(fn, prng_argnum, {"batch_argnums": batch})
    bound = _norm_bound(fn, l2_clip_norm, bool(rescale_to_unit_norm), normalize_by)
    mb = _microbatch(fn, microbatch_size)
    clip = functools.partial(clip_pytree, clip_norm=l2_clip_norm, rescale_to_unit_norm=rescale_to_unit_norm,
                             nan_safe=nan_safe)

    def cast_then_clip(value: Any, return_zero: Any) -> tuple:
        return clip(optax.tree.cast(value, dtype), return_zero=return_zero)

    one = _one_group(fun, has_aux, batch, keep_batch_dim, cast_then_clip)

    def clipped_fn(*args: Any, is_padding_example: Any = None, **kwargs: Any) -> Any:
        _check_called(fn, args, batch_argnums=batch, prng_argnum=prng)
        bsize = _batch_size(fn, batch, args)
        if mb is not None and bsize % mb:
            raise ValueError(f"{fn}: microbatch_size={mb} must divide the batch size {bsize}")
        split, axes = _split_keys(fn, args, batch, prng, bsize)
        acc = optax.microbatching.AccumulationType
        mapped = optax.microbatching.micro_vmap(
            one, in_axes=axes, microbatch_size=mb, accumulator=(acc.SUM, acc.CONCAT, acc.CONCAT),
            vmap_fn=functools.partial(jax.vmap, spmd_axis_name=spmd_axis_name))
        value, aux, norms = mapped(*split, is_padding_example=_padding(fn, is_padding_example, bsize), **kwargs)
        if keep_batch_dim:
            aux = jax.tree.map(_squeeze_axis_1, aux)
        value = jax.tree.map(lambda x: x / normalize_by, value)
        return _fun_outputs(value, aux, norms, has_aux, return_norms)

    return BoundedSensitivityCallable(clipped_fn, bound, has_aux or return_norms)


def _microbatch(fn: str, mb: Any) -> int | None:
    mb = static_value(fn, "microbatch_size", mb)
    if mb is not None and (not is_int(mb) or mb < 1):
        raise ValueError(f"{fn}: microbatch_size must be None or a positive int, got {mb!r}")
    return None if mb is None else int(mb)


def _split_keys(fn: str, args: Sequence[Any], batch: tuple[int, ...], prng: int | None,
                bsize: int) -> tuple[list[Any], list[int | None]]:
    """The arguments with the key argument split per example, and the vmap axes (batch and keys: 0)."""
    out = list(args)
    axes: list[int | None] = [0 if i in batch else None for i in range(len(out))]
    if prng is not None:
        out[prng] = _example_keys(fn, out[prng], bsize, prng)
        axes[prng] = 0
    return out, axes


def _fun_outputs(value: Any, aux: Any, norms: Any, has_aux: bool, return_norms: bool) -> Any:
    """jax-privacy 2.0.0's outputs: with ``return_norms`` and no aux, ``(value, ((), norms))``, as it
    returns them (its docstring says ``(value, norms)``), so code written against it keeps working."""
    if return_norms:
        return value, (aux if has_aux else (), norms)
    return (value, aux) if has_aux else value


# ----------------------------------------------------------------------------
# clipped_grad
# ----------------------------------------------------------------------------


class _Layout:
    """Where ``fun``'s arguments go: differentiated (params), batched (with the per-example
    keyword arguments and keys) or shared by all examples."""

    def __init__(self, fn: str, argnums: Any, batch_argnums: Any, prng_argnum: Any):
        self.single = isinstance(argnums, (int, np.integer))
        self.argnums = _argnums(fn, "argnums", argnums)
        self.batch = _argnums(fn, "batch_argnums", batch_argnums)
        shared = sorted(set(self.argnums) & set(self.batch))
        if shared:
            raise ValueError(f"{fn}: argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap at "
                             f"{shared}: a differentiated argument cannot carry the batch")
        self.prng = _prng_argnum(fn, prng_argnum, {"argnums": self.argnums, "batch_argnums": self.batch})

    def params(self, args: Sequence[Any]) -> Any:
        return args[self.argnums[0]] if self.single else tuple(args[i] for i in self.argnums)

    def shared(self, args: Sequence[Any]) -> list[Any]:
        skip = {*self.argnums, *self.batch, self.prng}
        return [a for i, a in enumerate(args) if i not in skip]

    def assemble(self, n: int, params: Any, example: dict, shared: Sequence[Any], keep_batch_dim: bool) -> list:
        """``fun``'s ``n`` positional arguments for one example."""
        placed: dict[int, Any] = dict(zip(self.argnums, (params,) if self.single else params))
        placed |= {i: _expand(x) if keep_batch_dim else x for i, x in zip(self.batch, example["args"])}
        if self.prng is not None:
            placed[self.prng] = example["keys"]  # one key, never expanded (as jax-privacy)
        rest = iter(shared)
        return [placed[i] if i in placed else next(rest) for i in range(n)]


def _split_static(values: Sequence[Any]) -> tuple[list[Any], Callable[[Sequence[Any]], list[Any]]]:
    """The array leaves of ``values`` (passed to gradclip_jax's function, which traces them) and
    a function rebuilding ``values`` from them; other leaves (flags, strings) stay Python values,
    as jax-privacy passes them to ``fun``."""
    leaves, treedef = jax.tree.flatten(list(values))
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray)) or is_traced(x)]

    def rebuild(arrays: Sequence[Any]) -> list[Any]:
        out = list(leaves)
        for i, x in zip(dynamic, arrays):
            out[i] = x
        return jax.tree.unflatten(treedef, out)  # type: ignore[no-any-return]

    return [leaves[i] for i in dynamic], rebuild


def _per_example_loss(fun: Callable[..., Any], layout: _Layout, n: int, has_aux: bool, keep_batch_dim: bool,
                      rebuild: Callable[[Sequence[Any]], list[Any]]) -> Callable[..., Any]:
    """gradclip_jax's loss contract, ``loss(params, batch, *arrays) -> (B,)`` losses: ``fun`` of each
    example, vmapped over the batch (so ghost clipping sees one batched computation)."""

    def loss(params: Any, batch: dict, *arrays: Any) -> Any:
        shared = rebuild(arrays)

        def one(example: dict) -> tuple:
            out = fun(*layout.assemble(n, params, example, shared, keep_batch_dim), **example["kwargs"])
            value, aux = out if has_aux else (out, None)
            if jnp.shape(value) != ():
                raise TypeError(f"clipped_grad: `fun` must return a scalar loss (of one example or group), "
                                f"got shape {jnp.shape(value)}")
            return value, aux

        values, aux = jax.vmap(one)(batch)
        return (values, aux) if has_aux else values

    return loss


def _grad_dtypes(params: Any, transform: Callable[[Any], Any] | None) -> Any:
    """Shapes and dtypes of one example's (transformed) gradient: jax-privacy's output dtypes."""
    spec = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), params)
    return spec if transform is None else jax.eval_shape(transform, spec)


def _ours_options(l2_clip_norm: Any, rescale: bool, **options: Any) -> dict:
    """gradclip_jax.clipped_grad's options. A static zero clip norm with ``rescale_to_unit_norm``
    (jax-privacy: every example scaled to norm 1) is automatic clipping with C = 1, gamma = 0."""
    zero = not is_traced(l2_clip_norm) and np.ndim(l2_clip_norm) == 0 and not callable(l2_clip_norm) \
        and isinstance(l2_clip_norm, (int, float, np.number, np.ndarray, jax.Array)) \
        and float(l2_clip_norm) == 0.0
    if rescale and zero:
        return {**options, "l2_clip_norm": 1.0, "normalize": True, "gamma": 0.0}
    return {**options, "l2_clip_norm": l2_clip_norm, "rescale_to_unit_norm": rescale}


def clipped_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    l2_clip_norm: float,
    rescale_to_unit_norm: bool = False,
    normalize_by: float = 1.0,
    batch_argnums: int | Sequence[int] = 1,
    keep_batch_dim: bool = True,
    return_values: bool = False,
    return_grad_norms: bool = False,
    pre_clipping_transform: Callable[[PyTree], PyTree] | None = None,
    microbatch_size: int | None = None,
    nan_safe: bool = True,
    dtype: Any = None,
    prng_argnum: int | None = None,
    spmd_axis_name: str | None = None,
    method: str = "auto",
) -> BoundedSensitivityCallable:
    """The sum of clipped per-example gradients of ``fun``: ``jax_privacy.clipping.clipped_grad``.

    ``fun(*args)`` returns the scalar loss of one example (a batch of one with
    ``keep_batch_dim``, one example or group without). The returned function takes
    ``fun``'s arguments plus an optional ``is_padding_example=`` ``(B,)`` bool array
    and returns the sum over the examples (slices of axis 0 of the
    ``batch_argnums`` arguments) of each example's gradient with respect to
    ``argnums``, clipped to L2 norm ``l2_clip_norm``; with ``has_aux``,
    ``return_values`` or ``return_grad_norms``, ``(grads, AuxiliaryOutput(values,
    grad_norms, aux))``, each per example. The sums come from
    :func:`gradclip_jax.clipped_grad` with ``method`` (default ``'auto'``: ghost
    clipping where it applies, see :mod:`gradclip_jax.ghost`). Its
    ``sensitivity(neighboring_relation)`` is ``l2_clip_norm`` (1 with
    ``rescale_to_unit_norm``) divided by ``normalize_by`` for add/remove and
    zero-out neighbours, twice that for replace-one.

    Args:
      fun: the loss of one example (or group); ``(loss, aux)`` with ``has_aux``.
      argnums: the argument(s) to differentiate (without a batch axis).
      has_aux: ``fun`` returns ``(loss, aux)``; aux comes back per example.
      l2_clip_norm: the clip norm of each example's gradient.
      rescale_to_unit_norm: divide each clipped gradient by ``l2_clip_norm``
        (sensitivity 1; with ``l2_clip_norm=0``, each gradient is normalized).
      normalize_by: divide the sum by this (> 0).
      batch_argnums: the argument(s) carrying the batch on axis 0.
      keep_batch_dim: pass each example with a leading axis of size 1 (True) or
        without it (False: per-example losses, or per-user clipping of groups).
      return_values: also return the per-example losses.
      return_grad_norms: also return the per-example gradient norms before clipping.
      pre_clipping_transform: applied to each example's gradient before it is
        clipped (needs per-example gradients: ``method='auto'`` then uses vmap).
      microbatch_size: examples per sequential chunk (any positive int).
      nan_safe: an example whose gradient is not finite contributes zero.
      dtype: the dtype of the returned sums (default: the gradients' dtypes).
      prng_argnum: the position of a PRNG key (or pytree of keys) split with
        ``jax.random.split(key, B)``; example ``i`` gets key ``i``.
      spmd_axis_name: passed to ``jax.vmap``.
      method: ``'auto'`` (default), ``'ghost'`` or ``'vmap'`` (see
        :func:`gradclip_jax.clipped_grad`); the results agree up to float rounding.

    Returns:
      A :class:`~jax_privacy.clipping.BoundedSensitivityCallable`.

    Raises:
      TypeError: a non-callable ``fun`` or ``pre_clipping_transform``, non-int
        argument positions, a loss that is not a scalar, a key argument that is not
        a PRNG key.
      ValueError: naming the argument, for empty, negative or overlapping
        ``argnums`` / ``batch_argnums``, a negative or NaN ``l2_clip_norm``,
        ``normalize_by <= 0``, a bad ``microbatch_size``, ``method`` or ``dtype``; at
        call time, argument positions beyond the call's arguments, batch arguments of
        different sizes, a bad ``is_padding_example``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.interop.jax_privacy import clipped_grad
      >>> f = lambda param, data: 0.5 * jnp.mean((data - param) ** 2)
      >>> g = clipped_grad(f, l2_clip_norm=jnp.inf, return_grad_norms=True)
      >>> grads, aux = g(3.0, jnp.array([0.0, 7.0, -2.0]))
      >>> grads, aux.grad_norms
      (Array(4., dtype=float32), Array([3., 4., 5.], dtype=float32))
      >>> g = clipped_grad(f, l2_clip_norm=1.0, method='vmap')
      >>> g(3.0, jnp.array([0.0, 7.0, -2.0])), g.sensitivity()
      (Array(1., dtype=float32), 1.0)
    """
    fn = "clipped_grad"
    _check_callable(fn, "fun", fun)
    layout = _Layout(fn, argnums, batch_argnums, prng_argnum)
    rescale = bool(static_value(fn, "rescale_to_unit_norm", rescale_to_unit_norm))
    _norm_bound(fn, l2_clip_norm, rescale, normalize_by)
    has_aux = bool(static_value(fn, "has_aux", has_aux))
    options = _ours_options(l2_clip_norm, rescale, has_aux=has_aux, microbatch_size=microbatch_size,
                            method=method, nan_safe=nan_safe, spmd_axis_name=spmd_axis_name, dtype=dtype,
                            pre_clipping_transform=pre_clipping_transform)

    def ours(loss: Callable[..., Any]) -> Any:
        return _clipped_grad(loss, **options)

    sensitivity = ours(fun).sensitivity()  # also checks every option now, not at the first call
    with_aux = has_aux or bool(return_values) or bool(return_grad_norms)

    def grad_fn(*args: Any, is_padding_example: Any = None, **kwargs: Any) -> Any:
        _check_called(fn, args, argnums=layout.argnums, batch_argnums=layout.batch, prng_argnum=layout.prng)
        bsize = _batch_size(fn, layout.batch, args)
        padding = _padding(fn, is_padding_example, bsize)
        batch = {"args": tuple(args[i] for i in layout.batch), "kwargs": kwargs,
                 "keys": None if layout.prng is None else _example_keys(fn, args[layout.prng], bsize, layout.prng)}
        arrays, rebuild = _split_static(layout.shared(args))
        loss = _per_example_loss(fun, layout, len(args), has_aux, keep_batch_dim, rebuild)
        params = layout.params(args)
        grads, info = ours(loss)(params, batch, *arrays, mask=~padding)
        if dtype is None:
            grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, _grad_dtypes(params, pre_clipping_transform))
        grads = jax.tree.map(lambda g: g / normalize_by, grads)
        if not with_aux:
            return grads
        aux = jax.tree.map(_squeeze_axis_1, info.aux) if keep_batch_dim else info.aux
        return grads, AuxiliaryOutput(values=info.values if return_values else None,
                                      grad_norms=info.norms if return_grad_norms else None,
                                      aux=aux if has_aux else None)

    return BoundedSensitivityCallable(grad_fn, sensitivity / normalize_by, with_aux)
