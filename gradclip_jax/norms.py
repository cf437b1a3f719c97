"""The norm engine: the single source of every norm in gradclip_jax.

Every transform, function and per-example clipper in the package measures through
this module, so a global norm always equals the norm of the concatenated leaves,
for every ``ord``, and every norm has the same numerical guarantees:

* **Accumulation.** 16-bit leaves (float16, bfloat16) accumulate in float32,
  float32 in float32 and float64 (under x64) in float64. Complex leaves use
  ``|x|`` and accumulate in their real dtype.
* **No overflow or underflow.** The fast path sums powers directly. When the
  sum is not finite or is so small that elements may have underflowed, one
  ``lax.cond`` recomputes with every element divided by ``max|x|`` (``min|x|``
  for negative ``p``), so fp16 values of 300 or float32 values of 1e30 give the
  right, finite norm. The predicate is a scalar, so the common case pays nothing.
  For 2-norms and ``'rms'`` a backend may instead use Blue's branch-free
  algorithm (three sums of squares scaled by fixed powers of two, one pass, no
  conditional): :data:`SUMSQ_STRATEGY` picks per backend; both give the same
  guarantees. float16 leaves need neither: their squares cannot over- or
  underflow float32.
* **Finite derivatives.** Roots and powers use the double-``where`` trick, so the
  gradient of a norm at zero is zero, never NaN.
* **Leaves.** ``None`` and :class:`optax.MaskedNode` are empty subtrees and count
  for nothing; ``float0`` leaves are skipped; integer and bool leaves raise a
  ``TypeError`` naming their path.

Supported ``ord`` values (see :func:`parse_ord`): any float ``p`` as
``torch.linalg.vector_norm`` defines it (``p != 0``: ``(sum |x|^p)^(1/p)``, negative
``p`` too; ``inf``: max|x|; ``-inf``: min|x|; ``0``: number of non-zeros), and the
strings ``'l0' 'l1' 'l2' 'l3' 'l4' 'linf'``, ``'mad'`` (mean |x|), ``'rms'``,
``'std'`` / ``'var'`` (unbiased; a one-element slice gives 0) and ``'sum'`` (signed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradclip_jax.hyperparams import is_traced, static_value

OrdLike = int | float | str
DimLike = None | int | Sequence[int] | str
Axes = tuple[int, ...] | None

__all__ = [
    "NormSpec",
    "OrdLike",
    "DimLike",
    "parse_ord",
    "tree_norm",
    "leaf_norms",
]

_STRING_ORDS = {
    "l0": 0.0,
    "l1": 1.0,
    "l2": 2.0,
    "l3": 3.0,
    "l4": 4.0,
    "linf": math.inf,
}
_STAT_ORDS = ("mad", "rms", "std", "var", "sum")
# kinds whose partial statistics are sums (and so combine across leaves by +)
_SUM_KINDS = ("pow", "count", "mad", "rms", "sum", "var", "std")
# kinds whose fast path can underflow (powers of small numbers)
_UNDERFLOW_KINDS = ("rms", "var", "std")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A parsed ``ord``.

    Attributes:
      kind: ``'pow'`` (a p-norm with ``p`` not 0 or +-inf), ``'max'``, ``'min'``,
        ``'count'``, ``'mad'``, ``'rms'``, ``'std'``, ``'var'`` or ``'sum'``.
      p: the exponent of a ``'pow'`` norm.
      label: the ``ord`` as the user wrote it, for messages.
    """

    kind: str
    p: float = 2.0
    label: str = "2"

    @property
    def signed(self) -> bool:
        """True when the "norm" can be negative (only ``'sum'``)."""
        return self.kind == "sum"


def parse_ord(ord: OrdLike | NormSpec, fn: str = "gradclip_jax") -> NormSpec:  # noqa: A002
    """Parses an ``ord`` argument.

    Args:
      ord: a number (``p``, ``inf``, ``-inf``, ``0``), one of the strings
        ``'l0' 'l1' 'l2' 'l3' 'l4' 'linf' 'mad' 'rms' 'std' 'var' 'sum'`` (case
        insensitive; ``'inf'`` and ``'-inf'`` are accepted too), or a
        :class:`NormSpec`.
      fn: the calling function's name, for error messages.

    Returns:
      The :class:`NormSpec`.

    Raises:
      ValueError: for an unknown string, NaN or a non-scalar.
      TypeError: for a traced ``ord`` or a non-number.
    """
    if isinstance(ord, NormSpec):
        return ord
    if is_traced(ord):
        static_value(fn, "ord", ord)  # raises the explanatory TypeError
    ord = static_value(fn, "ord", ord)  # noqa: A001
    if isinstance(ord, str):
        key = ord.strip().lower()
        if key in _STAT_ORDS:
            return NormSpec(kind=key, p=math.nan, label=key)
        if key in ("inf", "+inf", "infinity"):
            p = math.inf
        elif key in ("-inf", "-infinity"):
            p = -math.inf
        elif key in _STRING_ORDS:
            p = _STRING_ORDS[key]
        else:
            raise ValueError(
                f"{fn}: unknown ord {ord!r}; expected a number or one of "
                "'l0', 'l1', 'l2', 'l3', 'l4', 'linf', 'mad', 'rms', 'std', 'var', 'sum'"
            )
        label = key
    elif isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise TypeError(f"{fn}: ord must be a number or a string, got {ord!r}")
    else:
        p = float(ord)
        label = repr(ord)
        if math.isnan(p):
            raise ValueError(f"{fn}: ord must not be NaN")
    if p == math.inf:
        return NormSpec(kind="max", p=p, label=label)
    if p == -math.inf:
        return NormSpec(kind="min", p=p, label=label)
    if p == 0.0:
        return NormSpec(kind="count", p=p, label=label)
    return NormSpec(kind="pow", p=p, label=label)


