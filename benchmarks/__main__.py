"""Runs every benchmark in one process and prints/saves the ratio table.

Usage: ``python -m benchmarks [--quick] [--only core,stateful,dp,noise,ghost,sampling,cost,calibration,compile,sharded,core-gpu] [--out DIR]``.
Writes ``DIR/results.json`` and ``DIR/RESULTS.md`` (default ``benchmarks/results``);
the GPU suites (``core-gpu``, not run by default) write ``DIR/results_<suite>.json``
and ``DIR/RESULTS_<suite>.md`` of their own, so a GPU run does not replace the
CPU table. A run with ``--only`` merges into the existing files (same ``--quick``
and backend): it replaces the rows of the groups it ran and keeps the others,
each row stamped with the date it was measured.
Ratios are ours / baseline measured in this process, so < 1 means faster.

Suites in ``EXTRA_SUITES`` run only when named in ``--only``: ``ghost-gpu``
(full DP training steps of GPT-2 small and WRN-16-4 on a GPU; ``--models``
picks its configs, ``--force-cpu`` makes a tiny smoke run without a GPU) writes
its own results files (``DIR/GHOST_GPU.md``, ``DIR/ghost_gpu.json``) and its
rows are printed but not added to ``RESULTS.md``; ``profile-gpu``
(``benchmarks/profile_gpu.py``: profiler traces of the non-private, ghost and
vmap steps of the same configs, by kernel category; ``--models`` as for
``ghost-gpu``, default ``gpt2-b8,wrn-b256``) writes ``DIR/PROFILE_GPU.md`` and
``DIR/profile_gpu.json`` the same way. ``cost`` (``bench_cost``) reads the DP
steps' programs on the CPU: FLOPs, bytes, HLO instructions, control flow and
the CUDA lowering's matmul precisions, as ratios to the non-private step;
``compile`` (``bench_compile``) splits the DP steps' compile time into trace, lower
and XLA compile, with their HLO instructions by source; ``sharded`` (``bench_sharded``,
in a process of its own with 8 simulated CPU devices) reads the Llama decoder's DP steps
sharded FSDP-style on 8x1, 2x4 and 1x8 meshes: per-device temporaries and all-gathers. ``cost``
also reads the Llama decoder's DP steps (``benchmarks/cost_llama.py``, full and LoRA) and checks
the MLP's ghost gradient for variadic reductions.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pathlib
import platform
import time

import jax

SUITES = (
    "core",
    "stateful",
    "dp",
    "noise",
    "ghost",
    "sampling",
    "cost",
    "calibration",
    "compile",
    "sharded",
)
GPU_SUITES = ("core-gpu",)  # rows go to results_<suite>.json / RESULTS_<suite>.md
EXTRA_SUITES = ("ghost-gpu", "profile-gpu", *GPU_SUITES)  # run only when named in --only
MODULES = {"profile-gpu": "benchmarks.profile_gpu"}  # the others: benchmarks.bench_<name>


def module_name(suite: str) -> str:
    """The module whose ``run`` runs ``suite``."""
    return MODULES.get(suite, f"benchmarks.bench_{suite.replace('-', '_')}")


def merge_rows(old: list[dict], new: list[dict], ran: set[str], date: str) -> list[dict]:
    """``new`` (stamped with ``date``) in place of the rows of the groups that ran (``ran``);
    the other groups' rows from ``old`` are kept, so ``--only`` replaces only what it measured.
    Rows keep the order of their groups' first appearance (old groups first)."""
    stamped = [{**r, "date": r.get("date", date)} for r in new]
    kept = [r for r in old if r["group"] not in ran | {r2["group"] for r2 in new}]
    order: list[str] = []
    for r in old + stamped:
        if r["group"] not in order:
            order.append(r["group"])
    merged = kept + stamped
    return sorted(merged, key=lambda r: order.index(r["group"]))  # stable: rows keep their order


