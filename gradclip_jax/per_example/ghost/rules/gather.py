"""``gather``: batched row lookups; a table indexed by batched ids is an ``embedding`` site.

With ``ids_b`` of length ``T`` and cotangents ``g_b`` (zeroed for dropped
out-of-range ids), :math:`\\|G_b\\|_F^2 = \\sum_{t,s} [\\mathrm{ids}_{bt} =
\\mathrm{ids}_{bs}] \\langle g_{bt}, g_{bs} \\rangle`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

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
    ROW,
    Factor,
    RowCtx,
    RowNorms,
    Rule,
    Site,
    State,
    Use,
    axis0_only,
    register,
)


def _row_ok(c: RowCtx) -> bool:
    dn, p, states = c.param("dimension_numbers"), jc.params(c.eqn), c.states
    if states[1] == ROW:  # batched indices
        if 0 in tuple(dn.offset_dims) or len(c.ins[1]) < 2:
            return False
        if states[0] == ROW:
            ob, sb = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
            return 0 in ob and sb[ob.index(0)] == 0
        return True
    # batched operand, constant indices: the whole batch axis must be sliced through
    return bool(
        0 not in tuple(dn.start_index_map)
        and 0 not in tuple(dn.collapsed_slice_dims)
        and p["slice_sizes"][0] == c.bsize
        and len(dn.offset_dims) > 0
        and dn.offset_dims[0] == 0
        and not tuple(dn.operand_batching_dims)
    )


def _row_index(eqn: Any) -> int | None:
    """Which component of the index vectors picks the table row, when ``eqn`` is a row lookup.

    A row lookup reads whole rows of the table: slice size 1 along axis 0 and the
    full size along every other axis, with nothing batched inside the gather. Its
    index vectors (the last axis of the indices) hold the row, and possibly a start
    for other axes (``W[i]`` on a scalar ``i`` under ``vmap`` indexes ``(i, 0)``):
    a full-size slice's start is clamped to 0 unless out-of-range slices are
    dropped (``FILL_OR_DROP``), so only a lookup that clamps may carry them. The
    row axis is kept as a size-1 axis or collapsed; the slice's axes come last in
    the output.
    """
    dn = jc.param(eqn, "dimension_numbers")
    q, out, idx = shape(eqn.invars[0]), shape(eqn.outvars[0]), shape(eqn.invars[1])
    smap, collapsed = tuple(dn.start_index_map), tuple(dn.collapsed_slice_dims)
    if (
        len(q) < 1
        or 0 not in smap
        or collapsed not in ((0,), ())
        or tuple(dn.operand_batching_dims)
        or len(idx) < 1
        or idx[-1] != len(smap)
        or tuple(jc.param(eqn, "slice_sizes")) != (1, *q[1:])
    ):
        return None
    if len(smap) > 1 and jc.param(eqn, "mode") == lax.GatherScatterMode.FILL_OR_DROP:
        return None
    n_off = len(q) - len(collapsed)
    if tuple(dn.offset_dims) != tuple(range(len(out) - n_off, len(out))):
        return None
    return smap.index(0)


def is_row_lookup(eqn: Any) -> bool:
    """``table[ids]``: whole rows of the table (see :func:`_row_index`)."""
    return _row_index(eqn) is not None


def embedding_views(
    eqn: Any, idx: jax.Array, g: jax.Array, acc: Any
) -> tuple[jax.Array, jax.Array]:
    """``(ids, g3)`` of a row lookup: in-range ids ``(B, T)`` and cotangents ``(B, T, d)``.

    The gradient is JAX's, the transpose of the lookup: a scatter-add in the lookup's
    mode. Only ``CLIP`` clamps an out-of-range index there, as the lookup did; every other
    mode drops its update (``FILL_OR_DROP`` by definition; ``PROMISE_IN_BOUNDS``, the mode of
    ``table[ids]``, because XLA's scatter skips out-of-range updates although its gather
    clamped them), so those ids get no gradient: their cotangent rows are zeroed, and
    the norms measure the gradient that the sum adds. A 16-bit cotangent
    stays 16-bit (:func:`~gradclip_jax.per_example._products.view_dtype`): its products
    are exact in float32, and a tied head's Gram with it runs on 16-bit tensor cores.
    """
    bsz = idx.shape[0]
    ids = jnp.reshape(idx[..., _row_index(eqn)], (bsz, -1))
    g3 = as_measured(
        jnp.reshape(g, (bsz, ids.shape[1], -1)).astype(view_dtype(g.dtype, g.dtype, acc))
    )
    rows = shape(eqn.invars[0])[0]
    if jc.param(eqn, "mode") != lax.GatherScatterMode.CLIP:
        # in range: the row, and every other start of a full-size slice at 0
        inside = (idx == 0).at[..., _row_index(eqn)].set(True)
        ok = jnp.reshape(jnp.all(inside, axis=-1), ids.shape) & (ids >= 0) & (ids < rows)
        g3 = jnp.where(ok[:, :, None], g3, jnp.zeros((), g3.dtype))
    return jnp.clip(ids, 0, rows - 1), g3


class Gather(Rule):
    primitives = ("gather",)
    kind = "embedding"

    def row(self, c: RowCtx) -> list[State]:
        return c.res(_row_ok(c)) if axis0_only(c) else c.mixed()

    def classify(self, use: Use) -> Site | None:
        rows = use.row_operands()
        if (
            rows is None
            or use.pos != 0
            or use.bcast
            or use.in_states[1] != ROW
            or not is_row_lookup(use.eqn)
        ):
            return None
        return self.site(use, rows)

    def norm(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any
    ) -> jax.Array | RowNorms | None:
        ids, g3 = embedding_views(eqn, ops[1], g, acc)
        if ids.shape[1] == 1:
            return RowNorms((g3,), lambda n: n[0])
        same = (ids[:, :, None] == ids[:, None, :]).astype(acc)  # exact
        gg = product_einsum("btp,bsp->bts", g3, g3)
        r = self_gram_rows(g3, gg)  # times a one-hot row's norm, 1
        err = product_error(g3.shape[-1], acc)
        return gram_norm(
            [GramTerm(same, gg, err, (r, r), sizes=(0, g3.shape[-1]), live=nonzero(g3))]
        )

    def factors(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any, perm: list[int]
    ) -> tuple[Factor, Factor] | None:
        """One-hot rows of the table along axis 0 and the cotangent rows along axis 1."""
        if perm != [0, 1]:
            return None
        ids, g3 = embedding_views(eqn, ops[1], g, acc)
        return ("onehot", ids), ("dense", g3)


register(Gather())
