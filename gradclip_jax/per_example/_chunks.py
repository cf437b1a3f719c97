"""Microbatching: one strategy's ``chunk`` run over the whole batch at once or in
a ``lax.scan`` over chunks, and the ``(grads, info)`` it adds up to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax._core.numerics import rounding_margin
from gradclip_jax.per_example._batch import (
    Call,
    batch_axis_sharding,
    keystr,
    match_batch_sharding,
    vary_like,
)
from gradclip_jax.per_example._config import ClipConfig, ClippedGradInfo
from gradclip_jax.per_example._example_norms import per_layer_tree

# chunk(batch, valid) -> (sums, norms, flags, values, aux) for the examples of ``batch``
Chunk = Callable[[Any, "jax.Array | None"], tuple]


def _check_shardable(batch: Any, bsize: int, mb: int) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        _, shards = batch_axis_sharding(x)
        if shards > 1 and (bsize % mb or mb % shards):
            raise ValueError(
                f"clipped_grad: batch leaf {keystr(path)} is explicitly sharded over {shards} "
                f"devices on the batch axis; with microbatch_size={mb} the batch size ({bsize}) "
                f"must be a multiple of microbatch_size and microbatch_size a multiple of {shards}"
            )


def _to_chunks(x: jax.Array, mb: int, n: int) -> jax.Array:
    """``(B, ...)`` padded with copies of the last example to ``n * mb``, as ``(n, mb, ...)``.

    Chunk ``j`` holds examples ``j, j + n, j + 2n, ...``.
    """
    pad = n * mb - x.shape[0]
    if pad:
        x = jnp.concatenate([x, jnp.repeat(x[-1:], pad, axis=0)], axis=0)
    return jnp.swapaxes(jnp.reshape(x, (mb, n, *x.shape[1:])), 0, 1)


def _from_chunks(x: Any, bsize: int) -> Any:
    if x is None:
        return None
    x = jnp.swapaxes(x, 0, 1)  # (mb, n, ...)
    return jnp.reshape(x, (-1, *x.shape[2:]))[:bsize]


def scan_chunks(
    chunk: Chunk, init: list[jax.Array], batch: Any, valid: Any, bsize: int, mb: int
) -> tuple:
    """Runs ``chunk`` over ``ceil(B/mb)`` chunks of ``mb`` examples in a ``lax.scan``.

    Chunk ``j`` holds examples ``j, j + n, j + 2n, ...`` (``n`` chunks): a batch
    sharded over devices on axis 0 stays evenly spread in every chunk. The last
    examples are padded with copies of the last one and masked out.
    """
    _check_shardable(batch, bsize, mb)
    n = -(-bsize // mb)
    ref = jax.tree_util.tree_leaves(batch)[0]
    valid = match_batch_sharding(jnp.ones((bsize,), bool) if valid is None else valid, ref)
    pad = n * mb - bsize
    vpad = jnp.concatenate([valid, jnp.zeros((pad,), bool)]) if pad else valid
    vchunks = jnp.swapaxes(jnp.reshape(vpad, (mb, n)), 0, 1)
    chunked = jax.tree_util.tree_map(lambda x: _to_chunks(x, mb, n), batch)

    def body(carry: list, xs: tuple) -> tuple:
        sums, ns, flags, vals, aux = chunk(*xs)
        return [c + s for c, s in zip(carry, sums, strict=True)], (ns, flags, vals, aux)

    init = [vary_like(z, ref) for z in init]
    outs: Any
    sums, outs = lax.scan(body, init, (chunked, vchunks))
    ns, flags, vals, aux = jax.tree_util.tree_map(lambda x: _from_chunks(x, bsize), outs)
    return sums, ns, flags, vals, aux


def carry_dtype(config: ClipConfig, leaf_dtype: Any) -> np.dtype:
    """The dtype of a leaf's running sum: its accumulation dtype, widened to ``dtype`` when that is wider."""
    acc = _norms.sum_dtype(leaf_dtype)
    return acc if config.dtype is None else np.dtype(jnp.promote_types(acc, config.dtype))


def finish_sums(
    config: ClipConfig, sums: list[jax.Array], carry: list[Any], out: list[Any]
) -> list[jax.Array]:
    """The sums as returned: divided by the clip norm (``rescale_to_unit_norm``) in the
    running sum's dtype, then rounded once to the output dtype.

    The division is a multiplication by ``rounding_margin / C``: an example whose norm is
    just below ``C`` (not clipped, so stored unlowered) would otherwise come out a unit
    above norm 1 after the division's and the output's rounding (3 in 600 such
    one-example batches did)."""
    sums = [s.astype(a) for s, a in zip(sums, carry, strict=True)]
    if config.rescale_to_unit_norm:
        c = config.clip_norm()
        sums = [
            s * (jnp.asarray(rounding_margin(o, s.dtype), s.dtype) / jnp.asarray(c, s.dtype))
            for s, o in zip(sums, out, strict=True)
        ]
    return [s.astype(o) for s, o in zip(sums, out, strict=True)]


def run_chunks(chunk: Chunk, config: ClipConfig, call: Call) -> tuple[Any, ClippedGradInfo]:
    """Runs ``chunk`` over the batch (at once, or in microbatches) and builds ``(grads, info)``."""
    mb, pflat = config.microbatch_size, call.pflat
    carry = [carry_dtype(config, x.dtype) for x in pflat.arrays]
    if mb is None or mb >= call.bsize:
        sums, ns, flags, vals, aux = chunk(call.batch, call.valid)
    else:
        # zeros_like: the running sums carry their parameters' explicit sharding (a scan's
        # carry must keep its type)
        init = [jnp.zeros_like(x, a) for x, a in zip(pflat.arrays, carry, strict=True)]

        def cast_chunk(batch: Any, valid: Any) -> tuple:
            out = chunk(batch, valid)
            return ([s.astype(a) for s, a in zip(out[0], carry, strict=True)], *out[1:])

        sums, ns, flags, vals, aux = scan_chunks(
            cast_chunk, init, call.batch, call.valid, call.bsize, mb
        )
    sums = finish_sums(config, sums, carry, [config.acc_dtype(x.dtype) for x in pflat.arrays])
    if config.per_layer:
        num_clipped: Any = per_layer_tree(
            config, pflat, [jnp.sum(fl).astype(jnp.int32) for fl in flags]
        )
        ns = per_layer_tree(config, pflat, ns)
    else:
        num_clipped = jnp.sum(flags).astype(jnp.int32)
    # split as their parameters (under Explicit axes a sum over the batch comes back whole)
    sums = [jc.sharded_like(x, p) for x, p in zip(sums, pflat.arrays, strict=True)]
    grads = pflat.rebuild(sums, fill=None)
    return grads, ClippedGradInfo(
        num_clipped=num_clipped, norms=ns, values=vals, aux=aux if config.has_aux else None
    )
