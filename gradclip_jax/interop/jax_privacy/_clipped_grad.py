""":func:`clipped_grad`: jax-privacy's call on :func:`gradclip_jax.clipped_grad`, its arguments
laid out as a per-example loss over one batched computation (which ghost clipping can follow)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax_privacy.clipping import AuxiliaryOutput, BoundedSensitivityCallable

from gradclip_jax._core.validation import is_traced, static_value
from gradclip_jax.interop.jax_privacy._arguments import (
    _argnums,
    _batch_size,
    _check_callable,
    _check_called,
    _example_keys,
    _expand,
    _norm_bound,
    _padding,
    _prng_argnum,
    _squeeze_axis_1,
)
from gradclip_jax.interop.jax_privacy._clip_pytree import PyTree
from gradclip_jax.per_example.api import clipped_grad as _clipped_grad


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