def _markdown(rows: list[dict], meta: dict) -> str:
    dates: dict[str, set[str]] = {}
    for r in rows:
        dates.setdefault(r["group"], set()).add(r.get("date", meta["date"]))
    when = "; ".join(f"{g} {', '.join(sorted(d))}" for g, d in dates.items())
    lines = [
        "# Benchmark results",
        "",
        f"jax {meta['jax']}, backend {meta['backend']} ({meta['device']}), {meta['machine']}, "
        f"quick={meta['quick']}, {meta['date']}. Ratio = ours / baseline (< 1 is better).",
        "",
        f"Measured (per group): {when}. `--only` reruns replace their groups' rows and keep the others.",
        "",
        "| group | benchmark | ours (ms) | baseline (ms) | ratio | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['name']} | {r['ours_ms']:.2f} | {r['baseline_ms']:.2f} | "
            f"{r['ratio']:.3f} | {r.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="gradclip_jax benchmarks")
    parser.add_argument("--quick", action="store_true", help="small trees and few repetitions")
    parser.add_argument("--only", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument(
        "--models", default=None, help="ghost-gpu, profile-gpu: configs to run (e.g. gpt2,wrn)"
    )
    parser.add_argument(
        "--force-cpu",
        action="store_true",
        help="ghost-gpu, profile-gpu: tiny smoke run without a GPU",
    )
    return parser


def _run_suite(name: str, args: argparse.Namespace) -> list[dict]:
    """Runs suite ``name`` with the flags it takes, printing each row; returns its rows."""
    mod = importlib.import_module(module_name(name))
    params = inspect.signature(mod.run).parameters
    extra = {
        k: v
        for k, v in (
            ("out", args.out),
            ("models", args.models),
            ("force", True if args.force_cpu else None),
        )
        if k in params
    }
    t0 = time.perf_counter()
    suite_rows = mod.run(quick=args.quick, **extra)
    for r in suite_rows:
        unit = r.get("unit", "ms")  # rows of counts or sizes name their unit
        print(
            f"[{r['group']}] {r['name']}: {r['ours_ms']:.2f} {unit} vs {r['baseline_ms']:.2f} {unit} "
            f"= {r['ratio']:.3f}  {r.get('note', '')}",
            flush=True,
        )
    print(f"-- {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return suite_rows


def _write(rows: list[dict], names: list[str], args: argparse.Namespace) -> None:
    """Merges ``rows`` into the results file of these suites and writes its Markdown table."""
    meta = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "machine": f"{platform.machine()} {platform.system()}",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d"),
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu_only = all(n in EXTRA_SUITES for n in names)  # rows only from GPU suites
    suffix = "_" + "+".join(n for n in names if n in GPU_SUITES) if gpu_only else ""
    path = out / f"results{suffix}.json"
    old_rows: list[dict] = []
    if path.exists():
        previous = json.loads(path.read_text())
        old_meta = previous.get("meta", {})
        if old_meta.get("quick") == args.quick and old_meta.get("backend") == meta["backend"]:
            old_rows = [
                {**r, "date": r.get("date", old_meta.get("date", "?"))}
                for r in previous.get("rows", [])
            ]
    rows = merge_rows(old_rows, rows, set(names), meta["date"])
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"RESULTS{suffix}.md").write_text(_markdown(rows, meta))
    print(f"wrote {out / f'results{suffix}.json'} and {out / f'RESULTS{suffix}.md'}")


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    # The suites time compilations: a program read back from JAX's persistent cache (a user's or
    # CI's JAX_COMPILATION_CACHE_DIR) would time the read. JAX decides once, at the first compile,
    # whether it uses the cache, so this is set before any.
    jax.config.update("jax_enable_compilation_cache", False)
    rows: list[dict] = []
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    for name in names:
        if name not in SUITES + EXTRA_SUITES:
            parser.error(
                f"--only: unknown suite {name!r}; known: {', '.join(SUITES + EXTRA_SUITES)}"
            )
        suite_rows = _run_suite(name, args)
        if (
            name not in EXTRA_SUITES or name in GPU_SUITES
        ):  # ghost-gpu, profile-gpu write their own files
            rows += suite_rows
    if not rows:  # (also: rows only from GPU suites, without a GPU: nothing to write)
        return
    _write(rows, names, args)


if __name__ == "__main__":
    main()
