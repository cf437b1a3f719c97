"""Shared benchmark helpers: interleaved A/B timing, rows, compiled memory."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def num_params(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two trees' leaves."""
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def block(x: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x
    )


def interleaved_ms(
    fns: dict[str, Callable[[], Any]],
    reps: int,
    warmup: int = 2,
    max_s: float = 60.0,
    rounds: dict[str, int] | None = None,
) -> dict[str, float]:
    """Median wall time (ms) of each thunk, timed round-robin so drift hits all alike.

    Every thunk must return something ``block_until_ready`` can wait on. Warm-up
    calls (compilation) are excluded. It stops after ``reps`` rounds, or after
    ``max_s`` seconds once two rounds are done; ``rounds`` (if given) receives the
    number of timed calls of each thunk.
    """
    for f in fns.values():
        for _ in range(warmup):
            block(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    start = time.perf_counter()
    for r in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            block(f())
            times[k].append(time.perf_counter() - t0)
        if r >= 1 and time.perf_counter() - start > max_s:  # at least two rounds
            break
    if rounds is not None:
        rounds.update({k: len(v) for k, v in times.items()})
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def row(
    group: str, name: str, ours_ms: float, baseline_ms: float, note: str = "", **extra: Any
) -> dict:
    return {
        "group": group,
        "name": name,
        "ours_ms": ours_ms,
        "baseline_ms": baseline_ms,
        "ratio": ours_ms / baseline_ms if baseline_ms else float("nan"),
        "note": note,
        **extra,
    }


def same_measurement(old_meta: dict[str, Any], meta: dict[str, Any]) -> bool:
    """Whether results saved under ``old_meta`` may be merged with new ones under ``meta``:
    the same model sizes on the same kind of device (an H100's steps beside an H200's would
    read as one machine's)."""
    return all(old_meta.get(k) == meta.get(k) for k in ("sizes", "device"))


def memory_mb(compiled: Any) -> tuple[float, float]:
    """``(temporaries, peak)`` of a compiled executable's ``memory_analysis()``, in MiB.

    The peak adds the arguments and outputs (parameters, batch, gradients) to
    the temporaries, less what outputs alias from donated arguments.
    """
    m = compiled.memory_analysis()
    peak = (
        m.temp_size_in_bytes
        + m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )
    return m.temp_size_in_bytes / 2**20, peak / 2**20


def compiled_mb(f: Callable[..., Any], *args: Any) -> tuple[float, float]:
    """``(temporaries, peak)`` of ``jax.jit(f)`` compiled for ``args``, in MiB (see :func:`memory_mb`)."""
    return memory_mb(jax.jit(f).lower(*args).compile())


def chain_step_ms(grads: Any, reps: int) -> dict[str, float]:
    """Median ms of one training step, ``chain(clip_by_global_norm(1.0), adamw(1e-4))`` then
    ``apply_updates``, with ours (``"ours"``) and optax's (``"optax"``) clip, interleaved."""
    import optax

    import gradclip_jax as gcx

    def step_fn(tx: Any) -> Callable[[Any, Any, Any], Any]:
        def step(p: Any, g: Any, s: Any) -> Any:
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.jit(step)

    params = jax.tree_util.tree_map(lambda x: x * 10, grads)
    steps, states = {}, {}
    for name, clip in (
        ("ours", gcx.clip_by_global_norm(1.0)),
        ("optax", optax.clip_by_global_norm(1.0)),
    ):
        tx = optax.chain(clip, optax.adamw(1e-4))
        steps[name], states[name] = step_fn(tx), tx.init(params)
    return interleaved_ms(
        {k: (lambda k=k: steps[k](params, grads, states[k])) for k in steps}, reps=reps
    )
