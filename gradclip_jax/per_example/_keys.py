"""Per-example randomness: the PRNG key argument named by ``prng_argnum`` is split
into one key per example, carried with the batch, and handed to the loss of each
example in place of the shared key."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax.per_example._batch import batch_size_of, call_on_one_example


def _is_key(k: Any) -> bool:
    dtype = getattr(k, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return np.ndim(k) == 0
    return bool(np.dtype(dtype) == np.uint32 and np.ndim(k) >= 1)


def example_keys(key: Any, bsize: int, prng_argnum: int, fn: str) -> jax.Array:
    """``jax.random.split(key, B)``: example ``i`` draws with key ``i`` (whatever the chunking)."""
    if not _is_key(key):
        raise TypeError(
            f"{fn}: the argument at prng_argnum={prng_argnum} must be a single PRNG key "
            f"(jax.random.key or jax.random.PRNGKey), got {type(key).__name__} "
            f"with shape {np.shape(key)} and dtype {getattr(key, 'dtype', None)}"
        )
    return jax.random.split(key, bsize)


def _per_example_out(out: Any, has_aux: bool, fn: str) -> tuple:
    """``(loss of shape (), aux without its example axis)`` of ``loss_fn`` on a one-example batch."""
    loss, aux = out if has_aux else (out, None)
    if tuple(jnp.shape(loss)) != (1,):
        raise ValueError(
            f"{fn}: loss_fn must return per-example losses of shape (B,); on a batch of one "
            f"example it returned shape {tuple(jnp.shape(loss))}"
        )
    if has_aux:
        aux = jax.tree_util.tree_map(
            lambda x: jnp.squeeze(x, 0) if getattr(x, "ndim", 0) >= 1 and x.shape[0] == 1 else x,
            aux,
        )
    return jnp.reshape(loss, ()), aux


def keyed_loss(loss_fn: Callable[..., Any], pos: int, has_aux: bool, fn: str) -> Callable[..., Any]:
    """``loss(params, (batch, keys), *rest)``: ``loss_fn`` of each example with its own key.

    The key is inserted at position ``pos`` of the extra arguments. On a batch of
    one example ``loss_fn`` is called once; on more, it is vmapped over the
    examples (each a batch of one, with its key), so the losses are exactly
    those of a per-example loop.
    """

    def call(params: Any, example: Any, key: Any, rest: Sequence[Any]) -> Any:
        args = list(rest)
        args.insert(pos, key)
        return loss_fn(params, example, *args)

    def loss(params: Any, batch_keys: Any, *rest: Any) -> Any:
        batch, keys = batch_keys
        if keys.shape[0] == 1:
            return call(params, batch, keys[0], rest)

        def one(example: Any, key: Any) -> tuple:
            out = call_on_one_example(call, (1,), params, example, key, rest)
            return _per_example_out(out, has_aux, fn)

        losses, aux = jax.vmap(one)(batch, keys)
        return (losses, aux) if has_aux else losses

    return loss


def split_key_arg(
    loss_fn: Callable[..., Any],
    prng_argnum: int,
    has_aux: bool,
    batch: Any,
    args: Sequence[Any],
    fn: str,
) -> tuple[Callable[..., Any], Any, tuple]:
    """``(loss, batch, args)`` with the key argument moved into the batch as one key per example."""
    pos = prng_argnum - 2
    if pos >= len(args):
        raise ValueError(
            f"{fn}: prng_argnum={prng_argnum} names loss_fn's argument {prng_argnum} (counting params as "
            f"0 and batch as 1), but grad_fn was called with only {2 + len(args)} positional arguments"
        )
    bsize = batch_size_of(batch, fn)
    keys = example_keys(args[pos], bsize, prng_argnum, fn)
    rest = tuple(a for i, a in enumerate(args) if i != pos)
    return keyed_loss(loss_fn, pos, has_aux, fn), (batch, keys), rest
