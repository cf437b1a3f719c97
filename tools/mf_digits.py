"""Digits: DP-SGD vs BandMF (correlated noise) at the same epsilon, the table of
docs/guides/correlated-noise.md.

``python -m tools.mf_digits`` (``--quick``: epsilon 4, seed 0, adam only). The demo's
MLP (64-64-10, tanh) on scikit-learn's digits (:mod:`gradclip_jax.demo`: split,
initialisation and data order seeded by ``seed``), 400 steps, expected batch 64, clip
norm 1, delta 1e-5, ``method='vmap'``. Rows:

* ``DP-SGD (make_private)``: :func:`gradclip_jax.demo.run`'s DP-SGD run (Adam 1e-2,
  gradclip_jax's Poisson sampler and PLD accountant, add/remove neighbours);
* ``DP-SGD (plan, 1 band)`` and ``BandMF (b bands)``:
  :func:`gradclip_jax.interop.correlated_noise.bandmf_plan` (jax-privacy's batches,
  noise and PLD accounting, add/remove neighbours, noise seed ``seed``), trained by
  :func:`train_plan` with the same optimizer.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

STEPS, BATCH, DELTA, CLIP = 400, 64, 1e-5, 1.0
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-2),  # the demo's DP learning rate
    "sgdm": lambda: optax.sgd(0.5, momentum=0.9),
}


def train_plan(
    plan: Any, data: tuple[np.ndarray, ...], seed: int, optimizer: optax.GradientTransformation
) -> float:
    """Trains the demo's MLP with ``plan`` (an MFPlan) for its iterations; the test accuracy."""
    from jax_privacy.batch_selection import pad_to_multiple_of

    from gradclip_jax.demo import accuracy, init_mlp, per_example_loss

    x, y = jnp.asarray(data[0]), jnp.asarray(data[1])
    grad_fn = plan.clipped_grad(lambda p, b: jnp.mean(per_example_loss(p, b)), batch_argnums=1)
    noise = plan.noise_addition_transform

    @jax.jit
    def step(params: Any, opt_state: Any, noise_state: Any, idx: jax.Array) -> tuple[Any, Any, Any]:
        batch = {"x": x[jnp.maximum(idx, 0)], "y": y[jnp.maximum(idx, 0)]}  # -1: padding
        g = grad_fn(params, batch, is_padding_example=idx < 0)  # clipped sum / expected batch size
        g, noise_state = noise.update(g, noise_state)  # + correlated noise
        updates, opt_state = optimizer.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, noise_state

    params = init_mlp(jax.random.key(seed))
    opt_state, noise_state = optimizer.init(params), noise.init(params)
    for idx in plan.batch_selection_strategy.batch_iterator(len(data[0]), rng=seed):
        padded = pad_to_multiple_of(idx.astype(np.int32), BATCH)  # few shapes, few compilations
        params, opt_state, noise_state = step(params, opt_state, noise_state, jnp.asarray(padded))
    return accuracy(params, data[2], data[3])


def run_plan(bands: int, epsilon: float, seed: int, optimizer: str) -> dict[str, Any]:
    """One BandMF (or, with 1 band, DP-SGD) run through ``bandmf_plan``: a table row."""
    from gradclip_jax.demo import load_digits_split
    from gradclip_jax.interop.correlated_noise import bandmf_plan

    data = load_digits_split(seed)
    plan = bandmf_plan(
        num_examples=len(data[0]),
        expected_batch_size=BATCH,
        iterations=STEPS,
        num_bands=bands,
        epsilon=epsilon,
        delta=DELTA,
        l2_clip_norm=CLIP,
        method="vmap",
        noise_seed=seed,
    )
    name = "DP-SGD (plan, 1 band)" if bands == 1 else f"BandMF ({bands} bands)"
    return {
        "run": name,
        "optimizer": optimizer,
        "target": epsilon,
        "seed": seed,
        "epsilon": plan.epsilon,
        "noise_multiplier": plan.noise_multiplier,
        "accuracy": train_plan(plan, data, seed, OPTIMIZERS[optimizer]()),
    }


def run_make_private(epsilon: float, seed: int) -> dict[str, Any]:
    """The demo's DP-SGD run (``make_private``, Adam 1e-2) with the same settings: a table row."""
    from gradclip_jax.demo import run

    r = run(
        steps=STEPS,
        batch_size=BATCH,
        method="vmap",
        epsilon=epsilon,
        seed=seed,
        l2_clip_norm=CLIP,
        delta=DELTA,
        methods=("dp-sgd",),
        progress=False,
    )["dp-sgd"]
    return {
        "run": "DP-SGD (make_private)",
        "optimizer": "adam",
        "target": epsilon,
        "seed": seed,
        "epsilon": r.epsilon,
        "noise_multiplier": r.noise_multiplier,
        "accuracy": r.test_accuracy,
    }


def compare(
    epsilons: Sequence[float] = (1.0, 4.0),
    seeds: Sequence[int] = (0, 1, 2),
    bands: Sequence[int] = (1, 4, 8),
    optimizers: Sequence[str] = ("adam",),
) -> list[dict[str, Any]]:
    """Every run of the table, one row per (run, optimizer, target epsilon, seed)."""
    rows = []
    for eps in epsilons:
        for seed in seeds:
            if "adam" in optimizers:
                rows.append(run_make_private(eps, seed))
            rows += [run_plan(b, eps, seed, opt) for opt in optimizers for b in bands]
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: test accuracy, mean +- sd over seeds (largest epsilon spent), per run and target."""
    targets = sorted({r["target"] for r in rows})
    keys = list(dict.fromkeys((r["run"], r["optimizer"]) for r in rows))
    lines = [
        "| run | optimizer | " + " | ".join(f"epsilon = {t:g}" for t in targets) + " |",
        "|---|---|" + "---:|" * len(targets),
    ]
    for run, opt in keys:
        cells = []
        for t in targets:
            sel = [r for r in rows if (r["run"], r["optimizer"], r["target"]) == (run, opt, t)]
            acc = [r["accuracy"] for r in sel]
            sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
            cells.append(
                f"{statistics.mean(acc):.3f} ± {sd:.3f} ({max(r['epsilon'] for r in sel):.3f})"
            )
        lines.append(f"| {run} | {opt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="epsilon 4, seed 0, adam only")
    args = parser.parse_args(argv)
    if args.quick:
        rows = compare(epsilons=(4.0,), seeds=(0,))
    else:
        rows = compare(optimizers=("adam", "sgdm"))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
