""":func:`clipped_fun`: each example's output of a function clipped by :func:`clip_pytree`, and
the clipped outputs summed (jax-privacy's return layout)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax_privacy.clipping import BoundedSensitivityCallable

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.validation import check_sum_dtype, is_int, static_value
from gradclip_jax.interop.jax_privacy import _version
from gradclip_jax.interop.jax_privacy._arguments import (
    check_callable,
    check_called,
    checked_argnums,
    common_batch_size,
    keys_per_example,
    padding_mask,
    prng_argnum_of,
    squeeze_axis_1,
)
from gradclip_jax.interop.jax_privacy._clip_norms import PyTree, is_per_layer, norm_bound
from gradclip_jax.interop.jax_privacy._clip_pytree import clip_per_layer, clip_pytree
from gradclip_jax.interop.jax_privacy._grid import clip_and_round_to_grid
from gradclip_jax.per_example.internal import call_on_one_example


def _one_group(
    fun: Callable[..., Any],
    has_aux: bool,
    batch_argnums: tuple[int, ...],
    keep_batch_dim: bool,
    clip: Callable[..., tuple],
) -> Callable[..., tuple]:
    """``fun`` on one example (or group): its output clipped, its aux and output norm."""

    def one(*args: Any, is_padding_example: Any, **kwargs: Any) -> tuple:
        if keep_batch_dim:  # a batch of one: gcx.with_sharding_constraint leaves axis 0 to vmap
            out = call_on_one_example(fun, batch_argnums, *args, **kwargs)
        else:
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
    l2_clip_norm: float | PyTree = 1.0,
    rescale_to_unit_norm: bool = False,
    normalize_by: float = 1.0,
    return_norms: bool = False,
    microbatch_size: int | None = None,
    nan_safe: bool = True,
    dtype: Any = None,
    prng_argnum: int | None = None,
    spmd_axis_name: str | None = None,
    grid_scale: int | None = None,
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
      l2_clip_norm: the clip norm, or a pytree of clip norms that is a prefix of
        ``fun``'s output (per-layer: each subtree clipped to its norm; the
        sensitivity is ``sqrt(sum C_i**2)``, ``sqrt(K)`` rescaled, over ``normalize_by``).
      rescale_to_unit_norm: divide each clipped output by ``l2_clip_norm``.
      normalize_by: divide the sum by this (> 0).
      return_norms: also return the per-example norms before clipping.
      microbatch_size: examples per sequential chunk (must divide the batch size).
      nan_safe: an example's non-finite output cannot break the bound: with
        jax-privacy 2.0.0 installed its NaN and inf elements are zeroed (see
        :func:`clip_pytree`), with a later one the example contributes zero.
      dtype: cast ``fun``'s output to this dtype before clipping, 32 bits at
        least unless ``grid_scale`` is given. 16-bit outputs are clipped in their
        dtype and summed (and returned) in float32, where jax-privacy sums them in
        16 bits: the rounding of a 16-bit sum grows with the batch, and one example
        could move it by more than the sensitivity.
      prng_argnum: the position of a PRNG key (or pytree of keys) split into one
        key per example.
      spmd_axis_name: passed to ``jax.vmap``.
      grid_scale: None, or a positive int: each clipped output is rounded onto
        the integer grid of :func:`clip_and_round_to_grid` and the int64 outputs
        are summed exactly; the sensitivity is ``grid_scale``. Needs 64-bit mode,
        one clip norm, ``normalize_by=1`` and no ``rescale_to_unit_norm``.

    Returns:
      A :class:`~jax_privacy.clipping.BoundedSensitivityCallable` returning
      ``value``; ``(value, aux)`` with ``has_aux``; ``(value, (aux, norms))`` with
      both; with ``return_norms`` alone ``(value, ((), norms))`` where jax-privacy
      2.0.0 is installed (as it returns it), ``(value, norms)`` with a later one.

    Raises:
      TypeError: a non-callable ``fun``, non-int argument positions.
      ValueError: naming the argument, for an empty or negative ``batch_argnums``,
        a negative or NaN ``l2_clip_norm`` (or leaf of it), ``normalize_by <= 0``, a bad
        ``microbatch_size`` or ``grid_scale`` (or what it excludes); a per-layer
        ``l2_clip_norm`` that is not a prefix of the output; at call time, batch arguments of different sizes or a
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
    check_callable(fn, "fun", fun)
    batch = checked_argnums(fn, "batch_argnums", batch_argnums)
    prng = prng_argnum_of(fn, prng_argnum, {"batch_argnums": batch})
    bound = norm_bound(fn, l2_clip_norm, bool(rescale_to_unit_norm), normalize_by, grid_scale)
    mb = _microbatch(fn, microbatch_size)
    # a later jax-privacy drops an example whose norm is not finite (2.0.0: its non-finite elements)
    whole = bool(nan_safe) and _version.AFTER_2_0_0
    clip = _clip_one(l2_clip_norm, rescale_to_unit_norm, nan_safe and not whole, grid_scale)

    if grid_scale is None:  # (the grid's integer sums are exact)
        check_sum_dtype(fn, dtype)

    def cast_then_clip(value: Any, return_zero: Any) -> tuple:
        clipped, norm = clip(optax.tree.cast(value, dtype), return_zero=return_zero)
        if whole:
            finite = functools.reduce(
                jnp.logical_and, [jnp.isfinite(n) for n in jax.tree.leaves(norm)]
            )
            clipped = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), clipped)
        # summed in float32 at least: a sum rounded to 16 bits moves by more than one example's
        # clip norm (jax-privacy sums 16-bit outputs in their dtype)
        return jax.tree.map(_summed_in, clipped), norm

    one = _one_group(fun, has_aux, batch, keep_batch_dim, cast_then_clip)

    def clipped_fn(*args: Any, is_padding_example: Any = None, **kwargs: Any) -> Any:
        check_called(fn, args, batch_argnums=batch, prng_argnum=prng)
        bsize = common_batch_size(fn, batch, args)
        if mb is not None and bsize % mb:
            raise ValueError(f"{fn}: microbatch_size={mb} must divide the batch size {bsize}")
        split, axes = _split_keys(fn, args, batch, prng, bsize)
        acc = optax.microbatching.AccumulationType
        mapped = optax.microbatching.micro_vmap(
            one,
            in_axes=axes,
            microbatch_size=mb,
            accumulator=(acc.SUM, acc.CONCAT, acc.CONCAT),
            vmap_fn=functools.partial(jax.vmap, spmd_axis_name=spmd_axis_name),
        )
        value, aux, norms = mapped(
            *split, is_padding_example=padding_mask(fn, is_padding_example, bsize), **kwargs
        )
        if keep_batch_dim:
            aux = jax.tree.map(squeeze_axis_1, aux)
        if grid_scale is None:  # an integer sum stays integer (normalize_by is 1 then)
            value = jax.tree.map(lambda x: x / normalize_by, value)
        return _fun_outputs(value, aux, norms, has_aux, return_norms)

    return BoundedSensitivityCallable(clipped_fn, bound, has_aux or return_norms)


def _clip_one(
    l2_clip_norm: Any, rescale: Any, nan_safe: Any, grid_scale: int | None
) -> Callable[..., tuple]:
    """One example's clip: :func:`clip_pytree`, or :func:`clip_and_round_to_grid` with ``grid_scale``."""
    if grid_scale is not None:
        return functools.partial(
            clip_and_round_to_grid,
            l2_clip_norm=l2_clip_norm,
            grid_scale=grid_scale,
            nan_safe=nan_safe,
        )
    if is_per_layer(l2_clip_norm):  # errors name clipped_fun's argument
        return functools.partial(
            clip_per_layer,
            clip_norm=l2_clip_norm,
            rescale=rescale,
            nan_safe=nan_safe,
            fn="clipped_fun",
            name="l2_clip_norm",
        )
    return functools.partial(
        clip_pytree, clip_norm=l2_clip_norm, rescale_to_unit_norm=rescale, nan_safe=nan_safe
    )


