""":func:`clipped_grad`: jax-privacy's call on :func:`gradclip_jax.clipped_grad`, its arguments
laid out as a per-example loss over one batched computation (which ghost clipping can follow)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax_privacy.clipping import AuxiliaryOutput, BoundedSensitivityCallable

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.numerics import divide_or_zero, rounding_margin
from gradclip_jax._core.validation import check_sum_dtype, is_traced, static_value
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
from gradclip_jax.interop.jax_privacy._clipped_fun import clipped_fun
from gradclip_jax.per_example.api import clipped_grad as _clipped_grad
from gradclip_jax.per_example.internal import call_on_one_example


class _Layout:
    """Where ``fun``'s arguments go: differentiated (params), batched (with the per-example
    keyword arguments and keys) or shared by all examples."""

    def __init__(self, fn: str, argnums: Any, batch_argnums: Any, prng_argnum: Any):
        self.single = isinstance(argnums, (int, np.integer))
        self.argnums = checked_argnums(fn, "argnums", argnums)
        self.batch = checked_argnums(fn, "batch_argnums", batch_argnums)
        shared = sorted(set(self.argnums) & set(self.batch))
        if shared:
            raise ValueError(
                f"{fn}: argnums={argnums!r} and batch_argnums={batch_argnums!r} overlap at "
                f"{shared}: a differentiated argument cannot carry the batch"
            )
        self.prng = prng_argnum_of(
            fn, prng_argnum, {"argnums": self.argnums, "batch_argnums": self.batch}
        )

    def params(self, args: Sequence[Any]) -> Any:
        return args[self.argnums[0]] if self.single else tuple(args[i] for i in self.argnums)

    def shared(self, args: Sequence[Any]) -> list[Any]:
        skip = {*self.argnums, *self.batch, self.prng}
        return [a for i, a in enumerate(args) if i not in skip]

    def assemble(self, n: int, params: Any, example: dict, shared: Sequence[Any]) -> list:
        """``fun``'s ``n`` positional arguments for one example (its batch arguments as given)."""
        placed: dict[int, Any] = dict(zip(self.argnums, (params,) if self.single else params))
        placed |= dict(zip(self.batch, example["args"]))
        if self.prng is not None:
            placed[self.prng] = example["keys"]  # one key, never expanded (as jax-privacy)
        rest = iter(shared)
        return [placed[i] if i in placed else next(rest) for i in range(n)]


def _split_static(values: Sequence[Any]) -> tuple[list[Any], Callable[[Sequence[Any]], list[Any]]]:
    """The array leaves of ``values`` (passed to gradclip_jax's function, which traces them) and
    a function rebuilding ``values`` from them; other leaves (flags, strings) stay Python values,
    as jax-privacy passes them to ``fun``."""
    leaves, treedef = jax.tree.flatten(list(values))
    dynamic = [
        i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray)) or is_traced(x)
    ]

    def rebuild(arrays: Sequence[Any]) -> list[Any]:
        out = list(leaves)
        for i, x in zip(dynamic, arrays):
            out[i] = x
        return jax.tree.unflatten(treedef, out)  # type: ignore[no-any-return]

    return [leaves[i] for i in dynamic], rebuild


def _per_example_loss(
    fun: Callable[..., Any],
    layout: _Layout,
    n: int,
    has_aux: bool,
    keep_batch_dim: bool,
    rebuild: Callable[[Sequence[Any]], list[Any]],
) -> Callable[..., Any]:
    """gradclip_jax's loss contract, ``loss(params, batch, *arrays) -> (B,)`` losses: ``fun`` of each
    example, vmapped over the batch (so ghost clipping sees one batched computation)."""

    def loss(params: Any, batch: dict, *arrays: Any) -> Any:
        shared = rebuild(arrays)

        def one(example: dict) -> tuple:
            args = layout.assemble(n, params, example, shared)
            if keep_batch_dim:  # a batch of one: gcx.with_sharding_constraint leaves axis 0 to vmap
                out = call_on_one_example(fun, layout.batch, *args, **example["kwargs"])
            else:
                out = fun(*args, **example["kwargs"])
            value, aux = out if has_aux else (out, None)
            if jnp.shape(value) != ():
                raise TypeError(
                    f"clipped_grad: `fun` must return a scalar loss (of one example or group), "
                    f"got shape {jnp.shape(value)}"
                )
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
    zero = (
        not is_traced(l2_clip_norm)
        and np.ndim(l2_clip_norm) == 0
        and not callable(l2_clip_norm)
        and isinstance(l2_clip_norm, (int, float, np.number, np.ndarray, jax.Array))
        and float(l2_clip_norm) == 0.0
    )
    if rescale and zero:
        return {**options, "l2_clip_norm": 1.0, "normalize": True, "gamma": 0.0}
    return {**options, "l2_clip_norm": l2_clip_norm, "rescale_to_unit_norm": rescale}


