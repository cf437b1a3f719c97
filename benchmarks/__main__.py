"""Runs every benchmark in one process and prints/saves the ratio table.

Usage: ``python -m benchmarks [--quick] [--only core,stateful,dp,ghost] [--out DIR]``.
Writes ``DIR/results.json`` and ``DIR/RESULTS.md`` (default ``benchmarks/results``).
Ratios are ours / baseline measured in this process, so < 1 means faster.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import platform
import time

import jax

SUITES = ("core", "stateful", "dp", "ghost")


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"jax {meta['jax']}, backend {meta['backend']} ({meta['device']}), {meta['machine']}, "
        f"quick={meta['quick']}, {meta['date']}. Ratio = ours / baseline (< 1 is better).",
        "",
        "| group | benchmark | ours (ms) | baseline (ms) | ratio | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['group']} | {r['name']} | {r['ours_ms']:.2f} | {r['baseline_ms']:.2f} | "
                     f"{r['ratio']:.3f} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="gradclip_jax benchmarks")
    parser.add_argument("--quick", action="store_true", help="small trees and few repetitions")
    parser.add_argument("--only", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    rows: list[dict] = []
    for name in args.only.split(","):
        mod = importlib.import_module(f"benchmarks.bench_{name.strip()}")
        t0 = time.perf_counter()
        suite_rows = mod.run(quick=args.quick)
        for r in suite_rows:
            print(f"[{r['group']}] {r['name']}: {r['ours_ms']:.2f} ms vs {r['baseline_ms']:.2f} ms "
                  f"= {r['ratio']:.3f}  {r.get('note', '')}", flush=True)
        print(f"-- {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        rows += suite_rows
    meta = {"jax": jax.__version__, "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
            "machine": f"{platform.machine()} {platform.system()}", "quick": args.quick,
            "date": time.strftime("%Y-%m-%d")}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "RESULTS.md").write_text(_markdown(rows, meta))
    print(f"wrote {out / 'results.json'} and {out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
