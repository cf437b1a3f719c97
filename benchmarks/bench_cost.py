"""Benchmark: what the DP steps cost, read from their programs on the CPU (no GPU, nothing run).

The steps are those of ``bench_ghost_gpu`` (full training steps, the state
donated): ``nonprivate`` (``jax.grad`` + adamw), ``ghost``
(``clipped_grad(method='ghost')``, Gaussian noise, adamw) and ``vmap`` (the
same with ``method='vmap'``), on two models:

* ``gpt2-2l``: the fused-qkv GPT-2 of ``bench_ghost_gpu`` with 2 blocks, at
  full width otherwise (768, 12 heads, vocabulary 50257, T=256, tied head),
  B=8; with ``--quick`` its tiny size (width 64, vocabulary 512, T=16, B=4);
* ``wrn``: WRN-16-4 with GroupNorm on 32x32x3, B=32; with ``--quick``
  WRN-16-1 on 8x8, B=4.

For each step it reads, without running it:

* the program **lowered for CUDA** on this machine
  (``jax.jit(step).trace(...).lower(lowering_platforms=("cuda",))``), traced
  as on a GPU (``jax.default_backend()`` reads ``'gpu'`` while it is traced,
  so gradclip_jax's per-backend choices are the GPU's: noise per leaf,
  book-kept ghost sums, global norms unpacked): its StableHLO
  ``dot_general`` and ``convolution`` ops counted by precision
  (``precision = [HIGHEST, HIGHEST]``, ``DEFAULT``, ``algorithm = ...``; on
  an NVIDIA GPU from Ampere on float32 products at ``DEFAULT`` run as TF32,
  at ``HIGHEST`` as full float32), and its ``stablehlo.while`` and
  ``stablehlo.case``/``if`` ops. Counts are static (an op in a loop body
  counts once) and a private function's ops count once per call;
* the same trace (the GPU's choices) **compiled for the CPU** (compiled at
  backend optimization level 0, which leaves the optimized HLO and its cost
  analysis as they are and halves the compile time) as a GPU compiles it in
  two ways: optimization barriers kept through fusion
  (:data:`CPU_AS_GPU_OPTIONS`) and threefry's rounds unrolled into the fusions
  that read the draw (``gpu_threefry_on_cpu``; the CPU's own lowering rolls
  them into a loop): ``cost_analysis()`` FLOPs and bytes accessed, the number
  of HLO instructions of ``compiled.as_text()`` (fusion bodies included), the
  loops and conditionals it holds (``bench_ghost_gpu.control_flow``) less any
  loops of JAX's random number generation (:func:`rng_loops`: on a JAX whose
  CPU rule could not be swapped), and its temporaries (``memory_analysis()``:
  what the CPU's buffer assignment holds beside the arguments and outputs; a
  GPU's schedule differs, so again a difference to steer by). XLA's cost
  analysis counts a loop body once, whatever its trip count, and the bytes are
  those of XLA's CPU fusions: a GPU fuses otherwise, so they steer by their
  differences, not their values.

Rows (``python -m benchmarks --only cost``): one per model, DP step and
measure, ``ours_ms`` the DP step's value and ``baseline_ms`` the non-private
step's (counts, GFLOP or MB in the ms columns; ``unit`` says which), ``ratio``
their quotient (NaN where the non-private step has none).

Run alone: ``python -m benchmarks.bench_cost [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks import cost_llama
from benchmarks.common import memory_mb, row
from benchmarks.ghost_gpu.configs import TINY_BATCH, Config
from benchmarks.ghost_gpu.timing import control_flow
from benchmarks.ghost_gpu.variants import step_variants
from benchmarks.hlo_program import PHASES, hlo_phases
from benchmarks.models import gpt2, wrn
from benchmarks.steps import fresh_state
from gradclip_jax._core.jaxcompat import gpu_threefry_on_cpu

GROUP = "cost"
STEPS = ("nonprivate", "ghost", "vmap")
GPT2_LAYERS = 2
MODELS = {
    "gpt2-2l": Config("gpt2-2l-b8", "gpt2", 8, STEPS),
    "wrn": Config("wrn-b32", "wrn", 32, STEPS),
}
# (record key, row title, unit, scale of the value in the ms columns)
MEASURES = (
    ("flops", "FLOPs (CPU cost analysis)", "GFLOP", 1e-9),
    ("bytes", "bytes accessed (CPU cost analysis)", "MB", 1e-6),
    ("instructions", "HLO instructions (compiled for the CPU)", "count", 1.0),
    ("loops", "loops (compiled for the CPU)", "count", 1.0),
    ("conditionals", "conditionals (compiled for the CPU)", "count", 1.0),
    ("temporaries", "temporaries (compiled for the CPU)", "MiB", 1.0),
    ("products_highest", "dot_general+convolution at HIGHEST (lowered for CUDA)", "count", 1.0),
    ("products_default", "dot_general+convolution at DEFAULT (lowered for CUDA)", "count", 1.0),
    ("while", "stablehlo.while (lowered for CUDA)", "count", 1.0),
    ("case", "stablehlo.case/if (lowered for CUDA)", "count", 1.0),
)

_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_OP = re.compile(r"\bstablehlo\.(dot_general|convolution|while|case|if)\b")
_ALGORITHM = re.compile(r"algorithm = (?:#stablehlo\.dot_algorithm)?<([^>]*)>")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s", re.M)
_HLO_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s", re.M)


# --------------------------------------------------------------------------- reading programs


def product_precision(line: str) -> str:
    """The precision of the ``dot_general`` or ``convolution`` on one StableHLO line:
    ``HIGHEST``, ``HIGH``, ``DEFAULT`` (also when none is written), the two operands'
    settings joined by ``/`` where they differ, or ``algorithm <lhs type> x<passes>``."""
    algo = _ALGORITHM.search(line)
    if algo:
        fields = dict(f.split(" = ", 1) for f in algo.group(1).split(", ") if " = " in f)
        return f"algorithm {fields.get('lhs_precision_type', '?')} x{fields.get('num_primitive_operations', '?')}"
    found = re.search(r"precision = \[(\w+), (\w+)\]", line)
    settings = found.groups() if found else re.findall(r"#stablehlo<precision (\w+)>", line)
    unique = sorted(set(settings), key=list(settings).index)
    return "/".join(unique) if unique else "DEFAULT"


def _function_counts(text: str) -> tuple[dict[str, Counter], dict[str, Counter]]:
    """Per function of a StableHLO module: its own op counts and the functions it calls (how often)."""
    ops: dict[str, Counter] = {}
    calls: dict[str, Counter] = {}
    current = None
    for line in text.splitlines():
        head = _FUNC.match(line)
        if head:
            current = head.group(1)
            ops[current], calls[current] = Counter(), Counter()
            continue
        if current is None:
            continue
        calls[current].update(_CALL.findall(line))
        for op in _OP.findall(line):
            key = f"{op} {product_precision(line)}" if op in ("dot_general", "convolution") else op
            ops[current][key] += 1
    return ops, calls


def stablehlo_counts(text: str, entry: str = "main") -> dict[str, int]:
    """Static op counts of a lowered module, each private function counted once per call from
    ``entry``: ``'dot_general HIGHEST'``, ``'convolution DEFAULT'``, ... (see
    :func:`product_precision`), ``'while'``, ``'case'``, ``'if'``."""
    ops, calls = _function_counts(text)
    memo: dict[str, Counter] = {}

    def total(name: str, seen: frozenset[str]) -> Counter:
        if name not in memo:
            out = Counter(ops.get(name, {}))
            for callee, n in calls.get(name, {}).items():
                if callee not in seen:  # a recursive call would not lower; guard anyway
                    for key, m in total(callee, seen | {callee}).items():
                        out[key] += n * m
            memo[name] = out
        return memo[name]

    return dict(total(entry, frozenset({entry})))


def _sum_precision(counts: dict[str, int], precision: str) -> int:
    return sum(
        n
        for k, n in counts.items()
        if k.split(" ", 1)[0] in ("dot_general", "convolution") and k.split(" ", 1)[1] == precision
    )


def lowered_summary(text: str) -> dict[str, Any]:
    """What the report keeps of a CUDA-lowered module (see :func:`stablehlo_counts`)."""
    counts = stablehlo_counts(text)
    return {
        "products_highest": _sum_precision(counts, "HIGHEST"),
        "products_default": _sum_precision(counts, "DEFAULT"),
        "while": counts.get("while", 0),
        "case": counts.get("case", 0) + counts.get("if", 0),
        "lowered_ops": {k: v for k, v in sorted(counts.items())},
    }


_RNG_LOOP = re.compile(
    r"jit\((?:_uniform|_threefry_split|_threefry_fold_in|_random_bits|_normal_real)\)/"
    r"(?:[^\"/]+/)*while\""
)


def rng_loops(text: str) -> int:
    """The ``while`` ops of an optimized HLO text that JAX's random number generation emits: on the
    CPU threefry's rounds are a rolled loop (``jax._src.random.threefry2x32``'s CPU lowering), on
    GPUs they are unrolled; found by the op names of their metadata."""
    return sum(1 for line in text.splitlines() if " while(" in line and _RNG_LOOP.search(line))


def instructions_by_source(text: str) -> dict[str, int]:
    """The HLO instructions of a compiled program (fused bodies included) by the part of the DP
    step that wrote them (:func:`benchmarks.hlo_program.hlo_phases`; ``unattributed`` where no
    source is recorded), in the order of :data:`~benchmarks.hlo_program.PHASES`."""
    phases = hlo_phases(text)
    counts = Counter(phases.get(m.group(1), "unattributed") for m in _HLO_NAMED.finditer(text))
    return {p: counts[p] for p in PHASES if counts[p]}


def compiled_summary(compiled: Any) -> dict[str, Any]:
    """FLOPs, bytes accessed, HLO instructions (and :func:`instructions_by_source`), loops (less
    :func:`rng_loops`), conditionals and temporaries (MiB, :func:`~benchmarks.common.memory_mb`)
    of a compiled program."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per device program
        cost = cost[0]
    text = compiled.as_text()
    flow = control_flow(compiled)
    if "loops" in flow:
        flow["loops"] -= rng_loops(text)
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes": float(cost.get("bytes accessed", 0.0)),
        "instructions": len(_HLO_INSTRUCTION.findall(text)),
        "by_source": instructions_by_source(text),
        "temporaries": memory_mb(compiled)[0],
        **flow,
    }


