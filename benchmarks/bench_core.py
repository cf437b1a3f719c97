"""Core benchmarks: ``clip_by_global_norm`` runtime and compile time against optax.

Rows (ratio = ours / baseline, so < 1 is better):

* runtime of ``gcx.clip_by_global_norm(1.0).update`` under jit on a ~30M-parameter
  transformer-shaped float32 tree, against ``optax.clip_by_global_norm`` in the same
  process (interleaved, medians, compile excluded); the bar is <= 1.10;
* the same runtime against the memory floor: one read of the tree for the norm
  plus one read and one write for the scale (3 x 4 bytes per parameter), priced at
  the bandwidth of a plain ``x * 2`` over the same tree (read + write);
* the same on a bfloat16 tree (optax accumulates bf16 norms in bf16);
* one training step, ``chain(clip_by_global_norm(1.0), adamw(1e-4))`` update
  plus ``optax.apply_updates``, against the same chain with optax's clip, in
  float32 and bfloat16 (the bar is <= 1.0: the clip must not slow the step);
* compile time (``jit(...).lower(...).compile()``) of the update on 1000 bf16
  leaves of shape (16, 16); the bar is <= 0.6;
* the update called eagerly (no ``jit``, as in a notebook), against optax's
  eager update (the bar is <= 1.0; every call after the first must reuse the
  compiled kernels: a ``lax.cond`` traced per call once cost ~0.1 s a step);
* the documented loop's DP step (``priv.step``, called directly) of an MLP started warm from
  JAX's persistent compilation cache against its cold compile, each in a fresh
  process sharing one temporary cache folder (``benchmarks/warm_start.py``): the
  seconds to trace, lower and compile (the warm start still traces and lowers), and
  whether the two processes' first steps agree to the bit.

Run alone: ``python -m benchmarks.bench_core [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import gradclip_jax as gcx
from benchmarks.common import chain_step_ms, interleaved_ms, num_params, row
from benchmarks.models import transformer_tree

GROUP = "core"


def _update_fn(tx: optax.GradientTransformation) -> Any:
    return jax.jit(lambda g, s: tx.update(g, s))


def _runtime_rows(tree: Any, label: str, reps: int) -> list[dict]:
    ours_tx, ref_tx = gcx.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    ours_f, ref_f = _update_fn(ours_tx), _update_fn(ref_tx)
    ours_s, ref_s = ours_tx.init(tree), ref_tx.init(tree)
    copy_f = jax.jit(lambda g: jax.tree_util.tree_map(lambda x: x * 2, g))
    t = interleaved_ms(
        {
            "ours": lambda: ours_f(tree, ours_s),
            "optax": lambda: ref_f(tree, ref_s),
            "copy": lambda: copy_f(tree),
        },
        reps=reps,
    )
    n = num_params(tree)
    floor_ms = 1.5 * t["copy"]  # 3 passes over the tree vs the copy's 2
    return [
        row(
            GROUP,
            f"clip_by_global_norm vs optax, {label} ({n / 1e6:.1f}M params)",
            t["ours"],
            t["optax"],
            "bar <= 1.10",
        ),
        row(
            GROUP,
            f"clip_by_global_norm vs memory floor, {label}",
            t["ours"],
            floor_ms,
            f"floor = 3 passes at the bandwidth of x*2 ({t['copy']:.2f} ms for 2 passes)",
        ),
    ]


def _chain_row(tree: Any, label: str, reps: int) -> dict:
    t = chain_step_ms(tree, reps)
    return row(
        GROUP,
        f"chain(clip, adamw) + apply_updates vs optax, {label} ({num_params(tree) / 1e6:.1f}M params)",
        t["ours"],
        t["optax"],
        "bar <= 1.0",
    )


def _eager_row(tree: Any, label: str, reps: int) -> dict:
    ours_tx, ref_tx = gcx.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    ours_s, ref_s = ours_tx.init(tree), ref_tx.init(tree)
    t = interleaved_ms(
        {
            "ours": lambda: ours_tx.update(tree, ours_s),
            "optax": lambda: ref_tx.update(tree, ref_s),
        },
        reps=reps,
    )
    n, leaves = num_params(tree), len(jax.tree_util.tree_leaves(tree))
    return row(
        GROUP,
        f"clip_by_global_norm eager (no jit) vs optax eager, {label} ({n / 1e6:.1f}M params, "
        f"{leaves} leaves)",
        t["ours"],
        t["optax"],
        "bar <= 1.0; op-by-op dispatch, compile excluded",
    )


def _compile_s(make_tx: Any, tree: Any) -> float:
    tx = make_tx()
    state = tx.init(tree)
    fn = jax.jit(lambda g, s: tx.update(g, s))  # a fresh function: no cache hit
    t0 = time.perf_counter()
    fn.lower(tree, state).compile()
    return time.perf_counter() - t0


def _compile_rows(n_leaves: int, repeats: int) -> list[dict]:
    tree = [jnp.ones((16, 16), jnp.bfloat16) for _ in range(n_leaves)]
    ours = min(_compile_s(lambda: gcx.clip_by_global_norm(1.0), tree) for _ in range(repeats))
    ref = min(_compile_s(lambda: optax.clip_by_global_norm(1.0), tree) for _ in range(repeats))
    exact = (n_leaves * 256) ** 0.5
    ours_norm = float(gcx.tree_norm(tree))
    ref_norm = float(optax.tree.norm(tree))
    return [
        row(
            GROUP,
            f"compile time, clip_by_global_norm on {n_leaves} bf16 leaves (16,16)",
            1e3 * ours,
            1e3 * ref,
            f"bar <= 0.6; norm of ones: ours {ours_norm:.2f}, optax {ref_norm:.2f}, exact {exact:.2f}",
        )
    ]


def _warm_start_row(quick: bool) -> dict:
    from benchmarks import warm_start

    r = warm_start.measure(quick)
    cold, warm = r["cold"]["compile_s"], r["warm"]["compile_s"]
    label = "784-32-10" if quick else "784-128-10"
    return row(
        GROUP,
        f"DP step (make_private, MLP {label}, B=32) warm start from the persistent cache vs cold compile",
        1e3 * warm,
        1e3 * cold,
        f"trace+lower+compile in a fresh process, {r['entries']} programs cached, the warm step "
        f"read back: {r['warm']['hits'] == 1 and r['warm']['misses'] == 0}; same outputs to the bit: "
        f"{r['cold']['digest'] == r['warm']['digest']}",
    )


def run(quick: bool = False) -> list[dict]:
    rows: list[dict] = [_warm_start_row(quick)]
    if quick:
        rows += _runtime_rows(transformer_tree(2048, 256, 4), "fp32", reps=20)
        rows += _compile_rows(300, repeats=1)
        rows.append(_eager_row(transformer_tree(2048, 256, 4), "fp32", reps=10))
        return rows
    rows += _runtime_rows(transformer_tree(), "fp32", reps=30)
    rows += _runtime_rows(transformer_tree(dtype=jnp.bfloat16), "bf16", reps=30)[:1]
    rows.append(_chain_row(transformer_tree(), "fp32", reps=30))
    rows.append(_chain_row(transformer_tree(dtype=jnp.bfloat16), "bf16", reps=30))
    rows += _compile_rows(1000, repeats=2)
    rows.append(_eager_row(transformer_tree(), "fp32", reps=15))
    rows.append(_eager_row(transformer_tree(dtype=jnp.bfloat16), "bf16", reps=15))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in run(quick=args.quick):
        print(
            f"{r['name']:<80} {r['ours_ms']:10.2f} ms / {r['baseline_ms']:10.2f} ms = {r['ratio']:.3f}  {r['note']}"
        )


if __name__ == "__main__":
    main()