def clipped_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    l2_clip_norm: float | PyTree,
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
    grid_scale: int | None = None,
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
    clipping where it applies, see :mod:`gradclip_jax.per_example.ghost`). Its
    ``sensitivity(neighboring_relation)`` is ``l2_clip_norm`` (1 with
    ``rescale_to_unit_norm``) divided by ``normalize_by`` for add/remove and
    zero-out neighbours, twice that for replace-one.

    Args:
      fun: the loss of one example (or group); ``(loss, aux)`` with ``has_aux``.
      argnums: the argument(s) to differentiate (without a batch axis).
      has_aux: ``fun`` returns ``(loss, aux)``; aux comes back per example.
      l2_clip_norm: the clip norm of each example's gradient, or a pytree of clip
        norms that is a prefix of the gradient (per-layer clipping, jax-privacy's
        current source): each subtree that a clip norm ``C_i`` covers is clipped
        jointly to ``C_i``, on the ghost and vmap paths; the sensitivity is
        ``sqrt(sum_i C_i**2) / normalize_by``, and ``grad_norms`` is a tree of the
        subtrees' norms.
      rescale_to_unit_norm: divide each clipped gradient by ``l2_clip_norm``
        (sensitivity 1; with ``l2_clip_norm=0``, each gradient is normalized);
        per-layer, each subtree by its clip norm (sensitivity ``sqrt(K)`` for ``K``
        clip norms; a static per-layer clip norm of 0 is refused).
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
      dtype: the dtype of the returned sums, 32 bits at least (default: the
        gradients' accumulation dtypes: float32 for 16-bit gradients, where
        jax-privacy returns their own dtype. A sum rounded to 16 bits before the
        noise moves by up to half a unit in its last place, which grows with the
        batch: one example could change it by more than the sensitivity).
      prng_argnum: the position of a PRNG key (or pytree of keys) split with
        ``jax.random.split(key, B)``; example ``i`` gets key ``i``.
      spmd_axis_name: passed to ``jax.vmap``.
      method: ``'auto'`` (default), ``'ghost'`` or ``'vmap'`` (see
        :func:`gradclip_jax.clipped_grad`); the results agree up to float rounding.
      grid_scale: None, or a positive int: each example's clipped gradient is
        rounded onto the integer grid of :func:`clip_and_round_to_grid` and the
        int64 gradients are summed exactly (for the discrete Gaussian mechanism);
        the sensitivity is ``grid_scale``. Needs each example's gradient (the vmap
        path: ``method='ghost'`` refuses it), 64-bit mode, one clip norm,
        ``normalize_by=1`` and no ``rescale_to_unit_norm``; ``dtype`` then only sets
        the dtype the gradients are clipped in.

    Returns:
      A :class:`~jax_privacy.clipping.BoundedSensitivityCallable`.

    Raises:
      TypeError: a non-callable ``fun`` or ``pre_clipping_transform``, non-int
        argument positions, a loss that is not a scalar, a key argument that is not
        a PRNG key.
      ValueError: naming the argument, for empty, negative or overlapping
        ``argnums`` / ``batch_argnums``, a negative or NaN ``l2_clip_norm``,
        ``normalize_by <= 0``, a bad ``microbatch_size``, ``method``, ``dtype`` or
        ``grid_scale`` (or what it excludes), a static per-layer clip norm of 0 with
        ``rescale_to_unit_norm``; at
        call time, argument positions beyond the call's arguments, batch arguments of
        different sizes, a bad ``is_padding_example``, a per-layer ``l2_clip_norm``
        that is not a prefix of the gradient.

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
    check_callable(fn, "fun", fun)
    layout = _Layout(fn, argnums, batch_argnums, prng_argnum)
    rescale = bool(static_value(fn, "rescale_to_unit_norm", rescale_to_unit_norm))
    bound = norm_bound(fn, l2_clip_norm, rescale, normalize_by, grid_scale)
    has_aux = bool(static_value(fn, "has_aux", has_aux))
    if grid_scale is not None:
        return _grid_clipped_grad(
            fun,
            layout,
            has_aux,
            method,
            l2_clip_norm=l2_clip_norm,
            grid_scale=grid_scale,
            keep_batch_dim=keep_batch_dim,
            return_values=return_values,
            return_grad_norms=return_grad_norms,
            transform=pre_clipping_transform,
            microbatch_size=microbatch_size,
            nan_safe=nan_safe,
            dtype=dtype,
            spmd_axis_name=spmd_axis_name,
        )
    check_sum_dtype(fn, dtype)
    per_layer = is_per_layer(l2_clip_norm)
    if per_layer and rescale:
        _check_no_zero_layer(fn, l2_clip_norm)
    # per-layer rescaling divides each subtree by its own clip norm, after the sum (below)
    ours: Callable[..., Any] = functools.partial(
        _clipped_grad,
        **_ours_options(
            l2_clip_norm,
            rescale and not per_layer,
            has_aux=has_aux,
            microbatch_size=microbatch_size,
            method=method,
            nan_safe=nan_safe,
            spmd_axis_name=spmd_axis_name,
            dtype=dtype,
            pre_clipping_transform=pre_clipping_transform,
        ),
    )
    sensitivity = ours(fun).sensitivity()  # also checks every option now, not at the first call
    with_aux = has_aux or bool(return_values) or bool(return_grad_norms)

    def grad_fn(*args: Any, is_padding_example: Any = None, **kwargs: Any) -> Any:
        check_called(
            fn, args, argnums=layout.argnums, batch_argnums=layout.batch, prng_argnum=layout.prng
        )
        bsize = common_batch_size(fn, layout.batch, args)
        padding = padding_mask(fn, is_padding_example, bsize)
        batch = {
            "args": tuple(args[i] for i in layout.batch),
            "kwargs": kwargs,
            "keys": None
            if layout.prng is None
            else keys_per_example(fn, args[layout.prng], bsize, layout.prng),
        }
        arrays, rebuild = _split_static(layout.shared(args))
        loss = _per_example_loss(fun, layout, len(args), has_aux, keep_batch_dim, rebuild)
        params = layout.params(args)
        # 16-bit gradients: float32 sums (jax-privacy returns them rounded to 16 bits, where
        # one example can move the rounded sum by more than the sensitivity)
        out = jax.tree.map(
            lambda s: _norms.sum_dtype(s.dtype) if dtype is None else np.dtype(dtype),
            _grad_dtypes(params, pre_clipping_transform),
        )
        grads, info = ours(loss)(params, batch, *arrays, mask=~padding)
        if per_layer and rescale:
            grads = _rescale_per_layer(grads, l2_clip_norm, out)
        # divided where summed, then rounded once to the output dtype
        grads = jax.tree.map(lambda g, o: (g / normalize_by).astype(o), grads, out)
        if not with_aux:
            return grads
        return grads, _auxiliary(info, keep_batch_dim, has_aux, return_values, return_grad_norms)

    return BoundedSensitivityCallable(
        grad_fn, bound if per_layer else sensitivity / normalize_by, with_aux
    )


