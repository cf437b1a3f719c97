"""How the per-example path multiplies: the precision of its products, per backend.

Three kinds of products decide what each example contributes to a clipped sum:
the Gram matrices of ghost norms, the per-example gradients a ghost rule forms,
and the weighted sums (book-kept or over formed rows). They run at
:data:`PRODUCT_PRECISION` for the backend (read when the function is traced):

* ``"highest"`` (the default except on NVIDIA GPUs): ``Precision.HIGHEST``, float32
  products exact to rounding.
* ``"tf32"`` (the default on GPUs, ``"gpu"`` / ``"cuda"``): each float32 operand of a Gram
  norm, a formed per-example gradient or a book-kept sum is rounded once to TF32 (10
  mantissa bits, :func:`tf32_round`) and the products run at ``Precision.DEFAULT``,
  which NVIDIA GPUs run on TF32 tensor cores. A product of two TF32 values is exact in
  float32 (11 x 11 significant bits), so these products carry only float32
  accumulation error, as at ``"highest"``: the norms measure the per-example
  gradients of the rounded operands. A dense or convolution layer's book-kept sum runs in one pass: the
  clip weight, truncated toward zero to TF32, times the smaller rounded operand is
  rounded once more to TF32 (:func:`tf32_weighted_once`), and a clipped example's
  factor is taken from its norm widened by that rounding's bound (:data:`ONCE_ROUNDING`
  times the layer's spread, :func:`rounds_weighted_once`); every other sum adds exactly
  what was measured, as at ``"tf32x2"``. No margin on the clip norm. The
  gradient added differs from the float32 one by the operands' rounding (about
  ``2**-11`` relative, as a non-private step at TF32 does); weighted sums of formed
  rows stay at ``HIGHEST``. On a CPU ``DEFAULT`` is float32, so the same values come
  out there.
* ``"tf32x2"``: as ``"tf32"``, but every book-kept sum adds exactly what was measured: the
  truncated weight times the rounded operand (an exact float32 product of 22
  significant bits) is split into two TF32 parts (:func:`tf32_weighted`), two exact
  passes.
* ``"bf16x6"``: ``DotAlgorithmPreset.BF16_BF16_F32_X6``, six bfloat16 passes
  with float32 accumulation (about float32 accuracy, on bfloat16 tensor cores).
  Refused (a ValueError) on GPUs: there XLA's products at that algorithm were
  measured about 1e-3 relative off the float32 ones, more than its clip-norm
  margin allows (``benchmarks/results/MEASUREMENTS.md``).
* ``"tf32x3"``: ``DotAlgorithmPreset.TF32_TF32_F32_X3``, three TF32 passes
  (NVIDIA GPUs from Ampere on; XLA's CPU backend rejects it).

Only products of two float32 operands use a reduced-pass algorithm; float64 and
complex products stay at ``HIGHEST``. Operands of one 16-bit float type (a bfloat16
or float16 layer's activations and cotangents, :func:`exact_in_float32`) are
multiplied as they are, into float32: their products are exact in float32 and
summed there, so a 16-bit layer's Gram norms need no widened copy and run on
16-bit tensor cores on GPUs, whatever the setting. Convolutions take no dot algorithm: at
``"tf32x3"`` a convolution whose result is a clipped sum runs as the same three
passes written out (:func:`tf32_passes`: both operands split into a TF32 head
and a float32 tail, the tail x tail pass dropped, each pass at
``Precision.DEFAULT``, which NVIDIA GPUs run in TF32); at ``"bf16x6"`` it stays
at ``HIGHEST``. A reduced-pass product is within
``PRODUCT_UNITS[name]`` units of float32 roundoff of the float32 product
(relative to ``|a| |b|``), and the clip norm is lowered by that much
(:func:`product_margin`), so a contribution formed at that precision keeps the
rounding allowance it has at ``"highest"`` (see
:func:`gradclip_jax._core.numerics.rounding_margin`). At ``"tf32x3"`` that lowers
:math:`C` by ``2**-17`` (about 8e-6). The GPU benchmark
(``benchmarks/bench_ghost_gpu.py``) measures how far each setting moves the
per-example norms and the clipped sum from ``"highest"``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.backend import per_backend

__all__ = [
    "DEFAULT_PRODUCT_PRECISION",
    "ONCE_ROUNDING",
    "ONE_PASS_KINDS",
    "PRODUCT_PRECISION",
    "PRODUCT_UNITS",
    "ROUNDING_SIGMAS",
    "as_measured",
    "exact_in_float32",
    "product_einsum",
    "product_error",
    "product_margin",
    "product_precision",
    "product_refusal",
    "product_setting",
    "rounds_to_tf32",
    "rounds_weighted_once",
    "tf32_passes",
    "tf32_round",
    "tf32_weighted",
    "tf32_weighted_once",
    "view_dtype",
]

# Backend name -> one of _ALGORITHMS' keys; a backend not listed uses "highest".
DEFAULT_PRODUCT_PRECISION: dict[str, str] = {"gpu": "tf32", "cuda": "tf32"}
"""The library's defaults of :data:`PRODUCT_PRECISION` (read-only: change ``PRODUCT_PRECISION``)."""

