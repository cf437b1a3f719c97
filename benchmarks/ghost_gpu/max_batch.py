"""The largest batch a step fits in a device's memory, found by compiling (nothing run).

A step's footprint at batch ``B`` is read from ``memory_analysis()`` of its compiled program
(arguments, outputs and temporaries, less what donated arguments' outputs alias): the batch
doubles from 1 until it no longer fits, then bisects between the last that did and the first
that did not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from benchmarks.steps import fresh_state


def footprint_bytes(step: Callable, state: Any, data: Any) -> int:
    """What ``jax.jit(step)`` (state donated) holds on the device at its peak, by ``memory_analysis()``."""
    m = jax.jit(step, donate_argnums=0).lower(state, data).compile().memory_analysis()
    return int(
        m.temp_size_in_bytes
        + m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def largest_batch(
    fits: Callable[[int], bool],
    cap: int = 1 << 16,
    start: int = 1,
    give_up: Callable[[], bool] = lambda: False,
) -> tuple[int, bool]:
    """The largest ``B <= cap`` with ``fits(B)``, for a ``fits`` that holds up to some batch and not
    beyond (0 when ``fits(1)`` does not hold), and whether it is exact: the batch doubles from
    ``start`` (a guess saves compiles) and then bisects, O(log B) calls; once ``give_up()`` says so
    the search stops with the largest batch known to fit (a lower bound, ``False``)."""
    lo, hi = 0, cap + 1  # lo fits (0: trivially), hi does not (cap + 1: past the cap)
    b = max(1, min(start, cap))
    while b < hi:  # doubling
        if give_up():
            return lo, False
        if not fits(b):
            hi = b
            break
        lo, b = b, b * 2
    while hi - lo > 1:  # bisection
        if give_up():
            return lo, False
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, True


def device_limit_bytes(default: int) -> int:
    """The device's memory limit (``memory_stats()['bytes_limit']``), else ``default`` (the CPU has none)."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", default))


def max_batches(
    make_steps: Callable[[Callable, int, tuple[str, ...]], dict[str, Any]],
    model: Callable[[int], tuple[Any, Any, Any]],
    names: tuple[str, ...],
    limit: int,
    cap: int = 1 << 12,
    start: int = 1,
    deadline: float = float("inf"),
) -> dict[str, tuple[int, bool]]:
    """Per step name, the largest batch whose compiled step fits in ``limit`` bytes, and whether it
    is exact (:func:`largest_batch`; the search stops at ``deadline``, ``time.perf_counter()``'s).

    ``model(B)`` gives ``(losses, params, data)`` at batch ``B``; ``make_steps(losses, B, names)``
    the steps by name (:func:`benchmarks.variants.make_steps`' form).
    """
    out = {}
    for name in names:

        def fits(b: int, name: str = name) -> bool:
            losses, params, data = model(b)
            try:
                return (
                    footprint_bytes(
                        make_steps(losses, b, (name,))[name], fresh_state(params, 0), data
                    )
                    <= limit
                )
            except (
                Exception
            ) as err:  # a compiler that refuses the program for its size: does not fit
                if "RESOURCE_EXHAUSTED" in str(err) or "memory" in str(err).lower():
                    return False
                raise

        out[name] = largest_batch(fits, cap, start, give_up=lambda: time.perf_counter() > deadline)
    return out
