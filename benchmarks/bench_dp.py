"""Benchmark: per-example (DP-SGD) clipped gradients.

MLP 784-512-512-10 (669,706 parameters), softmax cross-entropy, float32, at batch
sizes 32, 128 and 512 (32 and 128 with ``quick=True``). For each batch size it
times, interleaved (one call of each function per round), medians over rounds,
``block_until_ready``, compile excluded:

* ``ours``: ``gradclip_jax.clipped_grad(loss, C, method='vmap')``;
* ``hand``: hand-written ``jax.vmap(jax.grad(...))`` + ``optax.per_example_global_norm_clip``;
* ``nonprivate``: ``jax.grad`` of the summed loss (no clipping);
* ``jax_privacy``: ``jax_privacy.clipped_grad`` when the package is importable
  (skipped otherwise; it is not a dependency). On CPU it takes seconds per call,
  so it is timed separately with at most 3 repetitions, next to ``dropin``: the
  same call through ``gradclip_jax.interop.jax_privacy.clipped_grad`` (its
  signature, ``method='auto'``). The drop-in row (ratio drop-in / jax-privacy,
  with the largest difference of the two sums) is also measured on the other CPU
  model of the benchmarks, ``bench_ghost``'s transformer LM (2 layers, width 128,
  sequence 64), at batch sizes 32 and 128 (32 with ``quick``). On both models (B=32) the
  drop-in's first call (trace, lower, compile, one run of a fresh jitted function) is timed
  against jax-privacy's: what a notebook user waits for.

and, at one batch size, the compiled temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``) of
``clipped_grad`` for shrinking ``microbatch_size``, next to the hand-written path.

Rows: ``{"group": "dp", "name", "ours_ms", "baseline_ms", "ratio", "note"}``
(``ratio = ours_ms / baseline_ms``); memory rows add ``ours_mb`` / ``baseline_mb``.

Run alone: ``python -m benchmarks.bench_dp`` (``--quick`` for fewer repetitions).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.common import compiled_mb, interleaved_ms, max_diff
from benchmarks.models import mlp, transformer
from benchmarks.steps import CLIP, dropin_grad, hand_clipped_grad, jax_privacy_grad
from gradclip_jax import clipped_grad

DROPIN_TRANSFORMER_BATCHES = {False: (32, 128), True: (32,)}  # by ``quick``


def dropin_ms(
    losses: Callable[..., Any], params: Any, data: Any, reps: int = 3, max_s: float = 10.0
) -> tuple[dict[str, float], float] | None:
    """``({'jax_privacy': ms, 'dropin': ms}, max |difference of the sums|)`` of jax-privacy's
    ``clipped_grad`` and the drop-in on the same call, timed interleaved with few repetitions
    (jax-privacy takes seconds per call on some CPU models); None without jax-privacy."""
    jp = jax_privacy_grad(losses)
    drop = dropin_grad(losses)
    if jp is None or drop is None:
        return None
    jp_jit, drop_jit = jax.jit(jp), jax.jit(drop)
    ms = interleaved_ms(
        {"jax_privacy": lambda: jp_jit(params, data), "dropin": lambda: drop_jit(params, data)},
        reps,
        warmup=1,
        max_s=max_s,
    )
    return ms, max_diff(jp_jit(params, data), drop_jit(params, data))


def dropin_row(tag: str, ms: dict[str, float], diff: float, env: str) -> dict:
    """The row "<tag> interop.jax_privacy.clipped_grad (drop-in) vs jax_privacy.clipped_grad"."""
    return {
        "group": "dp",
        "name": f"{tag} interop.jax_privacy.clipped_grad (drop-in) vs jax_privacy.clipped_grad",
        "ours_ms": ms["dropin"],
        "baseline_ms": ms["jax_privacy"],
        "ratio": ms["dropin"] / ms["jax_privacy"],
        "note": f"the same call on both (method='auto'), timed together after the others; "
        f"max |drop-in - jax_privacy| = {diff:.1e}; {env}",
    }


def first_call_s(
    losses: Callable[..., Any], params: Any, data: Any, rounds: int = 2
) -> dict[str, float] | None:
    """Seconds to the first result of jax-privacy's ``clipped_grad`` and of the drop-in, each a
    fresh function jitted after ``jax.clear_caches()`` (trace, lower, compile and one run: what a
    notebook user waits for), alternated over ``rounds``, the fastest kept; None without
    jax-privacy."""
    makers = {"jax_privacy": jax_privacy_grad, "dropin": dropin_grad}
    if any(m(losses) is None for m in makers.values()):
        return None
    best = dict.fromkeys(makers, float("inf"))
    for _ in range(rounds):
        for name, make in makers.items():
            jax.clear_caches()
            f = jax.jit(make(losses))
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, data))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def first_call_row(tag: str, secs: dict[str, float], env: str) -> dict:
    """The row "<tag> drop-in first call vs jax_privacy.clipped_grad's" (seconds in the ms columns)."""
    return _dp_row(
        f"{tag} interop.jax_privacy.clipped_grad (drop-in) first call vs jax_privacy.clipped_grad's",
        secs["dropin"],
        secs["jax_privacy"],
        "seconds in the ms columns: trace, lower, compile and one run of a fresh jitted function "
        f"(caches cleared, the fastest of 2, alternated); goal <= 1.0; {env}",
    )


def _dp_row(name: str, ours_ms: float, baseline_ms: float, note: str, **extra: Any) -> dict:
    return {
        "group": "dp",
        "name": name,
        "ours_ms": ours_ms,
        "baseline_ms": baseline_ms,
        "ratio": ours_ms / baseline_ms,
        "note": note,
        **extra,
    }


def _batch_rows(batch: int, reps: int, max_s: float, env: str) -> list[dict]:
    """The MLP rows at one batch size: ours against the hand-written clip, the non-private
    gradient and jax-privacy (with the drop-in's row)."""
    losses, params, data = mlp(0, batch)
    ours = jax.jit(clipped_grad(losses, CLIP, method="vmap"))
    hand = jax.jit(hand_clipped_grad(losses))
    nonprivate = jax.jit(jax.grad(lambda p, b: jnp.sum(losses(p, b))))
    fns: dict[str, Callable[[], Any]] = {
        "ours": lambda: ours(params, data)[0],
        "hand": lambda: hand(params, data),
        "nonprivate": lambda: nonprivate(params, data),
    }
    ms = interleaved_ms(fns, reps, warmup=1, max_s=max_s)
    # seconds per call on CPU: timed after the others, with few repetitions
    timed = dropin_ms(losses, params, data)
    diff = max_diff(ours(params, data)[0], hand(params, data))
    tag = f"mlp 784-512-512-10 B={batch}"
    rows = [
        _dp_row(
            f"{tag} clipped_grad(vmap) vs vmap(grad)+optax.per_example_global_norm_clip",
            ms["ours"],
            ms["hand"],
            f"bar <= 1.0; max |ours - hand| = {diff:.2e}; {env}",
        ),
        _dp_row(
            f"{tag} clipped_grad(vmap) vs non-private grad",
            ms["ours"],
            ms["nonprivate"],
            f"cost of materializing per-example gradients; {env}",
        ),
    ]
    name = f"{tag} clipped_grad(vmap) vs jax_privacy.clipped_grad"
    if timed is None:
        return [
            *rows,
            {
                **_dp_row(name, ms["ours"], float("nan"), "skipped: jax_privacy is not installed"),
                "ratio": float("nan"),
            },
        ]
    return [
        *rows,
        _dp_row(
            name,
            ms["ours"],
            timed[0]["jax_privacy"],
            f"jax_privacy timed after the others (few repetitions: it is slow here); {env}",
        ),
        dropin_row(tag, *timed, env),
    ]


def _microbatch_rows(quick: bool, reps: int, max_s: float, env: str) -> list[dict]:
    """Time and peak (temporary) memory of the MLP at B=128 as microbatches shrink."""
    batch = 128
    losses, params, data = mlp(0, batch)
    hand_f = hand_clipped_grad(losses)
    hand_mb = compiled_mb(hand_f, params, data)[0]
    hand_jit = jax.jit(hand_f)
    micro = (None, 64, 16) if quick else (None, 64, 32, 16, 8)
    fns, mbs = {"hand": lambda: hand_jit(params, data)}, {}
    for m in micro:
        f = clipped_grad(losses, CLIP, method="vmap", microbatch_size=m)
        mbs[m] = compiled_mb(f, params, data)[0]
        jf = jax.jit(f)
        fns[str(m)] = lambda jf=jf: jf(params, data)[0]
    ms = interleaved_ms(fns, max(3, reps // 3), warmup=1, max_s=max_s)
    return [
        _dp_row(
            f"mlp B={batch} clipped_grad microbatch_size={m} (time, temp memory)",
            ms[str(m)],
            ms["hand"],
            f"compiled temp memory {mbs[m]:.1f} MiB vs hand-written {hand_mb:.1f} MiB; "
            f"baseline = vmap(grad)+optax; {env}",
            ours_mb=mbs[m],
            baseline_mb=hand_mb,
        )
        for m in micro
    ]


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (see the module docstring)."""
    reps = 5 if quick else 15
    max_s = 20.0 if quick else 90.0
    env = f"{jax.default_backend()} x{jax.device_count()}, jax {jax.__version__}, {platform.machine()}"
    rows: list[dict] = []
    for batch in (32, 128) if quick else (32, 128, 512):
        rows += _batch_rows(batch, reps, max_s, env)
    # The drop-in against jax-privacy on the other CPU model of the benchmarks
    for batch in DROPIN_TRANSFORMER_BATCHES[quick]:
        timed = dropin_ms(*transformer(0, batch))
        if timed is not None:
            rows.append(dropin_row(f"transformer 2x128 T=64 B={batch}", *timed, env))
    # the time to the first result, beside the run-time rows
    for tag, model in (
        ("mlp 784-512-512-10 B=32", mlp(0, 32)),
        ("transformer 2x128 T=64 B=32", transformer(0, 32)),
    ):
        secs = first_call_s(*model)
        if secs is not None:
            rows.append(first_call_row(tag, secs, env))
    return rows + _microbatch_rows(quick, reps, max_s, env)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and batch sizes")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = run(quick=args.quick)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        mem = f"  mem {r['ours_mb']:.0f}/{r['baseline_mb']:.0f} MiB" if "ours_mb" in r else ""
        print(
            f"{r['name']:<100} {r['ours_ms']:9.2f} ms / {r['baseline_ms']:9.2f} ms = {r['ratio']:6.3f}{mem}"
        )


if __name__ == "__main__":
    _main()
