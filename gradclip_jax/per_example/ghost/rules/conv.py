"""``conv_general_dilated``: a kernel applied to a batched input is a ``conv`` site.

A convolution is a matmul of the input's patches with the kernel. With ``P_b``
the patches of example ``b`` as ``(T, D)`` (``T`` output positions, ``D`` one
group's input channels times the ``K`` kernel taps), and its output cotangent
``G_b`` as ``(T, P)`` (one group's output channels), the group's kernel gradient
is :math:`P_b^\\top G_b` and

.. math:: \\|P_b^\\top G_b\\|_F^2 = \\langle P_b P_b^\\top, G_b G_b^\\top\\rangle,
          \\qquad P_b P_b^\\top = \\sum_k X_{bk} X_{bk}^\\top,

with ``X_bk`` (``(T, Cin/groups)``) the input seen by tap ``k``: one strided window
of the padded (and, for ``lhs_dilation``, dilated) input. The groups' squared
norms add. Per group and example, the Gram form costs ``T^2 (D + P)``
multiply-adds and two ``(T, T)`` matrices, or, with the patches' Gram read from
the Gram of the whole padded input (``T_in`` positions), ``T_in^2 C + T^2 P``
and a ``(T_in, T_in)`` matrix (cheaper for stride 1 on small images); forming
the gradient :math:`\\sum_k X_{bk}^\\top G_b` (one batched matmul per tap) costs
``T D P`` and ``D P`` values: the multiply-adds and memory of the fallback (the
per-example gradient by a vmapped one-example convolution VJP), but as matmuls.
The taps are read one at a time, so the ``K`` times larger patches are never
formed: neither form is costlier than the fallback, whatever the input size.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import shape
from gradclip_jax._core.norms import joint_row_norms
from gradclip_jax.per_example._batch import along_axis
from gradclip_jax.per_example._products import (
    as_measured,
    product_einsum,
    product_error,
    view_dtype,
)
from gradclip_jax.per_example.ghost._gram import GramTerm, gram_norm, nonzero, self_gram_rows
from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    ROW,
    RowCtx,
    Rule,
    Site,
    State,
    Use,
    axis0_only,
    register,
)

# The Gram form when its multiply-adds per group and example (T^2 (D + P) from the
# taps' Grams) are below GRAM_RATIO times those of forming the gradient, T D P
# (tests set 0 or inf). At 1 this also bounds its memory: T < DP / (D + P) gives
# 2 T^2 <= DP / 2 (the input's Gram is taken only where its T_in^2 <= DP).
GRAM_RATIO = 1.0


def _after(x: jax.Array, g: jax.Array) -> jax.Array:
    """``x`` (batch on axis 0), computed from ``g`` too, so that it is computed once ``g`` exists.

    The views of the input are copies (rounded, moved, padded, one strided copy per tap) that
    only the norms read, and those need the cotangent. With nothing tying them to it, XLA's
    schedulers are free to make the copies in the forward pass, as soon as the input exists,
    and hold every site's copies through the backward pass, several times the non-private
    step's temporaries on a wide ResNet (``benchmarks/results/MEASUREMENTS.md``). Adding
    ``0 * g_b`` (of one entry of each example's cotangent) is the tie: no optimization barrier
    survives to the scheduler. It changes nothing but an example whose cotangent entry is
    infinite or NaN: its norm, non-finite anyway (the entry multiplies its inputs), becomes NaN.
    """
    gate = 0 * lax.index_in_dim(jnp.reshape(g, (g.shape[0], -1)), 0, axis=1, keepdims=False)
    return x + along_axis(gate, x.ndim).astype(x.dtype)


class ConvViews:
    """A conv site's operands per kernel tap, in the accumulation dtype.

    Args:
      eqn: the ``conv_general_dilated`` equation (batch on axis 0 of the input and output).
      x: its input at the whole batch.
      g: its output cotangent at the whole batch.
      acc: the accumulation dtype (float32 for 16-bit operands).

    Attributes:
      xp: the input as ``(B, Cin, *spatial)``, padded (and dilated) as the convolution reads it.
      offsets: ``K`` tuples of ``n`` ints, each tap's start in ``xp`` (``n`` spatial axes), row-major
        over the kernel's spatial axes as ``lax.conv_general_dilated_patches`` orders them.
      g: the output cotangent as ``(B, groups, T, P)``.
    """

    def __init__(self, eqn: Any, x: jax.Array, g: jax.Array, acc: Any) -> None:
        p = jc.params(eqn)
        lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
        self.groups = int(p["feature_group_count"])
        self.strides = tuple(p["window_strides"])
        out = [g.shape[d] for d in out_spec[2:]]
        self.bsz, self.t = g.shape[out_spec[0]], math.prod(out)
        gt = jnp.reshape(
            jnp.transpose(g, (out_spec[0], *out_spec[2:], out_spec[1])), (self.bsz, self.t, -1)
        )
        # a group's output channels, like its input channels, are contiguous (merging and
        # splitting axes in one reshape has no sharding rule: two reshapes)
        view = view_dtype(x.dtype, g.dtype, acc)  # 16-bit operands stay 16-bit: exact products
        gt = jnp.reshape(as_measured(gt.astype(view)), (self.bsz, self.t, self.groups, -1))
        self.g = jnp.transpose(gt, (0, 2, 1, 3))
        xc = as_measured(
            jnp.transpose(x, lhs_spec).astype(view)
        )  # (B, C, *spatial): the input, not the patches, is moved
        pads = [(0, 0, 0), (0, 0, 0)]
        pads += [
            (lo, hi, d - 1) for (lo, hi), d in zip(p["padding"], p["lhs_dilation"], strict=True)
        ]
        # the input as the convolution reads it, copied once the cotangent exists
        self.xp = lax.pad(_after(xc, self.g), jnp.zeros((), xc.dtype), pads)
        self.extent = (
            self.bsz,
            self.xp.shape[1],
            *((n - 1) * s + 1 for n, s in zip(out, self.strides, strict=True)),
        )
        kshape = shape(eqn.invars[1])
        taps = itertools.product(*(range(kshape[d]) for d in rhs_spec[2:]))
        self.offsets = tuple(
            tuple(int(o) * int(r) for o, r in zip(tap, p["rhs_dilation"], strict=True))
            for tap in taps
        )

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        """``(T, K, Cin/groups, P, groups)``: the patches are ``(T, D)`` with ``D = K Cin/groups``."""
        k, c = len(self.offsets), self.xp.shape[1] // self.groups
        return self.t, k, c, self.g.shape[-1], self.groups

    def tap(self, offset: tuple[int, ...]) -> jax.Array:
        """The input tap ``offset`` reads, ``X_bk``, as ``(B, groups, Cin/groups, T)``: one static
        strided slice of the padded input."""
        start = (0, 0, *offset)
        limit = tuple(a + n for a, n in zip(start, self.extent, strict=True))
        x = lax.slice(self.xp, start, limit, (1, 1, *self.strides))
        return jnp.reshape(
            jnp.reshape(x, (self.bsz, -1, self.t)), (self.bsz, self.groups, -1, self.t)
        )


def _tap_gram(views: ConvViews) -> jax.Array:
    """:math:`P_b P_b^\\top = \\sum_k X_{bk} X_{bk}^\\top`, ``(B, groups, T, T)``, one tap's
    window at a time, each a static slice (no loop in the program: a loop's ``K``
    sequential iterations, each a small product, run slowly on GPUs)."""

    def gram(x: jax.Array) -> jax.Array:
        return product_einsum("bgct,bgcs->bgts", x, x)

    pp = gram(views.tap(views.offsets[0]))
    for off in views.offsets[1:]:
        pp = pp + gram(views.tap(off))
    return pp


def _input_gram(views: ConvViews) -> jax.Array:
    """:math:`P_b P_b^\\top` from the Gram of the whole padded input, ``F_b = X_b X_b^\\top``
    over its ``T_in`` positions: entry ``(t, s)`` is :math:`\\sum_k F_b[\\sigma(t) + o_k,
    \\sigma(s) + o_k]` (``sigma`` the output position's start, ``o_k`` tap ``k``'s offset), ``K``
    strided slices of ``F_b``. One product of ``T_in^2 C`` multiply-adds and no copy of the
    input per tap, where the taps' Grams take ``K T^2 C`` and ``K`` copies."""
    b, g = views.bsz, views.groups
    padded = views.xp.shape[2:]
    # (merging and splitting axes in one reshape has no sharding rule: two reshapes)
    x = jnp.reshape(
        jnp.reshape(views.xp, (b, -1, math.prod(padded))), (b, g, -1, math.prod(padded))
    )
    f = product_einsum("bgcu,bgcv->bguv", x, x)
    f = jnp.reshape(
        jnp.reshape(f, (b, g, *padded, f.shape[-1])), (b, g, *padded, *padded)
    )  # (one axis at a time)
    pp = None
    for off in views.offsets:
        start = (0, 0, *off, *off)
        limit = (
            b,
            g,
            *(o + e for o, e in zip(off, views.extent[2:], strict=True)),
            *(o + e for o, e in zip(off, views.extent[2:], strict=True)),
        )
        block = lax.slice(f, start, limit, (1, 1, *views.strides, *views.strides))
        pp = block if pp is None else pp + block
    assert pp is not None
    return jnp.reshape(
        jnp.reshape(pp, (*pp.shape[: 2 + len(padded)], views.t)), (b, g, views.t, views.t)
    )


def _input_gram_is_cheaper(views: ConvViews) -> bool:
    """Whether :func:`_input_gram` does fewer multiply-adds than :func:`_tap_gram`, ``T_in^2 <
    K T^2`` (stride 1 and little padding; not with strides, whose outputs are sparser than the
    input), with a matrix no larger than the gradient it stands for, ``T_in^2 <= K C P``."""
    t, k, c, q, _ = views.dims
    tin2 = math.prod(views.xp.shape[2:]) ** 2
    return tin2 < k * t * t and tin2 <= k * c * q


def gram_norms(views: ConvViews) -> jax.Array:
    """:math:`\\sqrt{\\sum_g \\langle \\sum_k X_{bgk} X_{bgk}^\\top, G_{bg} G_{bg}^\\top\\rangle}`, ``(B,)``,
    raised by what rounding of its products may have taken off
    (:func:`~gradclip_jax.per_example.ghost._gram.gram_norm`). The patches' Gram comes from
    the input's Gram or the taps', whichever is cheaper."""
    pp = _input_gram(views) if _input_gram_is_cheaper(views) else _tap_gram(views)
    gg = product_einsum("bgtp,bgsp->bgts", views.g, views.g)
    _, k, c, q, _ = views.dims
    # each entry of pp adds K c products (in K sums of c, or one of K c) (its diagonal is read,
    # not formed again)
    r = self_gram_rows(None, pp) * self_gram_rows(views.g, gg)
    return gram_norm(
        [
            GramTerm(
                pp,
                gg,
                product_error(k * c, pp.dtype) + product_error(q, gg.dtype),
                (r, r),
                sizes=(k * c, q),
                live=nonzero(views.xp, views.g),
            )
        ]
    )


def _gram_cost(views: ConvViews) -> int:
    """Multiply-adds of :func:`gram_norms` per group and example."""
    t, k, c, q, _ = views.dims
    patches = (
        math.prod(views.xp.shape[2:]) ** 2 * c if _input_gram_is_cheaper(views) else k * t * t * c
    )
    return patches + t * t * q


def formed_norms(views: ConvViews) -> jax.Array:
    """The norm of each example's gradient, :math:`(X_{bgk}^\\top G_{bg})_{k,g}`, ``(B,)``:
    one batched matmul per tap (not a vmapped convolution), each tap a static slice (no loop).

    The taps' blocks of the gradient are disjoint, so their squared norms add: each
    block is measured as it is formed.
    """
    blocks = [product_einsum("bgct,bgtp->bgcp", views.tap(off), views.g) for off in views.offsets]
    # branch-free (no overflow conditional: a host round trip on GPUs), and finished once for
    # all taps: each block is reduced to its example's three partial sums as it is formed
    return joint_row_norms(blocks)


class Conv(Rule):
    primitives = ("conv_general_dilated",)
    kind = "conv"

    def row(self, c: RowCtx) -> list[State]:
        if not axis0_only(c):
            return c.mixed()
        dn = c.param("dimension_numbers")
        return c.res(
            c.states[0] == ROW
            and c.states[1] == CONST
            and dn.lhs_spec[0] == 0
            and dn.out_spec[0] == 0
            and c.param("batch_group_count") == 1
        )

    def classify(self, use: Use) -> Site | None:
        rows = use.row_operands()
        if rows != (0,) or use.pos != 1 or use.bcast:
            return None
        return self.site(use, rows)

    def norm(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any
    ) -> jax.Array | None:
        """Per-example ``||P_b^T G_b||_F`` (over groups): the Gram form when it does fewer
        multiply-adds, else each example's gradient by batched matmuls."""
        if jc.param(eqn, "batch_group_count") != 1 or g.size == 0:
            return None
        views = ConvViews(eqn, ops[0], g, acc)
        t, k, c, q, _ = views.dims
        if _gram_cost(views) < GRAM_RATIO * t * k * c * q:
            return gram_norms(views)
        return formed_norms(views)

    def spread(self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any) -> jax.Array:
        """:math:`\\sqrt{K} \\|x_b\\| \\|g_b\\|` (``K`` kernel taps): a bound on
        :math:`\\sum_t \\|p_{bt}\\| \\|g_{bt}\\|` over the output positions' patches ``p_bt``, by
        Cauchy-Schwarz, since each input element (of the dilated, padded input; per group)
        lies in at most ``K`` patches. No patches are formed."""
        dn = jc.param(eqn, "dimension_numbers")
        taps = math.prod(shape(eqn.invars[1])[d] for d in dn.rhs_spec[2:])

        def norms(v: jax.Array) -> jax.Array:
            v = as_measured(v.astype(acc))
            return jnp.sqrt(jnp.sum(jnp.square(v), axis=tuple(range(1, v.ndim))))

        return jnp.sqrt(jnp.asarray(taps, acc)) * norms(ops[0]) * norms(g)


register(Conv())