@contextlib.contextmanager
def traced_as_gpu() -> Iterator[None]:
    """``jax.default_backend()`` reads ``'gpu'`` inside: gradclip_jax reads its per-backend
    settings there when a function is traced (nothing else of JAX's tracing reads it)."""
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        yield


def _jit(step: Callable) -> Any:
    """``step`` jitted (state donated) through a new function, so that no trace is taken from
    JAX's cache of an earlier one made with other per-backend settings."""

    def fresh(state: Any, batch: Any) -> Any:
        return step(state, batch)

    return jax.jit(fresh, donate_argnums=0)


# Level 0 leaves the optimized HLO and its cost analysis as they are and halves the compile
# time; the barrier expander is the CPU's pass that removes optimization barriers before
# fusion, which a GPU runs only after scheduling: disabled, the CPU's fusions respect the
# barriers as a GPU's do (the noise's, gradclip_jax.dp.noise._stored).
COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}
CPU_AS_GPU_OPTIONS = {**COMPILE_OPTIONS, "xla_disable_hlo_passes": "cse_barrier_expander"}


def measure_step(step: Callable, state: Any, data: Any) -> dict[str, Any]:
    """One step's record: the CUDA lowering's counts and the CPU compilation's costs."""
    t0 = time.perf_counter()
    with traced_as_gpu():
        traced = _jit(step).trace(state, data)
    rec = lowered_summary(traced.lower(lowering_platforms=("cuda",)).as_text())
    # on another backend (the suite's GPU runs) the program is compiled as that backend compiles it
    options = CPU_AS_GPU_OPTIONS if jax.default_backend() == "cpu" else COMPILE_OPTIONS
    with gpu_threefry_on_cpu():
        compiled = traced.lower().compile(compiler_options=options)
    rec.update(compiled_summary(compiled))
    rec["seconds"] = time.perf_counter() - t0
    return rec


