"""Philox4x32-10 in jax.numpy: Random123's known answers, the multiply-high without
``lax.mulhi`` (jax < 0.10.2), and the normal draws' layout, statistics and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax.dp import philox

# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key) -> output
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _u32(*xs: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.uint32(x) for x in xs)


@pytest.mark.parametrize(("counter", "key", "want"), KNOWN_ANSWERS)
def test_known_answers(counter, key, want):
    got = philox.philox4x32(_u32(*counter), _u32(*key))
    assert [int(x) for x in got] == list(want)


@pytest.mark.parametrize("mulhi", [True, False], ids=["lax.mulhi", "16-bit limbs"])
def test_multiply_high_is_exact(mulhi, monkeypatch):
    if not mulhi:
        monkeypatch.delattr(lax, "mulhi", raising=False)
    elif not hasattr(lax, "mulhi"):
        pytest.skip("this jax has no lax.mulhi (jax < 0.10.2)")
    b = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64)
    b = np.concatenate([b, [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF]]).astype(np.uint64)
    for a in philox._MUL:
        want = ((np.uint64(a) * b) >> np.uint64(32)).astype(np.uint32)
        np.testing.assert_array_equal(
            np.asarray(philox._mulhi(a, jnp.asarray(b.astype(np.uint32)))), want
        )
    assert [
        int(x) for x in philox.philox4x32(_u32(*KNOWN_ANSWERS[1][0]), _u32(*KNOWN_ANSWERS[1][1]))
    ] == list(KNOWN_ANSWERS[1][2])


def test_normal_draw_follows_its_documented_layout():
    key = jax.random.key(7)
    z = philox.philox_normal(key, (3, 6))
    k0, k1 = jax.random.bits(key, (2,), jnp.uint32)
    # row r, column j: word j % 4 of counter r * 2 + j // 4 (two counters per row of 6)
    for r in range(3):
        for j in range(6):
            word = philox.philox4x32(_u32(r * 2 + j // 4, 0, 0, 0), (k0, k1))[j % 4]
            unit = np.array([(int(word) >> 9) | 0x3F800000], np.uint32).view(np.float32)[
                0
            ] - np.float32(1.0)
            u = max(np.nextafter(np.float32(-1), np.float32(0)), np.float32(unit * 2 - 1))
            want = np.sqrt(2.0) * float(lax.erf_inv(jnp.float32(u)))
            np.testing.assert_allclose(float(z[r, j]), float(want), rtol=1e-6)


def test_statistics_shapes_and_keys():
    z = np.asarray(philox.philox_normal(jax.random.key(1), (500, 403))).ravel()
    n = z.size
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert z.var() == pytest.approx(1.0, abs=6 * np.sqrt(2 / n))
    assert np.mean(z**4) == pytest.approx(3.0, abs=0.05)
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 / np.sqrt(n)
    assert philox.philox_normal(jax.random.key(0), ()).shape == ()
    assert not np.allclose(
        philox.philox_normal(jax.random.key(0), (8,)), philox.philox_normal(jax.random.key(1), (8,))
    )


def test_exact_under_vmap_and_jit():
    keys = jax.random.split(jax.random.key(0), 3)
    batched = jax.vmap(lambda k: philox.philox_normal(k, (5, 9)))(keys)
    jitted = jax.jit(lambda k: philox.philox_normal(k, (5, 9)))
    for i in range(3):
        np.testing.assert_array_equal(batched[i], philox.philox_normal(keys[i], (5, 9)))
        np.testing.assert_array_equal(jitted(keys[i]), philox.philox_normal(keys[i], (5, 9)))
