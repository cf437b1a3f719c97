"""The batch axis: checks of batches, losses and masks, sharding of axis 0, and
the one-example loss wrapper."""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax._core.validation import check_mask


def keystr(path: Any) -> str:
    """A leaf's path as text (``<root>`` for a bare leaf)."""
    return jax.tree_util.keystr(path) or "<root>"


def _check_batch_axis(pairs: Sequence[tuple[Any, Any]], fn: str, what: str) -> int | None:
    """The common size of axis 0 of ``(path, leaf)`` pairs; ValueError naming a bad leaf."""
    batch, first = None, None
    for path, x in pairs:
        shape = tuple(np.shape(x))
        if len(shape) == 0:
            raise ValueError(
                f"{fn}: {what} {keystr(path)} is a scalar (shape ()); every "
                f"{what} must carry the batch on axis 0"
            )
        if batch is None:
            batch, first = shape[0], path
        elif shape[0] != batch:
            raise ValueError(
                f"{fn}: {what} {keystr(path)} has batch size {shape[0]} on axis 0 "
                f"(shape {shape}), but {what} {keystr(first)} has batch size {batch}; "
                f"every {what} must carry the same batch on axis 0"
            )
    return batch


def batch_flatten(tree: Any, fn: str, what: str = "leaf") -> tuple[_norms.FlatTree, int | None]:
    """Flattens per-example ``tree`` and checks every leaf carries the batch on axis 0.

    Returns:
      ``(flat, batch_size)``; ``batch_size`` is ``None`` for a tree with no leaf.

    Raises:
      ValueError: naming the leaf, for a scalar leaf or mismatched batch sizes.
      TypeError: for integer or bool leaves (from the norm engine).
    """
    flat = _norms.flatten(tree, fn)
    pairs = [(flat.paths[i], flat.leaves[i]) for i in flat.active]
    return flat, _check_batch_axis(pairs, fn, what)


def batch_size_of(batch: Any, fn: str) -> int:
    """The batch size of a data batch (any dtypes), checking every leaf agrees on axis 0."""
    pairs = jax.tree_util.tree_flatten_with_path(batch)[0]
    size = _check_batch_axis(pairs, fn, "batch leaf")
    if size is None:
        raise ValueError(f"{fn}: `batch` has no array leaf, so it has no batch axis")
    return size


def check_loss_out(fn: str, out: Any, bsize: int, has_aux: bool) -> Any:
    """The losses of ``loss_fn``'s output (abstract or traced), checked to be of shape ``(B,)``."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"{fn}: with has_aux=True, loss_fn must return a pair (losses, aux), got {out!r}"
            )
        out = out[0]
    shape = getattr(out, "shape", None)
    if shape is None or tuple(shape) != (bsize,):
        raise ValueError(
            f"{fn}: loss_fn must return per-example losses of shape (B,) = ({bsize},) "
            f"(the batch size of `batch`), got {'shape ' + str(tuple(shape)) if shape is not None else repr(out)}; "
            "return the unreduced per-example losses (no mean or sum over the batch)"
        )
    return out


LOSS_CONTRACT = (
    "loss_fn(params, batch, *args) must return the per-example losses, shape (B,), each computed "
    "from its own example alone (clipped_grad calls it on batches of one example, so it must not close "
    "over arrays of length B or use statistics of the whole batch)"
)


BATCHNORM_REMEDY = (
    "batch statistics cannot be used with per-example clipping: each example would be normalized by "
    "its own statistics, and statistics of the whole batch mix the examples (the privacy accounting "
    "of DP-SGD no longer holds). Use GroupNorm or LayerNorm instead, or freeze the statistics "
    "outside the step: use_running_average=True (flax linen: BatchNorm(use_running_average=True) "
    "and no mutable=['batch_stats']; flax nnx: model.eval() or "
    "nnx.BatchNorm(use_running_average=True); haiku: is_training=False with the state as an input)"
)
_BATCHNORM_SIGNS = ("batchstat", "batch_stats", "batchnorm", "batch_norm", "batch_normalization")
# A name-scope part "bn" or ending in "_bn" (keras-hub's ResNet names its BatchNormalization
# layers "conv1_bn", "stack0_block0_1_bn"; torchvision-style ports "bn1").
_BN_SCOPE = re.compile(r"(^|[/_.-])bn\d*($|[/.-])")


def _names_batchnorm(text: str) -> bool:
    low = text.lower()
    return any(sign in low for sign in _BATCHNORM_SIGNS) or _BN_SCOPE.search(low) is not None


def batchnorm_error(err: BaseException, fn: str) -> ValueError | None:
    """The ValueError for a loss that updates BatchNorm statistics, recognised by the text of
    ``err`` (flax nnx ``TraceContextError`` on a ``BatchStat``, linen's immutable ``batch_stats``
    collection, haiku's ``batch_norm`` state); ``None`` when ``err`` is not about them."""
    text = f"{type(err).__name__}: {err}"
    if not any(
        sign in text.lower() for sign in _BATCHNORM_SIGNS
    ):  # not _BN_SCOPE: error texts name no scopes
        return None
    return ValueError(
        f"{fn}: loss_fn updates BatchNorm statistics ({text.splitlines()[0]}); {BATCHNORM_REMEDY}"
    )


def _names_in(jaxpr: Any) -> Iterator[str]:
    for eqn in jaxpr.eqns:
        yield jc.name_stack(eqn)
        for inner in jc.sub_jaxprs(eqn):
            yield from _names_in(inner)


def _abstract(batch: Any, rows: int | None = None) -> Any:
    """``batch`` as shapes and dtypes only (unsharded), with ``rows`` rows on axis 0 where given."""

    def spec(x: Any) -> jax.ShapeDtypeStruct:
        shape = np.shape(x) if rows is None else (rows, *np.shape(x)[1:])
        return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

    return jax.tree_util.tree_map(spec, batch)


def batchnorm_in_loss(
    loss_fn: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any]
) -> str | None:
    """The first BatchNorm layer (a name-scope, as flax names its modules) in the trace of
    ``loss_fn`` on ``batch``, or ``None`` (also when the loss cannot be traced)."""
    try:
        closed = jax.make_jaxpr(lambda p, b: loss_fn(p, b, *args))(params, _abstract(batch))
    except Exception:
        return None
    return next((n for n in _names_in(closed.jaxpr) if _names_batchnorm(n)), None)