# --------------------------------------------------------------------------- models and rows


def build(model: str, quick: bool) -> tuple[Callable, Any, Any, str, int]:
    """``(losses, params, data, label, batch)`` of ``model`` (a key of :data:`MODELS`)."""
    cfg = MODELS[model]
    batch = TINY_BATCH if quick else cfg.batch
    if cfg.model == "wrn":
        return (*wrn(batch, tiny=quick), batch)
    return (*gpt2(batch, fused=True, dtype=jnp.float32, tiny=quick, layers=GPT2_LAYERS), batch)


def measure_model(model: str, quick: bool) -> dict[str, Any]:
    """Every step of one model: ``{"model", "label", "batch", "steps": {step: record}}``."""
    losses, params, data, label, batch = build(model, quick)
    steps = step_variants(MODELS[model], losses, batch, STEPS)
    res: dict[str, Any] = {"model": model, "label": label, "batch": batch, "steps": {}}
    for i, name in enumerate(STEPS):
        res["steps"][name] = measure_step(steps[name], fresh_state(params, i), data)  # type: ignore[arg-type]
    return res


def _note(rec: dict[str, Any], base: dict[str, Any], key: str, label: str) -> str:
    if key.startswith("products") or key in ("while", "case"):
        mine = ", ".join(f"{k} {v}" for k, v in rec["lowered_ops"].items())
        theirs = ", ".join(f"{k} {v}" for k, v in base["lowered_ops"].items())
        return f"{label}; lowered for CUDA, traced as on a GPU: {mine} (non-private: {theirs})"
    note = f"{label}; traced as on a GPU, compiled for the CPU, {rec['seconds']:.1f} s to read"
    if key == "instructions" and "by_source" in rec:
        mine = ", ".join(f"{k} {v}" for k, v in rec["by_source"].items())
        theirs = ", ".join(f"{k} {v}" for k, v in base.get("by_source", {}).items())
        note += f"; by source: {mine} (non-private: {theirs})"
    return note


