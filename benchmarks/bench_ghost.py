"""Benchmark: ghost clipping (``clipped_grad(..., method='ghost')``).

MLP 784-512-512-10 (669,706 parameters), softmax cross-entropy, float32, at batch
sizes 32, 128 and 512 (32 and 128 with ``quick=True``). For each batch size it
times, interleaved (one call of each function per round, medians over rounds,
``block_until_ready``, compile excluded):

* ``ghost``: ``clipped_grad(loss, C, method='ghost')`` (two backward passes,
  no per-example gradient materialized);
* ``nonprivate``: ``jax.grad`` of the summed loss (the baseline, bar: ghost
  <= 1.5x);
* ``vmap``: ``clipped_grad(loss, C, method='vmap')`` (reported as a second row,
  ghost vs vmap).

Rows: ``{"group": "ghost", "name", "ours_ms", "baseline_ms", "ratio", "note"}``
(``ratio = ours_ms / baseline_ms``). Each note records the max abs difference
between the ghost and vmap clipped sums. Two last rows give the compiled
temporary memory (``memory_analysis().temp_size_in_bytes``, in MiB, in the
``ours_ms``/``baseline_ms`` columns and as ``ours_mb``/``baseline_mb``) at the
largest batch, ghost vs non-private and ghost vs vmap.

A second model is a small pre-LN transformer (2 layers, width 128, 4 heads,
sequence 64, vocabulary 256, plain JAX: token and position embeddings, attention,
MLP, layer norms and an output head) at batch 32 (and 128 without ``quick``): the
bar there is ghost <= 2x the non-private step.

Run alone: ``python -m benchmarks.bench_ghost`` (``--quick`` for fewer repetitions).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.bench_dp import CLIP, _max_diff, _mlp, _temp_mb
from benchmarks.common import interleaved_ms, row
from gradclip_jax.per_example import clipped_grad


def _transformer(seed: int, batch: int, *, layers: int = 2, d: int = 128, heads: int = 4,
                 seq: int = 64, vocab: int = 256) -> tuple[Callable[..., Any], Any, Any]:
    """A small pre-LN transformer LM with per-example losses (mean token cross-entropy)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * layers + 8))

    def dense(n_in: int, n_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (n_in, n_out)) / jnp.sqrt(n_in)

    params: dict[str, Any] = {
        "embed": 0.02 * jax.random.normal(next(keys), (vocab, d)),
        "pos": 0.02 * jax.random.normal(next(keys), (seq, d)),
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "head": dense(d, vocab),
        "layers": [
            {"ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)}, "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
             "q": dense(d, d), "k": dense(d, d), "v": dense(d, d), "o": dense(d, d),
             "up": dense(d, 4 * d), "up_b": jnp.zeros(4 * d), "down": dense(4 * d, d), "down_b": jnp.zeros(d)}
            for _ in range(layers)
        ],
    }
    tokens = jax.random.randint(next(keys), (batch, seq + 1), 0, vocab)
    data = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def norm(p: Any, h: jax.Array) -> jax.Array:
        mu = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
        return (h - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]

    def losses(p: Any, b: Any) -> jax.Array:
        h = p["embed"][b["x"]] + p["pos"]
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        for lp in p["layers"]:
            a = norm(lp["ln1"], h)
            q, k, v = (jnp.reshape(a @ lp[n], (*a.shape[:-1], heads, d // heads)) for n in "qkv")
            att = jnp.einsum("bthe,bshe->bhts", q, k) / jnp.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            h = h + jnp.reshape(jnp.einsum("bhts,bshe->bthe", att, v), a.shape) @ lp["o"]
            m = norm(lp["ln2"], h)
            h = h + jax.nn.gelu(m @ lp["up"] + lp["up_b"]) @ lp["down"] + lp["down_b"]
        logits = norm(p["ln_f"], h) @ p["head"]
        ll = jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], axis=-1)[..., 0]
        return -jnp.mean(ll, axis=-1)

    return losses, params, data


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (see the module docstring)."""
    reps = 5 if quick else 20
    max_s = 20.0 if quick else 60.0
    batches = (32, 128) if quick else (32, 128, 512)
    env = f"{jax.default_backend()} x{jax.device_count()}, jax {jax.__version__}, {platform.machine()}"
    rows: list[dict] = []
    for batch in batches:
        losses, params, data = _mlp(0, batch)
        ghost = jax.jit(clipped_grad(losses, CLIP, method="ghost"))
        vmap = jax.jit(clipped_grad(losses, CLIP, method="vmap"))
        nonprivate = jax.jit(jax.grad(lambda p, b: jnp.sum(losses(p, b))))
        diff = _max_diff(ghost(params, data)[0], vmap(params, data)[0])
        fns: dict[str, Callable[[], Any]] = {
            "ghost": lambda: ghost(params, data)[0],
            "nonprivate": lambda: nonprivate(params, data),
            "vmap": lambda: vmap(params, data)[0],
        }
        ms = interleaved_ms(fns, reps, max_s=max_s)
        note = f"MLP 784-512-512-10, B={batch}, {env}; max|ghost-vmap|={diff:.1e}"
        rows.append(row("ghost", f"ghost vs non-private grad, B={batch}", ms["ghost"], ms["nonprivate"],
                        note + "; bar <= 1.5x"))
        rows.append(row("ghost", f"ghost vs vmap clipped_grad, B={batch}", ms["ghost"], ms["vmap"], note))
    for batch in (32,) if quick else (32, 128):
        losses, params, data = _transformer(0, batch)
        ghost = jax.jit(clipped_grad(losses, CLIP, method="ghost"))
        vmap = jax.jit(clipped_grad(losses, CLIP, method="vmap"))
        nonprivate = jax.jit(jax.grad(lambda p, b: jnp.sum(losses(p, b))))
        diff = _max_diff(ghost(params, data)[0], vmap(params, data)[0])
        ms = interleaved_ms({
            "ghost": lambda: ghost(params, data)[0],
            "nonprivate": lambda: nonprivate(params, data),
            "vmap": lambda: vmap(params, data)[0],
        }, reps, max_s=max_s)
        note = f"transformer 2x128, T=64, B={batch}, {env}; max|ghost-vmap|={diff:.1e}"
        rows.append(row("ghost", f"transformer ghost vs non-private grad, B={batch}", ms["ghost"],
                        ms["nonprivate"], note + "; bar <= 2x"))
        rows.append(row("ghost", f"transformer ghost vs vmap clipped_grad, B={batch}", ms["ghost"], ms["vmap"], note))
    # compiled temporary memory (MiB) at the largest batch: ghost vs non-private vs vmap
    losses, params, data = _mlp(0, batches[-1])
    mem = {
        "ghost": _temp_mb(clipped_grad(losses, CLIP, method="ghost"), params, data),
        "nonprivate": _temp_mb(jax.grad(lambda p, b: jnp.sum(losses(p, b))), params, data),
        "vmap": _temp_mb(clipped_grad(losses, CLIP, method="vmap"), params, data),
    }
    note = (f"compiled temp memory (MiB, not ms), B={batches[-1]}: ghost {mem['ghost']:.1f}, "
            f"non-private {mem['nonprivate']:.1f}, vmap {mem['vmap']:.1f}")
    rows.append(row("ghost", f"memory ghost vs non-private, B={batches[-1]}", mem["ghost"], mem["nonprivate"], note,
                    ours_mb=mem["ghost"], baseline_mb=mem["nonprivate"]))
    rows.append(row("ghost", f"memory ghost vs vmap, B={batches[-1]}", mem["ghost"], mem["vmap"], note,
                    ours_mb=mem["ghost"], baseline_mb=mem["vmap"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in run(quick=args.quick):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