def _fails_on_the_batch(
    loss_fn: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any]
) -> bool:
    """Whether tracing ``loss_fn`` (shapes only) on the whole ``batch`` raises."""
    try:
        jax.eval_shape(loss_fn, params, _abstract(batch), *args)
    except Exception:
        return True
    return False


def _sharding_hint(err: Exception) -> str:
    """The remedy when ``err`` is a batch sharding applied to a batch of one, else ``""``."""
    if "does not evenly divide the dimension size 1" not in str(err):
        return ""
    return (
        ". A sharding that names the batch's mesh axes (an out_sharding, reshard or "
        "with_sharding_constraint) cannot apply to a batch of one: write it as "
        "gradclip_jax.batch_sharding(spec) (or gradclip_jax.with_sharding_constraint), which "
        "leaves the batch entry to vmap there"
    )


def check_one_example(
    fn: str,
    loss_fn: Callable[..., Any],
    has_aux: bool,
    params: Any,
    batch: Any,
    args: Sequence[Any],
) -> None:
    """Traces ``loss_fn`` (shapes only) on the first example as a batch of one; ValueError stating
    the contract when that fails or does not give one loss.

    A loss that fails on the whole batch as well is not told it broke the contract: the failure
    is its own (a framework's error, such as flax nnx's ``TraceContextError`` for a module
    updated inside the loss), and the caller re-raises it with its cause.
    """
    # Abstract and unsharded: slicing one row of a batch sharded on axis 0 is refused.
    try:
        with one_example_scope():  # as every path runs a loss on one example
            out = jax.eval_shape(loss_fn, params, _abstract(batch, rows=1), *args)
    except Exception as err:
        bn = batchnorm_error(err, fn)
        if bn is not None:
            raise bn from err
        if _fails_on_the_batch(loss_fn, params, batch, args):
            return
        raise ValueError(
            f"{fn}: calling loss_fn on a batch of one example failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); {LOSS_CONTRACT}"
            f"{_sharding_hint(err)}"
        ) from err
    loss = out[0] if has_aux and isinstance(out, tuple) and len(out) == 2 else out
    shape = getattr(loss, "shape", None)
    if shape is None or tuple(shape) != (1,):
        raise ValueError(
            f"{fn}: on a batch of one example loss_fn returned "
            f"{'shape ' + str(tuple(shape)) if shape is not None else repr(loss)} instead of (1,); "
            f"{LOSS_CONTRACT}"
        )