PRODUCT_PRECISION: dict[str, str] = dict(DEFAULT_PRODUCT_PRECISION)

_ALGORITHMS: dict[str, Any] = {
    "highest": lax.Precision.HIGHEST,
    # products of arbitrary float32 values (weighted sums of formed rows) stay exact to
    # rounding; the operands of Gram norms, formed and book-kept products are rounded first
    "tf32": lax.Precision.HIGHEST,
    "tf32x2": lax.Precision.HIGHEST,
    "bf16x6": lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
}

# Worst-case error of one product, in units of float32 roundoff (2**-24) relative to |a||b|,
# beyond what a float32 product makes. x6: operands split into three bfloat16 parts
# (round to nearest), the dropped cross terms and the split's residual are each <= 2**-24.
# x3: operands split into two TF32 parts; with truncating conversions the dropped
# low x low term and the two residuals are each <= 2**-20.
# tf32: the products are exact and the weighting is exact (see the module's docstring): 0.
PRODUCT_UNITS: dict[str, int] = {"highest": 0, "tf32": 0, "tf32x2": 0, "bf16x6": 8, "tf32x3": 128}

# Site kinds whose book-kept sum, at "tf32", rounds the weighted operand once to TF32 (one pass)
# and clips by a norm widened by that rounding's bound (see rounds_weighted_once).
# A convolution's spread is the Cauchy-Schwarz bound sqrt(K) |x| |g| (rules/conv.py): on a
# WRN-16-4 (32x32 inputs, at initialization) one pass clipped 0.13-0.20% harder than two.
ONE_PASS_KINDS = frozenset({"dense", "conv"})

# The relative error of rounding trunc(w) * x (exact in float32) to nearest TF32, 2**-11, raised
# by 2**-10 of itself for the float32 rounding of the spread it multiplies.
ONCE_ROUNDING = 2.0**-11 * (1.0 + 2.0**-10)


# Settings whose error bound (PRODUCT_UNITS) was measured not to hold on a backend: a clip-norm
# margin too small for the products' error would let a clipped contribution exceed the clip
# norm, silently. XLA:GPU's BF16_BF16_F32_X6 products were measured about 1e-3 relative off the
# float32 ones, not the 8 units of 2**-24 the margin allows (benchmarks/results/MEASUREMENTS.md).
_REFUSED = {
    ("bf16x6", "gpu"): "measured about 1e-3 relative off the float32 products on NVIDIA "
    "GPUs, far beyond the 8 units of float32 roundoff its clip-norm "
    "margin allows"
}


def product_refusal(name: str) -> str | None:
    """Why the product setting ``name`` is refused on the default backend (``None``: it is not)."""
    backend = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else jax.default_backend()
    return _REFUSED.get((name, backend))


