"""Blue's branch-free 2-norm: three sums of squares scaled by fixed powers of two."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core.norms._reduce import Combiner, Job, needs_guard, power_of_two, stack_rows


def _blue_consts(dtype: Any) -> tuple[float, float, float, float]:
    """``(t_big, s_big, t_small, s_small)`` powers of two for Blue's sums in ``dtype``.

    Elements above ``t_big`` are summed as ``(x * s_big)**2``, below ``t_small`` as
    ``(x * s_small)**2``, the rest as ``x**2``. The choice keeps every scaled square
    normal (no precision lost to underflow, also for subnormal inputs) and any sum
    of up to 2**48 squares finite; float32: 2**39, 2**-89, 2**-50, 2**89.
    """
    info = jnp.finfo(dtype)
    emax, emin = int(info.maxexp), int(info.minexp)
    b = (emax - 48) // 2 - 1
    sm = emin // 2 + 13
    return 2.0**b, 2.0 ** -(emax // 2 + 25), 2.0**sm, 2.0 ** (b - sm)


def _blue_squares(mag: jax.Array, acc: np.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each element's square from ``mag = |x|`` (in ``acc``), scaled into Blue's big, medium or
    small sum and zero in the other two."""
    zero = jnp.zeros((), acc)
    tb, sb, ts, ss = _blue_consts(acc)
    big, small = mag > tb, mag < ts
    # one per-element scale, squared with its element: a constant scale would let
    # XLA rewrite (x*c)**2 as x*x*(c*c), and c*c over- or underflows
    scale = jnp.where(
        big, jnp.asarray(sb, acc), jnp.where(small, jnp.asarray(ss, acc), jnp.ones((), acc))
    )
    u = mag * scale
    q = u * u
    return jnp.where(big, q, zero), jnp.where(big | small, zero, q), jnp.where(small, q, zero)


