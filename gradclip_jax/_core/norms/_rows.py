"""Per-example rows: the 2-norm and the peak ``max |x|`` of each row of many arrays at once,
stacked ``(K, B)``, exact across the float range (the per-example clip's measure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core.backend import per_backend
from gradclip_jax._core.control import cond
from gradclip_jax._core.norms._reduce import (
    Job,
    abs_acc,
    abs_sq,
    plan_jobs,
    power_of_two,
    pth_root,
    scaled_abs,
)
from gradclip_jax._core.norms._trees import tree_acc_dtype

# Per backend, how :func:`row_l2_and_max` keeps the squares free of overflow and underflow:
#
# * ``"scaled"``: every row in units of its peak (a power of two, so exact), no conditional. A
#   GPU reduces with the scaling fused in at the cost of a plain sum, and a conditional would
#   copy its predicate to the host.
# * ``"fallback"``: a plain sum of squares, and only when a row's sum over- or underflowed, the
#   rows again in units of their peaks, in a conditional. XLA:CPU (YNNPACK) reduces a plain sum
#   of squares, a max or a min at memory speed, but a reduction with any other elementwise
#   work before it (a scale, ``|x|``) about 15x slower: a 512 x 401408 float32 array's sum of
#   squares takes 21 ms, scaled 358 ms, and its ``max |x|`` 363 ms against 48 ms as a max and
#   a min.
#
# Backends not listed use ``"scaled"``.
ROW_L2_STRATEGY = {"cpu": "fallback"}


def row_l2_and_max(arrays: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(l2, peak)``: the 2-norm and the ``max |x|`` of each row (axis 0) of each array, each
    stacked ``(K, B)`` for ``K`` arrays ``(B, ...)``: row ``i`` holds ``arrays[i]``'s, in the
    arrays' common accumulation dtype.

    The peak is the larger of the largest element and the negated smallest (two plain
    reductions, exact). A row whose squares would over- or underflow is measured in units of
    its peak: with ``s`` the power of two just above ``max |x|`` (:func:`power_of_two`),

    .. math:: \\|x\\|_2 = s \\sqrt{\\textstyle\\sum_i (x_i / s)^2},

    whose squares lie in ``[0, 1]``, and scaling by a power of two is exact: in the normal range
    this is the plain ``sqrt(sum x_i^2)`` to the bit. Whether every row is so measured or only
    the rows whose plain sum failed, in a conditional, is the backend's
    :data:`ROW_L2_STRATEGY`. Either way no per-array fallback program: the rows' scales come
    from the peaks the caller (the per-example guard) needs anyway. ``s`` is a constant for
    differentiation (the norm is homogeneous): the derivative is ``x / norm``. A row with a NaN
    (inf) has a NaN (inf) norm; an all-zero row has norm 0.

    The reductions are those of :func:`slice_norms` (equal arrays stacked into one), and their
    results are stacked as they come, reordered by one gather: no operation per array, where a
    list of per-array norms costs a slice per array (and one more per operation on each).
    """
    jobs, where = plan_jobs(arrays, [tuple(range(1, x.ndim)) for x in arrays], keepdims=True)
    dtype = tree_acc_dtype([j.x for j in jobs])
    rows = _JobRows(jobs, where, arrays[0].shape[0], dtype)
    # the small elementwise work runs on the stacks, once, not once a job
    peak_jobs = jnp.maximum(
        rows.concat([_top(j, 1) for j in jobs]), -rows.concat([_top(j, -1) for j in jobs])
    )
    peak = rows.ordered(peak_jobs)

    def scaled(_: Any = None) -> jax.Array:
        inverse = 1.0 / _unit(peak_jobs)  # exact: a normal power of two
        sums = [_scaled_sumsq(j, rows.of_job(inverse, k)) for k, j in enumerate(jobs)]
        return _unit(peak) * pth_root(rows.ordered(rows.concat(sums)), 2.0)

    how = per_backend(
        ROW_L2_STRATEGY,
        "gradclip_jax._core.norms.ROW_L2_STRATEGY",
        "scaled",
        ("scaled", "fallback"),
    )
    if how == "scaled":
        return scaled(), peak
    sumsq = rows.ordered(rows.concat([j.sum(abs_sq(j.x, j.acc)) for j in jobs]))
    sizes = np.asarray([max(int(np.prod(x.shape[1:])), 1) for x in arrays], dtype)[:, None]
    info = jnp.finfo(dtype)
    # the engine's test (_is_bad): not finite, or so small that the underflowed squares could
    # have cost more than one ulp; rows with a NaN or inf element keep their plain sum
    bad = (
        jnp.isfinite(peak)
        & (peak > 0)
        & (~jnp.isfinite(sumsq) | (sumsq < sizes * (float(info.tiny) / float(info.eps))))
    )
    plain = pth_root(sumsq, 2.0)
    return jnp.where(bad, cond(jnp.any(bad), scaled, lambda _: plain, None), plain), peak


