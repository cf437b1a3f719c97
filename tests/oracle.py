"""An independent float64 NumPy statement of gradclip_jax's contract.

Used where the reference libraries have quirks we do not copy (QUIRK/BUG/EDGE
vectors): the test then checks our output against this oracle instead. It is
deliberately written differently from the package (plain NumPy, no scaling
tricks, no shared helpers) so the two can disagree.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ALIASES = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "l3": 3.0, "l4": 4.0, "linf": math.inf, "inf": math.inf}


def norm(x: np.ndarray, ord: Any, axes: tuple[int, ...] | None = None) -> np.ndarray:  # noqa: A002
    """Norm of ``x`` over ``axes`` (None: all), keepdims."""
    x = np.asarray(x)
    axes = tuple(range(x.ndim)) if axes is None else axes
    n = int(np.prod([x.shape[a] for a in axes])) if axes else 1
    a = np.abs(x)
    kd = {"axis": axes, "keepdims": True}
    if isinstance(ord, str) and ord not in ALIASES:
        if ord == "mad":
            return a.sum(**kd) / n
        if ord == "rms":
            return np.sqrt((a**2).sum(**kd) / n)
        if ord == "sum":
            return x.sum(**kd)
        if ord in ("var", "std"):
            if n < 2:
                return np.zeros_like(a.sum(**kd))
            v = x.var(ddof=1, **kd)
            return v if ord == "var" else np.sqrt(v)
        raise ValueError(ord)
    p = ALIASES[ord] if isinstance(ord, str) else float(ord)
    if p == math.inf:
        return a.max(**kd)
    if p == -math.inf:
        return a.min(**kd)
    if p == 0:
        return (x != 0).sum(**kd).astype(float)
    with np.errstate(divide="ignore"):
        return (a**p).sum(**kd) ** (1.0 / p)


def axes_for(ndim: int, dim: Any, inverse: bool) -> tuple[int, ...] | None:
    """Reduction axes under our rules; None when the leaf is left unchanged."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    picked = {d % ndim for d in dims if -ndim <= d < ndim}
    if inverse:
        picked = set(range(ndim)) - picked
    return tuple(sorted(picked)) or None


def _factor(n: np.ndarray, hi: Any, lo: Any, target: Any) -> np.ndarray:
    out = np.ones_like(n)
    good = np.isfinite(n) & (n > 0)
    if target is not None:
        return np.where(good, target / np.where(good, n, 1), 1)
    if hi is not None:
        out = np.where(good & (n > hi), hi / np.where(good, n, 1), out)
    if lo is not None:
        out = np.where(good & (n < lo), lo / np.where(good, n, 1), out)
    return out


def rescale(
    xs: list[np.ndarray],
    *,
    ord: Any = 2,  # noqa: A002
    dim: Any = None,
    inverse: bool = False,
    min_size: int = 1,
    hi: Any = None,
    lo: Any = None,
    target: Any = None,
) -> list[np.ndarray]:
    """clip_by_norm (hi/lo) or normalize (target) under our contract."""
    xs = [np.asarray(x, np.float64) for x in xs]
    if dim == "global":
        flat = np.concatenate([x.ravel() for x in xs]) if xs else np.zeros(0)
        n = norm(flat, ord).reshape(())
        f = _factor(n, hi, lo, target)
        return [x * f for x in xs]
    out = []
    for x in xs:
        ax = axes_for(x.ndim, dim, inverse)
        if ax is None or (int(np.prod([x.shape[a] for a in ax])) if ax else 1) < min_size:
            out.append(x)
            continue
        out.append(x * _factor(norm(x, ord, ax), hi, lo, target))
    return out


def centralize(
    xs: list[np.ndarray], dim: Any = None, inverse: bool = False, min_size: int = 2
) -> list[np.ndarray]:
    xs = [np.asarray(x, np.float64) for x in xs]
    if dim == "global":
        mean = np.concatenate([x.ravel() for x in xs]).mean()
        return [x - mean for x in xs]
    out = []
    for x in xs:
        ax = axes_for(x.ndim, dim, inverse)
        # a 0-d leaf (no axis) has nothing to centre over: unchanged whatever min_size
        if not ax or int(np.prod([x.shape[a] for a in ax])) < min_size:
            out.append(x)
            continue
        out.append(x - x.mean(axis=ax, keepdims=True))
    return out
