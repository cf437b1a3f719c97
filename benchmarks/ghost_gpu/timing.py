"""Compiling and timing the steps of one config of the GPU DP-step suite."""

from __future__ import annotations

import functools
import gc
import hashlib
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

import gradclip_jax as gcx
from benchmarks.common import interleaved_ms, memory_mb, num_params
from benchmarks.ghost_gpu.configs import STEPS, Config, build
from benchmarks.ghost_gpu.variants import error_text, product_accuracy, step_variants
from benchmarks.steps import fresh_state
from benchmarks.variants import PRODUCT_STEPS

# XLA's GPU autotuning (of gemm fusions' tilings, cuBLAS algorithms and convolutions) off: a
# second compile with it says how much of a step's compile time is autotuning.
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


class Runner:
    """Calls a compiled step on its own (donated) training state; waits for the new state."""

    def __init__(self, compiled: Any, state: Any, batch: Any):
        self.compiled, self.state, self.batch = compiled, state, batch

    def __call__(self) -> Any:
        self.state = jax.block_until_ready(self.compiled(self.state, self.batch))
        return self.state[2]


def control_flow(compiled: Any) -> dict[str, int]:
    """How many conditionals and loops the optimized program holds: on a GPU each conditional
    copies its predicate to the host (a round trip per step, per iteration inside a loop)."""
    try:
        text = compiled.as_text()
    except Exception:  # some backends cannot print a compiled program
        return {}
    return {"conditionals": text.count(" conditional("), "loops": text.count(" while(")}


def _compile_seconds(lowered: Any, options: dict[str, Any]) -> float:
    """Seconds to compile ``lowered`` with the XLA ``options`` (the executable is dropped)."""
    t0 = time.perf_counter()
    lowered.compile(compiler_options=options)
    return time.perf_counter() - t0


def _ghost_report(losses: Callable, params: Any, data: Any) -> dict[str, Any]:
    """``gcx.ghost_report`` summarized: leaves on the ghost path, by kind, and the fallbacks' reasons."""
    try:
        rep = gcx.ghost_report(losses, params, data)
    except Exception as err:  # recorded; the timing goes on
        return {"error": error_text(err)}
    return {
        "leaves": len(rep.ghost) + len(rep.fallback),
        "ghost": len(rep.ghost),
        "fallback": len(rep.fallback),
        "ghost_kinds": dict(Counter(k for _, k in rep.ghost)),
        "fallback_reasons": dict(Counter(r for _, r in rep.fallback)),
        "fallback_leaves": [p for p, _ in rep.fallback],
    }


@dataclass
class _Compiler:
    """Compiles a config's steps once each (identical programs share one executable) within a deadline."""

    deadline: float
    clock: dict[str, float]
    split_compile: bool
    log: Callable[[str], None]
    seen: dict[str, tuple[str, Any, float]] = field(default_factory=dict)

    def compile(self, name: str, step: Callable, state: Any, data: Any, rec: dict[str, Any]) -> Any:
        """The compiled ``step``; its lowering and compile times, memory and control flow go to ``rec``."""
        t0 = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=0).lower(state, data)
        rec["lower_s"] = time.perf_counter() - t0
        digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        if digest in self.seen:
            first, compiled, xla_s = self.seen[digest]
            rec["same_program_as"] = first
        else:
            t0 = time.perf_counter()
            compiled = lowered.compile()
            xla_s = time.perf_counter() - t0
            self.seen[digest] = (name, compiled, xla_s)
            if self.split_compile and time.perf_counter() + xla_s < self.deadline:
                rec["xla_noautotune_s"] = _compile_seconds(lowered, NO_AUTOTUNE)
        rec["xla_compile_s"] = xla_s
        rec["compile_s"] = rec["lower_s"] + xla_s
        self.clock["max_compile_s"] = max(self.clock.get("max_compile_s", 0.0), rec["compile_s"])
        rec["temp_mb"], rec["peak_mb"] = memory_mb(compiled)
        rec.update(control_flow(compiled))
        same = f" (same program as {rec['same_program_as']})" if "same_program_as" in rec else ""
        self.log(
            f"{name}: traced+lowered {rec['lower_s']:.1f} s, compiled {xla_s:.1f} s{same}, "
            f"temporaries {rec['temp_mb']:.1f} MiB"
        )
        return compiled

    def runner(
        self,
        name: str,
        step: Callable | str,
        state: Callable[[], Any],
        data: Any,
        rec: dict[str, Any],
    ) -> Runner | None:
        """A :class:`Runner` of the compiled step, or None with why in ``rec`` (skipped, out of time, failed)."""
        if isinstance(step, str):
            rec["skipped"] = step
            return None
        if time.perf_counter() + self.clock.get("max_compile_s", 0.0) > self.deadline:
            rec["skipped"] = (
                "skipped: time budget (GHOST_GPU_BUDGET_S) would be spent before it compiled"
            )
            self.log(f"{name}: {rec['skipped']}")
            return None
        try:
            first_state = state()
            return Runner(self.compile(name, step, first_state, data, rec), first_state, data)
        except Exception as err:  # one failing variant must not lose the others
            rec["error"] = error_text(err)
            self.log(rec["error"])
            traceback.print_exc()
            return None


