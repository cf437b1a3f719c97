"""GPU benchmarks: ``clip_by_global_norm`` against optax on a GPT-2-XL-shaped tree.

Rows (ratio = ours / optax in this process, so < 1 is better), for fp32 and bf16:

* runtime of the jitted ``update`` of ``clip_by_global_norm(1.0)`` alone;
* runtime of one training step ``chain(clip_by_global_norm(1.0), adamw(1e-4))``
  update plus ``optax.apply_updates``;
* compile time of the clip ``update`` (``jit(...).lower(...).compile()``, best of
  two fresh functions);
* compiled temporaries of the clip ``update`` (``memory_analysis``, MiB);
* the clip alone again with the engine's global-mode packing of small leaves
  switched on (the CPU strategy), to check the per-backend choice in
  :data:`gradclip_jax._core.norms.GLOBAL_PACK_MAX_SIZE`.

The tree has GPT-2-XL's shapes: 48 layers of width 1600, a 50257 x 1600 token
and a 1024 x 1600 position embedding, 580 leaves and 1.56B parameters. Without a
GPU the suite prints why and returns no rows; ``GCX_BENCH_SMALL=1`` (or
``--small``) shrinks the tree to a few thousand parameters so the script can be
tested on a CPU.

Run: ``python -m benchmarks --only core-gpu`` (writes
``benchmarks/results/results_core-gpu.json`` and ``RESULTS_core-gpu.md``) or
``python -m benchmarks.bench_core_gpu [--small]``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx
from benchmarks.common import chain_step_ms, interleaved_ms, num_params, row
from benchmarks.models import gpt2_grad_tree
from gradclip_jax._core import norms as _norms

GROUP = "core-gpu"


def _small() -> bool:
    return os.environ.get("GCX_BENCH_SMALL", "") not in ("", "0")


def _make_tree(dtype: Any) -> dict[str, Any]:
    if _small():
        return gpt2_grad_tree(layers=2, d=16, vocab=100, ctx=32, dtype=dtype)
    return gpt2_grad_tree(dtype=dtype)


def _clip_fn(tx: optax.GradientTransformation) -> Any:
    return jax.jit(lambda g, s: tx.update(g, s))


def _compile_s(make_tx: Any, tree: Any) -> float:
    best = float("inf")
    for _ in range(2):
        tx = make_tx()
        fn = jax.jit(lambda g, s, tx=tx: tx.update(g, s))  # a fresh function: no cache hit
        state = tx.init(tree)
        t0 = time.perf_counter()
        fn.lower(tree, state).compile()
        best = min(best, time.perf_counter() - t0)
    return best


def _temp_mib(make_tx: Any, tree: Any) -> float:
    tx = make_tx()
    m = jax.jit(lambda g, s: tx.update(g, s)).lower(tree, tx.init(tree)).compile().memory_analysis()
    return m.temp_size_in_bytes / 2**20


def _packed_row(tree: Any, label: str, reps: int, ref_f: Any, ref_s: Any) -> dict:
    """``clip_by_global_norm`` with the CPU strategy (small leaves packed) on this backend, against
    optax (``ref_f`` compiled with state ``ref_s``), for the per-backend choice."""
    backend = jax.default_backend()
    saved = dict(_norms.GLOBAL_PACK_MAX_SIZE)
    try:
        _norms.GLOBAL_PACK_MAX_SIZE[backend] = _norms.PACK_MAX_SIZE
        packed_tx = gcx.clip_by_global_norm(1.0)
        packed_f = _clip_fn(packed_tx)
        packed_s = packed_tx.init(tree)
        tp = interleaved_ms(
            {"packed": lambda: packed_f(tree, packed_s), "optax": lambda: ref_f(tree, ref_s)},
            reps=reps,
        )
        packed_tmp = _temp_mib(lambda: gcx.clip_by_global_norm(1.0), tree)
    finally:
        _norms.GLOBAL_PACK_MAX_SIZE.clear()
        _norms.GLOBAL_PACK_MAX_SIZE.update(saved)
    return row(
        GROUP,
        f"clip_by_global_norm alone, small leaves packed (CPU strategy), {label}",
        tp["packed"],
        tp["optax"],
        f"default on {backend}: {saved.get(backend, _norms.PACK_MAX_SIZE)}; "
        f"packed temporaries {packed_tmp:.2f} MiB",
    )


def _compile_and_memory_rows(tree: Any, label: str) -> list[dict]:
    """Compile time and compiled temporaries of ``clip_by_global_norm`` against optax's."""
    rows: list[dict] = []
    ours_c_s = _compile_s(lambda: gcx.clip_by_global_norm(1.0), tree)
    ref_c_s = _compile_s(lambda: optax.clip_by_global_norm(1.0), tree)
    rows.append(
        row(
            GROUP,
            f"compile time, clip_by_global_norm, {label}",
            1e3 * ours_c_s,
            1e3 * ref_c_s,
            "goal <= 1.0",
        )
    )
    ours_tmp = _temp_mib(lambda: gcx.clip_by_global_norm(1.0), tree)
    ref_tmp = _temp_mib(lambda: optax.clip_by_global_norm(1.0), tree)
    rows.append(
        row(
            GROUP,
            f"compiled temporaries (MiB, in the ms columns), clip_by_global_norm, {label}",
            ours_tmp,
            ref_tmp,
            "memory, not time: ours MiB / optax MiB",
        )
    )
    exact = float(
        np.sqrt(
            sum(
                float(jnp.sum(jnp.square(x.astype(jnp.float32))))
                for x in jax.tree_util.tree_leaves(tree)
            )
        )
    )
    rows[-1]["note"] += (
        f"; norm ours {float(gcx.tree_norm(tree)):.6g}, optax "
        f"{float(optax.tree.norm(tree)):.6g}, float32 sum {exact:.6g}"
    )
    return rows


