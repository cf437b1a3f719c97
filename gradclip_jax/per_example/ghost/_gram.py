"""Ghost norms in Gram form, raised by what rounding of their products may have taken off.

A ghost rule that measures a layer in Gram form computes
:math:`\\|G_b\\|^2 = \\sum_{t,s} \\langle x_t, x'_s\\rangle \\langle y_t, y'_s\\rangle` from
rounded inner products. Their errors are relative to the entries, not to the
norm: with a component common to every row ``x_t`` (transformer activations have
large ones) and rows ``y_t`` that sum to almost nothing over the positions (a
normalization over the positions makes cotangents do that), the entries are
large and their weighted sum is small. Measured against float64 on one layer
(``T = 256``, ``D = P = 768``), the float32 norm then came out ``8e-7``,
``8e-5`` and ``1e-2`` below the exact one for a common component 5, 50 and 500
times what varies, against a clip-factor rounding margin of ``4.8e-7``: a
clipped contribution, ``C`` times exact over measured, would exceed the clip
norm. :func:`gram_norm` adds a bound on that error, computed from the row norms
and, in the reduction that forms the norm, the magnitudes of the products it
sums. The norm is then not below the exact one in the rounding model of
:func:`~gradclip_jax.per_example._products.product_error`. On that layer it
rises by 2e-5 to 6e-5 relative where nothing cancels, and by 0.14%, 13% and 4.4
times for the 5, 50 and 500 times shared components, where clipping is then
stricter than it needs to be. The entries' bound includes the reduced-pass
error of ``PRODUCT_PRECISION`` (``"tf32x3"``: 128 more units of roundoff per
entry), which makes such errors larger still.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gradclip_jax._core.backend import per_backend
from gradclip_jax._core.numerics import sqrt_nonneg
from gradclip_jax.per_example import _products
from gradclip_jax.per_example._products import product_einsum

__all__ = ["DIAGONAL_FROM", "GramTerm", "gram_norm", "nonzero", "self_gram_rows"]

# Backend name -> where the row norms of a self-Gram come from: "gram" (its diagonal; free
# where the Gram is stored anyway, as GPU matmuls store it) or "rows" (the same products
# formed from the rows: XLA's CPU backend fuses the Gram products into the sum that reads
# them, and reading the diagonal would make it store both, 2x the time of that sum).
DIAGONAL_FROM: dict[str, str] = {"cpu": "rows"}


class GramTerm(NamedTuple):
    """One term :math:`w \\langle X, Y\\rangle` of a squared per-example norm.

    Attributes:
      x: computed inner products :math:`X_{ts} = \\langle x_t, x'_s\\rangle`, ``(B, ..., T, S)``.
      y: computed inner products :math:`Y_{ts} = \\langle y_t, y'_s\\rangle`, same shape.
      err: :math:`\\varepsilon_x + \\varepsilon_y`, the relative errors allowed the entries,
        :math:`|\\hat X_{ts} - X_{ts}| \\le \\varepsilon_x \\|x_t\\| \\|x'_s\\|` and the same for
        ``y`` (0 for an exact entry).
      rows: :math:`(\\|x_t\\| \\|y_t\\|)_t`, ``(B, ..., T)``, and
        :math:`(\\|x'_s\\| \\|y'_s\\|)_s`, ``(B, ..., S)``.
      weight: ``w`` (2 for a cross term counted once).
      sizes: the number of products summed into each entry of ``x`` and of ``y`` (0 for
        exact entries): each product, and each partial sum, that underflows loses less
        than the dtype's smallest normal number ``tiny`` (flushed to zero or not).
      live: ``(B,)`` bool, False where the example's gradient is exactly zero (from
        :func:`nonzero`): no product lost anything to underflow there, and its norm stays 0
        (a padding sequence's). ``None``: every example.
    """

    x: jax.Array
    y: jax.Array
    err: float
    rows: tuple[jax.Array, jax.Array]
    weight: float = 1.0
    sizes: tuple[int, int] = (0, 0)
    live: jax.Array | None = None


def nonzero(*factors: jax.Array) -> jax.Array:
    """``(B,)``: where every one of ``factors`` (batch on axis 0) has a nonzero element; a
    product of them, such as a dense layer's gradient ``a^T g``, is exactly zero elsewhere."""
    out = None
    for f in factors:
        nz = jnp.any(f != 0, axis=tuple(range(1, f.ndim)))
        out = nz if out is None else out & nz
    assert out is not None
    return out


def self_gram_rows(rows: jax.Array | None, gram: jax.Array) -> jax.Array:
    """The norms of ``rows`` ``(..., T, N)`` whose Gram is ``gram`` ``(..., T, T)``, ``(..., T)``:
    the square roots of the Gram's diagonal, read from it or formed again from ``rows``
    (see :data:`DIAGONAL_FROM`; always read when ``rows`` is ``None``)."""
    where = per_backend(
        DIAGONAL_FROM,
        "gradclip_jax.per_example.ghost._gram.DIAGONAL_FROM",
        "gram",
        ("gram", "rows"),
    )
    if rows is not None and where == "rows":
        diag = product_einsum("...tn,...tn->...t", rows, rows)
    else:
        diag = jnp.diagonal(gram, axis1=-2, axis2=-1)
    return sqrt_nonneg(diag)


def gram_norm(terms: Sequence[GramTerm]) -> jax.Array:
    """:math:`\\sqrt{\\sum_i w_i \\langle \\hat X_i, \\hat Y_i\\rangle + E}`, ``(B,)``: not below the exact
    norm :math:`\\sqrt{\\sum_i w_i \\langle X_i, Y_i\\rangle}` in the rounding model of
    :func:`~gradclip_jax.per_example._products.product_error`.

    ``E`` adds, over the terms, ``w`` times

    .. math:: (\\varepsilon_x + \\varepsilon_y) \\Big(\\sum_t \\|x_t\\|^2\\|y_t\\|^2
              \\sum_s \\|x'_s\\|^2\\|y'_s\\|^2\\Big)^{1/2}
              + \\lambda u (\\sqrt{S} + \\sqrt{R}) \\sum_{t,s} |\\hat X_{ts} \\hat Y_{ts}|.

    The first part carries the entries' errors, independent from entry to entry,
    through the weighted sum: their standard deviation is at most
    :math:`\\varepsilon_x (\\sum_{t,s} \\|x_t\\|^2 \\|x'_s\\|^2 Y_{ts}^2)^{1/2}/\\lambda`, and
    :math:`|Y_{ts}| \\le \\|y_t\\| \\|y'_s\\|` bounds that by the row norms alone. The
    second is the sum's own rounding, as ``R`` sums of ``S`` terms (``R``: ``T``
    times the leading axes) added up, in whatever order, with partial sums bounded
    by the sum of the magnitudes (as when the terms come sorted); it is summed in
    the same reduction as the norm. The product of two entries' errors is
    :math:`\\varepsilon_y` times the first part's and is left out. ``u`` is the unit
    roundoff, :math:`\\lambda` = :data:`~gradclip_jax.per_example._products.ROUNDING_SIGMAS`.

    Underflow is absolute, not relative: an entry of ``n`` products may lose up to
    :math:`2 n \\tau` to it (:math:`\\tau` the smallest normal number; a CPU flushes smaller
    results to zero), and each product the norm sums :math:`2 \\tau`. So ``E`` also adds
    :math:`2 \\tau \\sum_{t,s} (n_x |\\hat Y_{ts}| + n_y |\\hat X_{ts}| + 1)`, in the same
    reduction, where the example's gradient is not exactly zero (``live``). It changes no
    norm of ordinary values (1e-36 against entries of order 1),
    and keeps the norm of activations of 1e-20, whose inner products all flush to zero,
    from reading 0: their gradient would be added unclipped. (The product of two such
    errors, of order :math:`\\tau^2`, is left out: it matters only for a clip norm below
    1e-37 in float32.)
    """
    total = None
    for term in terms:
        x, y = term.x, term.y
        grid = tuple(range(1, x.ndim))
        rows = math.prod(x.shape[1:-1])
        kappa = (
            _products.ROUNDING_SIGMAS
            * float(jnp.finfo(x.dtype).eps)
            / 2.0
            * (math.sqrt(x.shape[-1]) + math.sqrt(rows))
        )
        xy = x * y
        tiny = float(jnp.finfo(x.dtype).tiny)
        lost = 2.0 * tiny * (term.sizes[0] * jnp.abs(y) + term.sizes[1] * jnp.abs(x) + 1.0)
        if term.live is not None:
            live = jnp.reshape(term.live, (-1,) + (1,) * (x.ndim - 1))
            lost = jnp.where(live, lost, jnp.zeros_like(lost))
        t = jnp.sum(xy + kappa * jnp.abs(xy) + lost, axis=grid)  # one reduction, with the products
        if term.err:
            lead = grid[:-1]
            rt, rs = term.rows
            t = t + term.err * jnp.sqrt(
                jnp.sum(jnp.square(rt), axis=lead) * jnp.sum(jnp.square(rs), axis=lead)
            )
        t = jnp.asarray(term.weight, t.dtype) * t
        total = t if total is None else total + t
    assert total is not None
    return sqrt_nonneg(total)
