"""The GPU DP-step suite's results: merged across runs, written as JSON and Markdown, and as rows."""

from __future__ import annotations

import json
import pathlib
import platform
import time
from collections.abc import Sequence
from typing import Any

import jax
import optax

from benchmarks.common import row, same_measurement
from benchmarks.ghost_gpu.configs import CONFIGS, STEP_TITLES, STEPS
from benchmarks.steps import NOISE_MULTIPLIER

RESULTS_JSON = "ghost_gpu.json"
RESULTS_MD = "GHOST_GPU.md"
_TABLES = (  # title, baseline key and format, ratio key and format, baseline unit
    ("Step time (ratio to non-private)", "ms", ".2f", "time_x", ".2f", "ms"),
    ("Compiled temporaries (ratio to non-private)", "temp_mb", ".1f", "temp_x", ".2f", "MiB"),
    (
        "Trace + lower + compile time (ratio to non-private)",
        "compile_s",
        ".1f",
        "compile_x",
        ".2f",
        "s",
    ),
)


def meta(tiny: bool) -> dict[str, Any]:
    """The versions, device and sizes a run's results were measured with."""
    import flax

    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "machine": f"{platform.machine()} {platform.system()}",
        "sizes": "tiny (smoke)" if tiny else "full",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _step_cell(rec: dict[str, Any], key: str, spec: str) -> str:
    if "error" in rec:
        return "error"
    if "skipped" in rec:
        return "-"
    return _fmt(rec.get(key), spec)


def _header(m: dict[str, Any]) -> list[str]:
    return [
        "# Ghost clipping on the GPU: DP training steps against the non-private step",
        "",
        f"jax {m['jax']}, flax {m['flax']}, optax {m['optax']}, backend {m['backend']} "
        f"({m['device']}), {m['machine']}, sizes: {m['sizes']}, {m['date']}.",
        "",
        "Every DP step is a full step: the clipped sum (C = 1), Gaussian noise of standard deviation z C "
        f"(z = {NOISE_MULTIPLIER:g}), division by the batch size and adamw; the non-private step is "
        "`jax.grad` of the mean loss and adamw. Jitted with the training state donated, compiled once. "
        "Times are medians over interleaved rounds (one step of each variant per round); ratios are to "
        "the non-private step of the same config in the same process (< 1 would be faster).",
        "",
    ]


