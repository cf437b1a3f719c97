"""Cost rows read from compiled programs (nothing run): the Llama-style decoder's DP steps and the
MLP's ghost gradient, on the CPU as it compiles them (not traced as on a GPU).

* ``llama``: :func:`benchmarks.models.llama` (2 layers of width 128, 4 heads, 2 kv-heads, vocabulary
  256, B=4) at T=512 and T=2048 (``--quick``: T=512), full fine-tuning and LoRA (rank 8 on q, v
  and the MLP); the steps of ``bench_ghost_gpu`` (noise, adamw, state donated): ``nonprivate``,
  ``ghost``, ``vmap`` and ``auto`` (``clipped_grad``'s default). Temporaries
  (``memory_analysis()``) are those of the model as users write it, blocks under ``nnx.remat`` in
  an ``nnx.scan``; FLOPs and bytes (``cost_analysis()``) are the unrolled model's, since XLA's cost
  analysis counts a loop body once. Each a ratio to the non-private (remat) step. With ``--quick``
  all come from one compile of the scanned model (FLOPs and bytes then count one layer: a proxy
  that moves with the step's work, not its total), and the ``auto`` step is the program of the
  path ``ghost_report`` says it takes (not compiled again). Unrolled, XLA:CPU keeps the remat'd
  blocks' activations (the non-private step's temporaries 155 MiB against 88 scanned at T=512),
  so the temporaries are always the scanned model's.
* ``mlp``: the 784-512-512-10 MLP at B=128, ``clipped_grad(method='ghost')`` against ``jax.grad``:
  their step times (interleaved medians, the one row here that runs anything: well under a
  second), FLOPs, bytes, HLO instructions and the variadic (tuple-result) reductions the compiled
  program runs on every call (a fallback branch's left out). XLA:CPU compiles a variadic
  reduction as a scalar loop; the ghost step's row norms in
  one (Blue's algorithm) took its CPU time from <= 1.5x to 1.6-1.8x the non-private step's
  (``ROW_NORMS`` in ``gradclip_jax/per_example/ghost/_measure.py``). :func:`check_mlp` fails the
  suite when the CPU's ghost gradient holds one again.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import gradclip_jax as gcx
from benchmarks.common import interleaved_ms, memory_mb, row
from benchmarks.hlo_program import every_step_variadic_reductions
from benchmarks.models import LlamaConfig, llama, mlp
from benchmarks.steps import CLIP, fresh_state
from benchmarks.variants import make_steps

GROUP = "cost"
STEPS = ("nonprivate", "ghost", "vmap", "auto")
LORA_RANK = 8
MLP_BATCH = 128
# Level 0 leaves the optimized HLO and its cost analysis as they are and halves the compile time.
OPTIONS = {"xla_backend_optimization_level": 0}
MEASURES = (
    ("temporaries", "temporaries", "MiB", 1.0),
    ("flops", "FLOPs", "GFLOP", 1e-9),
    ("bytes", "bytes accessed", "MB", 1e-6),
)
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s", re.M)


def compiled_costs(f: Callable, *args: Any, donate: bool = False) -> dict[str, Any]:
    """FLOPs, bytes accessed, temporaries (MiB), HLO instructions and variadic reductions of
    ``jax.jit(f)`` compiled for ``args`` on the default backend, and the seconds it took."""
    t0 = time.perf_counter()
    compiled = (
        jax.jit(f, donate_argnums=0 if donate else ())
        .lower(*args)
        .compile(compiler_options=OPTIONS)
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per device
    text = compiled.as_text()
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes": float(cost.get("bytes accessed", 0.0)),
        "temporaries": memory_mb(compiled)[0],
        "instructions": len(_HLO_INSTRUCTION.findall(text)),
        "variadic_reduces": every_step_variadic_reductions(text),
        "seconds": time.perf_counter() - t0,
    }


def llama_costs(cfg: LlamaConfig, batch: int, quick: bool) -> dict[str, Any]:
    """Each step's record: temporaries of ``cfg``, FLOPs and bytes of it unrolled (``quick``, or
    ``cfg`` unrolled already: of ``cfg`` itself, one compile a step)."""
    losses, params, data = llama(0, batch, cfg)
    auto = gcx.ghost_report(losses, params, data).auto[0]
    names = tuple(n for n in STEPS if not (quick and n == "auto"))
    recs = {
        n: compiled_costs(s, fresh_state(params, 0), data, donate=True)
        for n, s in make_steps(losses, batch, names).items()
    }
    if cfg.scan and cfg.layers > 1 and not quick:
        losses_u, params_u, _ = llama(0, batch, cfg._replace(scan=False))
        for n, s in make_steps(losses_u, batch, names).items():
            unrolled = compiled_costs(s, fresh_state(params_u, 0), data, donate=True)
            recs[n].update(
                flops=unrolled["flops"],
                bytes=unrolled["bytes"],
                seconds=recs[n]["seconds"] + unrolled["seconds"],
            )
    if quick:
        recs["auto"] = dict(recs[auto], seconds=0.0)
    return {
        "steps": recs,
        "auto_path": auto,
        "params": sum(x.size for x in jax.tree.leaves(params)),
    }


def llama_configs(quick: bool) -> list[tuple[str, LlamaConfig]]:
    """``(label, config)`` of each measured setting: T=512 (and 2048 unless ``quick``), full and LoRA."""
    out = []
    for seq in (512,) if quick else (512, 2048):
        for lora in (0, LORA_RANK):
            # quick: no unrolled compile (the CI smoke run's time); the temporaries stay the scanned
            # model's, since unrolled blocks are not rematerialized as the scanned ones are
            cfg = LlamaConfig(seq=seq, lora=lora, scan=True)
            out.append((f"T={seq} {'LoRA r=' + str(lora) if lora else 'full'}", cfg))
    return out


def llama_rows(
    quick: bool, batch: int = 4, configs: list[tuple[str, LlamaConfig]] | None = None
) -> list[dict]:
    """One row per setting (``configs``, by default :func:`llama_configs`), DP step and measure:
    the DP step's value against the non-private step's."""
    rows = []
    for label, cfg in llama_configs(quick) if configs is None else configs:
        res = llama_costs(cfg, batch, quick)
        base, secs = res["steps"]["nonprivate"], sum(r["seconds"] for r in res["steps"].values())
        note = (
            f"Llama nnx {cfg.layers}x{cfg.d}, {cfg.heads} heads / {cfg.kv_heads} kv, vocab {cfg.vocab}, "
            f"{res['params']:,} trainable parameters, float32; temporaries: {'nnx.scan' if cfg.scan else 'unrolled'} "
            f"+ nnx.remat; "
            f"FLOPs/bytes: {'scanned, a layer counted once' if quick else 'unrolled'}; auto takes the {res['auto_path']} path; compiled for the CPU in {secs:.0f} s"
        )
        for step in STEPS[1:]:
            rec = res["steps"][step]
            for key, title, unit, scale in MEASURES:
                rows.append(
                    row(
                        GROUP,
                        f"llama {label} {step} DP step vs non-private remat step, B={batch}: "
                        f"{title} ({unit}, in the ms columns)",
                        rec[key] * scale,
                        base[key] * scale,
                        note,
                        unit=unit,
                        measure=key,
                        step=step,
                        model=f"llama {label}",
                    )
                )
        print(f"[cost] llama {label}: compiled in {secs:.0f} s", flush=True)
    return rows


def mlp_costs(batch: int = MLP_BATCH, reps: int = 30) -> dict[str, dict[str, Any]]:
    """The MLP's ghost ``clipped_grad`` and ``jax.grad`` of its summed loss, compiled, and their
    median times over ``reps`` interleaved rounds (``ms``; each call a few milliseconds)."""
    losses, params, data = mlp(0, batch)
    fns = {
        "ghost": jax.jit(gcx.clipped_grad(losses, CLIP, method="ghost")),
        "nonprivate": jax.jit(jax.grad(lambda p, b: jnp.sum(losses(p, b)))),
    }
    res = {k: compiled_costs(f, params, data) for k, f in fns.items()}
    ms = interleaved_ms(
        {k: (lambda f=f: f(params, data)) for k, f in fns.items()}, reps, max_s=10.0
    )
    for k in fns:
        res[k]["ms"] = ms[k]
    return res


def mlp_rows(res: dict[str, dict[str, Any]], batch: int = MLP_BATCH) -> list[dict]:
    """Rows of :func:`mlp_costs`: step time, FLOPs, bytes, instructions and variadic reductions."""
    g, n = res["ghost"], res["nonprivate"]
    note = (
        f"MLP 784-512-512-10, B={batch}, clipped_grad(method='ghost') vs jax.grad, compiled for "
        f"{jax.default_backend()}; a variadic reduction is a scalar loop on XLA:CPU"
    )
    measures = (
        ("ms", "step time, interleaved medians", "ms", 1.0),
        ("flops", "FLOPs", "GFLOP", 1e-9),
        ("bytes", "bytes accessed", "MB", 1e-6),
        ("instructions", "HLO instructions", "count", 1.0),
        ("variadic_reduces", "variadic reductions", "count", 1.0),
    )
    return [
        row(
            GROUP,
            f"mlp ghost grad vs non-private grad, B={batch}: {title} ({unit}, in the ms columns)",
            g[key] * scale,
            n[key] * scale,
            note + ("; bar <= 1.5x" if key == "ms" else ""),
            unit=unit,
            measure=key,
            step="ghost",
            model="mlp",
        )
        for key, title, unit, scale in measures
        if key in g
    ]


def check_mlp(res: dict[str, dict[str, Any]]) -> None:
    """Fails on the CPU when the MLP's ghost gradient holds a variadic reduction (see the module doc)."""
    if jax.default_backend() == "cpu" and res["ghost"]["variadic_reduces"]:
        raise AssertionError(
            f"MLP ghost gradient compiled for the CPU holds {res['ghost']['variadic_reduces']} "
            "variadic reductions (scalar loops on XLA:CPU; see ROW_NORMS)"
        )


def run(quick: bool = False) -> list[dict]:
    """The MLP's rows (checked) and the Llama decoder's."""
    t0 = time.perf_counter()
    res = mlp_costs()
    check_mlp(res)
    rows = mlp_rows(res)
    print(f"[cost] mlp: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    return rows + llama_rows(quick)