def product_setting() -> str:
    """The :data:`PRODUCT_PRECISION` setting of the default backend (validated)."""
    return per_backend(
        PRODUCT_PRECISION,
        "gradclip_jax.per_example.PRODUCT_PRECISION",
        "highest",
        tuple(_ALGORITHMS),
    )


def _reduced(*dtypes: Any) -> str | None:
    """The backend's reduced-pass setting when it applies to operands of ``dtypes`` (all
    float32), else ``None``: the one rule both the products and their margin follow."""
    setting = "gradclip_jax.per_example.PRODUCT_PRECISION"
    name = product_setting()
    why = product_refusal(name)
    if why is not None:
        raise ValueError(
            f"{setting}: {name!r} is refused on {jax.default_backend()!r}: {why}; use 'tf32' "
            "(the default on GPUs) or 'highest'"
        )
    if name == "highest" or any(np.dtype(d) != np.float32 for d in dtypes):
        return None
    return name


def product_precision(*dtypes: Any) -> Any:
    """The ``precision`` argument for a product of operands of ``dtypes``.

    ``Precision.HIGHEST`` unless every operand is float32 and the backend's
    :data:`PRODUCT_PRECISION` names a reduced-pass algorithm.
    """
    name = _reduced(*dtypes)
    return lax.Precision.HIGHEST if name is None else _ALGORITHMS[name]


def rounds_to_tf32(*dtypes: Any) -> bool:
    """Whether products of operands of ``dtypes`` (all float32) run on TF32-rounded operands
    (:data:`PRODUCT_PRECISION` ``"tf32"`` or ``"tf32x2"`` for the backend)."""
    return _reduced(*dtypes) in ("tf32", "tf32x2")


def rounds_weighted_once(kind: str, *dtypes: Any) -> bool:
    """Whether a book-kept sum at a site of ``kind`` (operands of ``dtypes``) multiplies the clip
    weights into its smaller operand and rounds that once to TF32 (:func:`tf32_weighted_once`, one
    pass), its clip factor taken from a norm widened by that rounding's bound: at
    :data:`PRODUCT_PRECISION` ``"tf32"``, for the kinds of :data:`ONE_PASS_KINDS`."""
    return kind in ONE_PASS_KINDS and _reduced(*dtypes) == "tf32"


def tf32_round(x: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to nearest (ties to even) to TF32's 10 mantissa bits, kept as float32."""
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)


def as_measured(x: jax.Array) -> jax.Array:
    """The values the per-example products measure and add: ``x`` rounded to TF32 (:func:`tf32_round`)
    when :data:`PRODUCT_PRECISION` is ``"tf32"`` and ``x`` is float32, else ``x`` itself. Every site
    view a ghost norm is taken of goes through this, so a book-kept sum adds what was measured."""
    return tf32_round(x) if rounds_to_tf32(x.dtype) else x