class Call(NamedTuple):
    """One call of the returned function, checked: params marked like the batch, flattened."""

    params: Any
    pflat: _norms.FlatTree
    batch: Any
    args: tuple
    valid: jax.Array | None
    bsize: int


def prepare_call(params: Any, batch: Any, args: Sequence[Any], mask: Any, fn: str) -> Call:
    """Checks the batch and ``mask`` and flattens ``params`` (varying like the batch under shard_map)."""
    bsize = batch_size_of(batch, fn)
    valid = check_mask(fn, mask, bsize)
    params = vary_like_batch(params, batch, fn)
    return Call(params, _norms.flatten(params, fn), batch, tuple(args), valid, bsize)


def along_axis(v: jax.Array, ndim: int, axis: int = 0) -> jax.Array:
    """The vector ``v`` (one value an example) reshaped to broadcast along ``axis`` of an
    array of ``ndim`` dimensions (the batch axis: 0 unless given)."""
    return jnp.reshape(v, (1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def zeroed(keep: jax.Array, x: jax.Array, axis: int = 0) -> jax.Array:
    """``x`` with the slices of dropped examples (``keep`` False along ``axis``) set to exactly
    zero: a select, not a product, since a dropped example may hold NaN or inf."""
    return jnp.where(along_axis(keep, x.ndim, axis), x, jnp.zeros((), x.dtype))


def first_leaf(tree: Any) -> Any:
    return jax.tree_util.tree_leaves(tree)[0]


def _squeeze_example_axis(x: Any) -> Any:
    if hasattr(x, "shape") and len(x.shape) >= 1 and x.shape[0] == 1:
        return jnp.squeeze(x, 0)
    return x


# True while a loss is traced on one example (a batch of one) under vmap: read by
# ``with_sharding_constraint`` to leave the batch axis's placement to vmap.
_ONE_EXAMPLE = contextvars.ContextVar("gradclip_jax_one_example", default=False)


@contextlib.contextmanager
def one_example_scope() -> Iterator[None]:
    """Marks the trace of a loss on one example (its batch axis of size 1, under ``vmap``)."""
    token = _ONE_EXAMPLE.set(True)
    try:
        yield
    finally:
        _ONE_EXAMPLE.reset(token)


def in_one_example() -> bool:
    """Whether the loss being traced runs on one example (see :func:`one_example_scope`)."""
    return _ONE_EXAMPLE.get()


def as_batch_of_one(example: Any) -> Any:
    """``example`` with a leading batch axis of size 1 on every leaf."""
    return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), example)


