"""Benchmark: full DP training steps on a GPU, ghost clipping against vmap and the non-private step.

Models, written as a user would write them:

* **GPT-2 small** in flax nnx: 124.4M parameters, 12 pre-LN blocks, width 768,
  12 heads, vocabulary 50257, 1024 learned positions, sequence T=256, the
  output head **tied** to the token embedding (``Embed.attend``), GELU MLP,
  causal softmax attention; loss = mean token cross-entropy per example. Three
  variants: the query/key/value projection **fused** into one ``Linear(d, 3d)``
  split with ``jnp.split`` (as GPT-2 and nanoGPT do; configs ``gpt2-b8``,
  ``gpt2-b32``), **separate** q/k/v projections (``gpt2-qkv-*``), and the fused
  model with **bfloat16** parameters and activations (``gpt2-bf16-b8``; the
  loss is taken in float32), and the fused model with its 12 blocks **stacked**
  (``nnx.vmap``) and run by ``lax.scan`` (``gpt2-scan-*``), as large JAX
  models are written.
* **WRN-16-4** in flax linen: a pre-activation wide ResNet (depth 16, width
  factor 4, 2.75M parameters) with GroupNorm (16 groups) instead of BatchNorm,
  on 32x32x3 inputs, 10 classes, batch 256 (``wrn-b256``).

Every step is a full optimizer step, jitted with the training state donated:

* ``nonprivate``: ``jax.grad`` of the mean loss, then ``optax.adamw`` (the baseline);
* ``ghost`` / ``backward`` / ``bookkeeping``: ``gcx.clipped_grad(losses, C,
  method='ghost', ghost_sum='auto' | 'backward' | 'bookkeeping')``, then
  ``gcx.dp`` noise (``add_gaussian_noise``) (standard deviation ``z * C``, ``z = 1``),
  division by the batch size, then adamw;
* ``vmap``: the same with ``method='vmap'``;
* ``jax_privacy``: ``jax_privacy.clipped_grad`` (when importable) with the same
  noise and adamw;
* ``nonprivate_highest`` (``gpt2-b8``, ``wrn-b256``): the non-private step with
  every matmul at ``Precision.HIGHEST``. Ghost clipping forms its norms and
  book-kept sums at full precision (the DP bound needs them exact to float32
  rounding), so this row says what full precision alone costs on the device
  (on an H100, float32 matmuls otherwise run as TF32).
* ``ghost`` runs the per-example products at the backend's default
  ``PRODUCT_PRECISION`` (``"tf32"`` on GPUs: operands rounded once to TF32, exact
  products on tensor cores); ``ghost_highest`` the same step at ``"highest"``.
* ``ghost_tf32x2`` (``gpt2-b8``, ``gpt2-b32``, ``wrn-b256``): the ghost step with every book-kept
  sum in two exact TF32 passes (``PRODUCT_PRECISION`` ``"tf32x2"``), where ``"tf32"`` runs a dense
  layer's in one pass and clips by a norm widened by that pass's rounding;
* ``ghost_noise_shapes`` (``gpt2-b8``, ``wrn-b256``): the ghost step with the noise drawn
  once per distinct leaf shape (``NOISE_STRATEGY`` ``"shapes"``: the same draws, fewer and
  larger fusions; the GPU default), and ``ghost_noise_leaves`` with one draw per leaf (the
  default before 2026-11-29), to weigh the compile time and step time of the two;
* ``nonprivate_noise`` (``gpt2-b8``, ``wrn-b256``): ``jax.grad`` of the summed loss (no
  clipping) with the DP step's noise, division and adamw: the noise's own share of a DP step;
* ``ghost_noise_unstored`` (``gpt2-b8``, ``wrn-b256``): the ghost step with the noise drawn as
  ``optax.contrib.differentially_private_aggregate`` draws it (one ``jax.random.normal`` per
  leaf, nothing stored), against which ``ghost`` shows what storing each noised leaf and the
  leaves' keys saves (XLA's GPU fusion otherwise draws a leaf again in each optimizer kernel
  that reads it);
* ``ghost_tf32x3`` / ``ghost_bf16x6`` (``gpt2-b8``, ``gpt2-b32``, ``wrn-b256``):
  the ghost step with the per-example products (Gram norms, formed and
  book-kept sums) at ``DotAlgorithmPreset.TF32_TF32_F32_X3`` (GPU only) or
  ``BF16_BF16_F32_X6`` instead of ``HIGHEST``
  (``gcx.per_example.PRODUCT_PRECISION``; at TF32x3 the WRN's book-kept
  convolution sums run as three written-out TF32 passes); for these the suite also records
  how far the per-example norms and the clipped sum move from the ``HIGHEST``
  ones on the same batch (``product_accuracy``).

For each config it reports, all in the same process: the median step time over
>= 20 interleaved rounds (one step of every variant per round, compile
excluded) and its ratio to the non-private step; the compiled temporaries
(``memory_analysis().temp_size_in_bytes``) and their ratio; the time to trace,
lower and compile each step and its ratio; and, from ``gcx.ghost_report``, how
many parameter leaves the ghost path measures directly and which fall back to
per-example gradients, with the reasons given; and the conditionals and loops
of each compiled program (on a GPU a conditional copies its predicate to the
host). Each step is compiled once;
variants whose lowered programs are identical (``ghost_sum='auto'`` is one of
the other two; a model that falls back entirely makes ghost = vmap) share one
executable and say so.

Results go to ``OUT/GHOST_GPU.md`` and ``OUT/ghost_gpu.json`` (``OUT`` is
``--out``, by default ``benchmarks/results``), rewritten after every config and
merged with the configs already in that JSON, so a run split over several calls
with the same ``--out`` adds up; within a config, steps a later run did not
measure (``GHOST_GPU_STEPS``) are kept from the earlier one, marked so. Runs
made into different folders are combined with
``python -m benchmarks.bench_ghost_gpu --merge A/ghost_gpu.json B/ghost_gpu.json --out DIR``.

Without a GPU the suite prints why and returns no rows (exit status 0), unless
forced (``--force-cpu`` or ``GHOST_GPU_FORCE=1``): then it runs tiny versions
of the same models (GPT-2 with 2 layers, width 64, 4 heads, vocabulary 512, T=16;
WRN-16-1 on 8x8 inputs; batch 4) as a smoke test. ``GHOST_GPU_TINY=1`` picks
the tiny sizes on a GPU too.

Selection (``--models`` or ``GHOST_GPU_MODELS``, comma-separated): a name picks
every config equal to it or starting with it and a dash (``gpt2`` = all GPT-2
configs, ``gpt2-qkv`` = both separate-q/k/v ones, ``wrn``). ``GHOST_GPU_STEPS``
restricts the variants and orders them (``nonprivate`` is always run, first). ``GHOST_GPU_BUDGET_S``
(default 540) bounds the run: once that many seconds have passed, steps not yet
compiled are skipped and marked so, leaving what was measured in the results.
``GHOST_GPU_COMPILE_SPLIT=1`` compiles each program a second time with XLA's
autotuning off (``xla_gpu_autotune_level=0``, where the budget allows): the
notes then give both times, so one run tells how much of a step's compile time
is autotuning the gemm fusions and convolutions it adds, and how much is the rest.

Run: ``python -m benchmarks --only ghost-gpu [--models gpt2-b8,gpt2-b32] --out DIR``
or ``python -m benchmarks.bench_ghost_gpu`` with the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax

from benchmarks.common import row
from benchmarks.ghost_gpu.configs import CONFIGS, Config, llama_config, parse_steps, select
from benchmarks.ghost_gpu.max_batch import device_limit_bytes, max_batches
from benchmarks.ghost_gpu.results import (
    RESULTS_JSON,
    RESULTS_MD,
    markdown,
    meta,
    rows_of,
    write_results,
)
from benchmarks.ghost_gpu.timing import measure
from benchmarks.models import llama, llama_data
from benchmarks.variants import has_gpu, make_steps

DEFAULT_BUDGET_S = 540.0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


# The CPU has no memory limit to read: the tiny smoke run searches under this one, to a small cap
# (1: one compile of the tiny Llama per step, the footprint of B = 1 read and compared; the
# search's doubling, bisection and edges are tests/test_bench_llama.py's test_largest_batch_* on
# a fake footprint).
TINY_LIMIT_BYTES = 16 << 20
TINY_CAP = 1


def max_batch_rows(cfg: Config, tiny: bool, deadline: float = float("inf")) -> list[dict]:
    """The largest batch of a Llama config's non-private, ghost and vmap steps that fits the device
    (compiled footprint, :mod:`benchmarks.ghost_gpu.max_batch`; from the config's batch, until
    ``deadline``), each DP step's against the non-private one's."""
    lcfg = llama_config(cfg, tiny)
    limit = device_limit_bytes(TINY_LIMIT_BYTES) if not tiny or has_gpu() else TINY_LIMIT_BYTES
    t0 = time.perf_counter()
    # the model built once (eagerly: seconds even when tiny), only the data grow with B
    losses, params, _ = llama(0, 1, lcfg)
    found = max_batches(
        make_steps,
        lambda b: (losses, params, llama_data(lcfg, b)),
        ("nonprivate", "ghost", "vmap"),
        limit,
        cap=TINY_CAP if tiny else 1 << 12,
        start=1 if tiny else cfg.batch,
        deadline=deadline,
    )
    sizes = ", ".join(
        f"{k} {b}{'' if exact else '+ (stopped at the budget: a lower bound)'}"
        for k, (b, exact) in found.items()
    )
    note = (
        f"{cfg.name}: the largest B whose compiled step (state donated) fits {limit / 2**30:.2f} GiB: "
        f"{sizes}; searched in {time.perf_counter() - t0:.0f} s"
    )
    print(f"ghost-gpu: {note}", flush=True)
    return [
        row(
            "ghost-gpu",
            f"{cfg.name} largest batch that fits, {step} DP step vs non-private step "
            "(examples, in the ms columns)",
            found[step][0],
            found["nonprivate"][0],
            note,
            unit="examples",
            measure="max_batch",
            step=step,
            exact=found[step][1],
        )
        for step in ("ghost", "vmap")
    ]


def run(
    quick: bool = False,
    *,
    out: str | pathlib.Path | None = None,
    models: str | Sequence[str] | None = None,
    force: bool | None = None,
) -> list[dict]:
    """Runs the suite (see the module docstring); returns ``python -m benchmarks`` rows.

    Returns ``[]`` after printing why when there is no GPU and the run is not forced.
    """
    force = _env_flag("GHOST_GPU_FORCE") if force is None else force
    if not has_gpu() and not force:
        print(
            f"ghost-gpu: skipped, no GPU (jax backend is {jax.default_backend()!r}); set GHOST_GPU_FORCE=1 "
            "or pass --force-cpu for a tiny smoke run",
            flush=True,
        )
        return []
    tiny = not has_gpu() or _env_flag("GHOST_GPU_TINY")
    configs = select(models if models is not None else os.environ.get("GHOST_GPU_MODELS"))
    steps = parse_steps(os.environ.get("GHOST_GPU_STEPS"), "GHOST_GPU_STEPS")
    budget = float(os.environ.get("GHOST_GPU_BUDGET_S", DEFAULT_BUDGET_S))
    deadline = time.perf_counter() + budget
    reps, max_s = (5, 20.0) if quick else (20, 120.0)
    out_dir = pathlib.Path(out) if out is not None else pathlib.Path(__file__).parent / "results"
    run_meta = meta(tiny)
    print(
        f"ghost-gpu: {', '.join(c.name for c in configs)} on {run_meta['device']} ({run_meta['sizes']} sizes), "
        f"budget {budget:.0f} s, results in {out_dir}",
        flush=True,
    )
    done: list[dict[str, Any]] = []
    merged: list[dict[str, Any]] = []
    rows: list[dict] = []
    clock: dict[str, float] = {}
    for cfg in configs:
        res = measure(
            cfg,
            tiny=tiny,
            reps=reps,
            max_s=max_s,
            deadline=deadline,
            wanted=steps,
            clock=clock,
            on_update=lambda partial: write_results(out_dir, run_meta, [*done, partial]),
            split_compile=_env_flag("GHOST_GPU_COMPILE_SPLIT"),
        )
        done.append(res)
        rows += rows_of(res)
        if cfg.model.startswith("llama") and time.perf_counter() < deadline:
            rows += max_batch_rows(cfg, tiny, deadline)
        merged = write_results(out_dir, run_meta, done)
    if done:
        print(markdown(run_meta, merged), flush=True)
        print(f"ghost-gpu: wrote {out_dir / RESULTS_MD} and {out_dir / RESULTS_JSON}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="5 timing rounds instead of 20")
    parser.add_argument(
        "--models", default=None, help="configs: " + ", ".join(c.name for c in CONFIGS)
    )
    parser.add_argument("--force-cpu", action="store_true", help="tiny smoke run without a GPU")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="only merge these result files into --out"
    )
    args = parser.parse_args()
    if args.merge:
        docs = [json.loads(pathlib.Path(p).read_text()) for p in args.merge]
        out = pathlib.Path(args.out) if args.out else pathlib.Path(__file__).parent / "results"
        (out / RESULTS_JSON).unlink(missing_ok=True)
        merged = write_results(out, docs[-1]["meta"], [c for d in docs for c in d["configs"]])
        print(markdown(docs[-1]["meta"], merged))
        return
    run(quick=args.quick, out=args.out, models=args.models, force=True if args.force_cpu else None)


if __name__ == "__main__":
    main()
