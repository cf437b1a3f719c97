"""Reductions: elementwise kernels, the plan of jobs (small leaves packed together), and\ncombining partial statistics across leaves and devices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax._core import jaxcompat
from gradclip_jax._core.norms._axes import reduced_size
from gradclip_jax._core.norms._spec import Axes
from gradclip_jax._core.norms._trees import acc_dtype


def _safe_nonzero(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s == 0, s with zeros replaced by 1)``: the double-``where`` trick.

    Only exact zeros are replaced, so NaN (and inf) flow through unchanged while the
    derivative at zero stays finite.
    """
    zero = s == 0
    return zero, jnp.where(zero, jnp.ones_like(s), s)


def pth_root(s: jax.Array, p: float) -> jax.Array:
    """``s ** (1/p)`` with finite derivatives at 0 (and ``0 -> inf`` for p < 0)."""
    if p == 1.0:
        return s
    zero, safe = _safe_nonzero(s)
    r = jnp.sqrt(safe) if p == 2.0 else safe ** (1.0 / p)
    return jnp.where(zero, jnp.zeros_like(s) if p > 0 else jnp.full_like(s, jnp.inf), r)


def abs_acc(x: jax.Array, acc: np.dtype) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.abs(x).astype(acc)
    return jnp.abs(x.astype(acc))


def abs_sq(x: jax.Array, acc: np.dtype) -> jax.Array:
    if jnp.iscomplexobj(x):
        re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
        return re * re + im * im
    y = x.astype(acc)
    return y * y


def pow_abs(a: jax.Array, p: float) -> jax.Array:
    """``|x| ** p`` from ``a = |x|`` with finite derivatives where it matters."""
    if p == 1.0:
        return a
    if p == 2.0:
        return a * a
    if p > 1.0:
        return a**p
    zero, safe = _safe_nonzero(a)
    fill = jnp.zeros_like(a) if p > 0 else jnp.full_like(a, jnp.inf)
    return jnp.where(zero, fill, safe**p)


def scaled_abs(x: jax.Array, acc: np.dtype, scale: jax.Array | None) -> jax.Array:
    """``x`` in its accumulation dtype, divided by ``scale`` when one is given."""
    y = x.astype(jnp.result_type(acc, jnp.complex64)) if jnp.iscomplexobj(x) else x.astype(acc)
    if scale is not None:
        y = y / scale.astype(acc)
    return y


# Leaves at most this large are stacked with their equals before reducing (see plan_jobs).
PACK_MAX_SIZE = 1 << 12
# Per backend, the largest small leaf that global mode concatenates into one
# buffer before reducing. On CPU one reduction of the concatenation compiles much
# faster than hundreds of tiny reductions and costs nothing at run time; on GPU
# XLA fuses the tiny reductions itself, and the concatenation is a kernel and a
# temporary buffer of its own, so it is off
# there. Backends not listed use PACK_MAX_SIZE. ``benchmarks/bench_core_gpu.py``
# times both settings.
GLOBAL_PACK_MAX_SIZE = {"cpu": PACK_MAX_SIZE, "gpu": 0, "cuda": 0, "rocm": 0}


def _global_pack_limit() -> int:
    return GLOBAL_PACK_MAX_SIZE.get(jax.default_backend(), PACK_MAX_SIZE)


@dataclasses.dataclass
class Job:
    """One reduction: an array reduced over ``axes`` (``None`` = all of it).

    Small leaves of equal size and dtype are stacked into one ``(k, n)`` job
    reduced over axis 1 (see :func:`plan_jobs`).
    """

    x: jax.Array
    axes: Axes
    keepdims: bool  # False: reduce to one scalar (global mode)

    @property
    def acc(self) -> np.dtype:
        return acc_dtype(self.x.dtype)

    @property
    def n(self) -> int:
        return reduced_size(self.x.shape, self.axes)

    def sum(self, v: jax.Array) -> jax.Array:
        if self.keepdims:
            return jnp.sum(v, axis=self.axes, keepdims=True)
        return jnp.sum(v)

    def max(self, v: jax.Array) -> jax.Array:
        if self.keepdims:
            return jnp.max(v, axis=self.axes, keepdims=True, initial=0.0)
        return jnp.max(v, initial=0.0)

    def min(self, v: jax.Array) -> jax.Array:
        if self.keepdims:
            return jnp.min(v, axis=self.axes, keepdims=True, initial=jnp.inf)
        return jnp.min(v, initial=jnp.inf)