def _blue_parts(job: Job, variadic: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The job's (big, medium, small) scaled sums of squares, in its accumulation dtype."""
    acc = job.acc
    a = jnp.abs(job.x).astype(acc) if jnp.iscomplexobj(job.x) else job.x.astype(acc)
    zero = jnp.zeros((), acc)
    if not needs_guard(job):
        return zero, job.sum(a * a), zero
    qb, qm, qs = _blue_squares(jnp.abs(a), acc)
    if not variadic:
        return job.sum(qb), job.sum(qm), job.sum(qs)
    dims = tuple(range(a.ndim)) if job.axes is None else job.axes
    out = lax.reduce((qb, qm, qs), (zero, zero, zero), _add3, dims)
    if job.keepdims:
        out = tuple(jnp.expand_dims(o, dims) for o in out)
    return out


def _add3(p: tuple, q: tuple) -> tuple:
    # module-level: lax.reduce caches its traced reducer by function (a lambda made
    # per call is traced and compiled again on every eager call)
    return p[0] + q[0], p[1] + q[1], p[2] + q[2]


def _blue_finish(b: jax.Array, m: jax.Array, s: jax.Array) -> jax.Array:
    """The 2-norm from Blue's three sums (all in one dtype)."""
    _, sb, _, ss = _blue_consts(b.dtype)
    # each sum's own norm first (exact powers of two), then overflow-safe hypot: a
    # rescaled sum such as m * sb * sb would let XLA fold sb * sb, which underflows
    nb = jnp.sqrt(b) * jnp.asarray(1.0 / sb, b.dtype)
    ns = jnp.sqrt(s) * jnp.asarray(1.0 / ss, s.dtype)
    total = jnp.hypot(jnp.hypot(nb, jnp.sqrt(m)), ns)
    return jnp.where(jnp.isnan(m), m, total)  # NaN lands in the medium sum and wins


def _dot_over_norm(
    x: jax.Array, t: jax.Array, norm: jax.Array, job: Job
) -> tuple[jax.Array, jax.Array]:
    """``sum(Re(conj(x) t)) / norm`` over the job's axes without overflow (the 2-norm's JVP)."""
    acc = job.acc
    ok = (norm > 0) & jnp.isfinite(norm)
    p2 = power_of_two(norm)
    safe_p2 = jnp.where(ok, p2, jnp.ones_like(p2)).astype(acc)
    safe_c = jnp.where(ok, norm / jnp.where(ok, p2, jnp.ones_like(p2)), jnp.ones_like(norm))
    if jnp.iscomplexobj(x):
        xr, xi = jnp.real(x).astype(acc) / safe_p2, jnp.imag(x).astype(acc) / safe_p2
        prod = xr * jnp.real(t).astype(acc) + xi * jnp.imag(t).astype(acc)
    else:
        prod = (x.astype(acc) / safe_p2) * t.astype(acc)
    d = job.sum(prod).astype(norm.dtype) / safe_c
    return d, ok


def _finite_or_nan(d: jax.Array, norm: jax.Array) -> jax.Array:
    """A norm's derivative ``d`` where the norm is positive and finite; 0 at 0, else NaN."""
    ok = (norm > 0) & jnp.isfinite(norm)
    return jnp.where(
        ok, d, jnp.where(norm == 0, jnp.zeros_like(norm), jnp.full_like(norm, jnp.nan))
    )


def blue_norms(jobs: Sequence[Job], comb: Combiner, combine: bool, variadic: bool) -> Any:
    """2-norms of ``jobs`` (one scalar when ``combine``, else keepdims arrays), branch-free."""
    meta = [(j.axes, j.keepdims) for j in jobs]

    def value(xs: tuple) -> Any:
        parts = [_blue_parts(Job(x, *m), variadic) for m, x in zip(meta, xs)]
        if not combine:
            return [_blue_finish(*p) for p in parts]
        dt = comb.dtype
        tot: list[list[jax.Array]] = [[], [], []]
        for b, m, s in parts:
            if np.dtype(b.dtype) != dt:
                # another accumulation dtype (float32 leaves in a float64 norm): its
                # norm, rounded to dt, enters as one element
                v = _blue_finish(b, m, s).astype(dt)
                b, m, s = _blue_parts(Job(v, None, False), variadic=False)
            for acc_list, v in zip(tot, (b, m, s)):
                acc_list.append(v)
        sums = jnp.stack([jnp.sum(jnp.stack(t)) if t else jnp.zeros((), dt) for t in tot])
        if comb.axis_name is not None:
            sums = lax.psum(sums, comb.axis_name)
        return _blue_finish(sums[0], sums[1], sums[2])

    f = jax.custom_jvp(value)

    def jvp(primals: tuple, tangents: tuple) -> tuple:
        (xs,), (ts,) = primals, tangents
        out = f(xs)
        if not combine:
            outs = []
            for m, x, t, n in zip(meta, xs, ts, out):
                d, _ = _dot_over_norm(x, t, n, Job(x, *m))
                outs.append(_finite_or_nan(d, n))
            return out, outs
        ok = (out > 0) & jnp.isfinite(out)
        p2 = jnp.where(ok, power_of_two(out), jnp.ones_like(out))
        c = out / p2
        dots = []
        for m, x, t in zip(meta, xs, ts):
            acc = Job(x, *m).acc
            q = p2.astype(acc)
            if jnp.iscomplexobj(x):
                prod = (jnp.real(x).astype(acc) / q) * jnp.real(t).astype(acc) + (
                    jnp.imag(x).astype(acc) / q
                ) * jnp.imag(t).astype(acc)
            else:
                prod = (x.astype(acc) / q) * t.astype(acc)
            dots.append(jnp.sum(prod).astype(out.dtype))
        tot = jnp.sum(jnp.stack(dots))
        if comb.axis_name is not None:
            tot = lax.psum(tot, comb.axis_name)
        return out, _finite_or_nan(tot / jnp.where(ok, c, jnp.ones_like(c)), out)

    f.defjvp(jvp)
    return f(tuple(j.x for j in jobs))


def joint_row_norms(arrays: Sequence[jax.Array]) -> jax.Array:
    """The 2-norm of each example's slices of ``arrays`` taken together, ``(B,)``, branch-free.

    Each array has the batch on axis 0. Blue's three scaled sums of every array are
    added per example and finished once: ``K`` arrays cost ``K`` reductions and one
    finish, where a norm per array and their combination would cost ``K`` finishes
    (each two overflow-safe ``hypot``s, which XLA copies into every fusion that reads
    them: on a WRN-16-4 ghost step, half its HLO instructions). The derivative is
    ``sum(x t) / norm`` per example (finite everywhere). The joint norm of
    :func:`careful_row_norms` (its per-array norms are dropped as unused).
    """
    return careful_row_norms(arrays)[1]


def _row_parts(x: jax.Array, acc: np.dtype) -> tuple[jax.Array, ...]:
    """Blue's three scaled sums of squares of each row of ``x``: ``(B,)`` arrays from one
    variadic reduction (one kernel, one read of ``x``)."""
    a = jnp.abs(x).astype(acc) if jnp.iscomplexobj(x) else jnp.abs(x.astype(acc))
    zero = jnp.zeros((), acc)
    parts = _blue_squares(a, acc)  # (float16 rows all land in the medium sum)
    return lax.reduce(parts, (zero,) * 3, _add3, tuple(range(1, x.ndim)))  # type: ignore[no-any-return]


def careful_row_norms(arrays: Sequence[jax.Array]) -> tuple[Any, Any, Any]:
    """Per-row 2-norms of each array and of all together, and where each row is finite.

    For each array (batch on axis 0) one variadic reduction gives Blue's three sums of every
    row, so each array is read once whatever its values: the fallback of a plain sum of
    squares that over- or underflowed. Returns ``(norms, joint, finite)``: ``(K, B)`` norms
    of the ``K`` arrays, the ``(B,)`` norms of each example's rows taken together (the three
    sums added before one finish, as :func:`joint_row_norms`), both in the arrays' common
    accumulation dtype (``inf`` where a norm does not fit in it), and ``(K, B)`` bools: every
    element of the row is finite. Blue's sums of finite elements are finite (up to ``2**48``
    elements a row), so ``finite`` is read from them. The norms' derivative is
    ``sum(x t) / norm`` (finite everywhere).
    """
    accs = [Job(x, None, True).acc for x in arrays]
    dtype = np.dtype(jnp.result_type(*accs))

    def value(xs: tuple) -> tuple[Any, Any, Any]:
        parts = [_row_parts(x, acc) for x, acc in zip(xs, accs, strict=True)]
        b, m, s = (stack_rows([p[i].astype(dtype) for p in parts]) for i in range(3))
        joint = _blue_finish(jnp.sum(b, axis=0), jnp.sum(m, axis=0), jnp.sum(s, axis=0))
        return _blue_finish(b, m, s), joint, jnp.isfinite(b + m + s)

    f = jax.custom_jvp(value)

    def jvp(primals: tuple, tangents: tuple) -> tuple:
        (xs,), (ts,) = primals, tangents
        norms, joint, finite = out = f(xs)
        d_rows, d_joint = [], []
        for k, (x, t) in enumerate(zip(xs, ts, strict=True)):
            job, keep = Job(x, tuple(range(1, x.ndim)), True), (-1,) + (1,) * (x.ndim - 1)
            d, _ = _dot_over_norm(x, t, jnp.reshape(norms[k], keep), job)
            d_rows.append(jnp.reshape(d, (-1,)))
            d, _ = _dot_over_norm(x, t, jnp.reshape(joint, keep), job)
            d_joint.append(jnp.reshape(d, (-1,)))
        return out, (
            _finite_or_nan(stack_rows(d_rows), norms),
            _finite_or_nan(jnp.sum(stack_rows(d_joint), axis=0), joint),
            np.zeros(finite.shape, jax.dtypes.float0),
        )

    f.defjvp(jvp)
    return f(tuple(arrays))
