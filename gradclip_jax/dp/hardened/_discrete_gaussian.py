"""The discrete Gaussian on the integers, sampled by inverting a 96-bit fixed-point CDF computed
exactly on the host: integers out, so no floating-point output whose low bits can leak."""

from __future__ import annotations

import decimal
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core.validation import check_number

# Bits of the fixed-point CDF: each table entry is off by less than 2**-96 in probability.
CDF_BITS = 96
# The largest sigma with a table (its size grows as 13 sigma entries of 12 bytes: 10 MiB here).
MAX_SIGMA = float(1 << 16)
# Mass left out of the table: |y| is cut where exp(-y^2 / (2 sigma^2)) < 2**-TAIL_BITS.
TAIL_BITS = 128
# Elements drawn per block (each draws four uint32 words): bounds the temporaries of a big draw,
# and each block searches only as many steps as its widest guide bucket needs (see _guide).
BLOCK = 1 << 12
# The guide table is indexed by the top GUIDE_BITS of the 96-bit uniform.
GUIDE_BITS = 16


def check_sigma(fn: str, sigma: Any, name: str = "sigma") -> float:
    """``sigma`` as a Python float in ``[0, MAX_SIGMA]`` (the table is built on the host)."""
    s = check_number(fn, name, sigma, low=0.0, allow_inf=False)
    if s > MAX_SIGMA:
        raise ValueError(
            f"{fn}: `{name}`={s:g} is above {MAX_SIGMA:g}, the largest discrete Gaussian with a CDF table "
            "(13 sigma entries); use a coarser grid (smaller `grid_scale`): the noise's sigma on the "
            "grid is noise_multiplier * grid_scale * l2_clip_norm"
        )
    return s


@functools.lru_cache(maxsize=8)
def cdf_table(sigma: float) -> np.ndarray:
    """The CDF of :math:`|Y|`, :math:`Y \\sim \\mathcal{N}_{\\mathbb{Z}}(0, \\sigma^2)`, as ``(N, 3)`` uint32 words.

    Row :math:`k` holds :math:`c_k - 1` (most significant word first), with
    :math:`c_k = \\lfloor 2^{96} P(|Y| \\le k) \\rfloor` and the last :math:`c_{N-1} = 2^{96}`.
    The weights :math:`w_0 = 1,\\ w_k = 2 e^{-k^2/2\\sigma^2}` are computed in 60-digit decimal
    arithmetic by the recurrence :math:`e^{-(k+1)^2/2\\sigma^2} = e^{-k^2/2\\sigma^2} q^{2k+1}`,
    :math:`q = e^{-1/2\\sigma^2}` (relative error far below :math:`2^{-96}`).
    """
    with decimal.localcontext(decimal.Context(prec=60)):  # every operation below in 60 digits
        weights = _weights(decimal.Decimal(sigma))
        z = sum(weights, decimal.Decimal(0))
        scale = decimal.Decimal(2) ** CDF_BITS
        acc, rows = decimal.Decimal(0), []
        for w in weights[:-1]:
            acc += w
            rows.append(int((acc * scale / z).to_integral_value(decimal.ROUND_FLOOR)))
    rows.append(1 << CDF_BITS)  # the cut tail goes to the last entry
    c = np.array([v - 1 for v in rows], dtype=object)
    words = [(c >> s) & 0xFFFFFFFF for s in (64, 32, 0)]
    table = np.stack([w.astype(np.uint32) for w in words], axis=1)
    table.setflags(write=False)  # cached: shared by every caller
    return table


def _weights(sigma: decimal.Decimal) -> list[decimal.Decimal]:
    """:math:`w_0 = 1, w_k = 2 e^{-k^2/2\\sigma^2}` until :math:`e^{-k^2/2\\sigma^2} < 2^{-128}` (in the caller's context)."""
    q = (decimal.Decimal(-1) / (2 * sigma * sigma)).exp()
    q2, r, p = q * q, q, decimal.Decimal(1)
    cut = decimal.Decimal(2) ** -TAIL_BITS
    weights = [decimal.Decimal(1)]
    while True:
        p, r = p * r, r * q2  # exp(-k^2 / (2 sigma^2)) for the next k, and q^(2k+1)
        if p < cut:
            return weights
        weights.append(2 * p)


def sampler_tv_bound(sigma: float) -> float:
    """An upper bound on the total variation between one draw of :func:`discrete_gaussian` and
    the exact :math:`\\mathcal{N}_{\\mathbb{Z}}(0, \\sigma^2)`.

    Each of the table's :math:`N` probabilities is off by less than :math:`2^{-96}` (flooring), and
    the cut tail :math:`\\sum_{|y| > K} e^{-y^2/2\\sigma^2} / Z` is below
    :math:`2^{-128}(1 + 2\\sigma^2)`: the bound is :math:`N 2^{-96} + 2^{-128}(1 + 2\\sigma^2)`.
    By the triangle inequality a run of :math:`m` draws is within :math:`m` times this of the exact
    mechanism, so an :math:`(\\varepsilon, \\delta)` guarantee of the exact one holds with
    :math:`\\delta + (1 + e^\\varepsilon)\\, m \\cdot` this.
    """
    s = check_sigma("sampler_tv_bound", sigma)
    if s == 0.0:
        return 0.0
    n = int(cdf_table(s).shape[0])
    return float(n * 2.0**-CDF_BITS + 2.0**-TAIL_BITS * (1.0 + 2.0 * s * s))