def _rows_for(dtype: Any, label: str, reps: int) -> list[dict]:
    tree = _make_tree(dtype)
    n = num_params(tree)
    leaves = len(jax.tree_util.tree_leaves(tree))
    shape = (
        f"{n / 1e9:.2f}B params, {leaves} leaves"
        if n > 1e8
        else f"{n} params, {leaves} leaves (small)"
    )
    rows: list[dict] = []

    ours_tx, ref_tx = gcx.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    ours_f, ref_f = _clip_fn(ours_tx), _clip_fn(ref_tx)
    ours_s, ref_s = ours_tx.init(tree), ref_tx.init(tree)
    t = interleaved_ms(
        {"ours": lambda: ours_f(tree, ours_s), "optax": lambda: ref_f(tree, ref_s)}, reps=reps
    )
    rows.append(
        row(
            GROUP,
            f"clip_by_global_norm alone vs optax, {label} ({shape})",
            t["ours"],
            t["optax"],
            "goal <= 1.0",
        )
    )

    rows.append(_packed_row(tree, label, reps, ref_f, ref_s))

    t = chain_step_ms(tree, reps)
    rows.append(
        row(
            GROUP,
            f"chain(clip, adamw) + apply_updates vs optax, {label}",
            t["ours"],
            t["optax"],
            "goal <= 1.0",
        )
    )

    rows += _compile_and_memory_rows(tree, label)
    return rows


def run(quick: bool = False) -> list[dict]:
    """The GPU rows; none (with a message) without a GPU unless ``GCX_BENCH_SMALL=1``."""
    if jax.default_backend() not in ("gpu", "cuda", "rocm") and not _small():
        print(
            f"[{GROUP}] skipped: no GPU (backend {jax.default_backend()}); "
            "GCX_BENCH_SMALL=1 runs it on a tiny tree"
        )
        return []
    reps = 5 if (quick or _small()) else 30
    rows: list[dict] = []
    for dtype, label in ((jnp.float32, "fp32"), (jnp.bfloat16, "bf16")):
        rows += _rows_for(dtype, label, reps)
    for r in rows:
        r["note"] = f"{r['note']}; {jax.devices()[0].device_kind}"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--small", action="store_true", help="a tiny tree (same as GCX_BENCH_SMALL=1)"
    )
    args = parser.parse_args()
    if args.small:
        os.environ["GCX_BENCH_SMALL"] = "1"
    for r in run(quick=args.quick):
        print(
            f"{r['name']:<90} {r['ours_ms']:10.3f} / {r['baseline_ms']:10.3f} = {r['ratio']:.3f}  {r['note']}"
        )


if __name__ == "__main__":
    main()
