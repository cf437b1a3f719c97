"""The engine: one fast pass, an overflow-safe fallback, and the entry points that\nmeasure many arrays at once (``global_norm``, ``slice_norms``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core.backend import per_backend
from gradclip_jax._core.control import cond
from gradclip_jax._core.norms._blue import blue_norms
from gradclip_jax._core.norms._reduce import (
    Combiner,
    Job,
    abs_acc,
    abs_sq,
    needs_guard,
    plan_jobs,
    pow_abs,
    power_of_two,
    pth_root,
    scaled_abs,
    stack_rows,
    tree_ones_like,
)
from gradclip_jax._core.norms._spec import UNDERFLOW_KINDS, NormSpec
from gradclip_jax._core.norms._trees import FlatTree, tree_acc_dtype


def _stat(job: Job, spec: NormSpec, scale: jax.Array | None, center: jax.Array | None) -> jax.Array:
    """The partial statistic of one job (sum-type kinds) before combination."""
    acc = job.acc
    k = spec.kind
    if k == "sum":
        return job.sum(scaled_abs(job.x, acc, scale))
    if k == "count":
        return job.sum((job.x != 0).astype(acc))
    if k in ("var", "std"):
        y = scaled_abs(job.x, acc, scale)
        if center is not None:
            y = y - center
        return job.sum(abs_sq(y, acc))
    y = scaled_abs(job.x, acc, scale)
    if k == "rms" or (k == "pow" and spec.p == 2.0):
        return job.sum(abs_sq(y, acc))
    if k == "mad":
        return job.sum(abs_acc(y, acc))
    a = abs_acc(y, acc)
    if scale is None:
        a = _guard_power_grad(a, spec.p)
    return job.sum(pow_abs(a, spec.p))


def _guard_power_grad(a: jax.Array, p: float) -> jax.Array:
    """Blocks the gradient of elements whose ``|x|^p`` derivative would overflow.

    ``d|x|^p = p |x|^(p-1)`` is infinite for huge ``|x|`` (p > 1) or tiny ``|x|``
    (p < 0). Such elements overflow the fast path's sum, so the fallback's scaled
    pass carries the gradient; without this guard the unused fast path would
    still contribute ``0 * inf = NaN``. The value is unchanged.
    """
    if 0.0 <= p <= 1.0:
        return a
    info = jnp.finfo(a.dtype)
    # edge = (max / (|p| + 1)) ** (1 / (p - 1)), in logs so float64 cannot overflow
    log_edge = (math.log(float(info.max)) - math.log(abs(p) + 1.0)) / (p - 1.0)
    if log_edge >= math.log(float(info.max)):
        return a
    edge = math.exp(log_edge)
    risky = a > edge if p > 1.0 else a < edge
    return jnp.where(risky, lax.stop_gradient(a), a)


def _finish(spec: NormSpec, s: jax.Array, n: Any) -> jax.Array:
    """Turns a (combined) partial statistic into the norm (before rescaling)."""
    k = spec.kind
    if k in ("count", "sum"):
        return s
    if k == "mad":
        return s / jnp.maximum(n, 1)
    if k == "rms":
        return pth_root(s / jnp.maximum(n, 1), 2.0)
    if k in ("var", "std"):
        var = jnp.where(n > 1, s / jnp.maximum(n - 1, 1), jnp.zeros_like(s))
        return var if k == "var" else pth_root(var, 2.0)
    return pth_root(s, spec.p)


def _inexact(s: jax.Array, n: Any, underflow: bool) -> jax.Array:
    """Elementwise: the sum ``s`` of ``n`` terms may have over- or (``underflow``) underflowed."""
    bad = ~jnp.isfinite(s)
    if underflow:
        info = jnp.finfo(s.dtype)
        # Each underflowed element loses less than `tiny`; below n*tiny/eps that loss
        # could exceed one ulp of the sum, so recompute in scaled units.
        thr = jnp.asarray(n, s.dtype) * (float(info.tiny) / float(info.eps))
        bad = bad | (s < thr)
    return bad


def _is_bad(spec: NormSpec, s: jax.Array, n: Any) -> jax.Array:
    """True where the fast path's statistic may have over- or underflowed."""
    underflow = spec.kind in UNDERFLOW_KINDS or (spec.kind == "pow" and spec.p != 1.0)
    return jnp.any(_inexact(s, n, underflow))


