"""The largest batch a step fits in a device's memory, found by compiling (nothing run).

A step's footprint at batch ``B`` is read from ``memory_analysis()`` of its compiled program
(arguments, outputs and temporaries, less what donated arguments' outputs alias): the batch
doubles from 1 until it no longer fits, then bisects between the last that did and the first
that did not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from benchmarks.steps import fresh_state


def footprint_bytes(step: Callable, state: Any, data: Any) -> int:
    """What ``jax.jit(step)`` (state donated) holds on the device at its peak, by ``memory_analysis()``."""
    m = jax.jit(step, donate_argnums=0).lower(state, data).compile().memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def largest_batch(fits: Callable[[int], bool], cap: int = 1 << 16) -> int:
    """The largest ``B <= cap`` with ``fits(B)``, for a ``fits`` that holds up to some batch and not
    beyond (0 when ``fits(1)`` does not hold); ``fits`` is called O(log B) times."""
    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= cap and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, cap + 1)  # lo fits, hi does not (or is past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def device_limit_bytes(default: int) -> int:
    """The device's memory limit (``memory_stats()['bytes_limit']``), else ``default`` (the CPU has none)."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", default))


def max_batches(make_step: Callable[[Callable, int], Callable], model: Callable[[int], tuple[Any, Any, Any]],
                names: tuple[str, ...], limit: int, cap: int = 1 << 12) -> dict[str, int]:
    """Per step name, the largest batch whose compiled step fits in ``limit`` bytes.

    ``model(B)`` gives ``(losses, params, data)`` at batch ``B``; ``make_step(losses, B)`` the
    steps by name (:func:`benchmarks.cost_llama.llama_steps`' form).
    """
    out = {}
    for name in names:
        def fits(b: int, name: str = name) -> bool:
            losses, params, data = model(b)
            try:
                return footprint_bytes(make_step(losses, b)[name], fresh_state(params, 0), data) <= limit
            except Exception as err:  # a compiler that refuses the program for its size: does not fit
                if "RESOURCE_EXHAUSTED" in str(err) or "memory" in str(err).lower():
                    return False
                raise

        out[name] = largest_batch(fits, cap)
    return out
