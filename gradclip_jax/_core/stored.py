"""The stored bound, checked exactly: clip with the plain factor when the stored result
already satisfies the bound, and lower the factor only when it does not.

A clip factor ``f = C / n`` rounds, the norm ``n`` was measured in floating point
and each scaled value is rounded when stored, so ``x * f`` as stored can exceed
``C`` by a few units in the last place. :func:`gradclip_jax._core.numerics.bounded_factor`
lowers the factor by a margin that provably absorbs all of that, but it then
always stores values a few ulp inside the bound (``0.9999994`` for ``1.0``) where
optax stores ``1.0``. :func:`certified_factors` decides, with error-free arithmetic, whether
the values stored with the plain factor have an exact 2-norm ``<= C``; the
margin is used only where they do not (about half of the clipped cases in float32,
and wherever the check is too large to be cheap, see :data:`EXACT_CHECK_MAX`).

Exactness: each square ``v*v`` is split into ``p + e`` exactly (Dekker's product, its
operands split by a bit mask in float32: see :func:`_split`),
the pairs are summed by one variadic reduction whose combiner is built from
TwoSum (every rounding error it makes is computed exactly and bounded into a
third accumulator ``E``), and the comparison with ``C**2`` (itself an exact
pair) is made conservatively against ``E``. When every step is exact (one
element, values on a coarse grid) ``E`` is 0 and a result exactly at the bound
counts as within it. Values are scaled by a power of two (exact) from ``C``;
elements so small that their square would underflow are counted and bounded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core.numerics import bounded_factor, bounded_factors

__all__ = ["EXACT_CHECK_MAX", "certified_factors", "stored_scale"]

# Elements one check may read. The variadic reduction is not vectorized on CPU and runs
# much slower than a plain sum, so past this size the check would cost several times the
# clip itself (benchmarks/results/MEASUREMENTS.md). Larger trees keep the margin.
EXACT_CHECK_MAX = 1 << 12

_Dd = tuple[jax.Array, jax.Array, jax.Array]  # (hi, lo, bound on the neglected errors)


def stored_scale(x: jax.Array, factor: jax.Array, store: Any = None) -> jax.Array:
    """``x * factor`` in the wider of the two dtypes (16-bit values in float32; complex stays
    complex), rounded once to ``store`` (default x's dtype).

    The one product every clipper stores and :func:`certified_factors` checks, so both round alike.
    """
    work = jnp.promote_types(x.dtype, factor.dtype)
    return (x.astype(work) * factor.astype(work)).astype(x.dtype if store is None else store)


def _round_down(bound: Any, acc: Any) -> jax.Array:
    """``bound`` as the largest value of ``acc`` not above it (a Python float may lie
    between two float32 values: the stored norm must not exceed the number given)."""
    if not isinstance(bound, jax.Array) and not hasattr(bound, "aval"):
        given = np.asarray(bound, np.float64)
        near = np.asarray(given, acc)
        return jnp.asarray(
            np.nextafter(near, np.zeros_like(near)) if float(near) > float(given) else near, acc
        )
    b = lax.stop_gradient(jnp.asarray(bound))
    r = b.astype(acc)
    return jnp.where(r.astype(b.dtype) > b, jnp.nextafter(r, jnp.zeros_like(r)), r)


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a + b = s + e`` exactly (Knuth), in any exponent order."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` exactly, each with at most half the significand's bits, so their products are exact.

    float32: ``hi`` is ``a`` with its 12 low mantissa bits cleared, a bit mask. Veltkamp's
    ``t = a * c; hi = t - (t - a)`` is not used there: XLA's GPU backend lets LLVM fuse
    ``a * c - a`` into one fused multiply-add, which skips the rounding of ``t`` the split
    relies on, and the "exact" products would not be. Other dtypes (float64): Veltkamp, with
    ``a * c`` materialized behind an optimization barrier so that no such fusion can reach it.
    """
    if a.dtype == jnp.float32:
        bits = lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFFF000)
        hi = lax.bitcast_convert_type(bits, jnp.float32)
        return hi, a - hi
    c = float(2 ** ((jnp.finfo(a.dtype).nmant + 2) // 2) + 1)
    t = lax.optimization_barrier(a * c)
    hi = t - (t - a)
    return hi, a - hi


def _two_prod(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a * b = p + e`` exactly (Dekker), barring underflow (see :func:`_sumsq`)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _dd_add(a: _Dd, b: _Dd) -> _Dd:
    """The sum of two pairs; both roundings it makes are computed and added to the bound."""
    s, e = _two_sum(a[0], b[0])
    t, et = _two_sum(a[1], b[1])
    e2, ee = _two_sum(e, t)
    h, lo = _two_sum(s, e2)
    return h, lo, a[2] + b[2] + jnp.abs(et) + jnp.abs(ee)


def _sumsq(v: jax.Array, axes: tuple[int, ...]) -> _Dd:
    """``sum(v**2)`` over ``axes`` (keepdims) as an exact pair plus an error bound."""
    info = jnp.finfo(v.dtype)
    # below about this |v|, v*v's rounding error may not be representable (8 bits of headroom):
    # such elements are left out and counted as tiny**2 each in the bound
    tiny = float(2.0 ** -((-int(info.minexp) - int(info.nmant)) // 2 - 8))
    small = jnp.abs(v) < tiny
    v = jnp.where(small, jnp.zeros_like(v), v)
    p, e = _two_prod(v, v)
    z = jnp.zeros((), v.dtype)
    h, lo, err = lax.reduce((p, e, jnp.zeros_like(v)), (z, z, z), _dd_add, axes)
    err = err + jnp.sum(small, axis=axes).astype(v.dtype) * (tiny * tiny)
    return tuple(jnp.expand_dims(a, axes) for a in (h, lo, err))  # type: ignore[return-value]


def _within(total: _Dd, bound: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """``(certainly total <= count * bound**2, an upper bound of the relative excess of the norm)``.

    ``count`` > 1 compares an rms bound. The excess (0 where within) is what a
    factor must at least be lowered by to bring the norm down to the bound.
    """
    eps = float(jnp.finfo(bound.dtype).eps)
    b2, b2e = _two_prod(bound, bound)
    hi, hi_e = _two_prod(jnp.asarray(count, bound.dtype), b2)
    lo = hi_e + count * b2e  # exact for count == 1 (hi_e == 0)
    # the neglected errors (x2 for their own float sum), and lo's rounding if any
    slack = 2 * total[2] + (0.0 if count == 1 else 2 * eps * (jnp.abs(hi_e) + count * jnp.abs(b2e)))
    # total - bound**2 * count = d + r2 + (the exact errors r1e, r2e): every step error-free
    d, de = _two_sum(total[0], -hi)
    r1, r1e = _two_sum(total[1], -lo)
    r2, r2e = _two_sum(r1, de)
    s1, s1e = _two_sum(d, r2)
    q = s1e + (
        slack + jnp.abs(r1e) + jnp.abs(r2e)
    )  # small, >= 0 up to s1e: bound its rounding from above
    over = s1 + (q + 2 * eps * jnp.abs(q))
    return over <= 0, jnp.maximum(over / (2 * hi), 0)


def _check(
    stored: Sequence[jax.Array],
    axes: Sequence[tuple[int, ...]],
    bound: jax.Array,
    combine: bool,
    rms: bool,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """:func:`_within` for each array (``combine``: the arrays together, reduced axes dropped)."""
    acc = bound.dtype
    _, ex = jnp.frexp(bound)
    scale = jnp.ldexp(
        jnp.ones((), acc), -ex
    )  # a power of two: scaling is exact, squares stay in range
    sums = [
        _sumsq(lax.stop_gradient(x).astype(acc) * scale, ax)
        for x, ax in zip(stored, axes, strict=True)
    ]
    sizes = [int(np.prod([x.shape[a] for a in ax])) for x, ax in zip(stored, axes, strict=True)]
    bs = bound * scale
    if not combine:
        pairs = [_within(t, bs, n if rms else 1) for t, n in zip(sums, sizes, strict=True)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    flat = [tuple(jnp.squeeze(a, ax) for a in t) for t, ax in zip(sums, axes, strict=True)]
    total = flat[0]
    for t in flat[1:]:
        total = _dd_add(total, t)  # type: ignore[arg-type]
    ok, over = _within(total, bs, sum(sizes) if rms else 1)  # type: ignore[arg-type]
    return [ok] * len(stored), [over] * len(stored)


def _lowering(excess: jax.Array, extra: float, dtype: Any) -> jax.Array:
    """``1 - excess - extra`` in ``[0, 1]``, constant to differentiation: a zero bound gives an infinite
    (or NaN) excess, and a factor times inf would turn its gradient NaN even where not selected."""
    low = 1 - lax.stop_gradient(excess).astype(dtype) - extra
    return jnp.clip(jnp.nan_to_num(low, nan=0.0, posinf=0.0, neginf=0.0), 0.0, 1.0)


def certified_factors(
    arrays: Sequence[jax.Array],
    factors: Sequence[jax.Array],
    axes: Sequence[tuple[int, ...]],
    bound: Any,
    *,
    combine: bool,
    rms: bool = False,
    stores: Sequence[Any] | None = None,
) -> list[jax.Array]:
    """The factors to store with: as small a lowering as the exact check allows.

    Per array, a factor below 1 is kept where :func:`stored_scale` with it
    provably stores a 2-norm (or rms) ``<= bound``; else it is lowered by the
    measured excess (then by one more unit of roundoff) and kept if that checks;
    else lowered by the margin (:func:`~gradclip_jax._core.numerics.bounded_factor`).

    Args:
      arrays: the values to scale.
      factors: each array's factor, in its accumulation dtype, broadcasting
        against the array (keepdims; with ``combine`` the reduced axes dropped).
      axes: each array's reduction axes.
      bound: the clip norm, a scalar (traced too).
      combine: one norm over all arrays together (with the axes not reduced
        shared), else one per array.
      rms: the bound is on the root mean square over the reduced elements.
      stores: the dtype each array is stored in (default: its own).

    Returns:
      The factors. Where the check does not apply (more than
      :data:`EXACT_CHECK_MAX` elements, complex values) every factor below 1
      takes the margin.
    """
    if not arrays:
        return []
    stores = [x.dtype for x in arrays] if stores is None else list(stores)
    if sum(int(np.size(x)) for x in arrays) > EXACT_CHECK_MAX or any(
        jnp.iscomplexobj(x) for x in arrays
    ):
        return bounded_factors(factors, stores)
    acc = jnp.result_type(*[f.dtype for f in factors])
    return _certified(
        list(arrays),
        list(factors),
        _round_down(bound, acc),
        axes=tuple(map(tuple, axes)),
        combine=bool(combine),
        rms=bool(rms),
        stores=tuple(jnp.dtype(s) for s in stores),
    )


# One program, traced once per shapes and options: called eagerly, the check's few hundred
# operations per array would each be dispatched (and first compiled) on their own; under an
# outer jit the nested call is inlined by XLA, so the compiled step is the same.
@functools.partial(jax.jit, static_argnames=("axes", "combine", "rms", "stores"))
def _certified(
    arrays: list[jax.Array],
    factors: list[jax.Array],
    b: jax.Array,
    *,
    axes: tuple[tuple[int, ...], ...],
    combine: bool,
    rms: bool,
    stores: tuple[Any, ...],
) -> list[jax.Array]:
    """:func:`certified_factors` past its early exits, with the bound ``b`` already rounded down."""
    acc = b.dtype
    plain = [lax.stop_gradient(f) for f in factors]
    ok0, over = _check(
        [stored_scale(x, f, s) for x, f, s in zip(arrays, plain, stores, strict=True)],
        axes,
        b,
        combine,
        rms,
    )
    # with combine the answers dropped the reduced axes: give them each factor's shape
    ok0, over = (
        [jnp.reshape(a, f.shape) for a, f in zip(t, plain, strict=True)] for t in (ok0, over)
    )
    eps = float(jnp.finfo(acc).eps)
    # tried from the last to the first, so the first that checks wins: the margin, then the
    # plain factor lowered by the excess and one ulp, by the excess alone, then the plain factor
    out = [bounded_factor(f, s) for f, s in zip(factors, stores, strict=True)]
    for ulps, ok in ((1.0, None), (0.0, None), (None, ok0)):
        cand = [
            f if ulps is None else f * _lowering(o, ulps * eps, f.dtype)
            for f, o in zip(factors, over, strict=True)
        ]
        if ok is None:
            got, _ = _check(
                [
                    stored_scale(x, lax.stop_gradient(c), s)
                    for x, c, s in zip(arrays, cand, stores, strict=True)
                ],
                axes,
                b,
                combine,
                rms,
            )
            ok = [jnp.reshape(a, f.shape) for a, f in zip(got, plain, strict=True)]
        out = [jnp.where(a, c, o) for a, c, o in zip(ok, cand, out, strict=True)]
    return [jnp.where(f < 1, o, f) for f, o in zip(factors, out, strict=True)]