def _time(
    runners: dict[str, Runner],
    res: dict[str, Any],
    reps: int,
    max_s: float,
    deadline: float,
    log: Callable[[str], None],
) -> None:
    """Median step times over interleaved rounds, into ``res['steps'][name]['ms']`` (and ``rounds``)."""
    left = max(deadline - time.perf_counter(), 0.0)
    log(f"timing {', '.join(runners)}: {reps} interleaved rounds")
    try:
        rounds: dict[str, int] = {}
        ms = interleaved_ms(
            dict(runners), reps, warmup=2, max_s=min(max_s, max(left, 10.0)), rounds=rounds
        )
        for name, t in ms.items():
            res["steps"][name]["ms"] = t
            res["steps"][name]["rounds"] = rounds[name]
        log("  ".join(f"{n} {t:.2f} ms" for n, t in ms.items()))
    except Exception as err:
        res["timing_error"] = error_text(err)
        log(res["timing_error"])
        traceback.print_exc()


def _accuracy(
    res: dict[str, Any],
    timed: Sequence[str],
    model: tuple[Callable, Any, Any],
    deadline: float,
    clock: dict[str, float],
    log: Callable[[str], None],
) -> None:
    """The reduced-pass product settings' accuracy against HIGHEST, where the budget allows."""
    settings = [
        PRODUCT_STEPS[n] for n in timed if n in PRODUCT_STEPS and PRODUCT_STEPS[n] != "highest"
    ]
    default = gcx.per_example.PRODUCT_PRECISION.get(jax.default_backend(), "highest")
    if settings and default != "highest":
        settings.insert(0, default)  # the default ("tf32" on GPUs) against HIGHEST too
    if not settings or time.perf_counter() + 2 * clock.get("max_compile_s", 0.0) >= deadline:
        return
    log(f"product accuracy against HIGHEST: {', '.join(settings)}")
    try:
        res["product_accuracy"] = product_accuracy(*model, settings)
        log(str(res["product_accuracy"]))
    except Exception as err:
        res["product_accuracy"] = {"error": error_text(err)}
        log(res["product_accuracy"]["error"])


def add_ratios(res: dict[str, Any]) -> None:
    """Each step's time, temporaries and compile time as ratios to the non-private step's."""
    base = res["steps"].get("nonprivate", {})
    for rec in res["steps"].values():
        for key, ratio in (("ms", "time_x"), ("temp_mb", "temp_x"), ("compile_s", "compile_x")):
            if key in rec and base.get(key):
                rec[ratio] = rec[key] / base[key]


def measure(
    cfg: Config,
    *,
    tiny: bool,
    reps: int,
    max_s: float,
    deadline: float,
    wanted: Sequence[str] = STEPS,
    clock: dict[str, float] | None = None,
    on_update: Callable[[dict[str, Any]], Any] | None = None,
    split_compile: bool = False,
) -> dict[str, Any]:
    """Builds, compiles (once each) and times every step of one config; returns its result record.

    A step is skipped when the longest compile seen so far (``clock['max_compile_s']``,
    shared across configs) would end past ``deadline``. ``on_update(record)`` is
    called after each compile, so a run killed from outside keeps what it measured.
    With ``split_compile`` each program is compiled a second time without autotuning
    (:data:`NO_AUTOTUNE`), where the budget allows: ``xla_noautotune_s``.
    """
    clock = {} if clock is None else clock

    def log(msg: str) -> None:
        print(f"[ghost-gpu {cfg.name}] {msg}", flush=True)

    losses, params, data, label, batch = build(cfg, tiny)
    res: dict[str, Any] = {
        "config": cfg.name,
        "label": label,
        "batch": batch,
        "params": num_params(params),
        "steps": {},
    }
    log(f"{label}: {res['params'] / 1e6:.2f}M params, B={batch}")
    res["ghost_report"] = g = _ghost_report(losses, params, data)
    log(
        g["error"]
        if "error" in g
        else f"ghost_report: {g['ghost']}/{g['leaves']} leaves ghost; fallback reasons {g['fallback_reasons']}"
    )
    compiler = _Compiler(deadline, clock, split_compile, log)
    runners: dict[str, Runner] = {}
    for i, (name, step) in enumerate(step_variants(cfg, losses, batch, wanted).items()):
        rec: dict[str, Any] = {}
        res["steps"][name] = rec
        runner = compiler.runner(name, step, functools.partial(fresh_state, params, i), data, rec)
        if runner is not None:
            runners[name] = runner
        if on_update is not None and not isinstance(step, str):
            on_update(res)
    if runners:
        _time(runners, res, reps, max_s, deadline, log)
    _accuracy(res, list(runners), (losses, params, data), deadline, clock, log)
    add_ratios(res)
    del runners, compiler
    gc.collect()
    return res