# Per backend, how sum-of-squares norms (``ord=2`` and ``'rms'``; the norm of
# every clip_by_global_norm) are kept free of overflow and underflow:
#
# * ``"cond"``: one fast pass; a ``lax.cond`` recomputes in units of max|x| when the
#   sum over- or underflowed. Cheapest on CPU, but on GPU the conditional copies its
#   predicate to the host and splits the program, and its untaken branch doubles
#   the compiled program.
# * ``"blue"``: one branch-free pass (Blue's three-accumulator algorithm): each
#   element's square goes, scaled by a fixed power of two, into a "big", "medium"
#   or "small" sum, computed by one variadic reduction per leaf; the sums combine
#   exactly on scalars. Same bytes as the fast pass, no conditional, no fallback
#   program; derivatives come from a custom JVP (``x / norm``, finite everywhere).
# * ``"blue-sums"``: the same with three plain sums per leaf (XLA may fuse them
#   into one multi-output reduction).
#
# Backends not listed use ``"cond"``. ``benchmarks/probe_norm_gpu.py`` times them.
SUMSQ_STRATEGY = {"cpu": "cond", "gpu": "cond", "cuda": "cond", "rocm": "cond"}
_SUMSQ_STRATEGIES = ("cond", "blue", "blue-sums")


def _sumsq_strategy() -> str:
    return per_backend(
        SUMSQ_STRATEGY, "gradclip_jax._core.norms.SUMSQ_STRATEGY", "cond", _SUMSQ_STRATEGIES
    )


def _is_sumsq(spec: NormSpec) -> bool:
    return spec.kind == "rms" or (spec.kind == "pow" and spec.p == 2.0)


def _compute(
    jobs: Sequence[Job],
    spec: NormSpec,
    combine: bool,
    axis_name: Any,
    dtype: np.dtype | None = None,
    branch_free: bool = False,
) -> tuple[Any, Any]:
    """Norms of ``jobs`` as ``(r, m)`` with norm ``= r * m``.

    ``r`` is a list of keepdims arrays, or one scalar when ``combine``; ``m`` (same
    structure) is the constant the overflow fallback divided by (exactly 1 on the
    fast path; ``var`` scales with ``m**2``, and ``r`` holds the other ``m``),
    returned apart so that a norm past the dtype's range can be told from a
    non-finite element (:func:`_overflowed`).
    """
    k = spec.kind
    comb = Combiner(dtype or tree_acc_dtype([j.x for j in jobs]), axis_name)

    # max / min / count cannot overflow: no fallback needed.
    if k == "max":
        parts = [j.max(abs_acc(j.x, j.acc)) for j in jobs]
        out = comb.max(parts) if combine else parts
        return out, tree_ones_like(out)
    if k == "min":
        parts = [j.min(abs_acc(j.x, j.acc)) for j in jobs]
        if not combine:
            return parts, tree_ones_like(parts)
        total = comb.min(parts)
        # an empty tree has no minimum: report 0 ("counts for nothing")
        n = comb.count(sum(j.n for j in jobs))
        total = jnp.where(jnp.asarray(n) > 0, total, jnp.zeros_like(total))
        return total, jnp.ones_like(total)
    if k == "count":
        parts = [_stat(j, spec, None, None) for j in jobs]
        out = comb.sum(parts) if combine else parts
        return out, tree_ones_like(out)
    strategy = ("blue" if branch_free else _sumsq_strategy()) if _is_sumsq(spec) else "cond"
    if strategy != "cond" and jobs:
        norms = blue_norms(jobs, comb, combine, variadic=strategy == "blue")
        if not combine:
            if k == "rms":
                norms = [nm / math.sqrt(max(j.n, 1)) for nm, j in zip(norms, jobs)]
            return norms, tree_ones_like(norms)
        n_tot = comb.count(sum(j.n for j in jobs))
        if k == "rms":
            norms = norms / jnp.sqrt(jnp.maximum(jnp.asarray(n_tot, norms.dtype), 1))
        norms = jnp.where(jnp.asarray(n_tot) > 0, norms, jnp.zeros_like(norms))
        return norms, jnp.ones_like(norms)

    def one_pass(scale: Any) -> tuple[Any, Any]:
        """Returns (norms, bad) for a given scale (None, or per-job / global)."""
        scales = scale if isinstance(scale, list) else [scale] * len(jobs)
        centers: list[Any] = [None] * len(jobs)
        if k in ("var", "std"):
            # two-pass variance: the mean first, then squared deviations
            means = [_stat(j, NormSpec("sum"), s, None) for j, s in zip(jobs, scales)]
            if combine:
                n_tot = comb.count(sum(j.n for j in jobs))
                mu = comb.sum(means) / jnp.maximum(n_tot, 1)
                centers = [mu.astype(j.acc) if not jnp.iscomplexobj(j.x) else mu for j in jobs]
            else:
                centers = [m / max(j.n, 1) for j, m in zip(jobs, means)]
        stats = [_stat(j, spec, s, c) for j, s, c in zip(jobs, scales, centers)]
        if combine:
            n = comb.count(sum(j.n for j in jobs))
            s = comb.sum(stats)
            return _finish(spec, s, n), _is_bad(spec, s, n)
        norms = [_finish(spec, s, j.n) for j, s in zip(jobs, stats)]
        bads = [_is_bad(spec, s, j.n) for j, s in zip(jobs, stats)]
        bad = jnp.any(jnp.stack(bads)) if bads else jnp.zeros((), bool)
        return norms, bad

    main, bad = one_pass(None)

    def fallback(main: Any) -> Any:
        # Rescale by about max|x| (min|x| for negative p) so no power over/underflows.
        # Every norm here is homogeneous (N(x) = m N(x/m)), so the scale is a
        # constant for differentiation; its own derivative would bring in 1/m^2,
        # which over- or underflows exactly in the cases this branch exists for.
        ms: Any
        if k == "pow" and spec.p < 0:
            ms = [j.min(abs_acc(j.x, j.acc)) for j in jobs]
            ms = comb.min(ms) if combine else ms
        else:
            ms = [j.max(abs_acc(j.x, j.acc)) for j in jobs]
            ms = comb.max(ms) if combine else ms
        ms = lax.stop_gradient(jax.tree_util.tree_map(power_of_two, ms))
        if combine:
            ok = jnp.isfinite(ms) & (ms > 0)
            safe_m = jnp.where(ok, ms, jnp.ones_like(ms))
            scaled, _ = one_pass(safe_m)
            if spec.kind == "var":  # var scales with m^2: one m in r (r * m may overflow alone)
                return jnp.where(ok, scaled * safe_m, main), safe_m
            return jnp.where(ok, scaled, main), safe_m
        oks = [jnp.isfinite(m) & (m > 0) for m in ms]
        safe = [jnp.where(o, m, jnp.ones_like(m)) for o, m in zip(oks, ms)]
        scaled, _ = one_pass(safe)
        if spec.kind == "var":
            return [jnp.where(o, r * m, mn) for o, r, m, mn in zip(oks, scaled, safe, main)], safe
        return [jnp.where(o, r, mn) for o, r, mn in zip(oks, scaled, main)], safe

    if not jobs:
        zero = jnp.zeros((), comb.dtype)
        return (zero, jnp.ones_like(zero)) if combine else (main, main)
    if _is_sumsq(spec) and not any(needs_guard(j) for j in jobs):
        r, m = main, tree_ones_like(main)  # float16 squares in float32 cannot over/underflow
    else:
        r, m = cond(bad, fallback, lambda mn: (mn, tree_ones_like(mn)), main)
    if combine:
        # an empty tree has norm 0 for every ord (for p < 0 the empty sum would give inf)
        n_tot = comb.count(sum(j.n for j in jobs))
        r = jnp.where(jnp.asarray(n_tot) > 0, r, jnp.zeros_like(r))
    return r, m


