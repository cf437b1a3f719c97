"""``dot_general``: the batch may be on any free axis; a parameter operand is a ``dense`` site.

With the batched operand ``a_b`` as ``(T, D)`` and the output cotangent ``g_b``
as ``(T, P)``, the per-example gradient is :math:`a_b^\\top g_b` and its norm is
:math:`\\|a_b\\|\\|g_b\\|` (``T = 1``), that of the formed gradient, or
:math:`\\sqrt{\\langle a_b a_b^\\top, g_b g_b^\\top\\rangle}` raised by what rounding of its
Gram products may have taken off (:mod:`~gradclip_jax.per_example.ghost._gram`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import shape
from gradclip_jax.per_example._products import (
    as_measured,
    product_einsum,
    product_error,
    view_dtype,
)
from gradclip_jax.per_example.ghost._gram import GramTerm, gram_norm, nonzero, self_gram_rows
from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    Factor,
    Formed,
    RowCtx,
    RowNorms,
    Rule,
    Site,
    State,
    Use,
    register,
)


def _free(dims: int, contracted: Sequence[int], batch: Sequence[int]) -> list[int]:
    return [d for d in range(dims) if d not in contracted and d not in batch]


def dense_views(
    site: Site, eqn: Any, a: jax.Array, g: jax.Array, acc: Any
) -> tuple[jax.Array, jax.Array]:
    """``(a3, g3)``: a dense site's operand as ``(B, T, D)`` and cotangent as ``(B, T, P)`` (with a
    merged batch of ``B * m`` rows, ``T`` counts the ``m`` rows of each example too)."""
    (lc, rc), _ = jc.param(eqn, "dimension_numbers")
    a_pos, k = 1 - site.pos, site.axis
    ca = tuple(lc if a_pos == 0 else rc)
    n_lhs_free = len(shape(eqn.invars[0])) - len(lc)
    n_rhs_free = len(shape(eqn.invars[1])) - len(rc)
    a_free = [d for d in range(a.ndim) if d not in ca]
    offset = 0 if a_pos == 0 else n_lhs_free
    w_out = (
        list(range(n_lhs_free, n_lhs_free + n_rhs_free)) if a_pos == 0 else list(range(n_lhs_free))
    )
    seq = [d for d in a_free if d != k]
    g_perm = (offset + a_free.index(k), *[offset + a_free.index(d) for d in seq], *w_out)
    bsz = a.shape[k]
    t = math.prod(a.shape[d] for d in seq)
    dsz = math.prod(a.shape[d] for d in ca)
    # a merged batch: each example's rows are contiguous, so they regroup as more positions
    m = site.merged
    view = view_dtype(a.dtype, g.dtype, acc)  # 16-bit operands stay 16-bit: exact products
    a3 = jnp.reshape(jnp.transpose(a, (k, *seq, *ca)), (bsz // m, m * t, dsz)).astype(view)
    g3 = jnp.reshape(jnp.transpose(g, g_perm), (bsz // m, m * t, -1)).astype(view)
    return as_measured(a3), as_measured(g3)


def _gram_form(t: int, dsz: int, psz: int) -> bool:
    """Whether a dense site of ``T = t`` rows per example (``t > 1``) is measured in Gram form:
    when the two ``(T, T)`` Grams are smaller than the ``(D, P)`` per-example gradient."""
    return 2 * t * t < psz * dsz


def _grams(a3: jax.Array, g3: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The per-example Grams :math:`a_b a_b^\\top` and :math:`g_b g_b^\\top`, ``(B, T, T)`` each."""
    return product_einsum("btd,bsd->bts", a3, a3), product_einsum("btp,bsp->bts", g3, g3)