def _tf32_trunc(x: jax.Array) -> jax.Array:
    """``x`` (float32) truncated toward zero to TF32's 10 mantissa bits (``|result| <= |x|``)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def tf32_weighted(g: jax.Array, w: jax.Array) -> list[jax.Array] | None:
    """A cotangent ``g`` weighted by clip weights ``w`` (broadcast against it) as TF32 parts whose sum
    is ``trunc(w) * round(g)`` exactly, when :data:`PRODUCT_PRECISION` is ``"tf32"`` and ``g`` is
    float32; else ``None``.

    ``round(g)`` is :func:`tf32_round` (the cotangent the norms measured) and ``trunc(w)`` the weight
    truncated toward zero to TF32 (so ``|trunc(w)| <= |w|``). Their product has at most 22
    significant bits, exact in float32; split into a head of 11 and a tail of at most 11, each
    is a TF32 value, so a product with a TF32 operand at ``Precision.DEFAULT`` (tensor cores) is
    exact in each of the two passes. An example's contribution is then ``trunc(w_b)`` times the
    gradient whose norm was measured, to float32 accumulation: its norm is at most the clip norm.
    """
    if not rounds_to_tf32(g.dtype):
        return None
    ct = _tf32_trunc(w.astype(jnp.float32)) * tf32_round(g)
    head = _tf32_trunc(ct)
    return [head, ct - head]


def tf32_weighted_once(x: jax.Array, w: jax.Array) -> jax.Array:
    """``round(trunc(w) * round(x))``: the operand ``x`` (float32) weighted by ``w`` (broadcast against
    it) as one TF32 value per element, for a book-kept sum in one pass (:func:`rounds_weighted_once`).

    ``trunc(w) * round(x)`` is exact in float32 (see :func:`tf32_weighted`); rounding it to TF32 moves
    each element by at most ``2**-11`` of itself. For a dense use,
    :math:`\\tilde G_b = \\sum_t \\tilde x_t y_t^\\top` then differs from
    :math:`w'_b G_b = \\sum_t w'_b x_t y_t^\\top` by at most
    :math:`2^{-11} w'_b \\sum_t \\|x_t\\| \\|y_t\\|` (:data:`ONCE_ROUNDING` times the spread of
    :meth:`~gradclip_jax.per_example.ghost.rules.Rule.spread`), which the clip factor allows
    for. A weight of 1 (an example not clipped) or 0 (a dropped one) adds its values exactly.
    """
    return tf32_round(_tf32_trunc(w.astype(jnp.float32)) * tf32_round(x))


# 16-bit floats whose products are exact in float32: 8 x 8 (bfloat16) and 11 x 11 (float16)
# significant bits, with exponents float32 holds as it holds those of the widened operands.
_EXACT_IN_FLOAT32 = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def exact_in_float32(*dtypes: Any) -> bool:
    """Whether products of operands of ``dtypes`` (one 16-bit float type: bfloat16 or float16)
    are exact in float32: then :func:`product_einsum` multiplies them as they are, with float32
    accumulation, instead of widening them first (on GPUs, 16-bit tensor cores at twice the TF32
    rate, and no widened copy of the operands)."""
    return len({np.dtype(d) for d in dtypes}) == 1 and np.dtype(dtypes[0]) in _EXACT_IN_FLOAT32


def view_dtype(x: Any, g: Any, acc: Any) -> Any:
    """The dtype a site's views take for its per-example products: the operand's and cotangent's
    own 16-bit type where both share it and the accumulation dtype ``acc`` is float32
    (:func:`exact_in_float32`: the products lose nothing, and widening would only cost a copy),
    else ``acc``."""
    return np.dtype(x) if exact_in_float32(x, g) and np.dtype(acc) == np.float32 else acc


def product_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum`` of two operands at :func:`product_precision` (float32 result for float32);
    at ``"tf32"``, of both rounded to TF32 at ``Precision.DEFAULT`` (exact products). Operands
    of one 16-bit float type (:func:`exact_in_float32`) are multiplied as they are, at
    ``Precision.DEFAULT`` with a float32 result: exact products, float32 accumulation, the
    values their float32 widening gives at ``"highest"`` up to the order of the sum."""
    # under Explicit mesh axes a contraction over a sharded axis states its output's sharding
    out = jc.einsum_out_sharding(spec, a, b)
    if exact_in_float32(a.dtype, b.dtype):
        return jnp.einsum(
            spec,
            a,
            b,
            precision=lax.Precision.DEFAULT,
            preferred_element_type=jnp.float32,
            out_sharding=out,
        )
    if a.dtype != b.dtype:  # a 16-bit view beside a wider one: both widened, then as for those
        wide = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(wide), b.astype(wide)
    if rounds_to_tf32(a.dtype, b.dtype):
        return jnp.einsum(
            spec,
            tf32_round(a),
            tf32_round(b),
            precision=lax.Precision.DEFAULT,
            preferred_element_type=jnp.float32,
            out_sharding=out,
        )
    prec = product_precision(a.dtype, b.dtype)
    if isinstance(prec, lax.Precision):
        return jnp.einsum(spec, a, b, precision=prec, out_sharding=out)
    return jnp.einsum(
        spec, a, b, precision=prec, preferred_element_type=jnp.float32, out_sharding=out
    )