def global_norm(
    arrays: Sequence[jax.Array],
    spec: NormSpec,
    axis_name: Any = None,
    dtype: np.dtype | None = None,
) -> jax.Array:
    """One norm over all ``arrays`` (as if concatenated), in the accumulation dtype.

    ``axis_name`` combines the partial statistics across devices (``psum``/``pmax``)
    for leaves sharded by hand inside ``shard_map`` or ``pmap``.
    """
    r, m = _global_parts(arrays, spec, axis_name, dtype)
    return r * m


def global_norm_and_overflow(
    arrays: Sequence[jax.Array],
    spec: NormSpec,
    axis_name: Any = None,
    dtype: np.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`global_norm`, and whether it overflowed: every element finite, the norm
    past the dtype's range (reported ``inf``; see :func:`_overflowed`)."""
    r, m = _global_parts(arrays, spec, axis_name, dtype)
    norm = r * m
    return norm, _overflowed(r, m, norm)


def _global_parts(
    arrays: Sequence[jax.Array], spec: NormSpec, axis_name: Any, dtype: np.dtype | None
) -> tuple[Any, Any]:
    """:func:`_compute`'s ``(r, m)`` of the norm over all ``arrays``."""
    jobs, _ = plan_jobs(arrays, [None] * len(arrays), keepdims=False)
    return _compute(
        jobs, spec, combine=True, axis_name=axis_name, dtype=dtype or tree_acc_dtype(arrays)
    )


def _overflowed(r: jax.Array, m: jax.Array, norm: jax.Array) -> jax.Array:
    """Where the norm ``norm = r * m`` of finite elements is past the dtype's range.

    The fallback measures in units ``m`` of about max|x|, so ``r`` and ``m`` are
    finite exactly when every element is; an infinite or NaN element leaves the
    fast pass's non-finite ``r``. Only the product can then overflow. (With Blue's
    algorithm, :data:`SUMSQ_STRATEGY` ``"blue"``, ``m`` is 1 and an overflowed norm
    looks like an infinite element's.)
    """
    return jnp.isfinite(r) & jnp.isfinite(m) & ~jnp.isfinite(norm)


def slice_norms(
    arrays: Sequence[jax.Array],
    axes: Sequence[tuple[int, ...]],
    spec: NormSpec,
    then: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    branch_free: bool = False,
) -> Any:
    """Per-slice norms of each array over its ``axes``, with ``keepdims=True``.

    Every array's result broadcasts against the array; one ``lax.cond`` covers the
    overflow fallback of all of them.

    Args:
      arrays: the leaves.
      axes: each leaf's reduction axes.
      spec: the parsed ``ord``.
      then: optional elementwise function ``then(norms, overflowed)`` of the norms
        and where they overflowed (:func:`_overflowed`), for example a clip factor.
        It is applied to the packed norms of small leaves in one vectorized call,
        which keeps compile time flat for trees of thousands of small leaves.
      branch_free: 2-norms and ``'rms'`` by Blue's algorithm whatever the
        backend's :data:`SUMSQ_STRATEGY`: no conditional, for norms taken inside
        a loop body (a conditional there costs a host round trip per iteration
        on GPUs).

    Returns:
      The list of norms, or, with ``then``, a list of ``(norm, then(norm, overflowed))`` pairs.
    """
    jobs, where = plan_jobs(arrays, axes, keepdims=True)
    rs, ms = _compute(jobs, spec, combine=False, axis_name=None, branch_free=branch_free)
    norms = [r * m for r, m in zip(rs, ms)]
    derived = (
        [then(n, _overflowed(r, m, n)) for n, r, m in zip(norms, rs, ms)]
        if then is not None
        else norms
    )
    out = []
    for i, (x, (j, row)) in enumerate(zip(arrays, where)):
        n, d = norms[j], derived[j]
        if row is not None:  # a stacked job: row `row` holds this array's keepdims result
            n, d = n[row].reshape(_keep_shape(x, axes[i])), d[row].reshape(_keep_shape(x, axes[i]))
        out.append(n if then is None else (n, d))
    return out


def row_sums_of_squares(arrays: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Each array's sum of squares per row (axis 0), stacked, and where that sum is exact.

    The fast pass of the 2-norm alone, for a caller that keeps its own fallback (one for the
    whole program, not one per array): row ``k`` of the ``(K, B)`` results is ``arrays[k]``'s,
    in the arrays' common accumulation dtype. A sum is exact where it is finite and not below
    ``n * tiny / eps`` (``n`` the row's size): below that the squares lost to underflow may
    exceed one ulp of the sum, as the engine's own fallback decides (:func:`_inexact`);
    float16 squared in float32 can only fail on a non-finite element. Each array is reduced on its own: XLA compiles
    one kernel for all arrays of one shape, where stacking them first copies them.
    """
    jobs = [Job(x, tuple(range(1, x.ndim)), False) for x in arrays]
    dtype = np.dtype(jnp.result_type(*[j.acc for j in jobs]))
    sums, exact = [], []
    for j in jobs:
        s = jnp.sum(abs_sq(j.x, j.acc), axis=j.axes)
        sums.append(s.astype(dtype))
        exact.append(~_inexact(s, j.n, underflow=needs_guard(j)))
    return stack_rows(sums), stack_rows(exact)


def _keep_shape(x: jax.Array, axes: Any) -> tuple[int, ...]:
    """``x``'s shape with its reduction ``axes`` (``None``: all) kept as size 1."""
    red = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
    return tuple(1 if d in red else n for d, n in enumerate(x.shape))


def check_complex(fn: str, flat: FlatTree, spec: NormSpec) -> None:
    """A signed ``'sum'`` has no meaning for complex leaves: raise naming the leaf."""
    if spec.kind != "sum":
        return
    for i in flat.active:
        if jnp.iscomplexobj(flat.leaves[i]):
            raise TypeError(
                f"{fn}: ord='sum' is a signed sum and is not defined for the complex "
                f"leaf {jax.tree_util.keystr(flat.paths[i])}"
            )