# ----------------------------------------------------------------------------
# Leaves
# ----------------------------------------------------------------------------


def acc_dtype(dtype: Any) -> np.dtype:
    """The dtype a norm of a leaf of ``dtype`` accumulates in (and is returned in)."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        dtype = np.finfo(dtype).dtype  # complex64 -> float32, complex128 -> float64
    if dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _is_float0(x: Any) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def is_numeric_leaf(x: Any) -> bool:
    """True for a leaf the engine measures (not a ``float0`` placeholder)."""
    return not _is_float0(x)


def check_float_leaf(path: Any, x: Any, fn: str) -> jax.Array:
    """Returns ``x`` as an array, or raises ``TypeError`` naming the leaf's path."""
    if not hasattr(x, "dtype"):
        if isinstance(x, bool) or not isinstance(x, (int, float, complex)):
            raise TypeError(
                f"{fn}: leaf {jax.tree_util.keystr(path) or '<root>'} is {type(x).__name__} "
                f"{x!r}, not an array"
            )
        if isinstance(x, int):
            raise TypeError(
                f"{fn}: leaf {jax.tree_util.keystr(path) or '<root>'} is the integer {x!r}; "
                "norm-based functions need floating-point or complex leaves"
            )
        x = jnp.asarray(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # no numpy dtype: name the leaf here
        raise TypeError(
            f"{fn}: leaf {jax.tree_util.keystr(path) or '<root>'} is a PRNG key array; "
            "norm-based functions need floating-point or complex leaves"
        )
    dtype = np.dtype(x.dtype)
    if not (np.issubdtype(dtype, np.inexact) or dtype == jnp.bfloat16):
        raise TypeError(
            f"{fn}: leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}; "
            "norm-based functions need floating-point or complex leaves (cast it, or "
            "leave it out with optax.masked)"
        )
    return x


@dataclasses.dataclass
class FlatTree:
    """A flattened pytree split into measured leaves and pass-through leaves.

    Attributes:
      treedef: the tree structure.
      leaves: every leaf, in order.
      paths: every leaf's key path.
      active: indices (into ``leaves``) of the floating-point leaves to measure.
    """

    treedef: Any
    leaves: list[Any]
    paths: list[Any]
    active: list[int]

    @property
    def arrays(self) -> list[jax.Array]:
        """The measured leaves."""
        return [self.leaves[i] for i in self.active]

    def rebuild(self, new_active: Sequence[Any], fill: Any = "keep") -> Any:
        """A tree with the measured leaves replaced by ``new_active``.

        Pass-through leaves are kept (``fill='keep'``) or replaced by ``fill``.
        """
        out = list(self.leaves) if fill == "keep" else [fill] * len(self.leaves)
        for i, v in zip(self.active, new_active):
            out[i] = v
        return jax.tree_util.tree_unflatten(self.treedef, out)


def flatten(tree: Any, fn: str) -> FlatTree:
    """Flattens ``tree``, validating every leaf the engine will measure."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [p for p, _ in pairs]
    leaves = [x for _, x in pairs]
    active = []
    for i, (path, x) in enumerate(pairs):
        if _is_float0(x):
            continue
        leaves[i] = check_float_leaf(path, x, fn)
        active.append(i)
    return FlatTree(treedef=treedef, leaves=leaves, paths=paths, active=active)


def tree_acc_dtype(leaves: Sequence[Any]) -> np.dtype:
    """The common accumulation dtype of ``leaves`` (float32 when there are none).

    Leaves that are not floating point are ignored, so this is safe at ``init``.
    """
    dtypes = []
    for x in leaves:
        dtype = getattr(x, "dtype", None)
        if dtype is None or dtype == jax.dtypes.float0:
            continue
        dtype = np.dtype(dtype)
        if np.issubdtype(dtype, np.inexact) or dtype == jnp.bfloat16:
            dtypes.append(acc_dtype(dtype))
    if not dtypes:
        return np.dtype(jnp.zeros((), jnp.float32).dtype)
    return np.dtype(jnp.result_type(*dtypes))


# ----------------------------------------------------------------------------
# Axes
# ----------------------------------------------------------------------------


def check_dim(dim: DimLike, inverse_dims: bool, fn: str, allow_global: bool = True) -> DimLike:
    """Validates ``dim`` / ``inverse_dims`` at construction and normalises ``dim``."""
    dim = static_value(fn, "dim", dim)
    if isinstance(dim, str):
        if dim != "global" or not allow_global:
            allowed = "None, an int, a tuple of ints or 'global'" if allow_global else (
                "None, an int or a tuple of ints"
            )
            raise ValueError(f"{fn}: dim must be {allowed}, got {dim!r}")
        return dim
    if dim is None:
        if inverse_dims:
            raise ValueError(
                f"{fn}: inverse_dims=True needs dim (the axes to keep); with dim=None "
                "there would be no axis left to reduce"
            )
        return None
    if isinstance(dim, (int, np.integer)) and not isinstance(dim, bool):
        return (int(dim),)
    try:
        dims = tuple(static_value(fn, "dim", d) for d in dim)  # type: ignore[union-attr]
    except TypeError as err:
        raise TypeError(f"{fn}: dim must be None, an int or a tuple of ints, got {dim!r}") from err
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"{fn}: dim must be None, an int or a tuple of ints, got {dim!r}")
    return tuple(int(d) for d in dims)


def check_axes_exist(fn: str, shapes: Sequence[Sequence[int]], dim: DimLike) -> None:
    """``ValueError`` naming ``dim`` when no leaf has any of its axes.

    A leaf that lacks some of the axes is measured over those it has; one that
    lacks all of them is left unchanged. When *no* leaf has any of them, the
    ``dim`` is a mistake (``dim=5`` on matrices), not a choice.
    """
    if dim is None or isinstance(dim, str) or not shapes:
        return
    for shape in shapes:
        nd = len(shape)
        if any(-nd <= d < nd for d in dim):  # type: ignore[union-attr]
            return
    most = max(len(s) for s in shapes)
    raise ValueError(
        f"{fn}: no leaf has any of the axes dim={tuple(dim)} (the leaves have at most "  # type: ignore[arg-type]
        f"{most} axes), so nothing would be measured; pick axes the leaves have"
    )


def reduction_axes(
    shape: Sequence[int], dim: DimLike, inverse_dims: bool = False, min_size: int = 1
) -> Axes:
    """The axes of a leaf of ``shape`` that one norm reduces over.

    Args:
      shape: the leaf's shape.
      dim: ``None`` (the whole leaf), or a tuple of axes (negative axes count from
        this leaf's last axis; axes the leaf lacks are ignored).
      inverse_dims: reduce over every axis not in ``dim``.
      min_size: slices with fewer elements are left alone.

    Returns:
      A sorted tuple of axes, or ``None`` when the leaf is left unchanged (no axis to
      reduce, or slices smaller than ``min_size``).
    """
    ndim = len(shape)
    if dim is None:
        axes: tuple[int, ...] = tuple(range(ndim))
    else:
        assert not isinstance(dim, str)
        picked = set()
        for d in dim:  # type: ignore[union-attr]
            d = d + ndim if d < 0 else d
            if 0 <= d < ndim:
                picked.add(d)
        if inverse_dims:
            picked = set(range(ndim)) - picked
        axes = tuple(sorted(picked))
        if not axes:
            return None
    size = 1
    for a in axes:
        size *= shape[a]
    if size < min_size:
        return None
    return axes


def _size(shape: Sequence[int], axes: Axes) -> int:
    n = 1
    for a in range(len(shape)) if axes is None else axes:
        n *= shape[a]
    return n


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


def _safe_nonzero(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s == 0, s with zeros replaced by 1)``: the double-``where`` trick.

    Only exact zeros are replaced, so NaN (and inf) flow through unchanged while the
    derivative at zero stays finite.
    """
    zero = s == 0
    return zero, jnp.where(zero, jnp.ones_like(s), s)


def _root(s: jax.Array, p: float) -> jax.Array:
    """``s ** (1/p)`` with finite derivatives at 0 (and ``0 -> inf`` for p < 0)."""
    if p == 1.0:
        return s
    zero, safe = _safe_nonzero(s)
    r = jnp.sqrt(safe) if p == 2.0 else safe ** (1.0 / p)
    return jnp.where(zero, jnp.zeros_like(s) if p > 0 else jnp.full_like(s, jnp.inf), r)


def _abs(x: jax.Array, acc: np.dtype) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.abs(x).astype(acc)
    return jnp.abs(x.astype(acc))


def _abs_sq(x: jax.Array, acc: np.dtype) -> jax.Array:
    if jnp.iscomplexobj(x):
        re, im = jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
        return re * re + im * im
    y = x.astype(acc)
    return y * y


def _pow_abs(a: jax.Array, p: float) -> jax.Array:
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


def _scaled(x: jax.Array, acc: np.dtype, scale: jax.Array | None) -> jax.Array:
    """``x`` in its accumulation dtype, divided by ``scale`` when one is given."""
    y = x.astype(jnp.result_type(acc, jnp.complex64)) if jnp.iscomplexobj(x) else x.astype(acc)
    if scale is not None:
        y = y / scale.astype(acc)
    return y


# Leaves at most this large are stacked with their equals before reducing (see _plan).
PACK_MAX_SIZE = 1 << 12
# Per backend, the largest small leaf that global mode concatenates into one
# buffer before reducing. On CPU one reduction of the concatenation compiles much
# faster than hundreds of tiny reductions and costs nothing at run time; on GPU
# XLA fuses the tiny reductions itself, and the concatenation is a kernel and a
# temporary buffer of its own (1.8 MiB on a GPT-2-XL-shaped tree), so it is off
# there. Backends not listed use PACK_MAX_SIZE. ``benchmarks/bench_core_gpu.py``
# times both settings.
GLOBAL_PACK_MAX_SIZE = {"cpu": PACK_MAX_SIZE, "gpu": 0, "cuda": 0, "rocm": 0}


def _global_pack_limit() -> int:
    return GLOBAL_PACK_MAX_SIZE.get(jax.default_backend(), PACK_MAX_SIZE)


@dataclasses.dataclass
class _Job:
    """One reduction: an array reduced over ``axes`` (``None`` = all of it).

    Small leaves of equal size and dtype are stacked into one ``(k, n)`` job
    reduced over axis 1 (see :func:`_plan`).
    """

    x: jax.Array
    axes: Axes
    keepdims: bool  # False: reduce to one scalar (global mode)

    @property
    def acc(self) -> np.dtype:
        return acc_dtype(self.x.dtype)

    @property
    def n(self) -> int:
        return _size(self.x.shape, self.axes)

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


def _replicated_type(x: jax.Array) -> bool:
    """False for a leaf whose type carries an explicit sharding over some mesh axis.

    Stacking such leaves would mix shardings (a ShardingTypeError under explicit
    sharding), so they are reduced on their own.
    """
    try:
        spec = jax.typeof(x).sharding.spec
    except AttributeError:  # pragma: no cover - older jax
        return True
    return all(s is None for s in spec)


def _plan(arrays: Sequence[jax.Array], axes: Sequence[Axes], keepdims: bool) -> tuple[list[_Job], list[Any]]:
    """Builds the reductions for ``arrays``; returns (jobs, where each result lives).

    XLA's compile time grows faster than linearly with the number of separate
    reductions (1000 small bf16 leaves took minutes), so whole-leaf reductions of
    small leaves with the same size and dtype are stacked into one ``(k, n)`` array
    and reduced over axis 1; copying small leaves costs next to nothing.
    ``where[i]`` is ``(job, None)`` for a leaf reduced on its own and ``(job, row)``
    for a stacked one.
    """
    jobs: list[_Job] = []
    where: list[Any] = [None] * len(arrays)
    groups: dict[Any, list[int]] = {}
    limit = PACK_MAX_SIZE if keepdims else _global_pack_limit()
    for i, (x, ax) in enumerate(zip(arrays, axes)):
        whole = ax is None or tuple(ax) == tuple(range(x.ndim))
        if whole and 0 < x.size <= limit and _replicated_type(x):
            # one norm per leaf: group equal sizes; one norm for all: any sizes
            groups.setdefault((np.dtype(x.dtype), x.size if keepdims else 0), []).append(i)
        else:
            where[i] = (len(jobs), None)
            jobs.append(_Job(x, None if ax is None else tuple(ax), keepdims))
    for (_, size), idx in groups.items():
        if len(idx) == 1:
            i = idx[0]
            ax_i = axes[i]
            where[i] = (len(jobs), None)
            jobs.append(_Job(arrays[i], None if ax_i is None else tuple(ax_i), keepdims))
            continue
        if not keepdims:  # global mode: one flat buffer, reduced whole
            for i in idx:
                where[i] = (len(jobs), None)
            jobs.append(_Job(jnp.concatenate([arrays[i].ravel() for i in idx]), None, keepdims))
            continue
        stacked = jnp.stack([arrays[i].reshape(size) for i in idx])
        for row, i in enumerate(idx):
            where[i] = (len(jobs), row)
        jobs.append(_Job(stacked, (1,), keepdims))
    return jobs, where


def _stat(job: _Job, spec: NormSpec, scale: jax.Array | None, center: jax.Array | None) -> jax.Array:
    """The partial statistic of one job (sum-type kinds) before combination."""
    acc = job.acc
    k = spec.kind
    if k == "sum":
        return job.sum(_scaled(job.x, acc, scale))
    if k == "count":
        return job.sum((job.x != 0).astype(acc))
    if k in ("var", "std"):
        y = _scaled(job.x, acc, scale)
        if center is not None:
            y = y - center
        return job.sum(_abs_sq(y, acc))
    y = _scaled(job.x, acc, scale)
    if k == "rms" or (k == "pow" and spec.p == 2.0):
        return job.sum(_abs_sq(y, acc))
    if k == "mad":
        return job.sum(_abs(y, acc))
    a = _abs(y, acc)
    if scale is None:
        a = _guard_power_grad(a, spec.p)
    return job.sum(_pow_abs(a, spec.p))


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


class _Combiner:
    """Combines per-leaf partial statistics into one (global mode, psum'd)."""

    def __init__(self, dtype: np.dtype, axis_name: Any):
        self.dtype = dtype
        self.axis_name = axis_name

    def sum(self, parts: Sequence[jax.Array]) -> jax.Array:
        if parts:
            total = jnp.sum(jnp.stack([p.astype(self.dtype) for p in parts]))
        else:
            total = jnp.zeros((), self.dtype)
        if self.axis_name is not None:
            total = lax.psum(total, self.axis_name)
        return total

    def max(self, parts: Sequence[jax.Array]) -> jax.Array:
        total = jnp.max(jnp.stack([p.astype(self.dtype) for p in parts])) if parts else jnp.zeros((), self.dtype)
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


def _finish(spec: NormSpec, s: jax.Array, n: Any) -> jax.Array:
    """Turns a (combined) partial statistic into the norm (before rescaling)."""
    k = spec.kind
    if k in ("count", "sum"):
        return s
    if k == "mad":
        return s / jnp.maximum(n, 1)
    if k == "rms":
        return _root(s / jnp.maximum(n, 1), 2.0)
    if k in ("var", "std"):
        var = jnp.where(n > 1, s / jnp.maximum(n - 1, 1), jnp.zeros_like(s))
        return var if k == "var" else _root(var, 2.0)
    return _root(s, spec.p)


def _is_bad(spec: NormSpec, s: jax.Array, n: Any) -> jax.Array:
    """True where the fast path's statistic may have over- or underflowed."""
    bad = ~jnp.isfinite(s)
    underflow = spec.kind in _UNDERFLOW_KINDS or (spec.kind == "pow" and spec.p != 1.0)
    if underflow:
        info = jnp.finfo(s.dtype)
        # Each underflowed element loses less than `tiny`; below n*tiny/eps that loss
        # could exceed one ulp of the sum, so recompute in scaled units.
        thr = jnp.asarray(n, s.dtype) * (float(info.tiny) / float(info.eps))
        bad = bad | (s < thr)
    return jnp.any(bad)


def _ones_like(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.ones_like, tree)


def _power_of_two(m: jax.Array) -> jax.Array:
    """The power of two nearest above ``m``, clamped so its reciprocal is normal.

    Dividing by it is exact, and XLA may turn the division into a multiplication
    by the reciprocal without flushing it to zero (dividing by ``max|x|`` itself
    broke for ``max|x| > 8.5e37`` in float32, whose reciprocal is subnormal).
    Zero, inf and NaN pass through so the caller can recognise them.
    """
    info = jnp.finfo(m.dtype)
    _, e = jnp.frexp(m)
    e = jnp.clip(e, int(info.minexp) + 1, int(info.maxexp) - 2)
    p2 = jnp.ldexp(jnp.ones_like(m), e)
    return jnp.where(jnp.isfinite(m) & (m > 0), p2, m)


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
    name = SUMSQ_STRATEGY.get(jax.default_backend(), "cond")
    if name not in _SUMSQ_STRATEGIES:
        raise ValueError(f"gradclip_jax.norms.SUMSQ_STRATEGY: unknown strategy {name!r}; "
                         f"expected one of {_SUMSQ_STRATEGIES}")
    return name


def _is_sumsq(spec: NormSpec) -> bool:
    return spec.kind == "rms" or (spec.kind == "pow" and spec.p == 2.0)


def _needs_guard(job: _Job) -> bool:
    """False for a leaf whose squares can neither overflow nor underflow the accumulator.

    float16 (max 65504, smallest subnormal 6e-8) squared and summed in float32 stays
    in float32's normal range for any realistic size, so its plain sum is exact.
    """
    return not (np.dtype(job.x.dtype) == np.float16 and job.acc == np.float32)


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


def _blue_parts(job: _Job, variadic: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The job's (big, medium, small) scaled sums of squares, in its accumulation dtype."""
    acc = job.acc
    a = jnp.abs(job.x).astype(acc) if jnp.iscomplexobj(job.x) else job.x.astype(acc)
    zero = jnp.zeros((), acc)
    if not _needs_guard(job):
        return zero, job.sum(a * a), zero
    tb, sb, ts, ss = _blue_consts(acc)
    mag = jnp.abs(a)
    big, small = mag > tb, mag < ts
    # one per-element scale, squared with its element: a constant scale would let
    # XLA rewrite (x*c)**2 as x*x*(c*c), and c*c over- or underflows
    scale = jnp.where(big, jnp.asarray(sb, acc), jnp.where(small, jnp.asarray(ss, acc), jnp.ones((), acc)))
    u = a * scale
    q = u * u
    qb, qs = jnp.where(big, q, zero), jnp.where(small, q, zero)
    qm = jnp.where(big | small, zero, q)
    if not variadic:
        return job.sum(qb), job.sum(qm), job.sum(qs)
    dims = tuple(range(a.ndim)) if job.axes is None else job.axes
    out = lax.reduce(
        (qb, qm, qs), (zero, zero, zero),
        lambda p, q: (p[0] + q[0], p[1] + q[1], p[2] + q[2]), dims,
    )
    if job.keepdims:
        out = tuple(jnp.expand_dims(o, dims) for o in out)
    return out


def _blue_finish(b: jax.Array, m: jax.Array, s: jax.Array) -> jax.Array:
    """The 2-norm from Blue's three sums (all in one dtype)."""
    _, sb, _, ss = _blue_consts(b.dtype)
    # each sum's own norm first (exact powers of two), then overflow-safe hypot: a
    # rescaled sum such as m * sb * sb would let XLA fold sb * sb, which underflows
    nb = jnp.sqrt(b) * jnp.asarray(1.0 / sb, b.dtype)
    ns = jnp.sqrt(s) * jnp.asarray(1.0 / ss, s.dtype)
    total = jnp.hypot(jnp.hypot(nb, jnp.sqrt(m)), ns)
    return jnp.where(jnp.isnan(m), m, total)  # NaN lands in the medium sum and wins


def _dot_over_norm(x: jax.Array, t: jax.Array, norm: jax.Array, job: _Job) -> tuple[jax.Array, jax.Array]:
    """``sum(Re(conj(x) t)) / norm`` over the job's axes without overflow (the 2-norm's JVP)."""
    acc = job.acc
    ok = (norm > 0) & jnp.isfinite(norm)
    p2 = _power_of_two(norm)
    safe_p2 = jnp.where(ok, p2, jnp.ones_like(p2)).astype(acc)
    safe_c = jnp.where(ok, norm / jnp.where(ok, p2, jnp.ones_like(p2)), jnp.ones_like(norm))
    if jnp.iscomplexobj(x):
        xr, xi = jnp.real(x).astype(acc) / safe_p2, jnp.imag(x).astype(acc) / safe_p2
        prod = xr * jnp.real(t).astype(acc) + xi * jnp.imag(t).astype(acc)
    else:
        prod = (x.astype(acc) / safe_p2) * t.astype(acc)
    d = job.sum(prod).astype(norm.dtype) / safe_c
    return d, ok


def _blue_norms(jobs: Sequence[_Job], comb: _Combiner, combine: bool, variadic: bool) -> Any:
    """2-norms of ``jobs`` (one scalar when ``combine``, else keepdims arrays), branch-free."""
    meta = [(j.axes, j.keepdims) for j in jobs]

    def value(xs: tuple) -> Any:
        parts = [_blue_parts(_Job(x, *m), variadic) for m, x in zip(meta, xs)]
        if not combine:
            return [_blue_finish(*p) for p in parts]
        dt = comb.dtype
        tot: list[list[jax.Array]] = [[], [], []]
        for b, m, s in parts:
            if np.dtype(b.dtype) != dt:
                # another accumulation dtype (float32 leaves in a float64 norm): its
                # norm, rounded to dt, enters as one element
                v = _blue_finish(b, m, s).astype(dt)
                b, m, s = _blue_parts(_Job(v, None, False), variadic=False)
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
                d, ok = _dot_over_norm(x, t, n, _Job(x, *m))
                outs.append(jnp.where(ok, d, jnp.where(n == 0, jnp.zeros_like(n), jnp.full_like(n, jnp.nan))))
            return out, outs
        ok = (out > 0) & jnp.isfinite(out)
        p2 = jnp.where(ok, _power_of_two(out), jnp.ones_like(out))
        c = out / p2
        dots = []
        for m, x, t in zip(meta, xs, ts):
            acc = _Job(x, *m).acc
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
        d = tot / jnp.where(ok, c, jnp.ones_like(c))
        return out, jnp.where(ok, d, jnp.where(out == 0, jnp.zeros_like(out), jnp.full_like(out, jnp.nan)))

    f.defjvp(jvp)
    return f(tuple(j.x for j in jobs))


def _compute(
    jobs: Sequence[_Job], spec: NormSpec, combine: bool, axis_name: Any, dtype: np.dtype | None = None
) -> tuple[Any, Any]:
    """Norms of ``jobs`` as ``(r, m)`` with norm ``= r * m``.

    ``r`` is a list of keepdims arrays, or one scalar when ``combine``; ``m`` (same
    structure) is the constant the overflow fallback divided by (exactly 1 on the
    fast path), returned apart so that ``var`` (which scales with ``m**2``) and the
    rest share one code path.
    """
    k = spec.kind
    comb = _Combiner(dtype or tree_acc_dtype([j.x for j in jobs]), axis_name)

    # max / min / count cannot overflow: no fallback needed.
    if k == "max":
        parts = [j.max(_abs(j.x, j.acc)) for j in jobs]
        out = comb.max(parts) if combine else parts
        return out, _ones_like(out)
    if k == "min":
        parts = [j.min(_abs(j.x, j.acc)) for j in jobs]
        if not combine:
            return parts, _ones_like(parts)
        total = comb.min(parts)
        # an empty tree has no minimum: report 0 ("counts for nothing")
        n = comb.count(sum(j.n for j in jobs))
        total = jnp.where(jnp.asarray(n) > 0, total, jnp.zeros_like(total))
        return total, jnp.ones_like(total)
    if k == "count":
        parts = [_stat(j, spec, None, None) for j in jobs]
        out = comb.sum(parts) if combine else parts
        return out, _ones_like(out)
    strategy = _sumsq_strategy() if _is_sumsq(spec) else "cond"
    if strategy != "cond" and jobs:
        norms = _blue_norms(jobs, comb, combine, variadic=strategy == "blue")
        if not combine:
            if k == "rms":
                norms = [nm / math.sqrt(max(j.n, 1)) for nm, j in zip(norms, jobs)]
            return norms, _ones_like(norms)
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
            ms = [j.min(_abs(j.x, j.acc)) for j in jobs]
            ms = comb.min(ms) if combine else ms
        else:
            ms = [j.max(_abs(j.x, j.acc)) for j in jobs]
            ms = comb.max(ms) if combine else ms
        ms = lax.stop_gradient(jax.tree_util.tree_map(_power_of_two, ms))
        if combine:
            ok = jnp.isfinite(ms) & (ms > 0)
            safe_m = jnp.where(ok, ms, jnp.ones_like(ms))
            scaled, _ = one_pass(safe_m)
            if spec.kind == "var":  # var scales with m^2: report it in one piece
                return jnp.where(ok, scaled * safe_m * safe_m, main), jnp.ones_like(main)
            return jnp.where(ok, scaled, main), safe_m
        oks = [jnp.isfinite(m) & (m > 0) for m in ms]
        safe = [jnp.where(o, m, jnp.ones_like(m)) for o, m in zip(oks, ms)]
        scaled, _ = one_pass(safe)
        if spec.kind == "var":
            return [jnp.where(o, r * m * m, mn) for o, r, m, mn in zip(oks, scaled, safe, main)], _ones_like(main)
        return [jnp.where(o, r, mn) for o, r, mn in zip(oks, scaled, main)], safe

    if not jobs:
        zero = jnp.zeros((), comb.dtype)
        return (zero, jnp.ones_like(zero)) if combine else (main, main)
    if _is_sumsq(spec) and not any(_needs_guard(j) for j in jobs):
        r, m = main, _ones_like(main)  # float16 squares in float32 cannot over/underflow
    else:
        r, m = lax.cond(bad, fallback, lambda mn: (mn, _ones_like(mn)), main)
    if combine:
        # an empty tree has norm 0 for every ord (for p < 0 the empty sum would give inf)
        n_tot = comb.count(sum(j.n for j in jobs))
        r = jnp.where(jnp.asarray(n_tot) > 0, r, jnp.zeros_like(r))
    return r, m


def global_norm(
    arrays: Sequence[jax.Array], spec: NormSpec, axis_name: Any = None, dtype: np.dtype | None = None
) -> jax.Array:
    """One norm over all ``arrays`` (as if concatenated), in the accumulation dtype.

    ``axis_name`` combines the partial statistics across devices (``psum``/``pmax``)
    for leaves sharded by hand inside ``shard_map`` or ``pmap``.
    """
    jobs, _ = _plan(arrays, [None] * len(arrays), keepdims=False)
    r, m = _compute(jobs, spec, combine=True, axis_name=axis_name, dtype=dtype or tree_acc_dtype(arrays))
    return r * m


def slice_norms(
    arrays: Sequence[jax.Array],
    axes: Sequence[tuple[int, ...]],
    spec: NormSpec,
    then: Callable[[jax.Array], jax.Array] | None = None,
) -> Any:
    """Per-slice norms of each array over its ``axes``, with ``keepdims=True``.

    Every array's result broadcasts against the array; one ``lax.cond`` covers the
    overflow fallback of all of them.

    Args:
      arrays: the leaves.
      axes: each leaf's reduction axes.
      spec: the parsed ``ord``.
      then: optional elementwise function of the norms (for example a clip factor).
        It is applied to the packed norms of small leaves in one vectorized call,
        which keeps compile time flat for trees of thousands of small leaves.

    Returns:
      The list of norms, or, with ``then``, a list of ``(norm, then(norm))`` pairs.
    """
    jobs, where = _plan(arrays, axes, keepdims=True)
    rs, ms = _compute(jobs, spec, combine=False, axis_name=None)
    norms = [r * m for r, m in zip(rs, ms)]
    derived = [then(n) for n in norms] if then is not None else norms
    out = []
    for x, (j, row) in zip(arrays, where):
        n, d = norms[j], derived[j]
        if row is not None:
            n, d = n[row].reshape((1,) * x.ndim), d[row].reshape((1,) * x.ndim)
        out.append(n if then is None else (n, d))
    return out


def check_complex(flat: FlatTree, spec: NormSpec, fn: str) -> None:
    """A signed ``'sum'`` has no meaning for complex leaves: raise naming the leaf."""
    if spec.kind != "sum":
        return
    for i in flat.active:
        if jnp.iscomplexobj(flat.leaves[i]):
            raise TypeError(
                f"{fn}: ord='sum' is a signed sum and is not defined for the complex "
                f"leaf {jax.tree_util.keystr(flat.paths[i])}"
            )


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


def tree_norm(tree: Any, ord: OrdLike = 2, *, axis_name: Any = None) -> jax.Array:  # noqa: A002
    """The global norm of a pytree: the norm of all its leaves concatenated.

    .. math:: \\|g\\|_p = \\Big(\\sum_{\\text{leaves } i} \\sum_j |g_{ij}|^p\\Big)^{1/p}

    and the corresponding definition for the other ``ord`` values (see
    :func:`parse_ord`). 16-bit leaves accumulate in float32; the result is finite
    whenever every element is finite; an empty tree has norm 0.

    Args:
      tree: a pytree of floating-point or complex arrays (``None``,
        :class:`optax.MaskedNode` and ``float0`` leaves count for nothing).
      ord: which norm (default 2, the Euclidean norm).
      axis_name: inside ``shard_map`` / ``pmap``, the axis over which the leaves are
        sharded by hand; partial norms are combined across it.

    Returns:
      A scalar in the accumulation dtype (float32, or float64 for float64 leaves).

    Raises:
      TypeError: for an integer or bool leaf (the message names its path).
      ValueError: for an unknown ``ord``.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> float(gcx.tree_norm({'a': jnp.array([3.0]), 'b': jnp.array([4.0])}))
      5.0
      >>> float(gcx.tree_norm([jnp.full(4, 300.0, jnp.float16)]))  # no fp16 overflow
      600.0
    """
    spec = parse_ord(ord, "tree_norm")
    flat = flatten(tree, "tree_norm")
    check_complex(flat, spec, "tree_norm")
    return global_norm(flat.arrays, spec, axis_name)


def leaf_norms(
    tree: Any,
    ord: OrdLike = 2,  # noqa: A002
    dim: DimLike = None,
    inverse_dims: bool = False,
    *,
    keepdims: bool = False,
) -> Any:
    """Per-leaf (or per-slice) norms, as a tree of the same structure.

    Args:
      tree: a pytree of floating-point or complex arrays.
      ord: which norm (see :func:`parse_ord`).
      dim: ``None`` for one norm per leaf, or an int / tuple of axes to reduce
        over (negative axes count from each leaf's last axis). A leaf that lacks
        some of the axes is measured over those it has; a leaf that has none of
        them gets ``None``; when no leaf has any of them, ``ValueError``.
      inverse_dims: reduce over every axis *not* in ``dim``.
      keepdims: keep the reduced axes with size 1 (so the result broadcasts
        against the leaf).

    Returns:
      A tree whose leaves are the norms (shape of the leaf with the reduced axes
      removed, or kept with size 1), in the accumulation dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> import gradclip_jax as gcx
      >>> gcx.leaf_norms({'w': jnp.array([[3.0, 0.0], [4.0, 1.0]])}, dim=0)
      {'w': Array([5., 1.], dtype=float32)}
    """
    spec = parse_ord(ord, "leaf_norms")
    d = check_dim(dim, inverse_dims, "leaf_norms", allow_global=False)
    flat = flatten(tree, "leaf_norms")
    check_complex(flat, spec, "leaf_norms")
    check_axes_exist("leaf_norms", [x.shape for x in flat.arrays], d)
    arrays, axes, where = [], [], []
    for pos, x in enumerate(flat.arrays):
        ax = reduction_axes(x.shape, d, inverse_dims)
        if ax is not None:
            arrays.append(x)
            axes.append(ax)
            where.append(pos)
    norms = slice_norms(arrays, axes, spec)
    out: list[Any] = [None] * len(flat.active)
    for pos, ax, nrm in zip(where, axes, norms):
        out[pos] = nrm if keepdims else jnp.squeeze(nrm, axis=ax)
    return flat.rebuild(out, fill=None)
