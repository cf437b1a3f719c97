"""Compile breakdown: where a DP step's time to its first call goes, on the CPU.

For the small transformer LM of ``bench_ghost`` (2 layers, width 64, sequence 32,
vocabulary 128, 118k parameters) at B=8, four training steps jitted with the state
donated: ``nonprivate`` (``jax.grad`` of the mean loss, adamw), ``hand`` (a
hand-written ``vmap(grad)`` + optax's per-example clip + sum, then the DP noise and
adamw), ``vmap`` and ``ghost`` (``clipped_grad(method=...)``, then the same noise and
adamw). Each is traced (``jax.jit(step).trace``: Python and the jaxpr), lowered
(StableHLO) and compiled (XLA's passes and code generation; a GPU adds its
autotuning there, which ``tools/gpu_check.sh``'s GPU rows time) in turn, each phase
timed (outside ``--quick`` the median of :data:`REPS` rounds, the steps in turn, each traced
once before); the compiled program's HLO instructions are counted by the part of the step
that wrote them (:func:`benchmarks.bench_cost.instructions_by_source`), and its kernels and
distinct kernels (what XLA:CPU compiles, one per distinct fused computation).

Rows (group ``compile``; seconds in the ms columns): each DP step's trace, lower and
compile against the non-private step's same phase, and the ``vmap`` step's total
against the hand-written one's (the issue's goals: DP step <= 1.5x the non-private
step, ``clipped_grad(method='vmap')`` <= 1.2x the hand-written version), and the same two
totals for the clipped sum alone (:data:`SUMS`: no noise, no optimizer; ghost against
``jax.grad`` of the summed loss). The notes give the instructions by source and the (distinct) kernels.

Without ``--quick``, the issue's larger models too (:data:`LARGER`: the Llama-style decoder of
``cost_llama``, scanned and rematerialized, at T=512; GPT-2 with 2 blocks at full width and
WRN-16-4, ``bench_cost``'s models): one row per DP step, its total against the non-private
step's, the phases in the note.

Run alone: ``python -m benchmarks.bench_compile``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_cost import build, instructions_by_source
from benchmarks.common import row
from benchmarks.cost_llama import llama_configs
from benchmarks.hlo_program import distinct_kernel_count, kernel_count
from benchmarks.models import llama, transformer
from benchmarks.steps import fresh_state, hand_clipped_grad
from benchmarks.variants import make_steps, parts_of

GROUP = "compile"
BATCH = 8
PHASES = ("trace", "lower", "compile")
# Rounds of each measurement (the median is reported) outside the quick run.
REPS = 3


def breakdown(step: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Seconds to trace, lower and compile a fresh ``jax.jit(step, donate_argnums=0)`` for
    ``args`` (``"trace"``, ``"lower"``, ``"compile"``, ``"total"``) and its HLO
    instructions by source (``"by_source"``), its kernels (``"kernels"``,
    :func:`~benchmarks.hlo_program.kernel_count`) and its distinct kernels (``"distinct"``,
    :func:`~benchmarks.hlo_program.distinct_kernel_count`: what the CPU's compile time follows)."""
    f = jax.jit(lambda *a: step(*a), donate_argnums=0)  # a new function: nothing cached in memory
    # the garbage of the steps measured before (their jaxprs and programs) is collected now, not
    # by a collection that lands in whichever phase runs next (0.2 s in a GPT-2 lowering of 0.05 s)
    gc.collect()
    t0 = time.perf_counter()
    traced = f.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    text = compiled.as_text()
    return {
        "trace": t1 - t0,
        "lower": t2 - t1,
        "compile": t3 - t2,
        "total": t3 - t0,
        "by_source": instructions_by_source(text),
        "kernels": kernel_count(text),
        "distinct": distinct_kernel_count(text),
    }


STEPS = ("nonprivate", "hand", "vmap", "ghost")
# The summed gradients alone, (params, batch) -> sum: ``jax.grad`` of the summed loss, the
# hand-written clipped sum, ``clipped_grad(method='vmap')``'s and ``'ghost'``'s.
SUMS = ("sum_grad", "sum_hand", "sum_vmap", "sum_ghost")


def _sums(losses: Callable, batch: int) -> dict[str, Callable]:
    parts = parts_of(losses, batch)
    return {
        "sum_grad": jax.grad(lambda p, b: jnp.sum(losses(p, b))),
        "sum_hand": hand_clipped_grad(losses),
        "sum_vmap": parts.clipped_sum("vmap"),
        "sum_ghost": parts.clipped_sum("ghost"),
    }


def measured(steps: dict[str, Callable], args: tuple, reps: int = 1) -> dict[str, dict[str, Any]]:
    """:func:`breakdown` of each of ``steps`` on ``args``, each phase the median of ``reps``
    rounds taken in turn. Each step is traced once first: JAX traces a helper it jits (``jnp.where``,
    say) once a process, so without this the first step measured would pay for the others'
    shared first traces (the non-private step's trace took 0.1 s or 0.3 s by its place)."""
    for step in steps.values():
        jax.jit(lambda *a, step=step: step(*a)).trace(*args)
    rounds = [{n: breakdown(s, *args) for n, s in steps.items()} for _ in range(reps)]
    return {
        n: rounds[-1][n]
        | {p: float(np.median([r[n][p] for r in rounds])) for p in (*PHASES, "total")}
        for n in steps
    }


