"""What the aggregation transforms share: the PRNG key from a seed, the clipped sum of the
per-example rows (in the accumulation dtype) and the public divisor of the noised sum."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core.hyperparam_rules import as_scalar
from gradclip_jax._core.validation import check_int, check_mask
from gradclip_jax.per_example.internal import as_rows, clip_and_sum, clip_factors, unrow


def seed_key(seed: Any, fn: str) -> jax.Array:
    """A typed PRNG key from an int seed, a typed key or a raw uint32 key."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return seed
    if isinstance(seed, (jax.Array, np.ndarray)) and seed.shape == (2,) and seed.dtype == np.uint32:
        return jax.random.wrap_key_data(jnp.asarray(seed))
    if not isinstance(seed, (jax.Array, np.ndarray)):
        seed = check_int(fn, "seed", seed)  # not a key: an int seed (never a bool)
        if seed >= 2**32:
            return _wide_seed_key(fn, seed)
    return jax.random.key(seed)


def _wide_seed_key(fn: str, seed: int) -> jax.Array:
    """The key of an int seed of more than 32 bits, all of them kept: without 64-bit mode
    ``jax.random.key`` keeps the low 32 (``2**32 + s`` and ``s`` drew the same noise, and a
    63-bit secret seed had 2**32 values); this is the key 64-bit mode makes from it."""
    if seed >= 2**64:
        raise ValueError(f"{fn}: seed must be below 2**64, got {seed}")
    if str(jax.random.key_impl(jax.random.key(0))) != "threefry2x32":
        raise ValueError(
            f"{fn}: a seed of more than 32 bits needs the threefry key implementation; pass a "
            "typed key instead (e.g. gradclip_jax.dp.hardened.os_key())"
        )
    return jax.random.wrap_key_data(jnp.asarray([seed >> 32, seed & 0xFFFFFFFF], jnp.uint32))


def batch_divisor(batch_size: Any, actual: int, dtype: Any) -> jax.Array:
    """The public constant the noised sum is divided by (``batch_size``: resolved, or ``None``)."""
    if batch_size is None:
        return jnp.asarray(max(actual, 1), dtype)
    return as_scalar(batch_size, dtype)


def clip_sum_rows(
    arrays: list[jax.Array],
    clip: jax.Array,
    nan_safe: bool,
    mask: Any,
    fn: str,
    batch: int,
    store: Any = None,
) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Clipped per-example sums (accumulation dtype), per-example norms and the kept rows.

    ``store``: the dtype the result is finally rounded to (for the clip factors' rounding margin).
    """
    valid = check_mask(fn, mask, batch)
    sums, w = clip_and_sum(
        [as_rows(x) for x in arrays],
        clip,
        valid=valid,
        nan_safe=nan_safe,
        factor_fn=lambda n, c: clip_factors(n, c, store),
    )
    keep = jnp.ones((batch,), bool) if w.keep is None else w.keep
    return unrow(sums, arrays), w.norms, keep
