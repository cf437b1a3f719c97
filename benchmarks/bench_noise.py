"""Benchmark: drawing the DP-SGD noise of a whole model, ours against optax's way.

``gcx.privacy.add_gaussian_noise`` (the noise of ``make_private`` and of the DP
steps in ``bench_ghost_gpu``) against the per-leaf draw that
``optax.contrib.differentially_private_aggregate`` makes (one
``jax.random.normal`` per leaf from ``jax.random.split(key, num_leaves)``), on
the tree of GPT-2 small (148 leaves, 124.4M parameters; ``--quick``: the same
148 leaves at width 128 and vocabulary 4096). Three rows, each a ratio of
ours to optax's way in this process: the time of one jitted call (median of
interleaved runs), the time to lower and compile it, and its compiled
temporaries. On the CPU ours draws in blocks (``gcx.privacy.NOISE_STRATEGY``).
A fourth row times ours drawing by ``"philox"`` (Philox4x32-10 bits instead of
threefry's) against the same per-leaf threefry draw.

Run: ``python -m benchmarks --only noise``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import gradclip_jax as gcx
from benchmarks.common import interleaved_ms, memory_mb, row
from gradclip_jax._core.backend import backend_setting


def gpt2_tree(width: int = 768, vocab: int = 50257, layers: int = 12, positions: int = 1024) -> dict[str, Any]:
    """Zeros shaped like GPT-2's parameters (tied head: no separate output matrix)."""
    d = width
    tree: dict[str, Any] = {"wte": jnp.zeros((vocab, d)), "wpe": jnp.zeros((positions, d)),
                            "ln_f": {"scale": jnp.zeros(d), "bias": jnp.zeros(d)}}
    for i in range(layers):
        tree[f"h{i}"] = {
            "ln_1": {"scale": jnp.zeros(d), "bias": jnp.zeros(d)},
            "c_attn": {"kernel": jnp.zeros((d, 3 * d)), "bias": jnp.zeros(3 * d)},
            "attn_proj": {"kernel": jnp.zeros((d, d)), "bias": jnp.zeros(d)},
            "ln_2": {"scale": jnp.zeros(d), "bias": jnp.zeros(d)},
            "c_fc": {"kernel": jnp.zeros((d, 4 * d)), "bias": jnp.zeros(4 * d)},
            "mlp_proj": {"kernel": jnp.zeros((4 * d, d)), "bias": jnp.zeros(d)},
        }
    return tree


def optax_way(tree: Any, stddev: float, key: jax.Array) -> Any:
    """The per-leaf draw of ``optax.contrib.differentially_private_aggregate``."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noised = [x + stddev * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, noised)


def _compile(f: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def run(quick: bool = False) -> list[dict]:
    tree = gpt2_tree(width=128, vocab=4096) if quick else gpt2_tree()
    leaves = jax.tree.leaves(tree)
    n = sum(x.size for x in leaves)
    key = jax.random.key(0)
    fns = {"ours": lambda t, k: gcx.privacy.add_gaussian_noise(t, 1.0, k), "optax": lambda t, k: optax_way(t, 1.0, k)}
    _compile(lambda t, k: optax_way(t, 1.0, k), {"w": jnp.zeros(3)}, key)  # one-time warm-up of the compiler
    fns["philox"] = lambda t, k: gcx.privacy.add_gaussian_noise(t, 1.0, k)  # traced with "philox" below
    backend = jax.default_backend()
    compiled, compile_s, temp = {}, {}, {}
    for name, f in fns.items():  # compiled once each: a second compile would hit jax's cache
        with backend_setting(gcx.privacy.NOISE_STRATEGY, "philox" if name == "philox" else None):
            compiled[name], compile_s[name] = _compile(f, tree, key)
        temp[name] = memory_mb(compiled[name])[0]
    ms = interleaved_ms({k: (lambda c=c: c(tree, key)) for k, c in compiled.items()}, reps=5 if quick else 15)
    strategy = gcx.privacy.NOISE_STRATEGY.get(backend, "leaves")
    what = f"{len(leaves)} leaves, {n / 1e6:.1f}M params (GPT-2{' shapes at width 128' if quick else ' small'}), " \
           f"{backend}, ours draws by {strategy!r}"
    return [
        row("noise", "add_gaussian_noise vs optax per-leaf draw: time", ms["ours"], ms["optax"], what),
        row("noise", "add_gaussian_noise vs optax per-leaf draw: lower+compile (ms)", compile_s["ours"] * 1e3,
            compile_s["optax"] * 1e3, what),
        row("noise", "add_gaussian_noise vs optax per-leaf draw: temporaries (MiB, not ms)", temp["ours"],
            temp["optax"], what),
        row("noise", "add_gaussian_noise drawing by 'philox' vs optax per-leaf draw (threefry): time",
            ms["philox"], ms["optax"], what.split(", ours draws")[0]),
    ]


if __name__ == "__main__":
    for r in run():
        print(f"{r['name']}: {r['ours_ms']:.2f} vs {r['baseline_ms']:.2f} -> {r['ratio']:.3f}  ({r['note']})")