def measure(batch: int = BATCH, reps: int = 1) -> dict[str, dict[str, Any]]:
    """:func:`measured` of each of :data:`STEPS` (:mod:`benchmarks.variants`) and :data:`SUMS` on
    the small transformer."""
    losses, params, data = transformer(0, batch, layers=2, d=64, seq=32, vocab=128)
    res = measured(make_steps(losses, batch, STEPS), (fresh_state(params, 0), data), reps)  # type: ignore[arg-type]
    return res | measured(_sums(losses, batch), (params, data), reps)


def rows_of(res: dict[str, dict[str, Any]], label: str) -> list[dict]:
    """The rows of the module docstring from :func:`measure`'s result."""

    def sources(n: str) -> str:
        by = res[n]["by_source"]
        kernels = (
            f", {res[n]['kernels']} kernels ({res[n]['distinct']} distinct)"
            if "kernels" in res[n]
            else ""
        )
        return f"{n} {sum(by.values())} ({', '.join(f'{k} {v}' for k, v in by.items())}){kernels}"

    def note(*names: str) -> str:
        return f"seconds in the ms columns; {label}; HLO instructions by source: " + "; ".join(
            map(sources, names)
        )

    base = res["nonprivate"]
    rows = [
        row(
            GROUP,
            f"{phase}: DP step ({n}) vs non-private step ({label})",
            1e3 * res[n][phase],
            1e3 * base[phase],
            note(n, "nonprivate") + ("; goal <= 1.5x (total)" if phase == "total" else ""),
        )
        for n in ("ghost", "vmap", "hand")
        for phase in (*PHASES, "total")
    ]
    rows.append(
        row(
            GROUP,
            f"total: DP step, clipped_grad(method='vmap') vs hand-written vmap(grad) + clip + sum "
            f"({label})",
            1e3 * res["vmap"]["total"],
            1e3 * res["hand"]["total"],
            note("vmap", "hand") + "; goal <= 1.2x",
        )
    )
    if all(n in res for n in SUMS):
        rows += [
            row(
                GROUP,
                f"total: clipped sum alone, {ours} ({label})",
                1e3 * res[n]["total"],
                1e3 * res[base_n]["total"],
                note(n, base_n) + goal,
            )
            for n, base_n, ours, goal in (
                (
                    "sum_vmap",
                    "sum_hand",
                    "clipped_grad(method='vmap') vs hand-written vmap(grad) + clip + sum",
                    "; goal <= 1.2x",
                ),
                ("sum_ghost", "sum_grad", "clipped_grad(method='ghost') vs jax.grad", ""),
            )
        ]
    return rows


def _llama() -> tuple[Callable, Any, Any, str, int]:
    cfg = next(c for _, c in llama_configs(quick=True) if not c.lora)  # T=512, the full model
    return (*llama(0, 8, cfg), f"Llama {cfg.layers}x{cfg.d} T={cfg.seq} scan+remat, B=8", 8)


# model -> its ``(losses, params, data, label, batch)``: the larger models, as the cost
# rows build them (bench_cost's GPT-2 with 2 blocks and WRN-16-4, cost_llama's T=512 decoder)
LARGER: dict[str, Callable[[], tuple]] = {
    "llama": _llama,
    "gpt2": functools.partial(build, "gpt2-2l", False),
    "wrn": functools.partial(build, "wrn", False),
}
LARGER_STEPS = ("nonprivate", "ghost", "vmap")


def measure_larger(model: str, reps: int = 1) -> tuple[dict[str, dict[str, Any]], str]:
    """:func:`measured` of :data:`LARGER_STEPS` on one of :data:`LARGER`, and its label."""
    losses, params, data, label, batch = LARGER[model]()
    steps = make_steps(losses, batch, LARGER_STEPS)
    return measured(steps, (fresh_state(params, 0), data), reps), label  # type: ignore[arg-type]


def larger_rows(res: dict[str, dict[str, Any]], label: str) -> list[dict]:
    """One row per DP step of :func:`measure_larger`'s result: its total against the non-private
    step's, each phase's ratio and the kernels in the note."""
    base = res["nonprivate"]

    def phases(n: str) -> str:
        split = ", ".join(f"{p} {res[n][p] / base[p]:.2f}x" for p in PHASES)
        return (
            f"{n}: {split}, {res[n]['kernels']} kernels, {res[n]['distinct']} distinct "
            f"(non-private {base['kernels']}, {base['distinct']})"
        )

    return [
        row(
            GROUP,
            f"total: DP step ({n}) vs non-private step ({label}, {jax.default_backend()})",
            1e3 * res[n]["total"],
            1e3 * base["total"],
            f"seconds in the ms columns; {phases(n)}; goal <= 1.5x",
        )
        for n in LARGER_STEPS[1:]
    ]


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (``quick``: the small transformer alone)."""
    reps = 1 if quick else REPS
    rows = rows_of(
        measure(reps=reps), f"transformer 2x64 T=32 V=128, B={BATCH}, {jax.default_backend()}"
    )
    for model in () if quick else LARGER:
        rows += larger_rows(*measure_larger(model, reps))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in run(quick=args.quick):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