class DotGeneral(Rule):
    primitives = ("dot_general",)
    kind = "dense"

    def row(self, c: RowCtx) -> list[State]:
        (lc, rc), (lb, rb) = c.param("dimension_numbers")
        lfree, rfree = _free(len(c.ins[0]), lc, lb), _free(len(c.ins[1]), rc, rb)
        sl, sr = c.states[0], c.states[1]
        if isinstance(sl, int) and sr == CONST and sl in lfree:
            return c.res_at(len(lb) + lfree.index(sl))
        if sl == CONST and isinstance(sr, int) and sr in rfree:
            return c.res_at(len(lb) + len(lfree) + rfree.index(sr))
        if isinstance(sl, int) and isinstance(sr, int) and sl in lb and sr in rb:
            i = tuple(lb).index(sl)
            return c.res_at(i) if tuple(rb)[i] == sr else c.mixed()
        return c.mixed()

    def crosses(self, c: RowCtx) -> bool:
        """A batch axis contracted (``h.T @ h``), or both operands' batch axes kept apart in the
        output (``za @ zb.T``: entry ``(i, j)`` reads examples ``i`` and ``j``, as in-batch
        contrastive losses and attention across the batch do)."""
        (lc, rc), (lb, rb) = c.param("dimension_numbers")
        sl, sr = c.states[0], c.states[1]
        if any(
            isinstance(s, int) and s in contracted
            for s, contracted in zip((sl, sr), (lc, rc), strict=True)
        ):
            return True
        lfree, rfree = _free(len(c.ins[0]), lc, lb), _free(len(c.ins[1]), rc, rb)
        return isinstance(sl, int) and isinstance(sr, int) and sl in lfree and sr in rfree

    def classify(self, use: Use) -> Site | None:
        """The batch may be on any free axis of the other operand. With batch dimensions (one
        weight per expert, ``einsum('etm,emh->eth')``), the leaf's per-example gradients are formed
        (:class:`Formed`): the views here have no axis for them."""
        (lc, rc), (lb, rb) = jc.param(use.eqn, "dimension_numbers")
        other = 1 - use.pos
        k = use.in_states[other]
        contracted, batched = (lc, lb) if other == 0 else (rc, rb)
        if use.bcast or not isinstance(k, int) or k in contracted or k in batched:
            return None
        site = self.site(use, (other,), k, int(use.out_states[0]))  # type: ignore[arg-type]
        return dataclasses.replace(site, rule=Formed(self)) if lb else site

    def norm(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any
    ) -> jax.Array | RowNorms | None:
        """Per-example ``||a_b^T g_b||_F``: ``a``'s free axes other than the batch are ``T``,
        its contracted axes ``D``, the parameter's free axes the ``P`` axes of the output."""
        a3, g3 = dense_views(site, eqn, ops[1 - site.pos], g, acc)
        bsz, t, dsz = a3.shape
        psz = g3.shape[-1]
        if t == 1:  # 2-D views (a bitcast for the usual (B, D) operand, no copy of the activations)
            return RowNorms(
                (jnp.reshape(a3, (bsz, dsz)), jnp.reshape(g3, (bsz, psz))),
                lambda n: (n[0] * n[1]).astype(acc),
            )
        if _gram_form(t, dsz, psz):
            aa, gg = _grams(a3, g3)
            r = self_gram_rows(a3, aa) * self_gram_rows(g3, gg)
            return gram_norm(
                [
                    GramTerm(
                        aa,
                        gg,
                        product_error(dsz, acc) + product_error(psz, acc),
                        (r, r),
                        sizes=(dsz, psz),
                        live=nonzero(a3, g3),
                    )
                ]
            )
        per_example = product_einsum(
            "btd,btp->bdp", a3, g3
        )  # this layer's per-example gradients only
        return RowNorms((per_example,), lambda n: n[0])

    def spread(self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any) -> jax.Array:
        """:math:`\\sum_t \\|a_t\\| \\|g_t\\|` per example, over the rows of the views :meth:`norm` measures,
        raised by what rounding of the row norms may have taken off.

        Where :meth:`norm` takes the Gram form, the row norms are those it reads (the Grams'
        diagonals on GPUs, :func:`~gradclip_jax.per_example.ghost._gram.self_gram_rows`): the
        same products, which XLA computes once, so the spread reads no activation again."""
        a3, g3 = dense_views(site, eqn, ops[1 - site.pos], g, acc)
        _, t, dsz = a3.shape
        psz = g3.shape[-1]
        if t > 1 and _gram_form(t, dsz, psz):
            aa, gg = _grams(a3, g3)
            rows = self_gram_rows(a3, aa) * self_gram_rows(g3, gg)
        else:
            a3, g3 = a3.astype(acc), g3.astype(acc)  # an upper bound: no 16-bit sums of squares
            rows = jnp.sqrt(jnp.sum(jnp.square(a3), axis=-1)) * jnp.sqrt(
                jnp.sum(jnp.square(g3), axis=-1)
            )
        # each squared row norm is within product_error of its value (relative), its root within half that
        return jnp.sum(rows, axis=-1) * (1.0 + product_error(dsz, acc) + product_error(psz, acc))

    def factors(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any, perm: list[int]
    ) -> tuple[Factor, Factor] | None:
        """The rows of ``a`` along the contracted axis and those of ``g`` along the free one."""
        (lc, rc), _ = jc.param(eqn, "dimension_numbers")
        cw = tuple(lc if site.pos == 0 else rc)
        if len(cw) != 1:
            return None
        a3, g3 = dense_views(site, eqn, ops[1 - site.pos], g, acc)
        by_axis = {perm[cw[0]]: ("dense", a3), perm[1 - cw[0]]: ("dense", g3)}
        return by_axis[0], by_axis[1]


register(DotGeneral())
