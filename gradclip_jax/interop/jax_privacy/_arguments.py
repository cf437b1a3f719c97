"""The arguments shared by :func:`clipped_fun` and :func:`clipped_grad`: argument positions, the
batch size, padding, per-example keys and the sensitivity bound, each checked with errors
naming the argument."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core.validation import check_mask, is_int, static_value
from gradclip_jax.per_example.internal import batch_size_of, example_keys


def checked_argnums(fn: str, name: str, value: Any) -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints) as a tuple of distinct non-negative ints."""
    nums = (value,) if is_int(value) else value
    if not isinstance(nums, Sequence) or not all(is_int(n) for n in nums):
        raise TypeError(f"{fn}: `{name}` must be an int or a sequence of ints, got {value!r}")
    nums = tuple(int(n) for n in nums)
    if not nums:
        raise ValueError(f"{fn}: `{name}` must not be empty: name at least one argument")
    if min(nums) < 0:
        raise ValueError(f"{fn}: `{name}`={value!r} must be >= 0 (positions of the arguments)")
    if len(set(nums)) != len(nums):
        raise ValueError(f"{fn}: `{name}`={value!r} names an argument twice")
    return nums


def prng_argnum_of(fn: str, value: Any, taken: dict[str, tuple[int, ...]]) -> int | None:
    """``prng_argnum`` checked: None, or a non-negative int naming no argument in ``taken``."""
    value = static_value(fn, "prng_argnum", value)
    if value is None:
        return None
    if not is_int(value):
        raise TypeError(f"{fn}: `prng_argnum` must be None or an int, got {value!r}")
    if value < 0:
        raise ValueError(
            f"{fn}: `prng_argnum`={value} must be >= 0 (the position of the key argument)"
        )
    for name, nums in taken.items():
        if value in nums:
            raise ValueError(
                f"{fn}: prng_argnum={value} is also in {name}={nums}; the key argument is split "
                "into one key per example and must be neither differentiated nor batched"
            )
    return int(value)


def check_called(fn: str, args: Sequence[Any], **named: Any) -> None:
    """ValueError when an argument position named at construction is beyond the call's arguments."""
    for name, nums in named.items():
        top = max(nums) if isinstance(nums, tuple) else nums
        if top is not None and top >= len(args):
            raise ValueError(
                f"{fn}: {name}={nums} names argument {top}, but the function was called with "
                f"{len(args)} positional argument(s)"
            )


def common_batch_size(fn: str, batch_argnums: tuple[int, ...], args: Sequence[Any]) -> int:
    """The common size of axis 0 of the batch arguments; ValueError naming them when they differ."""
    sizes = {
        i: batch_size_of(args[i], f"{fn}: argument {i} (in batch_argnums)") for i in batch_argnums
    }
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"argument {i}: {s}" for i, s in sizes.items())
        raise ValueError(
            f"{fn}: Batch axis sizes differ ({listed}); every argument in "
            f"batch_argnums={batch_argnums} must have the same size on axis 0"
        )
    return sizes[batch_argnums[0]]


def padding_mask(fn: str, is_padding_example: Any, bsize: int) -> jax.Array:
    """``is_padding_example`` as a ``(B,)`` bool array (all False when None)."""
    if is_padding_example is None:
        return jnp.zeros((bsize,), jnp.bool_)
    shape = tuple(np.shape(is_padding_example))
    if shape != (bsize,):
        raise ValueError(
            f"{fn}: `is_padding_example` must have shape (B,) = ({bsize},) (the batch size of "
            f"the batch arguments), got {shape}"
        )
    return check_mask(fn, is_padding_example, bsize)  # type: ignore[return-value]


def keys_per_example(fn: str, key_arg: Any, bsize: int, prng_argnum: int) -> Any:
    """Each key of the ``prng_argnum`` argument split into ``bsize`` keys, one per example."""
    return jax.tree.map(lambda k: example_keys(k, bsize, prng_argnum, fn), key_arg)


def squeeze_axis_1(x: Any) -> Any:
    """Drops axis 1 when it has size 1: with ``keep_batch_dim`` a per-example aux of shape
    ``(1, ...)`` is stacked to ``(B, 1, ...)``; jax-privacy returns ``(B, ...)``."""
    if hasattr(x, "shape") and len(x.shape) >= 2 and x.shape[1] == 1:
        return jnp.squeeze(x, axis=1)
    return x


def check_callable(fn: str, name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{fn}: `{name}` must be callable, got {value!r}")