@functools.lru_cache(maxsize=8)
def _guide(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: for each value ``b`` of the uniform's top :data:`GUIDE_BITS`, the answer lies in
    ``[lo[b], hi[b]]`` (row ``k``'s top bits are nondecreasing in ``k``). Most buckets hold one to
    a few rows; only the far tail's are wide, and few draws land there."""
    top = cdf_table(sigma)[:, 0] >> (32 - GUIDE_BITS)
    b = np.arange(1 << GUIDE_BITS)
    lo = np.searchsorted(top, b, "left")
    hi = np.minimum(np.searchsorted(top, b + 1, "left"), len(top) - 1)
    return lo.astype(np.int32), hi.astype(np.int32)


def _search(table: jax.Array, u: jax.Array, lo: jax.Array, hi: jax.Array, steps: Any) -> jax.Array:
    """The smallest ``k`` in ``[lo, hi]`` with ``u <= table[k]`` (96-bit words, most significant first),
    per column of ``u``, by ``steps`` halvings (enough when ``hi - lo < 2**steps``; may be traced)."""

    def step(_: Any, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = (lo + hi) >> 1
        row = table[mid]  # (m, 3)
        a, b = u, row.T
        le = (a[0] < b[0]) | ((a[0] == b[0]) & ((a[1] < b[1]) | ((a[1] == b[1]) & (a[2] <= b[2]))))
        return jnp.where(le, lo, mid + 1), jnp.where(le, mid, hi)

    lo, _ = lax.fori_loop(0, steps, step, (lo, hi))
    return lo


def _magnitudes(
    table: jax.Array, guide: tuple[jax.Array, jax.Array], u: jax.Array, constant_time: bool = False
) -> jax.Array:
    """:math:`|Y|` for the 96-bit uniforms ``u`` (3, m): searched from the guide's buckets, with as
    many halvings as the block's widest bucket needs (:math:`\\lceil \\log_2 \\text{width} \\rceil`),
    or, ``constant_time``, :math:`\\lceil \\log_2 N \\rceil` whatever the draws."""
    lo_b, hi_b = guide
    b = (u[0] >> (32 - GUIDE_BITS)).astype(jnp.int32)
    lo, hi = lo_b[b], hi_b[b]
    if constant_time:
        return _search(table, u, lo, hi, max(1, math.ceil(math.log2(table.shape[0]))))
    widest = jnp.max(hi - lo).astype(jnp.uint32)  # width - 1
    steps = (32 - lax.clz(widest)).astype(jnp.int32)  # ceil(log2(width)); 0 when every width is 1
    return _search(table, u, lo, hi, steps)


def discrete_gaussian(
    key: jax.Array, shape: tuple[int, ...], sigma: float, *, constant_time: bool = False
) -> jax.Array:
    """Independent draws of the discrete Gaussian :math:`\\mathcal{N}_{\\mathbb{Z}}(0, \\sigma^2)`, as int32.

    .. math:: P(Y = y) = \\frac{e^{-y^2 / 2\\sigma^2}}{\\sum_{x \\in \\mathbb{Z}} e^{-x^2/2\\sigma^2}},
        \\qquad y \\in \\mathbb{Z}

    (Canonne, Kamath and Steinke 2020, "The Discrete Gaussian for Differential Privacy").
    Each draw takes 96 random bits :math:`U` and one sign bit from ``jax.random.bits``:
    :math:`|Y|` is the smallest :math:`k` with :math:`U < c_k`, the fixed-point CDF of
    :func:`cdf_table`, found by a binary search that starts from a guide table of the 16 top
    bits of :math:`U` (a block of draws takes as many steps as its widest bucket needs: a few,
    more only when one of its draws falls in the far tail), and the sign bit negates it. No floating-point number is formed: the output is an
    integer, and its distribution is within :func:`sampler_tv_bound` (below
    :math:`10^{-23}` for :math:`\\sigma \\le 2^{16}`) of the exact one in total variation.
    The table is computed on the host, once per ``sigma`` (cached), so ``sigma`` is a Python
    number; the draw itself works under ``jax.jit`` and ``jax.vmap`` (over keys).

    Args:
      key: a ``jax.random`` key.
      shape: the output's shape.
      sigma: :math:`\\sigma \\in [0, 2^{16}]` (0 gives zeros).
      constant_time: search every block for :math:`\\lceil \\log_2 N \\rceil` steps, so the
        draw's time does not depend on the values drawn (a timing channel, Jin et al. 2022); the
        same draws, about 4x slower at :math:`\\sigma = 1024` on a CPU. Default ``False``: a
        block's time tells whether one of its draws fell in the far tail.

    Returns:
      An int32 array of ``shape``.

    Example:
      >>> import jax
      >>> from gradclip_jax.dp.hardened import discrete_gaussian
      >>> y = discrete_gaussian(jax.random.key(0), (4,), 3.0)
      >>> y.dtype, y.shape
      (dtype('int32'), (4,))
    """
    s = check_sigma("discrete_gaussian", sigma)
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if s == 0.0 or size == 0:
        return jnp.zeros(shape, jnp.int32)
    table = jnp.asarray(cdf_table(s))
    lo_b, hi_b = _guide(s)
    guide = (jnp.asarray(lo_b), jnp.asarray(hi_b))
    block = min(BLOCK, size)
    count = -(-size // block)

    def draw(j: jax.Array) -> jax.Array:
        bits = jax.random.bits(jax.random.fold_in(key, j), (4, block), jnp.uint32)
        k = _magnitudes(table, guide, bits[:3], constant_time)
        return jnp.where((bits[3] & 1) == 1, -k, k)  # k = 0 either way: its weight is w_0 alone

    y = (
        lax.map(draw, jnp.arange(count, dtype=jnp.uint32))
        if count > 1
        else draw(jnp.uint32(0))[None]
    )
    return jnp.reshape(jnp.reshape(y, (-1,))[:size], shape)
