"""Probe: which global-norm strategy makes ``clip_by_global_norm`` fastest on this backend.

Times every candidate engine setting of :mod:`gradclip_jax.norms` against optax in
ONE process, on the GPT-2-XL-shaped tree of ``bench_core_gpu`` (1.56B params, 580
leaves; ``GCX_BENCH_SMALL=1`` or ``--small`` for a tiny tree that runs on a CPU):

* ``SUMSQ_STRATEGY``: ``cond`` (fast pass + ``lax.cond`` rescaled fallback),
  ``blue`` (branch-free, one variadic reduction per leaf), ``blue-sums``
  (branch-free, three sums per leaf);
* ``GLOBAL_PACK_MAX_SIZE``: small leaves concatenated before reducing (``pack``)
  or not (``nopack``).

For each variant and dtype (fp32, bf16) it prints: clip-alone time against optax
(interleaved timer, same process; ratio < 1 is better), compile time of the clip
``update`` (one ``lower().compile()``, against optax's), compiled temporaries,
kernel-ish counts from the optimized HLO (fusions, conditionals, reductions) and
the norm's relative difference to a float32 reference (one plain sum per leaf);
the variadic ``blue`` reduction accumulated less accurately on CPU (6e-5 on
200k bf16 elements), so check that column before picking it. Then, for the two fastest variants
per dtype, one ``chain(clip, adamw) + apply_updates`` step against optax's.

Rows are printed as soon as they are measured; a deadline (``--budget``, default
270 s) skips what would not finish. The winner goes into
``SUMSQ_STRATEGY["gpu"/"cuda"]`` (``gradclip_jax/_core/norms/_engine.py``) and
``GLOBAL_PACK_MAX_SIZE["gpu"/"cuda"]`` (``gradclip_jax/_core/norms/_reduce.py``); the summary
line says which.

Run: ``python -m benchmarks.probe_norm_gpu`` (``--small`` on a CPU).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import gradclip_jax as gcx
from benchmarks.common import interleaved_ms
from benchmarks.models import gpt2_grad_tree
from gradclip_jax._core import norms as _norms

# (name, SUMSQ_STRATEGY value, pack small leaves?) in the order they are tried
VARIANTS = (
    ("cond/nopack", "cond", False),
    ("blue/nopack", "blue", False),
    ("blue-sums/nopack", "blue-sums", False),
    ("cond/pack", "cond", True),
    ("blue/pack", "blue", True),
    ("blue-sums/pack", "blue-sums", True),
)


class _Setting:
    """Sets the engine's per-backend strategy and packing limit for this backend, then restores them."""

    def __init__(self, strategy: str, pack: bool):
        self.strategy, self.pack = strategy, pack
        self.backend = jax.default_backend()

    def __enter__(self) -> None:
        self.saved = dict(_norms.SUMSQ_STRATEGY), dict(_norms.GLOBAL_PACK_MAX_SIZE)
        _norms.SUMSQ_STRATEGY[self.backend] = self.strategy
        _norms.GLOBAL_PACK_MAX_SIZE[self.backend] = _norms.PACK_MAX_SIZE if self.pack else 0

    def __exit__(self, *exc: Any) -> None:
        for live, old in zip((_norms.SUMSQ_STRATEGY, _norms.GLOBAL_PACK_MAX_SIZE), self.saved):
            live.clear()
            live.update(old)


def hlo_counts(compiled: Any) -> dict[str, int]:
    """Fusions (about one kernel each on GPU), conditionals and reductions in optimized HLO."""
    txt = compiled.as_text()
    return {
        "fusions": len(re.findall(r"\bfusion\(", txt)),
        "conds": len(re.findall(r"\bconditional\(", txt)),
        "reduces": len(re.findall(r"\breduce\(", txt)),
    }


def _compile(make_tx: Any, tree: Any) -> tuple[Any, Any, float]:
    """``(compiled clip update, state, compile seconds)`` for a fresh transformation."""
    tx = make_tx()
    state = tx.init(tree)
    fn = jax.jit(lambda g, s: tx.update(g, s))
    t0 = time.perf_counter()
    compiled = fn.lower(tree, state).compile()
    return compiled, state, time.perf_counter() - t0


def _step(tx: optax.GradientTransformation) -> Any:
    def step(p: Any, g: Any, s: Any) -> Any:
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(step)


def _print(line: str) -> None:
    print(line, flush=True)


def _variant_row(
    name: str, strategy: Any, pack: Any, tree: Any, ref: tuple, label: str, reps: int
) -> dict:
    """One variant's row against optax (``ref``: its compiled step, state, compile time and the
    reference norm), printed as it is measured."""
    ref_c, ref_s, ref_t, ref_norm = ref
    with _Setting(strategy, pack):
        comp, state, ct = _compile(lambda: gcx.clip_by_global_norm(1.0), tree)
    t = interleaved_ms(
        {"ours": lambda c=comp, s=state: c(tree, s), "optax": lambda: ref_c(tree, ref_s)},
        reps=reps,
        max_s=15.0,
    )
    norm = float(comp(tree, state)[1].norm)
    counts = hlo_counts(comp)
    tmp = comp.memory_analysis().temp_size_in_bytes / 2**20
    r = {
        "variant": name,
        "strategy": strategy,
        "pack": pack,
        "dtype": label,
        "ours_ms": t["ours"],
        "optax_ms": t["optax"],
        "ratio": t["ours"] / t["optax"],
        "compile_s": ct,
        "compile_ratio": ct / ref_t,
        "tmp_mib": tmp,
        **counts,
        "norm_rel": abs(norm - ref_norm) / ref_norm,
    }
    _print(
        f"{name:<18} {r['ours_ms']:9.3f} {r['optax_ms']:9.3f} {r['ratio']:6.3f} {ct:9.2f} "
        f"{r['compile_ratio']:7.2f} {tmp:8.2f} {counts['fusions']:7d} {counts['conds']:5d} "
        f"{counts['reduces']:7d} {r['norm_rel']:13.2e}"
    )
    return r


