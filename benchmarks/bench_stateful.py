"""Per-step cost of the stateful clippers, as a ratio to ``optax.clip_by_global_norm``.

Each clipper's ``update`` is jitted and timed on a transformer-shaped float32 tree
(~30M parameters: an 8192 x 512 embedding and 8 layers of four 512 x 512
attention matrices, a 512 x 2048 and a 2048 x 512 MLP matrix and four layer-norm
vectors; ``quick=True`` uses a ~3M-parameter tree). Timing is interleaved A/B
against ``optax.clip_by_global_norm`` in the same process: every repetition times
the baseline and the clipper back to back, each call ends with
``block_until_ready`` on the updates and the state, compilation is excluded (two
warm-up calls), and the medians are reported.

Every clipper is timed twice: with its state passed as a plain argument, and with
the state donated (``jax.jit(update, donate_argnums=1)``), as a training step that
donates its optimizer state runs it; there XLA may overwrite the state in place.
The donated step returns the new state before the updates: JAX gives a donated
buffer to the first output of its shape and dtype, so this way each state
buffer goes to the new state, as in a training step (where the updates are
consumed, not returned); returned after the updates, the state's buffers would
go to the updates instead. optax's state is empty, so its timing is the same
either way.

Run alone with ``python -m benchmarks.bench_stateful [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import optax

from benchmarks.models import transformer_tree
from gradclip_jax import adagc, autoclip, quantile_clip, skip_on_spike, zclip
from gradclip_jax.transforms.ema import clip_norm_by_ema, clip_value_by_ema, normalize_by_ema
from gradclip_jax.transforms.growth import clip_norm_growth, clip_value_growth

GROUP = "stateful"


# (name, factory, note): scalar-statistic clippers first (target <= 1.15x).
CLIPPERS: list[tuple[str, Callable[[], optax.GradientTransformation], str]] = [
    ("autoclip", lambda: autoclip(), "scalar statistic; history 1000 sorted per step"),
    ("zclip", lambda: zclip(), "scalar statistic"),
    ("quantile_clip", lambda: quantile_clip(), "scalar statistic"),
    (
        "skip_on_spike(zclip)",
        lambda: skip_on_spike(zclip()),
        "scalar statistic + a select per leaf",
    ),
    ("adagc", lambda: adagc(warmup_steps=0), "per-leaf norms, after warm-up"),
    (
        "adagc(warm-up)",
        lambda: adagc(warmup_steps=10**9),
        "per-leaf norms + the global norm (warm-up only)",
    ),
    ("clip_norm_growth", lambda: clip_norm_growth(), "per-leaf norms"),
    ("clip_norm_growth(global)", lambda: clip_norm_growth(tensorwise=False), "scalar statistic"),
    ("clip_norm_by_ema", lambda: clip_norm_by_ema(), "param-sized EMA: read+write state, 2 norms"),
    ("clip_norm_by_ema(global)", lambda: clip_norm_by_ema(tensorwise=False), "param-sized EMA"),
    ("normalize_by_ema", lambda: normalize_by_ema(), "param-sized EMA"),
    ("clip_value_by_ema", lambda: clip_value_by_ema(), "param-sized EMA, elementwise"),
    ("clip_value_growth", lambda: clip_value_growth(), "param-sized state, elementwise"),
]


def _timer(
    tx: optax.GradientTransformation, updates: Any, donate: bool = False
) -> Callable[[], float]:
    """A closure that runs one jitted step (feeding the state back) and returns seconds."""
    step = jax.jit(
        lambda u, s: tx.update(u, s)[::-1], donate_argnums=1 if donate else ()
    )  # (state, updates)
    state = [tx.init(updates)]

    def run() -> float:
        t0 = time.perf_counter()
        new, out = step(updates, state[0])
        jax.block_until_ready((out, new))
        t1 = time.perf_counter()
        state[0] = new
        return t1 - t0

    for _ in range(2):  # compile and warm up
        run()
    return run


def run(quick: bool = False) -> list[dict]:
    """Times every stateful clipper against ``optax.clip_by_global_norm``.

    Args:
      quick: a ~3M-parameter tree and few repetitions (for CI smoke runs).

    Returns:
      One row per clipper: ``{"group", "name", "ours_ms", "baseline_ms", "ratio",
      "note"}`` with median milliseconds per step and ``ratio = ours / baseline``.
    """
    if quick:
        updates, reps = transformer_tree(4096, 192, 6), 7
    else:
        updates, reps = transformer_tree(8192, 512, 8), 31
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(updates))
    baseline = _timer(optax.clip_by_global_norm(1.0), updates)
    rows = []
    for (name, make, note), donate in ((c, d) for c in CLIPPERS for d in (False, True)):
        ours = _timer(make(), updates, donate)
        if donate:
            name, note = f"{name} [donated]", f"{note}; state donated"
        a, b = [], []
        for _ in range(reps):
            a.append(baseline())
            b.append(ours())
        base_ms = statistics.median(a) * 1e3
        ours_ms = statistics.median(b) * 1e3
        rows.append(
            {
                "group": GROUP,
                "name": name,
                "ours_ms": ours_ms,
                "baseline_ms": base_ms,
                "ratio": ours_ms / base_ms,
                "note": f"{note}; {n_params / 1e6:.1f}M fp32 params, {jax.default_backend()}, "
                f"median of {reps}",
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~3M parameters, few repetitions")
    args = parser.parse_args()
    rows = run(quick=args.quick)
    width = max(len(r["name"]) for r in rows)
    print(f"{'name':<{width}}  {'ours ms':>9}  {'optax ms':>9}  {'ratio':>6}  note")
    for r in rows:
        print(
            f"{r['name']:<{width}}  {r['ours_ms']:9.3f}  {r['baseline_ms']:9.3f}  {r['ratio']:6.3f}  {r['note']}"
        )


if __name__ == "__main__":
    main()
