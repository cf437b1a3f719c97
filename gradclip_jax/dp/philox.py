"""Standard normal draws from the Philox4x32-10 counter-based generator, written in ``jax.numpy``.

Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy
as 1, 2, 3", SC 2011; the Random123 library) maps a 128-bit counter and a 64-bit
key to 128 random bits in ten rounds of two 32 x 32 -> 64-bit multiplications:
about half the integer work per bit of JAX's default threefry2x32-20, for the same
statistical quality (both pass TestU01's BigCrush; neither is a cryptographic
generator). Written elementwise over an iota of counters, the draw fuses into the
addition of the noise like JAX's own threefry does, is exact under ``vmap`` (each
key's draw is the one it gives alone) and partitions under sharding, which XLA's
``RngBitGenerator`` (JAX's ``"rbg"`` keys) does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["normal_from_bits", "philox4x32", "philox_normal"]

_MUL = (0xD2511F53, 0xCD9E8D57)  # the round multipliers
_BUMP = (0x9E3779B9, 0xBB67AE85)  # the key schedule's increments (golden ratio, sqrt(3) - 1)
_ROUNDS = 10


def _mulhi(a: int, b: jax.Array) -> jax.Array:
    """The high 32 bits of the 64-bit product ``a * b`` (uint32)."""
    if hasattr(lax, "mulhi"):  # jax >= 0.10.2: one multiply-high instruction
        return lax.mulhi(jnp.uint32(a), b)
    # older jax: 16-bit limbs, every partial product exact in uint32
    a_hi, a_lo = jnp.uint32(a >> 16), jnp.uint32(a & 0xFFFF)
    b_hi, b_lo = b >> 16, b & 0xFFFF
    cross = ((a_lo * b_lo) >> 16) + (a_hi * b_lo & 0xFFFF) + (a_lo * b_hi & 0xFFFF)
    return a_hi * b_hi + ((a_hi * b_lo) >> 16) + ((a_lo * b_hi) >> 16) + (cross >> 16)


def philox4x32(
    counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, ...]:
    """Philox4x32-10 of the four uint32 counter words and two uint32 key words (broadcast together).

    Each round: ``(c0, c1, c2, c3) <- (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1,
    lo(M0 c0))``, then the key is bumped by the Weyl increments; ten rounds.
    """
    c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
    k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
    m0, m1 = jnp.uint32(_MUL[0]), jnp.uint32(_MUL[1])
    for _ in range(_ROUNDS):
        hi0, lo0 = _mulhi(_MUL[0], c0), m0 * c0
        hi1, lo1 = _mulhi(_MUL[1], c2), m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = k0 + jnp.uint32(_BUMP[0]), k1 + jnp.uint32(_BUMP[1])
    return c0, c1, c2, c3


def _counters(shape: tuple[int, ...]) -> jax.Array:
    """uint32 counter numbers of the array ``(*shape[:-1], ceil(shape[-1] / 4))``: its row-major
    flat index, built from per-axis iotas so that a sharded leading axis stays sharded."""
    index = jnp.zeros((), jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    return index


def philox_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 standard normal draws of ``shape`` from Philox4x32-10 keyed by 64 bits of ``key``.

    Element ``(..., j)`` takes word ``j mod 4`` of the counter ``(c, 0, 0, 0)``, ``c`` the
    row-major index of ``(..., j // 4)`` in an array of shape ``(*shape[:-1],
    ceil(shape[-1] / 4))``; the key is ``jax.random.bits(key, (2,), uint32)``. Each
    word becomes a uniform ``u`` in ``(-1, 1)`` from its top 23 bits, and the draw is
    ``sqrt(2) erfinv(u)``, the transform of ``jax.random.normal``.

    Example:
      >>> import jax
      >>> from gradclip_jax.dp.philox import philox_normal
      >>> philox_normal(jax.random.key(0), (2, 3)).shape
      (2, 3)
    """
    full = tuple(shape) or (1,)
    counts = (*full[:-1], -(-full[-1] // 4))
    if int(np.prod(counts, dtype=np.int64)) > 2**32:
        raise ValueError(
            f"philox_normal: {np.prod(full)} draws in one array exceed the 2**34 of one key"
        )
    k0, k1 = jax.random.bits(key, (2,), jnp.uint32)
    zero = jnp.zeros((), jnp.uint32)
    words = philox4x32((_counters(counts), zero, zero, zero), (k0, k1))
    bits = jnp.stack(words, axis=-1).reshape(*counts[:-1], 4 * counts[-1])[..., : full[-1]]
    return normal_from_bits(bits).reshape(shape)


def normal_from_bits(bits: jax.Array) -> jax.Array:
    """float32 standard normals from uint32 random words, by ``jax.random.normal``'s transform.

    Each word becomes a uniform ``u`` in ``(-1, 1)`` from its top 23 bits, and the
    draw is ``sqrt(2) erfinv(u)``.
    """
    unit = (
        lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    )  # [0, 1)
    lo = np.nextafter(np.float32(-1.0), np.float32(0.0))
    u = jnp.maximum(lo, unit * 2.0 - 1.0)  # (-1, 1): erfinv(-1) would be -inf
    return np.float32(np.sqrt(2.0)) * lax.erf_inv(u)