def _chain_ratios(best: list[dict], tree: Any, label: str, reps: int) -> None:
    """Times ``chain(clip_by_global_norm, adamw)`` + apply for the variants ``best`` against optax's
    chain, recording each one's ``chain_ratio``."""
    params = jax.tree_util.tree_map(lambda x: x * 10, tree)
    fns: dict[str, Any] = {}
    for r in best:
        with _Setting(r["strategy"], r["pack"]):
            tx = optax.chain(gcx.clip_by_global_norm(1.0), optax.adamw(1e-4))
            st = tx.init(params)
            f = _step(tx).lower(params, tree, st).compile()
        fns[r["variant"]] = lambda f=f, st=st: f(params, tree, st)
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    ref_st = ref_tx.init(params)
    ref_f = _step(ref_tx).lower(params, tree, ref_st).compile()
    fns["optax"] = lambda: ref_f(params, tree, ref_st)
    t = interleaved_ms(fns, reps=reps, max_s=20.0)
    for r in best:
        r["chain_ratio"] = t[r["variant"]] / t["optax"]
        _print(
            f"[{label}] chain(clip, adamw)+apply {r['variant']:<18} {t[r['variant']]:9.3f} ms vs optax "
            f"{t['optax']:9.3f} ms = {r['chain_ratio']:.3f}"
        )


def probe_dtype(dtype: Any, label: str, reps: int, deadline: float, names: list[str]) -> list[dict]:
    tree = (
        gpt2_grad_tree(dtype=dtype)
        if not _small()
        else gpt2_grad_tree(layers=2, d=16, vocab=100, ctx=32, dtype=dtype)
    )
    jax.block_until_ready(tree)
    ref_c, ref_s, ref_t = _compile(lambda: optax.clip_by_global_norm(1.0), tree)
    # reference: float32 squares, one plain XLA sum per leaf (optax's bf16 norm is off by ~1e-3)
    ref_norm = float(
        jnp.sqrt(
            sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree))
        )
    )
    ref_tmp = ref_c.memory_analysis().temp_size_in_bytes / 2**20
    _print(
        f"[{label}] optax: compile {ref_t:.2f} s, temporaries {ref_tmp:.2f} MiB, {hlo_counts(ref_c)}"
    )
    _print(
        f"{'variant':<18} {'ours ms':>9} {'optax ms':>9} {'ratio':>6} {'compile s':>9} {'c-ratio':>7} "
        f"{'tmp MiB':>8} {'fusions':>7} {'conds':>5} {'reduces':>7} {'norm rel diff':>13}"
    )
    rows = []
    for name, strategy, pack in VARIANTS:
        if name not in names:
            continue
        if time.perf_counter() > deadline:
            _print(f"{name:<18} skipped: out of time (--budget)")
            continue
        rows.append(
            _variant_row(name, strategy, pack, tree, (ref_c, ref_s, ref_t, ref_norm), label, reps)
        )
    # the chain for the two fastest variants
    best = sorted(rows, key=lambda r: r["ratio"])[:2]
    if best and time.perf_counter() < deadline:
        _chain_ratios(best, tree, label, reps)
    elif best:
        _print(f"[{label}] chain rows skipped: out of time (--budget)")
    return rows


def _small() -> bool:
    return os.environ.get("GCX_BENCH_SMALL", "") not in ("", "0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--small", action="store_true", help="a tiny tree (same as GCX_BENCH_SMALL=1)"
    )
    parser.add_argument(
        "--budget", type=float, default=270.0, help="seconds before remaining rows are skipped"
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    if args.small:
        os.environ["GCX_BENCH_SMALL"] = "1"
    start = time.perf_counter()
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    dts = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    _print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}; "
        f"defaults SUMSQ_STRATEGY={_norms.SUMSQ_STRATEGY} GLOBAL_PACK_MAX_SIZE={_norms.GLOBAL_PACK_MAX_SIZE}"
    )
    rows: list[dict] = []
    for i, label in enumerate(dts):
        dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[label]
        # give each dtype its share of the budget
        share = start + args.budget * (i + 1) / len(dts)
        rows += probe_dtype(dtype, label, args.reps, share, names)
    if rows:
        _print("\nsummary (ratio = ours / optax, < 1 is better; clip alone):")
        by_variant: dict[str, list[dict]] = {}
        for r in rows:
            by_variant.setdefault(r["variant"], []).append(r)
        for name, rs in by_variant.items():
            worst = max(r["ratio"] for r in rs)
            _print(
                f"  {name:<18} worst ratio over dtypes {worst:.3f}; compile ratios "
                + ", ".join(f"{r['dtype']} {r['compile_ratio']:.2f}" for r in rs)
            )
        full = [n for n, rs in by_variant.items() if len(rs) == len(dts)]
        if full:
            win = min(full, key=lambda n: max(r["ratio"] for r in by_variant[n]))
            strategy, pack = next((s, p) for n, s, p in VARIANTS if n == win)
            _print(
                f"winner (best worst-case runtime ratio): {win} -> in gradclip_jax/_core/norms/ set "
                f"SUMSQ_STRATEGY['gpu'] = SUMSQ_STRATEGY['cuda'] = {strategy!r} and "
                f"GLOBAL_PACK_MAX_SIZE['gpu'] = GLOBAL_PACK_MAX_SIZE['cuda'] = "
                f"{'PACK_MAX_SIZE' if pack else 0}"
            )
    _print(f"total {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