def call_on_one_example(
    fn: Callable[..., Any], batch_argnums: Sequence[int], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` with the arguments at ``batch_argnums`` made batches of one
    example (:func:`as_batch_of_one`), traced inside :func:`one_example_scope`: the one way
    every path runs a loss on one example, so that none forgets the scope
    ``with_sharding_constraint`` reads."""
    args = tuple(as_batch_of_one(a) if i in batch_argnums else a for i, a in enumerate(args))
    with one_example_scope():
        return fn(*args, **kwargs)


def one_example_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., tuple]:
    """``(params, example, *args) -> (loss, aux)``: ``loss_fn`` on a batch of one example.

    The example gets a leading axis of 1; the loss comes back as a scalar and the
    aux leaves lose that axis (they are stacked again by ``vmap``).
    """

    def scalar_loss(p: Any, example: Any, *a: Any) -> tuple:
        out = call_on_one_example(loss_fn, (1,), p, example, *a)
        loss, aux = out if has_aux else (out, None)
        if has_aux:
            aux = jax.tree_util.tree_map(_squeeze_example_axis, aux)
        return jnp.reshape(loss, ()), aux

    return scalar_loss


# ----------------------------------------------------------------------------
# Sharding of the batch axis
# ----------------------------------------------------------------------------


def explicit_spec(x: Any) -> tuple[Any, ...] | None:
    """The partition spec of ``x`` (padded to its rank) under explicit sharding, else ``None``."""
    try:
        sharding = jax.typeof(x).sharding
        spec = tuple(sharding.spec)
    except Exception:  # not under a mesh
        return None
    spec = spec + (None,) * (np.ndim(x) - len(spec))
    if all(s is None for s in spec):
        return None
    return spec


def batch_axis_sharding(x: Any) -> tuple[Any, int]:
    """``(mesh_axes, num_shards)`` of ``x``'s axis 0 under explicit sharding, else ``(None, 1)``."""
    spec = explicit_spec(x)
    if spec is None or not spec or spec[0] is None:
        return None, 1
    ax0 = spec[0]
    names = ax0 if isinstance(ax0, tuple) else (ax0,)
    mesh = jax.typeof(x).sharding.mesh
    return ax0, int(math.prod(mesh.shape[a] for a in names))


def match_batch_sharding(v: jax.Array, like: jax.Array) -> jax.Array:
    """``v`` (batch on axis 0) resharded like axis 0 of ``like`` when that is explicitly sharded.

    Explicit sharding requires both sides of a ``select`` to agree; a replicated
    mask or validity vector must follow the (sharded) per-example values.
    """
    ax0, _ = batch_axis_sharding(like)
    if ax0 is None or batch_axis_sharding(v)[0] == ax0:
        return v
    spec = jax.sharding.PartitionSpec(ax0, *([None] * (v.ndim - 1)))
    return jax.sharding.reshard(v, jc.on_mesh_of(like, spec))


def gathered_over_batch(tree: Any, batch: Any, axis: int = 0) -> Any:
    """``tree``'s leaves with the batch's mesh axes (those of axis ``axis`` of ``batch``'s first
    leaf) removed from their explicit shardings.

    ``jax.vmap`` over a batch explicitly sharded on mesh axis ``"data"`` refuses an unmapped
    argument sharded on ``"data"`` too (parameters split FSDP-style under ``Explicit`` axes):
    each device's examples need the whole parameter, which the loss would gather anyway.
    """
    spec = explicit_spec(first_leaf(batch))
    ax0 = None if spec is None else spec[axis]
    if ax0 is None:
        return tree
    axes = set(ax0 if isinstance(ax0, tuple) else (ax0,))

    def without(entry: Any) -> Any:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    def gathered(x: Any) -> Any:
        spec = explicit_spec(x)
        if spec is None or not axes.intersection(
            n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))
        ):
            return x
        return jax.sharding.reshard(
            x, jc.on_mesh_of(x, jax.sharding.PartitionSpec(*map(without, spec)))
        )

    return jax.tree_util.tree_map(gathered, tree)


def vary_like(x: jax.Array, ref: Any) -> jax.Array:
    """``x`` marked as varying over every ``shard_map`` axis ``ref`` varies over."""
    return jc.vary_over(x, jc.varying_axes(ref))  # type: ignore[no-any-return]


def batch_axes(batch: Any) -> frozenset:
    """The ``shard_map`` mesh axes the batch is split over (empty outside ``shard_map``)."""
    return frozenset().union(*map(jc.varying_axes, jax.tree_util.tree_leaves(batch)))


def vary_like_batch(params: Any, batch: Any, fn: str = "clipped_grad") -> Any:
    """Inside ``shard_map``: marks params as varying over the batch's mesh axes.

    Otherwise the gradient with respect to replicated (invariant) params is
    summed over devices by autodiff (the transpose of the implicit ``pcast``), which
    would mix examples of different devices before they are clipped. With this,
    ``grad_fn`` returns the clipped sum of the *local* examples; ``psum`` it.
    """
    axes = batch_axes(batch)
    _check_params_whole(fn, params, axes)
    if not axes:
        return params
    return jax.tree_util.tree_map(
        lambda p: jc.vary_over(p, axes) if hasattr(p, "dtype") else p, params
    )


def _check_params_whole(fn: str, params: Any, batch_axes: frozenset) -> None:
    """ValueError when a parameter leaf inside ``shard_map`` varies over a mesh axis the batch
    does not: a shard of the parameter (tensor parallelism by hand), whose per-example norms
    would cover the local shard only, so each example would be clipped by part of its norm (an
    audit measured a contribution of 1.86 against a clip norm of 1)."""
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        extra = jc.varying_axes(p) - batch_axes
        if extra:
            axes = tuple(sorted(extra))
            raise ValueError(
                f"{fn}: parameter leaf {keystr(path)} differs across the manual mesh axes "
                f"{axes} inside shard_map, and the batch does not: a shard of a parameter split over "
                f"{axes[0]!r}, whose per-example gradient norms would cover the local shard only (each "
                "example clipped by part of its norm, its contribution above the clip norm). Call "
                "clipped_grad outside shard_map, under jax.jit with the parameters sharded "
                "(NamedSharding), where the norms cover whole parameters; or, if each device holds a "
                "whole model of its own, jax.vmap clipped_grad over the models instead"
            )
