"""Tied leaves whose every use factors into per-position vectors: the norm of the
sum of the uses' gradients from inner products of the factors, cross terms included.

.. math:: \\Big\\|\\sum_i G_{b,i}\\Big\\|_F^2 = \\sum_{i,j} \\sum_{t,s}
          \\langle x_{bit}, x_{bjs}\\rangle \\langle y_{bit}, y_{bjs}\\rangle
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax.per_example._products import product_einsum, product_error
from gradclip_jax.per_example.ghost._gram import GramTerm, gram_norm, nonzero, self_gram_rows
from gradclip_jax.per_example.ghost.rules import Factor, Site, names

# Chain operations a factored use may go through (anything else: no factors).


def _chain_perm(closed: Any, chain: Sequence[int]) -> list[int] | None:
    """``perm[i]``: the leaf axis that is axis ``i`` of the operand, through transposes and casts."""
    perm = [0, 1]
    for k in chain:
        e = closed.jaxpr.eqns[k]
        if e.primitive.name == names.TRANSPOSE:
            perm = [perm[p] for p in jc.param(e, "permutation")]
        elif e.primitive.name not in names.CASTS:
            return None
    return perm


def site_factors(
    closed: Any, site: Site, ops: Sequence[Any], g: jax.Array, leaf: jax.Array, acc: Any
) -> tuple[Factor, Factor] | None:
    """A use of a 2-D leaf as a sum of outer products, ``G_b = sum_t x_bt (x) y_bt``, or ``None``."""
    if leaf.ndim != 2:
        return None
    perm = _chain_perm(closed, site.chain)
    if perm is None:
        return None
    return site.rule.factors(site, closed.jaxpr.eqns[site.eqn], ops, g, acc, perm)


def _factor_inner(f: Factor, h: Factor) -> jax.Array:
    """``<x_bt, x'_bs>`` for all positions: ``(B, T, S)``."""
    (kf, xf), (kh, xh) = f, h
    if kf == "dense" and kh == "dense":
        return product_einsum("btn,bsn->bts", xf, xh)
    if kf == "onehot" and kh == "onehot":
        return (xf[:, :, None] == xh[:, None, :]).astype(jnp.float32)
    if kf == "dense":  # x_bt[ids_bs]
        return jnp.swapaxes(_factor_inner(h, f), 1, 2)
    cols = jnp.swapaxes(xh, 1, 2)  # (B, n, S): x'_bs[ids_bt] for every t
    return jnp.take_along_axis(cols, xf[:, :, None], axis=1)


def _factor_rows(f: Factor, self_inner: jax.Array, acc: Any) -> jax.Array:
    """Each position's vector norm, ``(B, T)``: from ``f``'s inner products with itself (a one-hot row's is 1)."""
    kind, x = f
    return self_gram_rows(x.astype(acc), self_inner) if kind == "dense" else jnp.ones(x.shape, acc)


def _inner_size(f: Factor, h: Factor) -> int:
    """The products summed into each entry of :func:`_factor_inner` (0 where it only reads or
    compares values)."""
    return f[1].shape[-1] if f[0] == "dense" and h[0] == "dense" else 0


def _inner_error(f: Factor, h: Factor, acc: Any) -> float:
    """The rounding error allowed :func:`_factor_inner` (0 where it only reads or compares values)."""
    n = _inner_size(f, h)
    return product_error(n, acc) if n else 0.0


def _live(factors: Sequence[tuple[Factor, Factor]]) -> jax.Array:
    """``(B,)``: where some use's gradient can be nonzero (both its dense factors have a nonzero
    element; a one-hot factor always has one)."""
    out = None
    for x, y in factors:
        dense = [f[1] for f in (x, y) if f[0] == "dense"]
        nz = nonzero(*dense) if dense else jnp.ones((x[1].shape[0],), bool)
        out = nz if out is None else out | nz
    assert out is not None
    return out


def factored_norm(factors: Sequence[tuple[Factor, Factor]], acc: Any) -> jax.Array:
    """Per-example Frobenius norm of ``sum_i G_i`` from the factors of every use ``i``, raised by
    what rounding may have taken off (:func:`~gradclip_jax.per_example.ghost._gram.gram_norm`).

    Each pair of uses once (doubled), in ``O(T_i T_j (n_0 + n_1))`` per example
    and pair: nothing of the leaf's size is formed.
    """
    pairs = [(i, j) for i in range(len(factors)) for j in range(i, len(factors))]
    inner = {
        (i, j): (
            _factor_inner(factors[i][0], factors[j][0]).astype(acc),
            _factor_inner(factors[i][1], factors[j][1]).astype(acc),
        )
        for i, j in pairs
    }
    rows = [
        _factor_rows(x, inner[i, i][0], acc) * _factor_rows(y, inner[i, i][1], acc)
        for i, (x, y) in enumerate(factors)
    ]
    live = _live(factors)
    return gram_norm(
        [
            GramTerm(
                *inner[i, j],
                _inner_error(factors[i][0], factors[j][0], acc)
                + _inner_error(factors[i][1], factors[j][1], acc),
                (rows[i], rows[j]),
                1.0 if i == j else 2.0,
                sizes=(
                    _inner_size(factors[i][0], factors[j][0]),
                    _inner_size(factors[i][1], factors[j][1]),
                ),
                live=live,
            )
            for i, j in pairs
        ]
    )


def factored_is_cheaper(factors: Sequence[tuple[Factor, Factor]], shape: tuple[int, ...]) -> bool:
    """Inner products of the factors cost less than forming each use's gradient."""
    ts = [x[1].shape[1] for x, _ in factors]
    n0, n1 = shape
    return sum(ti * tj for ti in ts for tj in ts) * (n0 + n1) < sum(ts) * n0 * n1