def _auxiliary(
    info: Any, keep_batch_dim: bool, has_aux: bool, return_values: Any, return_grad_norms: Any
) -> AuxiliaryOutput:
    """jax-privacy's ``AuxiliaryOutput`` of a call: the fields asked for, the rest ``None``."""
    aux = jax.tree.map(squeeze_axis_1, info.aux) if keep_batch_dim else info.aux
    return AuxiliaryOutput(
        values=info.values if return_values else None,
        grad_norms=info.norms if return_grad_norms else None,
        aux=aux if has_aux else None,
    )


def _check_no_zero_layer(fn: str, l2_clip_norm: PyTree) -> None:
    """ValueError naming a static per-layer clip norm of 0 with ``rescale_to_unit_norm`` (jax-privacy
    then normalizes that subtree, which gradclip_jax's per-layer clipping does not do)."""
    for path, c in jax.tree_util.tree_flatten_with_path(l2_clip_norm)[0]:
        if not is_traced(c) and float(np.asarray(c)) == 0.0:
            raise ValueError(
                f"{fn}: `l2_clip_norm{jax.tree_util.keystr(path)}` is 0 with "
                "rescale_to_unit_norm=True (normalizing a layer) is not supported per layer; "
                "give it a positive clip norm"
            )


def _rescale_per_layer(grads: PyTree, l2_clip_norm: PyTree, out: PyTree) -> PyTree:
    """Each subtree's clipped sum divided by its clip norm (0 where a traced clip norm is 0).

    The division is a multiplication by ``rounding_margin / C_i`` (as gradclip_jax's own
    rescaling): one example's subtree, of norm at most ``C_i``, then stays within norm 1 as
    stored in its output dtype ``out``.
    """

    def divide(c: Any, sub: PyTree, outs: PyTree) -> PyTree:
        return jax.tree.map(
            lambda g, o: (
                g
                * divide_or_zero(
                    jnp.asarray(rounding_margin(o, g.dtype), g.dtype), jnp.asarray(c, g.dtype)
                )
            ),
            sub,
            outs,
        )

    return jax.tree.map(divide, l2_clip_norm, grads, out)


