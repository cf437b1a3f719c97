"""Draws the figures of the "Choosing a clipper" guide (docs/assets/*.png).

Run ``python docs/plots.py`` (needs the ``demo`` extra for matplotlib). Each
clipper is fed the same synthetic gradient stream: a slowly decaying norm with
noise and a few 20-50x spikes, and the figure shows the norm of what it lets
through, step by step.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

import gradclip_jax as gcx

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUT = pathlib.Path(__file__).parent / "assets"
STEPS = 300
SPIKES = {60: 30.0, 61: 20.0, 150: 50.0, 230: 25.0}


def gradient_norms(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = 2.0 * np.exp(-np.arange(STEPS) / 200.0) + 0.5
    norms = base * np.exp(0.15 * rng.standard_normal(STEPS))
    for step, factor in SPIKES.items():
        norms[step] *= factor
    return norms


def passed_norms(tx, norms: np.ndarray) -> np.ndarray:
    """Norm of each update after ``tx``, for gradients with the given norms."""
    direction = {"w": jnp.ones((8, 4)) / jnp.sqrt(32.0), "b": jnp.zeros(4)}
    grads = jax.vmap(lambda n: jax.tree_util.tree_map(lambda x: x * n, direction))(jnp.asarray(norms))

    def step(state, g):
        out, state = tx.update(g, state, direction)
        return state, gcx.tree_norm(out)

    _, out = jax.lax.scan(step, tx.init(direction), grads)
    return np.asarray(out)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    norms = gradient_norms()
    clippers = {
        "clip_by_global_norm(2.0)": gcx.clip_by_global_norm(2.0),
        "autoclip(percentile=10)": gcx.autoclip(percentile=10.0),
        "zclip()": gcx.zclip(),
        "quantile_clip(0.9)": gcx.quantile_clip(target_quantile=0.9, initial_norm=1.0),
        "adagc(warmup_steps=25)": gcx.adagc(warmup_steps=25, warmup_max_norm=5.0),
        "clip_norm_growth(mul=1.5, tensorwise=False)": gcx.clip_norm_growth(mul=1.5, tensorwise=False),
    }
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True, sharey=True)
    for ax, (name, tx) in zip(axes.ravel(), clippers.items()):
        ax.semilogy(norms, color="0.75", lw=1, label="gradient norm")
        ax.semilogy(passed_norms(tx, norms), color="C0", lw=1.2, label="after the clipper")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("norm")
    fig.suptitle("The same gradient stream (with spikes at steps 60, 150, 230) through each clipper")
    fig.tight_layout()
    fig.savefig(OUT / "choosing_clippers.png", dpi=110)
    print("wrote", OUT / "choosing_clippers.png")


if __name__ == "__main__":
    main()
