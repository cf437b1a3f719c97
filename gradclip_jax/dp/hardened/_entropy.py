"""Seeds and keys from the operating system's entropy (or from a caller's generator), never from
a user integer: a seed a person picks (0, 42, the date) is guessable, and whoever guesses it can
regenerate the noise and subtract it."""

from __future__ import annotations

import secrets
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np


@runtime_checkable
class BitGenerator(Protocol):
    """What a caller's generator must offer: ``getrandbits(k) -> int`` of ``k`` random bits.

    :class:`secrets.SystemRandom` (the default's source, the OS's CSPRNG) and
    :class:`random.Random` (a seeded, *predictable* generator: for tests only) both do.
    """

    def getrandbits(self, k: int, /) -> int: ...


_SYSTEM = secrets.SystemRandom()


def check_generator(fn: str, rng: Any) -> BitGenerator:
    """``rng`` (default: the OS's CSPRNG), checked to offer ``getrandbits``.

    Raises:
      TypeError: naming ``rng`` when it has no ``getrandbits`` (an int seed, a numpy generator).
    """
    if rng is None:
        return _SYSTEM
    if isinstance(rng, (bool, int, np.integer)) or not isinstance(rng, BitGenerator):
        raise TypeError(
            f"{fn}: `rng` must be None (the OS's entropy, via the secrets module) or a generator with "
            f"getrandbits(k), such as secrets.SystemRandom(); got {rng!r}. A hardened run never takes an "
            "integer seed: a chosen seed can be guessed, and with it the noise"
        )
    return rng


def os_seed(rng: BitGenerator | None = None, bits: int = 128) -> int:
    """A ``bits``-bit seed from ``rng`` (default: the OS's CSPRNG through :mod:`secrets`).

    Args:
      rng: ``None`` or a generator with ``getrandbits`` (see :class:`BitGenerator`).
      bits: the seed's size (default 128, as numpy's ``SeedSequence`` pools).

    Returns:
      A non-negative Python int below ``2**bits``.

    Example:
      >>> from gradclip_jax.dp.hardened import os_seed
      >>> 0 <= os_seed() < 2**128
      True
    """
    return int(check_generator("os_seed", rng).getrandbits(bits))


def os_key(rng: BitGenerator | None = None) -> jax.Array:
    """A typed ``jax.random`` key whose bits come from ``rng`` (default: the OS's CSPRNG).

    The key's data (all of it: two 32-bit words for threefry) is drawn, not derived from a
    small integer. Call it on the host, once per step (it cannot run under ``jax.jit``).

    Args:
      rng: ``None`` or a generator with ``getrandbits`` (see :class:`BitGenerator`).

    Returns:
      A key of the default implementation (``jax.random.key_impl``).

    Example:
      >>> import jax
      >>> from gradclip_jax.dp.hardened import os_key
      >>> k1, k2 = os_key(), os_key()
      >>> bool((jax.random.key_data(k1) != jax.random.key_data(k2)).any())
      True
    """
    gen = check_generator("os_key", rng)
    shape = jax.random.key_data(jax.random.key(0)).shape  # the default implementation's key size
    words = np.array([gen.getrandbits(32) for _ in range(int(np.prod(shape)))], np.uint32).reshape(
        shape
    )
    return jax.random.wrap_key_data(jnp.asarray(words))