def _type_spec(x: jax.Array) -> tuple:
    """The partition spec ``x``'s type carries (explicit sharding; empty or all ``None``
    otherwise)."""
    try:
        return tuple(jax.typeof(x).sharding.spec)
    except AttributeError:  # pragma: no cover - older jax
        return ()


def _replicated_type(x: jax.Array) -> bool:
    """False for a leaf whose type carries an explicit sharding over some mesh axis.

    Stacking such leaves would mix shardings (a ShardingTypeError under explicit
    sharding), so they are reduced on their own.
    """
    return all(s is None for s in _type_spec(x))


def stack_rows(parts: Sequence[jax.Array]) -> jax.Array:
    """``jnp.stack`` of per-row results ``(B,)`` of arrays whose batch axes may be placed
    differently under explicit sharding (a leaf's rows split over the mesh, another's
    replicated): each is resharded like the first one that is split, a local slice where it
    was replicated. Stacking mixed placements is a ``ShardingTypeError``."""
    specs = [_type_spec(p) for p in parts]
    first, target = next(
        ((p, s) for p, s in zip(parts, specs) if any(a is not None for a in s)), (None, None)
    )
    if target is not None:
        spec = jaxcompat.on_mesh_of(first, jax.sharding.PartitionSpec(*target))
        parts = [p if s == target else jax.sharding.reshard(p, spec) for p, s in zip(parts, specs)]
    return jnp.stack(parts)


# Arrays at most this large that are reduced over the same axes as others of their
# shape and dtype (per-example rows of bias and scale leaves, per-slice norms of
# equal leaves) are stacked and reduced as one (see plan_jobs).
SLICE_PACK_MAX_SIZE = 1 << 18


def plan_jobs(
    arrays: Sequence[jax.Array], axes: Sequence[Axes], keepdims: bool
) -> tuple[list[Job], list[Any]]:
    """Builds the reductions for ``arrays``; returns (jobs, where each result lives).

    XLA's compile time grows faster than linearly with the number of separate
    reductions (1000 small bf16 leaves took minutes), so whole-leaf reductions of
    small leaves with the same size and dtype are stacked into one ``(k, n)`` array
    and reduced over axis 1, and small arrays of one shape and dtype reduced over
    the same axes are stacked into one ``(k, *shape)`` array reduced over those
    axes shifted by one; copying small arrays costs next to nothing.
    ``where[i]`` is ``(job, None)`` for an array reduced on its own and ``(job, row)``
    for a stacked one.
    """
    jobs: list[Job] = []
    where: list[Any] = [None] * len(arrays)
    groups: dict[Any, list[int]] = {}
    slices: dict[Any, list[int]] = {}
    limit = PACK_MAX_SIZE if keepdims else _global_pack_limit()
    for i, (x, ax) in enumerate(zip(arrays, axes)):
        whole = ax is None or tuple(ax) == tuple(range(x.ndim))
        if whole and 0 < x.size <= limit and _replicated_type(x):
            # one norm per leaf: group equal sizes; one norm for all: any sizes
            groups.setdefault((np.dtype(x.dtype), x.size if keepdims else 0), []).append(i)
        elif keepdims and not whole and 0 < x.size <= SLICE_PACK_MAX_SIZE and _replicated_type(x):
            key_axes = tuple(sorted(a % x.ndim for a in ax))  # type: ignore[union-attr]
            slices.setdefault((np.dtype(x.dtype), tuple(x.shape), key_axes), []).append(i)
        else:
            where[i] = (len(jobs), None)
            jobs.append(Job(x, None if ax is None else tuple(ax), keepdims))
    for (_, _, ax), idx in slices.items():
        if len(idx) == 1:
            where[idx[0]] = (len(jobs), None)
            jobs.append(Job(arrays[idx[0]], ax, keepdims))
            continue
        for row, i in enumerate(idx):
            where[i] = (len(jobs), row)
        jobs.append(Job(jnp.stack([arrays[i] for i in idx]), tuple(a + 1 for a in ax), keepdims))
    for (_, size), idx in groups.items():
        if len(idx) == 1:
            i = idx[0]
            ax_i = axes[i]
            where[i] = (len(jobs), None)
            jobs.append(Job(arrays[i], None if ax_i is None else tuple(ax_i), keepdims))
            continue
        if not keepdims:  # global mode: one flat buffer, reduced whole
            for i in idx:
                where[i] = (len(jobs), None)
            jobs.append(Job(jnp.concatenate([arrays[i].ravel() for i in idx]), None, keepdims))
            continue
        stacked = jnp.stack([arrays[i].reshape(size) for i in idx])
        for row, i in enumerate(idx):
            where[i] = (len(jobs), row)
        jobs.append(Job(stacked, (1,), keepdims))
    return jobs, where


