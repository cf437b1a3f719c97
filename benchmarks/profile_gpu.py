"""Profile of the DP training steps: where each step's device time goes, kernel by kernel.

For each chosen config of ``bench_ghost_gpu`` (``--models``, default
``gpt2-b8,wrn-b256``; the same models, batch sizes and step builders) it
compiles the ``nonprivate``, ``ghost`` and ``vmap`` steps (state donated), runs
a few warm-up steps, then records a few more with
``jax.profiler.trace(logdir, create_perfetto_trace=True)`` (one trace per
step) and reads the ``perfetto_trace.json.gz`` written under ``logdir`` with
the standard library (Chrome trace-event format).

Which events count (:func:`summarize`): on a GPU the kernels and copies on the
device's streams (process ``/device:GPU:N``, threads named ``Stream ...``;
the ``classifier`` field says ``device``); where the trace holds no device
kernels (the CPU) the XLA ops, which run on host threads and carry an
``hlo_op`` argument (``classifier`` ``host``). Nested events (an XLA:CPU ``while`` and the ops of
its body) count by their own time, less their children's. Each event falls
into one category (:func:`categorize`, from its name, its HLO op and what the
compiled program says that op holds, :func:`hlo_hints`):

* ``matmul_<precision>``: by the kernel name where it tells (``tf32``:
  ``tf32``, ``s1688``/``s16816`` names; ``f32``: ``sgemm``, ``ffma``,
  ``f32f32_f32f32``, SIMT kernels; ``bf16``; ``fp16``), else by the HLO dot's
  precision (``highest``, ``default``: float32 on the CPU, TF32 on NVIDIA
  GPUs from Ampere on; ``3xtf32``, ``6xbf16``: reduced-pass algorithms);
* ``convolution``; then ``loop``: anything else run inside a while body
  (matmuls and convolutions keep their own category wherever they run;
  ``in_while_ms`` adds up everything inside while bodies); ``reduction``;
  ``copy`` (copies, transposes, device-to-device memcpy, slices);
  ``transfer`` (memcpy host to device or back: a conditional's predicate, for
  one); ``other``.

Each step gets: the total time per training step (device time, or on the CPU
host-op time summed over the threads that ran ops), the wall time per step
while traced, the time and share of each category, the time by source (which
part of the step wrote each kernel: the model's forward and backward pass, the
per-example norms, the clipped sum, the noise or the optimizer, read from the
compiled program, :func:`benchmarks.hlo_program.hlo_phases`) with its
difference to the non-private step's, and the 15 kernels that took longest. Results: ``OUT/profile_gpu.json`` (merged by config with the
configs already there) and ``OUT/PROFILE_GPU.md``.

Without a GPU it prints why and does nothing unless ``--tiny`` or
``--force-cpu`` asks for a smoke run of the tiny models on the CPU.
``PROFILE_GPU_BUDGET_S`` (default 540) stops compiling new steps once that
many seconds would be spent. ``PROFILE_GPU_STEPS`` (comma-separated steps of
``bench_ghost_gpu``, default ``ghost,vmap``) picks the steps profiled beside
the non-private one, which is always profiled first (the ratios are to it).

Run: ``python -m benchmarks.profile_gpu --models gpt2-b8,wrn-b256 --out DIR`` or
``python -m benchmarks --only profile-gpu --out DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import pathlib
import re
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks.common import num_params, row, same_measurement
from benchmarks.ghost_gpu.configs import Config, build, parse_steps, select
from benchmarks.ghost_gpu.timing import Runner, control_flow
from benchmarks.ghost_gpu.variants import error_text, step_variants
from benchmarks.hlo_program import PHASES, hlo_hints, hlo_phases
from benchmarks.steps import fresh_state

GROUP = "profile-gpu"
RESULTS_JSON = "profile_gpu.json"
RESULTS_MD = "PROFILE_GPU.md"
DEFAULT_MODELS = "gpt2-b8,wrn-b256"
STEPS = ("nonprivate", "ghost", "vmap")
TOP_KERNELS = 15  # in the Markdown report
TOP_KERNELS_JSON = 60  # in the JSON: a GPU call is rare, keep what a later reading may need
DEFAULT_BUDGET_S = 540.0
CATEGORIES = (
    "matmul_f32",
    "matmul_highest",
    "matmul_tf32",
    "matmul_3xtf32",
    "matmul_bf16",
    "matmul_6xbf16",
    "matmul_fp16",
    "matmul_default",
    "matmul_unknown",
    "convolution",
    "loop",
    "reduction",
    "copy",
    "transfer",
    "other",
)

# ----------------------------------------------------------------------------- categories

_TRANSFER = re.compile(r"memcpy\s*_?(htod|dtoh|h2d|d2h)|\b(htod|dtoh|h2d|d2h)\b")
_CONV = re.compile(r"convolution|conv(?!ert)|fprop|dgrad|wgrad|implicit_gemm|winograd")
_MATMUL = re.compile(r"gemm|cublas|cutlass|xmma|matmul|(^|[^a-z])dot([^a-z]|$)")
_WHILE_NAME = re.compile(r"^while([._\-/]|$)|while[._/]body|_body([._]|$)")
_WHILE_SCOPE = re.compile(r"(^|/)while/body(/|$)|(^|/)while(/|$)")
_COPY = re.compile(
    r"copy|transpose|memcpy|concatenate|dynamic[-_]update[-_]slice|dynamic[-_]slice|"
    r"(^|[^a-z])slice|(^|[^a-z])pad([^a-z]|$)"
)
_SCOPE_KEYS = ("tf_op", "long_name", "op_name", "name_scope", "scope")


def _matmul_precision(name: str, hint: str) -> str:
    """What the kernel name says of a matmul's arithmetic, else the HLO dot's precision."""
    if "bf16" in name:
        return "bf16"
    if re.search(r"f16|h1688|h16816|hgemm|half", name):
        return "fp16"
    if re.search(r"tf32|s1688|s16816", name):
        return "tf32"
    if re.search(r"sgemm|ffma|f32f32_f32f32|simt", name):
        return "f32"
    words = hint.split()
    if len(words) > 1 and words[0] == "dot" and f"matmul_{words[1]}" in CATEGORIES:
        return words[1]
    return "unknown"


def categorize(name: str, args: dict[str, Any]) -> str:
    """The category (one of :data:`CATEGORIES`) of one trace event.

    ``name`` is the kernel's (or XLA:CPU op's) name; ``args`` its trace
    arguments, of which ``hlo_op`` (the HLO instruction), the scope keys
    (``tf_op``, ``long_name``, ...: JAX's ``jit(f)/while/body/...`` names) and
    the keys :func:`summarize` adds are read: ``hlo`` (what the compiled
    program says the op holds, :func:`hlo_hints`: ``"dot highest"``,
    ``"convolution default"``, ``"reduce"``, ``"copy"``, ``"while"``, ...,
    ending in ``" in_while"`` inside a while body), ``in_while`` (the event runs
    inside a while op's event) and ``thread`` (its thread's name).
    """
    n = name.lower()
    hint = str(args.get("hlo", "")).lower()
    op = str(args.get("hlo_op", "")).lower()
    thread = str(args.get("thread", "")).lower()
    scope = " ".join(str(args.get(k, "")) for k in _SCOPE_KEYS).lower()
    if _TRANSFER.search(n) or (
        "memcpy" in n and _TRANSFER.search(thread.replace("memcpy", "memcpy "))
    ):
        return "transfer"
    if _CONV.search(n) or hint.startswith("convolution") or op.startswith("convolution"):
        return "convolution"
    if _MATMUL.search(n) or hint.startswith("dot") or _MATMUL.search(op):
        return f"matmul_{_matmul_precision(n, hint)}"
    if (
        args.get("in_while")
        or hint.endswith(" in_while")
        or hint.startswith("while")
        or _WHILE_NAME.search(n)
        or _WHILE_SCOPE.search(scope)
    ):
        return "loop"
    if "reduc" in n or hint.startswith("reduce") or op.startswith("reduce"):
        return "reduction"
    if _COPY.search(n) or hint.startswith("copy") or _COPY.search(op):
        return "copy"
    return "other"


# ----------------------------------------------------------------------------- the trace


def _names(events: list[dict]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    """Process and thread names from the metadata events (``ph == "M"``)."""
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return procs, threads


def _select(events: list[dict]) -> tuple[list[dict], str, str]:
    """The events that are kernels or ops: ``(events, classifier, where)``. Device kernels where the
    trace has a device process with any, else the XLA ops run on host threads."""
    procs, threads = _names(events)
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    device = {pid for pid, n in procs.items() if "/device:" in n.lower()}
    streams = {k for k, n in threads.items() if k[0] in device and "stream" in n.lower()}
    if not streams:  # no CUDA streams (a TPU, say): its op line
        streams = {k for k, n in threads.items() if k[0] in device and n.lower() == "xla ops"}
    chosen = [
        e
        for e in complete
        if ((e["pid"], e.get("tid")) in streams if streams else e["pid"] in device)
    ]
    if chosen:
        lines = sorted({threads.get(k, str(k[1])) for k in streams}) or ["all threads"]
        where = f"device kernels: {', '.join(sorted(procs[p] for p in device))}; {', '.join(lines)}"
        return chosen, "device", where
    chosen = [
        e
        for e in complete
        if "hlo_op" in e.get("args", {}) and not str(e.get("name", "")).startswith("end: ")
    ]
    lines = sorted({threads.get((e["pid"], e.get("tid")), "?").split("/")[0] for e in chosen})
    note = "no device kernels in the trace; " if device else ""
    return (
        chosen,
        "host",
        f"{note}XLA ops (events with an hlo_op) on host threads: {', '.join(lines) or 'none'}",
    )


def _nest(
    evs: list[dict], thread: str, hints: dict[str, str], phases: dict[str, str]
) -> list[tuple[str, dict[str, Any], float]]:
    """``(name, args, self time in us)`` of the events of one thread: each event's duration less
    its nested children's, with ``thread``, ``hlo``, ``phase`` (:func:`~benchmarks.hlo_program.hlo_phases`)
    and ``in_while`` (inside a while op's event) added to its args."""
    out: list[tuple[str, dict[str, Any], float]] = []
    stack: list[list[Any]] = []  # [end, name, args, self time, children run in a loop]
    for e in sorted(evs, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        ts, dur = float(e["ts"]), float(e["dur"])
        while stack and (stack[-1][0] <= ts + 1e-3 or ts + dur > stack[-1][0] + 1e-3):
            _, name, args, self_us, _ = stack.pop()
            out.append((name, args, max(self_us, 0.0)))
        name = str(e.get("name", ""))
        op = str(e.get("args", {}).get("hlo_op", name))
        hint = hints.get(op, hints.get(name, ""))
        phase = phases.get(op, phases.get(name, "unattributed"))
        in_loop = bool(stack and stack[-1][4])
        if stack:
            stack[-1][3] -= dur
        is_while = bool(_WHILE_NAME.match(name.lower())) or hint.startswith("while")
        args = {
            **e.get("args", {}),
            "thread": thread,
            "hlo": hint,
            "phase": phase,
            "in_while": in_loop,
        }
        stack.append([ts + dur, name, args, dur, in_loop or is_while])
    out += [(name, args, max(self_us, 0.0)) for _, name, args, self_us, _ in reversed(stack)]
    return out


def _self_times(
    events: list[dict],
    threads: dict[tuple[Any, Any], str],
    hints: dict[str, str],
    phases: dict[str, str],
) -> list[tuple[str, dict[str, Any], float]]:
    """:func:`_nest` over the events of each thread."""
    by_thread: dict[tuple[Any, Any], list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    return [
        t for key, evs in by_thread.items() for t in _nest(evs, threads.get(key, ""), hints, phases)
    ]


def _in_while(name: str, args: dict[str, Any]) -> bool:
    scope = " ".join(str(args.get(k, "")) for k in _SCOPE_KEYS).lower()
    return bool(
        args.get("in_while")
        or str(args.get("hlo", "")).endswith(" in_while")
        or _WHILE_SCOPE.search(scope)
        or _WHILE_NAME.search(name.lower())
    )


def summarize(
    trace_json: dict[str, Any],
    steps: int,
    hints: dict[str, str] | None = None,
    phases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Per training step, from a Chrome-format trace of ``steps`` steps: ``ms_per_step``,
    ``categories`` (ms per step by :func:`categorize`'s category, largest first), ``shares``,
    ``phases`` (ms per step by the part of the DP step that wrote each op, in the order of
    :data:`~benchmarks.hlo_program.PHASES`),
    ``in_while_ms``, ``top`` (the :data:`TOP_KERNELS_JSON` longest kernels: name, category, source
    (the part of the step), ms and calls per step, share), ``classifier`` (``device`` or ``host``), ``source`` and ``events``.

    ``hints`` (:func:`~benchmarks.hlo_program.hlo_hints` of the compiled step) tell what each HLO
    op holds, ``phases`` (:func:`~benchmarks.hlo_program.hlo_phases`) which part of the step wrote it.
    """
    events = trace_json.get("traceEvents", [])
    chosen, classifier, where = _select(events)
    _, threads = _names(events)
    timed = _self_times(chosen, threads, hints or {}, phases or {})
    categories: dict[str, float] = defaultdict(float)
    by_phase: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[Any]] = {}
    in_while = 0.0
    for name, args, us in timed:
        cat = categorize(name, args)
        categories[cat] += us
        by_phase[args["phase"]] += us
        k = kernels.setdefault(name, [cat, 0.0, 0, args["phase"]])
        k[1] += us
        k[2] += 1
        if k[3] != args["phase"]:  # one library kernel (a cuBLAS gemm) run for ops of several parts
            k[3] = "mixed"
        in_while += us if _in_while(name, args) else 0.0
    total = sum(categories.values())
    per = 1e-3 / max(steps, 1)  # us over the trace -> ms per step
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS_JSON]
    return {
        "classifier": classifier,
        "source": where,
        "steps": steps,
        "events": len(timed),
        "ms_per_step": total * per,
        "categories": {c: v * per for c, v in sorted(categories.items(), key=lambda cv: -cv[1])},
        "shares": {
            c: (v / total if total else 0.0)
            for c, v in sorted(categories.items(), key=lambda cv: -cv[1])
        },
        "phases": {p: by_phase[p] * per for p in PHASES if p in by_phase},
        "in_while_ms": in_while * per,
        "top": [
            {
                "name": n,
                "category": c,
                "source": src,
                "ms": us * per,
                "calls": calls / max(steps, 1),
                "share": us / total if total else 0.0,
            }
            for n, (c, us, calls, src) in top
        ],
    }


def find_trace(logdir: str | pathlib.Path) -> pathlib.Path:
    """The newest ``perfetto_trace.json.gz`` under ``logdir``."""
    found = sorted(
        pathlib.Path(logdir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime
    )
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {logdir}")
    return found[-1]


def load_trace(path: str | pathlib.Path) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


# ----------------------------------------------------------------------------- measuring


def trace_steps(
    run_step: Callable[[], Any], logdir: pathlib.Path, steps: int
) -> tuple[dict[str, Any], float]:
    """``steps`` calls of ``run_step`` under the profiler: ``(trace, wall ms per step)``."""
    logdir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("dp_step", step_num=i):
                run_step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    return load_trace(find_trace(logdir)), wall_ms


def profile_step(
    step: Callable,
    params: Any,
    data: Any,
    seed: int,
    *,
    warmup: int,
    steps: int,
    logdir: pathlib.Path,
) -> dict[str, Any]:
    """Compiles one step, runs ``warmup`` steps, traces ``steps`` more and summarizes them."""
    t0 = time.perf_counter()
    state = fresh_state(params, seed)
    compiled = jax.jit(step, donate_argnums=0).lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    hints, phases = hlo_hints(text), hlo_phases(text)
    runner = Runner(compiled, state, data)
    for _ in range(warmup):
        runner()
    trace, wall_ms = trace_steps(runner, logdir, steps)
    return {
        **summarize(trace, steps, hints, phases),
        "wall_ms": wall_ms,
        "compile_s": compile_s,
        **control_flow(compiled),
    }


def chosen_steps(wanted: str | None) -> tuple[str, ...]:
    """The steps to profile: ``nonprivate`` first, then those of ``wanted`` (default :data:`STEPS`)."""
    names = parse_steps(wanted, "PROFILE_GPU_STEPS", STEPS)
    return ("nonprivate", *dict.fromkeys(n for n in names if n != "nonprivate"))


def measure(
    cfg: Config,
    *,
    tiny: bool,
    warmup: int,
    steps: int,
    trace_root: pathlib.Path,
    deadline: float,
    clock: dict[str, float],
    names: Sequence[str] = STEPS,
) -> dict[str, Any]:
    """Profiles the steps ``names`` (``nonprivate`` among them) of one config."""
    losses, params, data, label, batch = build(cfg, tiny)
    fns = step_variants(dataclasses.replace(cfg, steps=tuple(names)), losses, batch, tuple(names))
    res: dict[str, Any] = {
        "config": cfg.name,
        "label": label,
        "batch": batch,
        "params": num_params(params),
        "steps": {},
    }
    for i, name in enumerate(names):
        if time.perf_counter() + clock.get("max_s", 0.0) > deadline:
            res["steps"][name] = {
                "skipped": "skipped: time budget (PROFILE_GPU_BUDGET_S) would be spent"
            }
            continue
        t0 = time.perf_counter()
        try:
            rec = profile_step(
                fns[name],
                params,
                data,
                i,
                warmup=warmup,
                steps=steps,  # type: ignore[arg-type]
                logdir=trace_root / cfg.name / name,
            )
        except Exception as err:  # one failing step must not lose the others
            traceback.print_exc()
            rec = {"error": error_text(err)}
        clock["max_s"] = max(clock.get("max_s", 0.0), time.perf_counter() - t0)
        res["steps"][name] = rec
        print(
            f"[profile-gpu {cfg.name}] {name}: "
            + (
                rec.get("error")
                or f"{rec['ms_per_step']:.2f} ms/step "
                f"({rec['classifier']}), wall {rec['wall_ms']:.2f} ms"
            ),
            flush=True,
        )
    base = res["steps"]["nonprivate"].get("ms_per_step")
    for rec in res["steps"].values():
        if base and "ms_per_step" in rec:
            rec["time_x"] = rec["ms_per_step"] / base
    return res


# ----------------------------------------------------------------------------- results


def _cell(ms: float | None, share: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f} ({100 * (share or 0.0):.0f}%)"


def _config_lines(c: dict[str, Any]) -> list[str]:
    recs = {s: r for s, r in c["steps"].items() if "ms_per_step" in r}
    cats = [k for k in CATEGORIES if any(k in r["categories"] for r in recs.values())]
    lines = [
        f"## {c['config']}: {c['label']}, {c['params'] / 1e6:.2f}M params, B={c['batch']}",
        "",
        "| step | ms/step | x non-private | wall ms/step | in while bodies | "
        + " | ".join(f"{k} ms (share)" for k in cats)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(cats),
    ]
    for s, r in c["steps"].items():
        if s not in recs:
            lines.append(f"| {s} | {r.get('error') or r.get('skipped', '-')} |")
            continue
        cells = [_cell(r["categories"].get(k), r["shares"].get(k)) for k in cats]
        lines.append(
            f"| {s} | {r['ms_per_step']:.2f} | {r.get('time_x', float('nan')):.2f} | {r['wall_ms']:.2f} | "
            f"{r['in_while_ms']:.2f} | " + " | ".join(cells) + " |"
        )
    lines += ["", *_phase_lines(c["config"], recs)]
    for s, r in recs.items():
        lines += [
            f"### {c['config']} {s}: top {len(r['top'][:TOP_KERNELS])} kernels ({r['classifier']}: {r['source']}; "
            f"{r.get('conditionals', '?')} conditionals, {r.get('loops', '?')} loops in the compiled program)",
            "",
            "| # | kernel | category | source | ms/step | calls/step | share |",
            "|---:|---|---|---|---:|---:|---:|",
        ]
        for i, k in enumerate(r["top"][:TOP_KERNELS], 1):
            name = k["name"].replace("|", "\\|")
            name = name if len(name) <= 110 else name[:107] + "..."
            lines.append(
                f"| {i} | `{name}` | {k['category']} | {k.get('source', '-')} | {k['ms']:.3f} | {k['calls']:g} | "
                f"{100 * k['share']:.1f}% |"
            )
        lines.append("")
    return lines


def _phase_lines(config: str, recs: dict[str, dict[str, Any]]) -> list[str]:
    """The steps' time by the part of the step that wrote each kernel, and each part's difference
    to the non-private step's (a record without ``phases``, from an older run, is left out)."""
    recs = {s: r for s, r in recs.items() if "phases" in r}
    if not recs:
        return []
    cols = [p for p in PHASES if any(p in r["phases"] for r in recs.values())]
    base = recs.get("nonprivate", {}).get("phases", {})
    lines = [
        f"### {config}: time by source (ms/step; in brackets, the difference to the non-private step)",
        "",
        "| step | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for s, r in recs.items():
        cells = [
            f"{r['phases'].get(p, 0.0):.2f}"
            + ("" if s == "nonprivate" else f" ({r['phases'].get(p, 0.0) - base.get(p, 0.0):+.2f})")
            for p in cols
        ]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def markdown(meta: dict[str, Any], configs: Sequence[dict[str, Any]]) -> str:
    """The results as Markdown: per config a table of steps by category, then each step's top kernels."""
    lines = [
        "# Where the DP steps' time goes: profiler traces",
        "",
        f"jax {meta['jax']}, backend {meta['backend']} ({meta['device']}), sizes: {meta['sizes']}, "
        f"{meta['warmup']} warm-up steps, {meta['steps']} traced steps per step function, {meta['date']}.",
        "",
        f"Classifier: {meta['classifier']}. ms/step is the time of the kernels (on the CPU: the XLA ops, summed "
        "over the threads that ran them) per training step, each nested event by its own time; "
        "wall ms/step is the host's clock over the traced steps. Categories: matmul_<p> by the kernel "
        "name where it tells the arithmetic (f32, tf32, bf16, fp16), else by the HLO dot's precision "
        "(highest; default: float32 on the CPU, TF32 on NVIDIA GPUs from Ampere on; 3xtf32, 6xbf16); "
        "loop = whatever else runs in a while body; transfer = memcpy between host and device. "
        "Sources: each kernel by the code that wrote its (root) operation (benchmarks.hlo_program.PHASES): "
        "model (forward and backward, the ghost path's replay of them, the step's own code), norms "
        "(per-example norms and clip factors), clipped sum, noise, optimizer.",
        "",
    ]
    for c in configs:
        lines += _config_lines(c)
    return "\n".join(lines) + "\n"


def write_results(
    out: pathlib.Path, meta: dict[str, Any], configs: Sequence[dict[str, Any]]
) -> list[dict]:
    """Merges ``configs`` (by name) into ``out/profile_gpu.json`` when its sizes and device match
    (:func:`~benchmarks.common.same_measurement`); rewrites both files."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_JSON
    known: dict[str, dict[str, Any]] = {}
    if path.exists():
        old = json.loads(path.read_text())
        if same_measurement(old.get("meta", {}), meta):
            known = {c["config"]: c for c in old.get("configs", [])}
    known.update({c["config"]: c for c in configs})
    merged = list(known.values())
    path.write_text(json.dumps({"meta": meta, "configs": merged}, indent=1))
    (out / RESULTS_MD).write_text(markdown(meta, merged))
    return merged


def rows_of(res: dict[str, Any]) -> list[dict]:
    """Rows for ``python -m benchmarks`` (printed, not kept): each DP step's traced time per step
    against the non-private step's."""
    base = res["steps"].get("nonprivate", {})
    out = []
    for name, rec in res["steps"].items():
        if name == "nonprivate" or "ms_per_step" not in rec or "ms_per_step" not in base:
            continue
        top = ", ".join(f"{c} {100 * s:.0f}%" for c, s in list(rec["shares"].items())[:3])
        out.append(
            row(
                GROUP,
                f"{res['config']} {name} DP step vs non-private step, {rec['classifier']} time "
                f"per step (profiler), B={res['batch']}",
                rec["ms_per_step"],
                base["ms_per_step"],
                f"{res['label']}; {top}",
            )
        )
    return out


def _meta(tiny: bool, warmup: int, steps: int, classifiers: set[str]) -> dict[str, Any]:
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "sizes": "tiny (smoke)" if tiny else "full",
        "warmup": warmup,
        "steps": steps,
        "classifier": " and ".join(sorted(classifiers)) or "none",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run(
    quick: bool = False,
    *,
    out: str | pathlib.Path | None = None,
    models: str | Sequence[str] | None = None,
    force: bool | None = None,
    tiny: bool = False,
    warmup: int | None = None,
    steps: int | None = None,
    trace_dir: str | pathlib.Path | None = None,
) -> list[dict]:
    """Profiles the chosen configs (see the module docstring); returns ``python -m benchmarks`` rows.

    Without a GPU it returns ``[]`` after saying why, unless ``force`` or ``tiny``.
    """
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not (force or tiny):
        print(
            f"profile-gpu: skipped, no GPU (jax backend is {jax.default_backend()!r}); pass --tiny or "
            "--force-cpu for a tiny smoke run on the CPU",
            flush=True,
        )
        return []
    tiny = tiny or not on_gpu
    warmup = warmup if warmup is not None else (2 if quick else 3)
    steps = steps if steps is not None else (2 if quick else 3)
    configs = select(models or DEFAULT_MODELS)
    out_dir = pathlib.Path(out) if out is not None else pathlib.Path(__file__).parent / "results"
    deadline = time.perf_counter() + float(os.environ.get("PROFILE_GPU_BUDGET_S", DEFAULT_BUDGET_S))
    names = chosen_steps(os.environ.get("PROFILE_GPU_STEPS"))
    done: list[dict[str, Any]] = []
    rows: list[dict] = []
    clock: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="profile_gpu_") as tmp:
        root = pathlib.Path(trace_dir) if trace_dir is not None else pathlib.Path(tmp)
        for cfg in configs:
            res = measure(
                cfg,
                tiny=tiny,
                warmup=warmup,
                steps=steps,
                trace_root=root,
                deadline=deadline,
                clock=clock,
                names=names,
            )
            done.append(res)
            rows += rows_of(res)
            classifiers = {
                r["classifier"] for c in done for r in c["steps"].values() if "classifier" in r
            }
            merged = write_results(out_dir, _meta(tiny, warmup, steps, classifiers), done)
    print(markdown(_meta(tiny, warmup, steps, classifiers), merged), flush=True)
    print(f"profile-gpu: wrote {out_dir / RESULTS_MD} and {out_dir / RESULTS_JSON}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--models", default=None, help=f"configs of bench_ghost_gpu (default {DEFAULT_MODELS})"
    )
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny models (on the CPU too: a smoke run)"
    )
    parser.add_argument("--force-cpu", action="store_true", help="run without a GPU (tiny models)")
    parser.add_argument(
        "--quick", action="store_true", help="2 warm-up and 2 traced steps instead of 3 and 3"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps before tracing")
    parser.add_argument("--steps", type=int, default=None, help="traced steps per step function")
    parser.add_argument(
        "--trace-dir", default=None, help="keep the profiler traces here (default: a temp dir)"
    )
    args = parser.parse_args()
    run(
        quick=args.quick,
        out=args.out,
        models=args.models,
        force=args.force_cpu,
        tiny=args.tiny,
        warmup=args.warmup,
        steps=args.steps,
        trace_dir=args.trace_dir,
    )


if __name__ == "__main__":
    main()
