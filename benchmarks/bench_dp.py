"""Benchmark: per-example (DP-SGD) clipped gradients.

MLP 784-512-512-10 (669,706 parameters), softmax cross-entropy, float32, at batch
sizes 32, 128 and 512 (32 and 128 with ``quick=True``). For each batch size it
times, interleaved (one call of each function per round), medians over rounds,
``block_until_ready``, compile excluded:

* ``ours``: ``gradclip_jax.per_example.clipped_grad(loss, C, method='vmap')``;
* ``hand``: hand-written ``jax.vmap(jax.grad(...))`` + ``optax.per_example_global_norm_clip``;
* ``nonprivate``: ``jax.grad`` of the summed loss (no clipping);
* ``jax_privacy``: ``jax_privacy.clipped_grad`` when the package is importable
  (skipped otherwise; it is not a dependency). On CPU it takes seconds per call,
  so it is timed separately with at most 3 repetitions, next to ``dropin``: the
  same call through ``gradclip_jax.interop.jax_privacy.clipped_grad`` (its
  signature, ``method='auto'``). The drop-in row (ratio drop-in / jax-privacy,
  with the largest difference of the two sums) is also measured on the other CPU
  model of the benchmarks, ``bench_ghost``'s transformer LM (2 layers, width 128,
  sequence 64), at batch sizes 32 and 128 (32 with ``quick``).

and, at one batch size, the compiled temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``) of
``clipped_grad`` for shrinking ``microbatch_size``, next to the hand-written path.

Rows: ``{"group": "dp", "name", "ours_ms", "baseline_ms", "ratio", "note"}``
(``ratio = ours_ms / baseline_ms``); memory rows add ``ours_mb`` / ``baseline_mb``.

Run alone: ``python -m benchmarks.bench_dp`` (``--quick`` for fewer repetitions).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import compiled_mb, interleaved_ms
from gradclip_jax.per_example import clipped_grad

CLIP = 1.0
SIZES = (784, 512, 512, 10)
DROPIN_TRANSFORMER_BATCHES = {False: (32, 128), True: (32,)}  # by ``quick``


def _mlp(seed: int, batch: int) -> tuple[Callable[..., Any], Any, Any]:
    r = np.random.default_rng(seed)
    params = [
        {"w": jnp.asarray(r.normal(size=(a, b)) / np.sqrt(a), jnp.float32), "b": jnp.zeros(b, jnp.float32)}
        for a, b in itertools.pairwise(SIZES)
    ]
    data = {
        "x": jnp.asarray(r.normal(size=(batch, SIZES[0])), jnp.float32),
        "y": jnp.asarray(r.integers(0, SIZES[-1], size=batch)),
    }

    def losses(p: Any, b: Any) -> jax.Array:
        h = b["x"]
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.take_along_axis(logp, b["y"][:, None], axis=1)[:, 0]

    return losses, params, data


def _hand(losses: Callable[..., Any]) -> Callable[..., Any]:
    """The hand-written baseline: vmap(grad) then optax's per-example clip."""

    def one(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return losses(p, {"x": x[None], "y": y[None]})[0]

    def f(p: Any, b: Any) -> Any:
        g = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(p, b["x"], b["y"])
        leaves, treedef = jax.tree.flatten(g)
        summed, _ = optax.per_example_global_norm_clip(leaves, CLIP)
        return jax.tree.unflatten(treedef, summed)

    return f


def _jax_privacy(losses: Callable[..., Any]) -> Callable[..., Any] | None:
    try:
        import jax_privacy
    except Exception:  # not installed (or broken): skip
        return None
    fn = jax_privacy.clipped_grad(lambda p, b: jnp.sum(losses(p, b)), l2_clip_norm=CLIP, batch_argnums=1)
    return fn


def _dropin(losses: Callable[..., Any]) -> Callable[..., Any] | None:
    """jax-privacy's call, word for word, on gradclip_jax.interop.jax_privacy (None without the extra)."""
    try:
        from gradclip_jax.interop import jax_privacy as dropin
    except ImportError:
        return None
    return dropin.clipped_grad(lambda p, b: jnp.sum(losses(p, b)), l2_clip_norm=CLIP, batch_argnums=1)


def _max_diff(a: Any, b: Any) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def dropin_ms(losses: Callable[..., Any], params: Any, data: Any, reps: int = 3,
              max_s: float = 10.0) -> tuple[dict[str, float], float] | None:
    """``({'jax_privacy': ms, 'dropin': ms}, max |difference of the sums|)`` of jax-privacy's
    ``clipped_grad`` and the drop-in on the same call, timed interleaved with few repetitions
    (jax-privacy takes seconds per call on some CPU models); None without jax-privacy."""
    jp = _jax_privacy(losses)
    drop = _dropin(losses)
    if jp is None or drop is None:
        return None
    jp_jit, drop_jit = jax.jit(jp), jax.jit(drop)
    ms = interleaved_ms({"jax_privacy": lambda: jp_jit(params, data), "dropin": lambda: drop_jit(params, data)},
                        reps, warmup=1, max_s=max_s)
    return ms, _max_diff(jp_jit(params, data), drop_jit(params, data))


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


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (see the module docstring)."""
    reps = 5 if quick else 15
    max_s = 20.0 if quick else 90.0
    batches = (32, 128) if quick else (32, 128, 512)
    env = f"{jax.default_backend()} x{jax.device_count()}, jax {jax.__version__}, {platform.machine()}"
    rows: list[dict] = []
    for batch in batches:
        losses, params, data = _mlp(0, batch)
        ours = jax.jit(clipped_grad(losses, CLIP, method="vmap"))
        hand = jax.jit(_hand(losses))
        nonprivate = jax.jit(jax.grad(lambda p, b: jnp.sum(losses(p, b))))
        fns: dict[str, Callable[[], Any]] = {
            "ours": lambda: ours(params, data)[0],
            "hand": lambda: hand(params, data),
            "nonprivate": lambda: nonprivate(params, data),
        }
        ms = interleaved_ms(fns, reps, warmup=1, max_s=max_s)
        # seconds per call on CPU: timed after the others, with few repetitions
        timed = dropin_ms(losses, params, data)
        if timed is not None:
            ms.update(timed[0])
        diff = _max_diff(ours(params, data)[0], hand(params, data))
        tag = f"mlp 784-512-512-10 B={batch}"
        rows.append(
            {
                "group": "dp",
                "name": f"{tag} clipped_grad(vmap) vs vmap(grad)+optax.per_example_global_norm_clip",
                "ours_ms": ms["ours"],
                "baseline_ms": ms["hand"],
                "ratio": ms["ours"] / ms["hand"],
                "note": f"bar <= 1.0; max |ours - hand| = {diff:.2e}; {env}",
            }
        )
        rows.append(
            {
                "group": "dp",
                "name": f"{tag} clipped_grad(vmap) vs non-private grad",
                "ours_ms": ms["ours"],
                "baseline_ms": ms["nonprivate"],
                "ratio": ms["ours"] / ms["nonprivate"],
                "note": f"cost of materializing per-example gradients; {env}",
            }
        )
        if timed is not None:
            rows.append(
                {
                    "group": "dp",
                    "name": f"{tag} clipped_grad(vmap) vs jax_privacy.clipped_grad",
                    "ours_ms": ms["ours"],
                    "baseline_ms": ms["jax_privacy"],
                    "ratio": ms["ours"] / ms["jax_privacy"],
                    "note": f"jax_privacy timed after the others (few repetitions: it is slow here); {env}",
                }
            )
            rows.append(dropin_row(tag, *timed, env))
        else:
            rows.append(
                {
                    "group": "dp",
                    "name": f"{tag} clipped_grad(vmap) vs jax_privacy.clipped_grad",
                    "ours_ms": ms["ours"],
                    "baseline_ms": float("nan"),
                    "ratio": float("nan"),
                    "note": "skipped: jax_privacy is not installed",
                }
            )

    # The drop-in against jax-privacy on the other CPU model of the benchmarks (bench_ghost's
    # transformer; imported here: bench_ghost imports this module)
    from benchmarks.bench_ghost import _transformer

    for batch in DROPIN_TRANSFORMER_BATCHES[quick]:
        timed = dropin_ms(*_transformer(0, batch))
        if timed is not None:
            rows.append(dropin_row(f"transformer 2x128 T=64 B={batch}", *timed, env))

    # Peak (temporary) memory as microbatches shrink.
    batch = 128
    losses, params, data = _mlp(0, batch)
    hand_f = _hand(losses)
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
    for m in micro:
        rows.append(
            {
                "group": "dp",
                "name": f"mlp B={batch} clipped_grad microbatch_size={m} (time, temp memory)",
                "ours_ms": ms[str(m)],
                "baseline_ms": ms["hand"],
                "ratio": ms[str(m)] / ms["hand"],
                "ours_mb": mbs[m],
                "baseline_mb": hand_mb,
                "note": (
                    f"compiled temp memory {mbs[m]:.1f} MiB vs hand-written {hand_mb:.1f} MiB; "
                    f"baseline = vmap(grad)+optax; {env}"
                ),
            }
        )
    return rows


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
        print(f"{r['name']:<100} {r['ours_ms']:9.2f} ms / {r['baseline_ms']:9.2f} ms = {r['ratio']:6.3f}{mem}")


if __name__ == "__main__":
    _main()