class Combiner:
    """Combines per-leaf partial statistics into one (global mode, psum'd)."""

    def __init__(self, dtype: np.dtype, axis_name: Any):
        self.dtype = dtype
        self.axis_name = axis_name

    def sum(self, parts: Sequence[jax.Array]) -> jax.Array:
        # complex parts (the mean of complex leaves) stay complex: their imaginary part counts
        dtype = jnp.result_type(self.dtype, *[p.dtype for p in parts])
        if parts:
            total = jnp.sum(jnp.stack([p.astype(dtype) for p in parts]))
        else:
            total = jnp.zeros((), self.dtype)
        if self.axis_name is not None:
            total = lax.psum(total, self.axis_name)
        return total

    def max(self, parts: Sequence[jax.Array]) -> jax.Array:
        total = (
            jnp.max(jnp.stack([p.astype(self.dtype) for p in parts]))
            if parts
            else jnp.zeros((), self.dtype)
        )
        if self.axis_name is not None:
            total = lax.pmax(total, self.axis_name)
        return total

    def min(self, parts: Sequence[jax.Array]) -> jax.Array:
        total = (
            jnp.min(jnp.stack([p.astype(self.dtype) for p in parts]))
            if parts
            else jnp.full((), jnp.inf, self.dtype)
        )
        if self.axis_name is not None:
            total = lax.pmin(total, self.axis_name)
        return total

    def count(self, n: int) -> Any:
        if self.axis_name is not None:
            return lax.psum(jnp.asarray(n, self.dtype), self.axis_name)
        return n


def tree_ones_like(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.ones_like, tree)


def power_of_two(m: jax.Array) -> jax.Array:
    """The power of two nearest above ``m``, clamped so its reciprocal is normal.

    Dividing by it is exact, and XLA may turn the division into a multiplication
    by the reciprocal without flushing it to zero (dividing by ``max|x|`` itself
    broke for ``max|x| > 8.5e37`` in float32, whose reciprocal is subnormal).
    Zero, inf and NaN pass through so the caller can recognise them.

    Read from the exponent bits (``2**floor(log2 m)`` is ``m`` with its mantissa
    cleared; a subnormal ``m`` gives 0 and is clamped up): a handful of
    operations where ``frexp``/``ldexp`` take about fifty, which every norm pays
    in trace and compile time.
    """
    info = jnp.finfo(m.dtype)
    uint = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(m.dtype).itemsize]
    exponent = np.asarray(((1 << int(info.nexp)) - 1) << int(info.nmant), uint)
    below = lax.bitcast_convert_type(lax.bitcast_convert_type(m, uint) & exponent, m.dtype)
    lo, hi = 2.0 ** (int(info.minexp) + 1), 2.0 ** (int(info.maxexp) - 2)
    p2 = jnp.clip(below * 2, jnp.asarray(lo, m.dtype), jnp.asarray(hi, m.dtype))
    return jnp.where(jnp.isfinite(m) & (m > 0), p2, m)


def needs_guard(job: Job) -> bool:
    """False for a leaf whose squares can neither overflow nor underflow the accumulator.

    float16 (max 65504, smallest subnormal 6e-8) squared and summed in float32 stays
    in float32's normal range for any realistic size, so its plain sum is exact.
    """
    return not (np.dtype(job.x.dtype) == np.float16 and job.acc == np.float32)
