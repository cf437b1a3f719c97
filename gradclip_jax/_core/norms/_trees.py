"""Which leaves are measured, and in which accumulation dtype."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def acc_dtype(dtype: Any) -> np.dtype:
    """The dtype a norm of a leaf of ``dtype`` accumulates in (and is returned in)."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        dtype = np.finfo(dtype).dtype  # complex64 -> float32, complex128 -> float64
    if dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def sum_dtype(dtype: Any) -> np.dtype:
    """The dtype sums of leaves of ``dtype`` are formed and returned in (clipped sums, noise).

    The accumulation dtype, complex kept: float32 for 16-bit leaves, a complex
    dtype for complex leaves (whose norms accumulate in the real dtype).
    """
    return np.dtype(jnp.promote_types(dtype, acc_dtype(dtype)))


def _is_float0(x: Any) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def is_numeric_leaf(x: Any) -> bool:
    """True for a leaf the engine measures (not a ``float0`` placeholder)."""
    return not _is_float0(x)


def check_float_leaf(fn: str, path: Any, x: Any) -> jax.Array:
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


def promote_ints(tree: Any, *, bools: bool = False) -> Any:
    """Integer (and, with ``bools``, bool) leaves as the default float dtype, as optax computes them.

    For the functions that carry an optax name, which accept what optax accepts:
    optax's arithmetic promotes such leaves to float32 (float64 under x64).
    """

    def one(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is None or dtype == jax.dtypes.float0:
            return x
        if jax.dtypes.issubdtype(dtype, np.integer) or (bools and dtype == np.bool_):
            return jnp.asarray(x, float)
        return x

    return jax.tree_util.tree_map(one, tree)


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
        leaves[i] = check_float_leaf(fn, path, x)
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