class _JobRows:
    """The jobs' per-row results as ``(K, B)`` stacks: concatenated in job order
    (:meth:`concat`; a job's rows contiguous, :meth:`of_job`), then put in the arrays' order
    (:meth:`ordered`, ``where`` of :func:`plan_jobs`) by one gather."""

    def __init__(self, jobs: Sequence[Job], where: Sequence[Any], batch: int, dtype: Any):
        self.jobs, self.batch, self.dtype = jobs, batch, dtype
        self.counts = [int(np.prod(j.x.shape)) // (batch * j.n) for j in jobs]
        self.first = [int(f) for f in np.cumsum([0, *self.counts[:-1]])]
        self.order = [self.first[j] + (0 if row is None else row) for j, row in where]

    def concat(self, rs: Sequence[jax.Array]) -> jax.Array:
        parts = [jnp.reshape(r, (-1, self.batch)).astype(self.dtype) for r in rs]
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def of_job(self, stack: jax.Array, k: int) -> jax.Array:
        """Job ``k``'s rows of a job-ordered stack, in the shape of its keepdims results."""
        j = self.jobs[k]
        part = lax.slice_in_dim(stack, self.first[k], self.first[k] + self.counts[k])
        axes = range(j.x.ndim) if j.axes is None else [a % j.x.ndim for a in j.axes]
        return jnp.reshape(part, [1 if d in axes else n for d, n in enumerate(j.x.shape)])

    def ordered(self, stack: jax.Array) -> jax.Array:
        o = self.order
        return stack if o == list(range(len(o))) else stack[np.asarray(o)]


def _top(j: Job, sign: int) -> jax.Array:
    """The largest (``sign`` 1) or the smallest (-1) element of each slice of a job, in the
    array's own dtype (exact; for a complex job the largest ``|x|`` either way): the peak is the
    larger of the largest and the negated smallest, two plain reductions where ``|x|`` reduced
    in one pass is several times slower on XLA:CPU (see :data:`ROW_L2_STRATEGY`). NaN and inf
    kept."""
    if jnp.iscomplexobj(j.x):
        return j.max(abs_acc(j.x, j.acc))
    return j.max(j.x) if sign > 0 else j.min(j.x)


def _scaled_sumsq(j: Job, inverse: jax.Array) -> jax.Array:
    """``sum (x / s)^2`` over each slice of a job, ``inverse = 1 / s``: multiplied by the
    reciprocal, not divided, which XLA keeps as written and costs several times more an
    element."""
    return j.sum(abs_sq(scaled_abs(j.x, j.acc, None) * inverse.astype(j.acc), j.acc))


def _unit(peak: jax.Array) -> jax.Array:
    """The power of two just above ``peak`` (1 where ``peak`` is 0, inf or NaN), a constant for
    differentiation."""
    s = lax.stop_gradient(power_of_two(peak))
    return jnp.where(jnp.isfinite(s) & (s > 0), s, jnp.ones_like(s))