def _microbatch(fn: str, mb: Any) -> int | None:
    mb = static_value(fn, "microbatch_size", mb)
    if mb is not None and (not is_int(mb) or mb < 1):
        raise ValueError(f"{fn}: microbatch_size must be None or a positive int, got {mb!r}")
    return None if mb is None else int(mb)


def _split_keys(
    fn: str, args: Sequence[Any], batch: tuple[int, ...], prng: int | None, bsize: int
) -> tuple[list[Any], list[int | None]]:
    """The arguments with the key argument split per example, and the vmap axes (batch and keys: 0)."""
    out = list(args)
    axes: list[int | None] = [0 if i in batch else None for i in range(len(out))]
    if prng is not None:
        out[prng] = keys_per_example(fn, out[prng], bsize, prng)
        axes[prng] = 0
    return out, axes


def _fun_outputs(value: Any, aux: Any, norms: Any, has_aux: bool, return_norms: bool) -> Any:
    """The installed jax-privacy's outputs: with ``return_norms`` and no aux, 2.0.0 returns
    ``(value, ((), norms))`` (its docstring says ``(value, norms)``), a later one ``(value, norms)``;
    code written against either keeps working."""
    if return_norms:
        if not has_aux and _version.AFTER_2_0_0:
            return value, norms
        return value, (aux if has_aux else (), norms)
    return (value, aux) if has_aux else value


def _summed_in(x: Any) -> Any:
    """``x`` in the dtype its sum over examples is formed in: float32 for a 16-bit float."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(_norms.sum_dtype(x.dtype))
    return x