def _tables(configs: Sequence[dict[str, Any]]) -> list[str]:
    steps = [s for s in STEPS if s != "nonprivate"]
    lines = []
    for title, base_key, base_spec, key, spec, unit in _TABLES:
        lines += [
            f"## {title}",
            "",
            f"| config | model | params | B | non-private ({unit}) | "
            + " | ".join(STEP_TITLES[s] for s in steps)
            + " |",
            "|---|---|---:|---:|---:|" + "---:|" * len(steps),
        ]
        for c in configs:
            recs = c["steps"]
            cells = [_step_cell(recs.get(s, {"skipped": ""}), key, spec) for s in steps]
            lines.append(
                f"| {c['config']} | {c['label']} | {c['params'] / 1e6:.1f}M | {c['batch']} | "
                f"{_step_cell(recs.get('nonprivate', {}), base_key, base_spec)} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    return lines


def _report_note(g: dict[str, Any]) -> str:
    if "error" in g:
        return f"ghost_report failed: {g['error']}"
    reasons = "; ".join(f'{n}x "{r}"' for r, n in g.get("fallback_reasons", {}).items()) or "none"
    kinds = ", ".join(f"{k} {n}" for k, n in g.get("ghost_kinds", {}).items()) or "none"
    rep = (
        f"ghost_report: {g.get('ghost')}/{g.get('leaves')} leaves on the ghost path ({kinds}); "
        f"{g.get('fallback')} fall back to per-example gradients, reasons: {reasons}"
    )
    if g.get("fallback_leaves"):
        shown = g["fallback_leaves"][:8]
        more = len(g["fallback_leaves"]) - len(shown)
        rep += f"; leaves: {', '.join(shown)}" + (f" and {more} more" if more > 0 else "")
    return rep


def _step_note(rec: dict[str, Any]) -> str:
    extra = []
    if "same_program_as" in rec:
        extra.append(f"same compiled program as {STEP_TITLES[rec['same_program_as']]}")
    if rec.get("earlier_run"):
        extra.append("measured in an earlier run (ratios to that run's non-private step)")
    if "skipped" in rec or "error" in rec:
        extra.append(rec.get("error") or rec["skipped"])
    if "peak_mb" in rec:
        extra.append(f"peak {rec['peak_mb']:.0f} MiB")
    if "conditionals" in rec:
        extra.append(
            f"{rec['conditionals']} conditionals, {rec['loops']} loops in the compiled program"
        )
    if "lower_s" in rec:
        extra.append(f"trace+lower {rec['lower_s']:.1f} s, XLA {rec['xla_compile_s']:.1f} s")
    if "xla_noautotune_s" in rec:
        extra.append(f"XLA without autotuning {rec['xla_noautotune_s']:.1f} s")
    if "rounds" in rec:
        extra.append(f"{rec['rounds']} rounds")
    return "; ".join(extra)


def _accuracy_notes(c: dict[str, Any]) -> list[str]:
    lines = []
    for setting, acc in c.get("product_accuracy", {}).items():
        if not isinstance(acc, dict):
            lines.append(f"  - product accuracy: {acc}")
        elif "error" in acc:
            lines.append(f"  - products at {setting}: accuracy check failed: {acc['error']}")
        else:
            lines.append(
                f"  - products at {setting} against HIGHEST: per-example norms within "
                f"{acc['norm_rel_err']:.1e} relative, clipped sum within {acc['sum_rel_err']:.1e}"
            )
    return lines


def markdown(m: dict[str, Any], configs: Sequence[dict[str, Any]]) -> str:
    """The results as Markdown: a table per measure, then notes per config and step."""
    lines = _header(m) + _tables(configs) + ["## Notes per config", ""]
    for c in configs:
        lines.append(f"- **{c['config']}**: {_report_note(c.get('ghost_report', {}))}.")
        lines += [f"  - {STEP_TITLES[s]}: {_step_note(rec)}" for s, rec in c["steps"].items()]
        if "timing_error" in c:
            lines.append(f"  - timing failed: {c['timing_error']}")
        lines += _accuracy_notes(c)
    return "\n".join(lines) + "\n"


def _measured(rec: dict[str, Any]) -> bool:
    return "skipped" not in rec


def merge_config(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the steps (and product accuracies) it did not measure taken from ``old``.

    So one config's steps can be measured in several runs (``GHOST_GPU_STEPS``),
    each within one device call. A step kept from ``old`` says so
    (``earlier_run``): its ratios are to the non-private step of its own run.
    """
    steps = dict(new["steps"])
    for name, rec in old.get("steps", {}).items():
        if _measured(rec) and not _measured(steps.get(name, {"skipped": ""})):
            steps[name] = {**rec, "earlier_run": True}
    merged = {**new, "steps": steps}
    acc = {**old.get("product_accuracy", {}), **new.get("product_accuracy", {})}
    if acc:
        merged["product_accuracy"] = acc
    return merged


def write_results(
    out: pathlib.Path, m: dict[str, Any], configs: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Merges ``configs`` into ``out/ghost_gpu.json`` (by config name, then by step: see
    :func:`merge_config`) when its sizes and device match (:func:`~benchmarks.common.same_measurement`),
    and rewrites both files."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_JSON
    known: dict[str, dict[str, Any]] = {}
    if path.exists():
        old = json.loads(path.read_text())
        if same_measurement(old.get("meta", {}), m):
            known = {c["config"]: c for c in old.get("configs", [])}
    for c in configs:
        known[c["config"]] = merge_config(known[c["config"]], c) if c["config"] in known else c
    order = [c.name for c in CONFIGS]
    merged = sorted(
        known.values(),
        key=lambda c: order.index(c["config"]) if c["config"] in order else len(order),
    )
    path.write_text(json.dumps({"meta": m, "configs": merged}, indent=1))
    (out / RESULTS_MD).write_text(markdown(m, merged))
    return merged


def rows_of(res: dict[str, Any]) -> list[dict]:
    """Rows for ``python -m benchmarks``: one per DP step with a time, ratio to the non-private step."""
    base = res["steps"].get("nonprivate", {})
    out = []
    for name, rec in res["steps"].items():
        if name == "nonprivate" or "ms" not in rec or "ms" not in base:
            continue
        note = (
            f"{res['label']}; temporaries {_fmt(rec.get('temp_x'), '.2f')}x ({rec['temp_mb']:.0f} MiB), "
            f"compile {_fmt(rec.get('compile_x'), '.2f')}x ({rec['compile_s']:.1f} s)"
        )
        if "same_program_as" in rec:
            note += f"; same program as {rec['same_program_as']}"
        kind = "step" if name.startswith("nonprivate") else "DP step"
        out.append(
            row(
                "ghost-gpu",
                f"{res['config']} {STEP_TITLES[name]} {kind} vs non-private step, B={res['batch']}",
                rec["ms"],
                base["ms"],
                note,
                temp_mb=rec["temp_mb"],
                baseline_temp_mb=base.get("temp_mb"),
                compile_s=rec["compile_s"],
                baseline_compile_s=base.get("compile_s"),
            )
        )
    return out