def _check_grid_method(method: Any, transform: Any) -> None:
    """``grid_scale`` needs each example's gradient: ``method`` must be ``'vmap'`` or ``'auto'``."""
    fn = "clipped_grad"
    if static_value(fn, "method", method) not in ("auto", "vmap", "ghost"):
        raise ValueError(f"{fn}: unknown method {method!r}; expected 'vmap', 'ghost' or 'auto'")
    if method == "ghost":
        raise ValueError(
            f"{fn}: grid_scale rounds each example's gradient, which method='ghost' never forms; "
            "use method='vmap' or 'auto' (which then uses vmap)"
        )
    if transform is not None:
        check_callable(fn, "pre_clipping_transform", transform)


def _grid_clipped_grad(
    fun: Callable[..., Any],
    layout: _Layout,
    has_aux: bool,
    method: Any,
    *,
    l2_clip_norm: Any,
    grid_scale: int,
    keep_batch_dim: bool,
    return_values: bool,
    return_grad_norms: bool,
    transform: Callable[[PyTree], PyTree] | None,
    microbatch_size: Any,
    nan_safe: bool,
    dtype: Any,
    spmd_axis_name: Any,
) -> Any:
    """``clipped_grad`` with ``grid_scale``: each example's gradient (vmap) clipped and rounded by
    :func:`clipped_fun`, whose integer sum is exact. Ghost clipping never forms the gradient to round."""
    _check_grid_method(method, transform)
    argnums = layout.argnums[0] if layout.single else layout.argnums

    def example_grad(*args: Any, **kwargs: Any) -> tuple:
        def loss(*a: Any) -> tuple:
            out = fun(*a, **kwargs)
            return out if has_aux else (out, None)

        (value, aux), grad = jax.value_and_grad(loss, argnums, has_aux=True)(*args)
        return (grad if transform is None else transform(grad)), (value, aux)

    summed = clipped_fun(
        example_grad,
        has_aux=True,
        batch_argnums=layout.batch,
        keep_batch_dim=keep_batch_dim,
        l2_clip_norm=l2_clip_norm,
        return_norms=True,
        microbatch_size=microbatch_size,
        nan_safe=nan_safe,
        dtype=dtype,
        prng_argnum=layout.prng,
        spmd_axis_name=spmd_axis_name,
        grid_scale=grid_scale,
    )
    with_aux = has_aux or bool(return_values) or bool(return_grad_norms)

    def grad_fn(*args: Any, is_padding_example: Any = None, **kwargs: Any) -> Any:
        grads, ((values, aux), norms) = summed(
            *args, is_padding_example=is_padding_example, **kwargs
        )
        if not with_aux:
            return grads
        return grads, AuxiliaryOutput(
            values=values if return_values else None,
            grad_norms=norms if return_grad_norms else None,
            aux=aux if has_aux else None,
        )

    return BoundedSensitivityCallable(grad_fn, summed.l2_norm_bound, with_aux)