def _tf32_split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(head, tail)`` with ``head + tail == x`` exactly: ``head`` keeps the sign, exponent and
    10 leading mantissa bits (a TF32 value), ``tail`` the rest (``|tail| < 2**-10 |x|``)."""
    head = _tf32_trunc(x)
    return head, x - head


def tf32_passes(a: jax.Array, b: jax.Array) -> list[tuple[jax.Array, jax.Array]] | None:
    """The operand pairs of a bilinear product of ``a`` and ``b`` run as three TF32 passes,
    tails first: ``[(a_head, b_tail), (a_tail, b_head), (a_head, b_head)]``, whose
    products, each at ``Precision.DEFAULT``, add up to the product of ``a`` and ``b``.
    ``None`` unless the backend's :data:`PRODUCT_PRECISION` is ``"tf32x3"`` and both
    operands are float32.

    For a product that takes no dot algorithm (a convolution). With TF32 passes
    (inputs rounded or truncated to 10 mantissa bits, float32 accumulation) the
    head x head pass is exact, each tail pass is within ``2**-20 |a||b|`` and the
    dropped tail x tail term is below ``2**-20 |a||b|``: inside the
    ``PRODUCT_UNITS["tf32x3"]`` margin. (At full float32 passes, as on a CPU, only
    the dropped term remains.)
    """
    if _reduced(a.dtype, b.dtype) != "tf32x3":
        return None
    ah, at = _tf32_split(a)
    bh, bt = _tf32_split(b)
    return [(ah, bt), (at, bh), (ah, bh)]


# How many standard deviations of the rounding-error model product_error allows.
ROUNDING_SIGMAS = 6.0


def product_error(depth: int, dtype: Any) -> float:
    """The relative rounding error allowed a product contracting ``depth`` terms in ``dtype``.

    :math:`\\varepsilon = (\\lambda \\sqrt{n} + k)\\, u` for ``n = depth``, with ``u`` the unit
    roundoff of ``dtype``, ``k`` the :data:`PRODUCT_UNITS` of the backend's setting (0 at
    ``"highest"``) and :math:`\\lambda` = :data:`ROUNDING_SIGMAS`: the computed
    :math:`\\hat s` of :math:`s = \\sum_{i \\le n} x_i y_i` is taken to be within
    :math:`\\varepsilon \\|x\\| \\|y\\|` of ``s``. This is the probabilistic model of
    rounding (independent zero-mean roundings; Higham and Mary, SIAM J. Sci.
    Comput., 2019), in which the bound fails with probability below
    :math:`2 e^{-\\lambda^2/2}` (``3e-8``). The worst case,
    :math:`\\gamma_n = n u / (1 - n u)`, holds for any rounding but overstates real
    errors by orders of magnitude: a ghost norm raised by it came out 3% above the
    exact one on transformer-like activations, and 11 times above where terms
    cancel. Ghost norms in Gram form are raised by what this allows
    (:mod:`gradclip_jax.per_example.ghost._gram`).
    """
    name = _reduced(dtype, dtype)
    units = 0 if name is None else PRODUCT_UNITS[name]
    return (ROUNDING_SIGMAS * math.sqrt(depth) + units) * float(jnp.finfo(dtype).eps) / 2.0


def product_margin(dtype: Any) -> float:
    """What the clip norm is multiplied by for products at this backend's precision.

    1.0 at ``"highest"`` and for norms that are not float32; else
    ``1 - PRODUCT_UNITS * 2**-24``.
    """
    name = _reduced(dtype)
    if name is None:
        return 1.0
    return 1.0 - PRODUCT_UNITS[name] * float(jnp.finfo(jnp.float32).eps) / 2.0