def rows_of(res: dict[str, Any]) -> list[dict]:
    """One row per DP step and measure: the DP step's value against the non-private step's."""
    base = res["steps"]["nonprivate"]
    out = []
    for name in STEPS[1:]:
        rec = res["steps"][name]
        for key, title, unit, scale in MEASURES:
            out.append(
                row(
                    GROUP,
                    f"{res['model']} {name} DP step vs non-private step, B={res['batch']}: "
                    f"{title} ({unit}, in the ms columns)",
                    rec[key] * scale,
                    base[key] * scale,
                    _note(rec, base, key, res["label"]),
                    unit=unit,
                    measure=key,
                    step=name,
                    model=res["model"],
                )
            )
    return out


def run(quick: bool = False) -> list[dict]:
    """The cost rows of both models (tiny sizes with ``quick``), then :mod:`benchmarks.cost_llama`'s."""
    rows: list[dict] = []
    for model in MODELS:
        t0 = time.perf_counter()
        res = measure_model(model, quick)
        print(
            f"[cost] {model}: {res['label']}, B={res['batch']}, read in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        rows += rows_of(res)
    t0 = time.perf_counter()
    rows += cost_llama.run(
        quick
    )  # the MLP's ghost gradient (checked) and the Llama decoder's steps
    print(f"[cost] mlp + llama: read in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny models")
    args = parser.parse_args()
    for r in run(quick=args.quick):
        print(f"{r['name']}: {r['ours_ms']:.4g} vs {r['baseline_ms']:.4g} = {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
