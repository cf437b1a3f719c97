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
  ``gcx.privacy.add_gaussian_noise`` (standard deviation ``z * C``, ``z = 1``),
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
  larger fusions), to weigh its compile time and step time against one draw per leaf;
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
import contextlib
import functools
import gc
import hashlib
import json
import os
import pathlib
import platform
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx
from benchmarks.bench_dp import CLIP, _jax_privacy
from benchmarks.bench_noise import optax_way
from benchmarks.common import interleaved_ms, memory_mb, num_params, row, same_measurement
from gradclip_jax._core.backend import backend_setting

NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 1e-4
DEFAULT_BUDGET_S = 540.0
RESULTS_JSON = "ghost_gpu.json"
RESULTS_MD = "GHOST_GPU.md"

STEPS = ("nonprivate", "ghost", "backward", "bookkeeping", "vmap", "jax_privacy", "nonprivate_highest",
         "ghost_highest", "ghost_tf32x2", "ghost_tf32x3", "ghost_bf16x6", "ghost_noise_shapes",
         "nonprivate_noise", "ghost_noise_unstored")
STEP_TITLES = {"nonprivate": "non-private", "ghost": "ghost (auto)", "backward": "ghost backward",
               "bookkeeping": "ghost bookkeeping", "vmap": "vmap", "jax_privacy": "jax-privacy",
               "nonprivate_highest": "non-private at HIGHEST", "ghost_highest": "ghost, products HIGHEST",
               "ghost_tf32x2": "ghost, book-kept sums in two exact TF32 passes",
               "ghost_tf32x3": "ghost, products 3xTF32",
               "ghost_bf16x6": "ghost, products 6xBF16",
               "ghost_noise_shapes": "ghost, noise drawn once per leaf shape",
               "nonprivate_noise": "non-private sum with the DP noise",
               "ghost_noise_unstored": "ghost, noise drawn as optax draws it (not stored)"}
GHOST_SUM = {"ghost": "auto", "backward": "backward", "bookkeeping": "bookkeeping"}
# Ghost (auto) with the per-example products at another gcx.per_example.PRODUCT_PRECISION
# setting than the backend's default ("tf32" on GPUs): HIGHEST, or a reduced-pass algorithm.
PRODUCT_STEPS = {"ghost_highest": "highest", "ghost_tf32x2": "tf32x2", "ghost_tf32x3": "tf32x3",
                 "ghost_bf16x6": "bf16x6"}


@dataclass(frozen=True)
class Config:
    """One measured setting: a model variant, a batch size and the steps timed."""

    name: str
    model: str  # 'gpt2' (fused qkv), 'gpt2-qkv' (separate q/k/v), 'gpt2-bf16', 'gpt2-scan', 'wrn'
    batch: int
    steps: tuple[str, ...]


CONFIGS = (  # in priority order: a run cut short by the time budget has measured the first ones
    Config("gpt2-b8", "gpt2", 8, STEPS),
    Config("gpt2-qkv-b8", "gpt2-qkv", 8, STEPS[:5]),
    Config("wrn-b256", "wrn", 256, STEPS),
    Config("gpt2-b32", "gpt2", 32, (*STEPS[:6], *PRODUCT_STEPS)),
    Config("gpt2-qkv-b32", "gpt2-qkv", 32, STEPS[:5]),
    Config("gpt2-bf16-b8", "gpt2-bf16", 8, STEPS[:5]),
    Config("gpt2-scan-b8", "gpt2-scan", 8, STEPS[:5]),
    Config("gpt2-scan-b32", "gpt2-scan", 32, STEPS[:5]),
)
TINY_BATCH = 4


def select(models: str | Sequence[str] | None) -> list[Config]:
    """The configs named by ``models`` (see the module docstring); all when empty."""
    if models is None or models == "" or models == []:
        return list(CONFIGS)
    names = [m.strip() for m in (models.split(",") if isinstance(models, str) else models) if m.strip()]
    chosen = []
    for n in names:
        hits = [c for c in CONFIGS if c.name == n or c.name.startswith(n + "-")]
        if not hits:
            raise ValueError(f"models: unknown config {n!r}; known: {', '.join(c.name for c in CONFIGS)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen


# --------------------------------------------------------------------------- models


def _gpt2(batch: int, *, fused: bool, dtype: Any, tiny: bool, seed: int = 0,
          scan: bool = False, layers: int | None = None) -> tuple[Callable, Any, Any, str]:
    """GPT-2 small (or the tiny smoke size) in flax nnx; returns ``(losses, params, data, label)``.
    ``scan``: the blocks stacked on axis 0 (``nnx.vmap``) and run by ``lax.scan``; ``layers``:
    that many blocks instead of the size's own (12, or 2 when tiny)."""
    from flax import nnx

    vocab, n_pos, d, depth, heads, seq = (512, 16, 64, 2, 4, 16) if tiny else (50257, 1024, 768, 12, 12, 256)
    layers = depth if layers is None else layers
    init = nnx.initializers.normal(0.02)
    lists = getattr(nnx, "List", list)  # flax >= 0.12 wants module lists wrapped

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            dense = dict(dtype=dtype, param_dtype=dtype, kernel_init=init, rngs=rngs)
            self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)
            if fused:
                self.c_attn = nnx.Linear(d, 3 * d, **dense)
            else:
                self.q_proj = nnx.Linear(d, d, **dense)
                self.k_proj = nnx.Linear(d, d, **dense)
                self.v_proj = nnx.Linear(d, d, **dense)
            self.attn_proj = nnx.Linear(d, d, **dense)
            self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)
            self.c_fc = nnx.Linear(d, 4 * d, **dense)
            self.mlp_proj = nnx.Linear(4 * d, d, **dense)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, _ = x.shape
            h = self.ln_1(x)
            if fused:
                q, k, v = jnp.split(self.c_attn(h), 3, axis=-1)
            else:
                q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads).astype(dtype)
            causal = jnp.tril(jnp.ones((t, t), dtype=bool))
            att = jnp.where(causal, att, jnp.finfo(att.dtype).min)
            att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(dtype)
            y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x))))

    class GPT2(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.wte = nnx.Embed(vocab, d, dtype=dtype, param_dtype=dtype, embedding_init=init, rngs=rngs)
            self.wpe = nnx.Embed(n_pos, d, dtype=dtype, param_dtype=dtype, embedding_init=init, rngs=rngs)
            if scan:
                @nnx.split_rngs(splits=layers)
                @nnx.vmap(in_axes=0, out_axes=0)
                def stacked(r: nnx.Rngs) -> Block:
                    return Block(r)

                self.h = stacked(rngs)
            else:
                self.h = lists([Block(rngs) for _ in range(layers)])
            self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
            if scan:
                blocks, stack = nnx.split(self.h)
                x, _ = jax.lax.scan(lambda x, s: (nnx.merge(blocks, s)(x), None), x, stack)
            else:
                for block in self.h:
                    x = block(x)
            return self.wte.attend(self.ln_f(x))  # tied output head

    graphdef, params = nnx.split(GPT2(nnx.Rngs(seed)))
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(batch, seq + 1))
    data = {"x": jnp.asarray(tokens[:, :-1], jnp.int32), "y": jnp.asarray(tokens[:, 1:], jnp.int32)}

    def losses(p: Any, b: Any) -> jax.Array:
        logits = nnx.merge(graphdef, p)(b["x"]).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), axis=-1)

    qkv = "fused qkv + jnp.split" if fused else "separate q/k/v"
    size = f"{layers}x{d}, {heads} heads, vocab {vocab}, T={seq}"
    kind = " (tiny)" if tiny else " small" if layers == depth else f" ({layers} blocks of small)"
    label = (f"GPT-2{kind} nnx, {size}, tied embedding, {qkv}, "
             f"{'blocks stacked, lax.scan, ' if scan else ''}{jnp.dtype(dtype).name}")
    return losses, params, data, label


def _wrn(batch: int, *, tiny: bool, seed: int = 0) -> tuple[Callable, Any, Any, str]:
    """WRN-16-4 with GroupNorm (WRN-16-1 on 8x8 when tiny) in flax linen."""
    from flax import linen as nn

    depth, k, hw, classes, groups = (16, 1, 8, 10, 16) if tiny else (16, 4, 32, 10, 16)
    n = (depth - 4) // 6

    class WideBasic(nn.Module):
        width: int
        stride: int

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            o = nn.relu(nn.GroupNorm(num_groups=groups)(x))
            y = nn.Conv(self.width, (3, 3), strides=self.stride, padding=1, use_bias=False)(o)
            y = nn.relu(nn.GroupNorm(num_groups=groups)(y))
            y = nn.Conv(self.width, (3, 3), padding=1, use_bias=False)(y)
            if self.stride != 1 or x.shape[-1] != self.width:
                x = nn.Conv(self.width, (1, 1), strides=self.stride, use_bias=False)(o)
            return x + y

    class WideResNet(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Conv(16, (3, 3), padding=1, use_bias=False)(x)
            for i, width in enumerate((16 * k, 32 * k, 64 * k)):
                for j in range(n):
                    x = WideBasic(width, 2 if (i > 0 and j == 0) else 1)(x)
            x = nn.relu(nn.GroupNorm(num_groups=groups)(x))
            return nn.Dense(classes)(jnp.mean(x, axis=(1, 2)))

    model = WideResNet()
    r = np.random.default_rng(seed)
    data = {"x": jnp.asarray(r.standard_normal((batch, hw, hw, 3)), jnp.float32),
            "y": jnp.asarray(r.integers(0, classes, size=batch), jnp.int32)}
    params = model.init(jax.random.key(seed), data["x"][:1])["params"]

    def losses(p: Any, b: Any) -> jax.Array:
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])

    label = f"WRN-{depth}-{k} GroupNorm({groups}) linen, {hw}x{hw}x3, {classes} classes, float32"
    return losses, params, data, label


def build(cfg: Config, tiny: bool) -> tuple[Callable, Any, Any, str, int]:
    """``(losses, params, data, label, batch)`` of a config at full or tiny size."""
    batch = TINY_BATCH if tiny else cfg.batch
    if cfg.model == "wrn":
        return (*_wrn(batch, tiny=tiny), batch)
    dtype = jnp.bfloat16 if cfg.model == "gpt2-bf16" else jnp.float32
    return (*_gpt2(batch, fused=cfg.model != "gpt2-qkv", dtype=dtype, tiny=tiny, scan=cfg.model == "gpt2-scan"),
            batch)


# --------------------------------------------------------------------------- steps


def _nonprivate_step(losses: Callable, opt: optax.GradientTransformation) -> Callable:
    def step(state: Any, batch: Any) -> Any:
        params, opt_state, key = state
        key, _ = jax.random.split(key)
        grads = jax.grad(lambda p: jnp.mean(losses(p, batch)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key

    return step


def _traced_within(step: Callable, context: Callable[[], contextlib.AbstractContextManager]) -> Callable:
    """``step`` traced inside ``context()``: every matmul at ``Precision.HIGHEST`` (what the
    full-precision products of the book-kept sums and ghost norms cost on this device), or
    another ``PRODUCT_PRECISION`` (:func:`gradclip_jax._core.backend.backend_setting`)."""

    def run(state: Any, batch: Any) -> Any:
        with context():
            return step(state, batch)

    return run


def product_accuracy(losses: Callable, params: Any, data: Any, settings: Sequence[str]) -> dict[str, Any]:
    """How far the clipped sum and the per-example norms at each reduced-pass ``setting`` are
    from those at ``Precision.HIGHEST`` (ghost path, same batch): max relative error of the
    norms, and the sum's L2 error relative to its norm."""

    def run(setting: str) -> tuple[Any, Any]:
        with backend_setting(gcx.per_example.PRODUCT_PRECISION, setting):
            grads, info = jax.jit(gcx.clipped_grad(losses, CLIP, method="ghost"))(params, data)
        return jax.device_get((grads, info.norms))

    ref_g, ref_n = run("highest")
    ref_n = np.asarray(ref_n, np.float64)
    ref_leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref_g)]
    ref_norm = float(np.sqrt(sum(np.sum(x * x) for x in ref_leaves)))
    out: dict[str, Any] = {}
    for setting in settings:
        try:
            g, n = run(setting)
        except Exception as err:  # recorded; the other settings go on
            out[setting] = {"error": _error(err)}
            continue
        diff = sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in zip(jax.tree.leaves(g), ref_leaves))
        out[setting] = {"norm_rel_err": float(np.max(np.abs(np.asarray(n, np.float64) / ref_n - 1))),
                        "sum_rel_err": float(np.sqrt(diff)) / ref_norm}
    return out


def _dp_step(summed_grad: Callable, stddev: float, batch_size: int, opt: optax.GradientTransformation,
             noise: Callable[[Any, Any, Any], Any] | None = None) -> Callable:
    """Clipped sum, Gaussian noise (``noise(tree, stddev, key)``, by default
    ``gcx.privacy.add_gaussian_noise``), division by the batch size, adamw."""
    add_noise = gcx.privacy.add_gaussian_noise if noise is None else noise

    def step(state: Any, batch: Any) -> Any:
        params, opt_state, key = state
        key, noise_key = jax.random.split(key)
        noisy = add_noise(summed_grad(params, batch), stddev, noise_key)
        grads = jax.tree.map(lambda g, p: (g / batch_size).astype(p.dtype), noisy, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key

    return step


def _steps(cfg: Config, losses: Callable, batch_size: int, wanted: Sequence[str]) -> dict[str, Callable | str]:
    """Each step function, or a string saying why the step is skipped."""
    opt = optax.adamw(LEARNING_RATE)
    stddev = NOISE_MULTIPLIER * CLIP
    out: dict[str, Callable | str] = {"nonprivate": _nonprivate_step(losses, opt)}
    # the wanted steps first, in the order asked for: a run cut short by its budget measured those
    order = [n for n in wanted if n in cfg.steps[1:]] + [n for n in cfg.steps[1:] if n not in wanted]
    for name in order:
        if name not in wanted:
            out[name] = "skipped: not selected (GHOST_GPU_STEPS)"
        elif name == "nonprivate_highest":
            out[name] = _traced_within(out["nonprivate"], lambda: jax.default_matmul_precision("highest"))  # type: ignore[arg-type]
        elif name == "ghost_tf32x3" and not _has_gpu():
            out[name] = "skipped: TF32 products need an NVIDIA GPU (Ampere or later)"
        elif name in PRODUCT_STEPS:
            grad_fn = gcx.clipped_grad(losses, CLIP, method="ghost")
            out[name] = _traced_within(_dp_step(lambda p, b, f=grad_fn: f(p, b)[0], stddev, batch_size, opt),
                                       functools.partial(backend_setting, gcx.per_example.PRODUCT_PRECISION,
                                                         PRODUCT_STEPS[name]))
        elif name == "ghost_noise_shapes":
            grad_fn = gcx.clipped_grad(losses, CLIP, method="ghost")
            out[name] = _traced_within(_dp_step(lambda p, b, f=grad_fn: f(p, b)[0], stddev, batch_size, opt),
                                       functools.partial(backend_setting, gcx.privacy.NOISE_STRATEGY, "shapes"))
        elif name == "nonprivate_noise":
            out[name] = _dp_step(jax.grad(lambda p, b: jnp.sum(losses(p, b))), stddev, batch_size, opt)
        elif name == "ghost_noise_unstored":
            grad_fn = gcx.clipped_grad(losses, CLIP, method="ghost")
            out[name] = _dp_step(lambda p, b, f=grad_fn: f(p, b)[0], stddev, batch_size, opt, noise=optax_way)
        elif name == "jax_privacy":
            jp = _jax_privacy(losses)
            out[name] = "skipped: jax_privacy is not importable" if jp is None else _dp_step(jp, stddev, batch_size, opt)
        else:
            method, ghost_sum = ("ghost", GHOST_SUM[name]) if name in GHOST_SUM else ("vmap", "auto")
            grad_fn = gcx.clipped_grad(losses, CLIP, method=method, ghost_sum=ghost_sum)
            out[name] = _dp_step(lambda p, b, f=grad_fn: f(p, b)[0], stddev, batch_size, opt)
    return out


class _Runner:
    """Calls a compiled step on its own (donated) training state; waits for the new state."""

    def __init__(self, compiled: Any, state: Any, batch: Any):
        self.compiled, self.state, self.batch = compiled, state, batch

    def __call__(self) -> Any:
        self.state = jax.block_until_ready(self.compiled(self.state, self.batch))
        return self.state[2]


# XLA's GPU autotuning (of gemm fusions' tilings, cuBLAS algorithms and convolutions) off: a
# second compile with it says how much of a step's compile time is autotuning.
NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


def _compile_seconds(lowered: Any, options: dict[str, Any]) -> float:
    """Seconds to compile ``lowered`` with the XLA ``options`` (the executable is dropped)."""
    t0 = time.perf_counter()
    lowered.compile(compiler_options=options)
    return time.perf_counter() - t0


def _fresh_state(params: Any, seed: int) -> Any:
    p = jax.tree.map(lambda x: x.copy(), params)
    return p, optax.adamw(LEARNING_RATE).init(p), jax.random.key(seed)


def control_flow(compiled: Any) -> dict[str, int]:
    """How many conditionals and loops the optimized program holds: on a GPU each conditional
    copies its predicate to the host (a round trip per step, per iteration inside a loop)."""
    try:
        text = compiled.as_text()
    except Exception:  # some backends cannot print a compiled program
        return {}
    return {"conditionals": text.count(" conditional("), "loops": text.count(" while(")}


def _report(losses: Callable, params: Any, data: Any) -> dict[str, Any]:
    rep = gcx.ghost_report(losses, params, data)
    return {"leaves": len(rep.ghost) + len(rep.fallback), "ghost": len(rep.ghost),
            "fallback": len(rep.fallback), "ghost_kinds": dict(Counter(k for _, k in rep.ghost)),
            "fallback_reasons": dict(Counter(r for _, r in rep.fallback)),
            "fallback_leaves": [p for p, _ in rep.fallback]}


def _error(err: BaseException) -> str:
    return f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def measure(cfg: Config, *, tiny: bool, reps: int, max_s: float, deadline: float,
            wanted: Sequence[str] = STEPS, clock: dict[str, float] | None = None,
            on_update: Callable[[dict[str, Any]], Any] | None = None, split_compile: bool = False) -> dict[str, Any]:
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
    res: dict[str, Any] = {"config": cfg.name, "label": label, "batch": batch, "params": num_params(params),
                           "steps": {}}
    log(f"{label}: {res['params'] / 1e6:.2f}M params, B={batch}")
    try:
        res["ghost_report"] = _report(losses, params, data)
        g = res["ghost_report"]
        log(f"ghost_report: {g['ghost']}/{g['leaves']} leaves ghost; fallback reasons {g['fallback_reasons']}")
    except Exception as err:  # recorded; the timing goes on
        res["ghost_report"] = {"error": _error(err)}
        log(res["ghost_report"]["error"])
    steps = _steps(cfg, losses, batch, wanted)
    compiled_by_text: dict[str, tuple[str, Any, float]] = {}
    runners: dict[str, _Runner] = {}
    for i, (name, step) in enumerate(steps.items()):
        rec: dict[str, Any] = {}
        res["steps"][name] = rec
        if isinstance(step, str):
            rec["skipped"] = step
            continue
        if time.perf_counter() + clock.get("max_compile_s", 0.0) > deadline:
            rec["skipped"] = "skipped: time budget (GHOST_GPU_BUDGET_S) would be spent before it compiled"
            log(f"{name}: {rec['skipped']}")
            continue
        try:
            state = _fresh_state(params, i)
            t0 = time.perf_counter()
            lowered = jax.jit(step, donate_argnums=0).lower(state, data)
            rec["lower_s"] = time.perf_counter() - t0
            digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
            if digest in compiled_by_text:
                first, compiled, xla_s = compiled_by_text[digest]
                rec["same_program_as"] = first
            else:
                t0 = time.perf_counter()
                compiled = lowered.compile()
                xla_s = time.perf_counter() - t0
                compiled_by_text[digest] = (name, compiled, xla_s)
                if split_compile and time.perf_counter() + xla_s < deadline:
                    rec["xla_noautotune_s"] = _compile_seconds(lowered, NO_AUTOTUNE)
            rec["xla_compile_s"] = xla_s
            rec["compile_s"] = rec["lower_s"] + xla_s
            clock["max_compile_s"] = max(clock.get("max_compile_s", 0.0), rec["compile_s"])
            rec["temp_mb"], rec["peak_mb"] = memory_mb(compiled)
            rec.update(control_flow(compiled))
            runners[name] = _Runner(compiled, state, data)
            same = f" (same program as {rec['same_program_as']})" if "same_program_as" in rec else ""
            log(f"{name}: traced+lowered {rec['lower_s']:.1f} s, compiled {xla_s:.1f} s{same}, "
                f"temporaries {rec['temp_mb']:.1f} MiB")
        except Exception as err:  # one failing variant must not lose the others
            rec["error"] = _error(err)
            log(rec["error"])
            traceback.print_exc()
        if on_update is not None:
            on_update(res)
    if runners:
        left = max(deadline - time.perf_counter(), 0.0)
        log(f"timing {', '.join(runners)}: {reps} interleaved rounds")
        try:
            rounds: dict[str, int] = {}
            ms = interleaved_ms(dict(runners), reps, warmup=2, max_s=min(max_s, max(left, 10.0)), rounds=rounds)
            for name, t in ms.items():
                res["steps"][name]["ms"] = t
                res["steps"][name]["rounds"] = rounds[name]
            log("  ".join(f"{n} {t:.2f} ms" for n, t in ms.items()))
        except Exception as err:
            res["timing_error"] = _error(err)
            log(res["timing_error"])
            traceback.print_exc()
    settings = [PRODUCT_STEPS[n] for n in runners if n in PRODUCT_STEPS and PRODUCT_STEPS[n] != "highest"]
    default = gcx.per_example.PRODUCT_PRECISION.get(jax.default_backend(), "highest")
    if settings and default != "highest":
        settings.insert(0, default)  # the default ("tf32" on GPUs) against HIGHEST too
    if settings and time.perf_counter() + 2 * clock.get("max_compile_s", 0.0) < deadline:
        log(f"product accuracy against HIGHEST: {', '.join(settings)}")
        try:
            res["product_accuracy"] = product_accuracy(losses, params, data, settings)
            log(str(res["product_accuracy"]))
        except Exception as err:
            res["product_accuracy"] = {"error": _error(err)}
            log(res["product_accuracy"]["error"])
    _add_ratios(res)
    del runners, compiled_by_text
    gc.collect()
    return res


def _add_ratios(res: dict[str, Any]) -> None:
    base = res["steps"].get("nonprivate", {})
    for rec in res["steps"].values():
        for key, ratio in (("ms", "time_x"), ("temp_mb", "temp_x"), ("compile_s", "compile_x")):
            if key in rec and base.get(key):
                rec[ratio] = rec[key] / base[key]


# --------------------------------------------------------------------------- results


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _step_cell(rec: dict[str, Any], key: str, spec: str) -> str:
    if "error" in rec:
        return "error"
    if "skipped" in rec:
        return "-"
    return _fmt(rec.get(key), spec)


def markdown(meta: dict[str, Any], configs: Sequence[dict[str, Any]]) -> str:
    """The results as Markdown tables (see the module docstring)."""
    lines = [
        "# Ghost clipping on the GPU: DP training steps against the non-private step",
        "",
        f"jax {meta['jax']}, flax {meta['flax']}, optax {meta['optax']}, backend {meta['backend']} "
        f"({meta['device']}), {meta['machine']}, sizes: {meta['sizes']}, {meta['date']}.",
        "",
        "Every DP step is a full step: the clipped sum (C = 1), Gaussian noise of standard deviation z C "
        f"(z = {NOISE_MULTIPLIER:g}), division by the batch size and adamw; the non-private step is "
        "`jax.grad` of the mean loss and adamw. Jitted with the training state donated, compiled once. "
        "Times are medians over interleaved rounds (one step of each variant per round); ratios are to "
        "the non-private step of the same config in the same process (< 1 would be faster).",
        "",
    ]
    steps = [s for s in STEPS if s != "nonprivate"]
    header = "| config | model | params | B |"
    for title, base_key, base_spec, key, spec, unit in (
        ("Step time (ratio to non-private)", "ms", ".2f", "time_x", ".2f", "ms"),
        ("Compiled temporaries (ratio to non-private)", "temp_mb", ".1f", "temp_x", ".2f", "MiB"),
        ("Trace + lower + compile time (ratio to non-private)", "compile_s", ".1f", "compile_x", ".2f", "s"),
    ):
        lines += [f"## {title}", "",
                  header + f" non-private ({unit}) | " + " | ".join(STEP_TITLES[s] for s in steps) + " |",
                  "|---|---|---:|---:|---:|" + "---:|" * len(steps)]
        for c in configs:
            recs = c["steps"]
            cells = [_step_cell(recs.get(s, {"skipped": ""}), key, spec) for s in steps]
            lines.append(f"| {c['config']} | {c['label']} | {c['params'] / 1e6:.1f}M | {c['batch']} | "
                         f"{_step_cell(recs.get('nonprivate', {}), base_key, base_spec)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Notes per config", ""]
    for c in configs:
        g = c.get("ghost_report", {})
        if "error" in g:
            rep = f"ghost_report failed: {g['error']}"
        else:
            reasons = "; ".join(f"{n}x \"{r}\"" for r, n in g.get("fallback_reasons", {}).items()) or "none"
            kinds = ", ".join(f"{k} {n}" for k, n in g.get("ghost_kinds", {}).items()) or "none"
            rep = (f"ghost_report: {g.get('ghost')}/{g.get('leaves')} leaves on the ghost path ({kinds}); "
                   f"{g.get('fallback')} fall back to per-example gradients, reasons: {reasons}")
            if g.get("fallback_leaves"):
                shown = g["fallback_leaves"][:8]
                more = len(g["fallback_leaves"]) - len(shown)
                rep += f"; leaves: {', '.join(shown)}" + (f" and {more} more" if more > 0 else "")
        lines.append(f"- **{c['config']}**: {rep}.")
        for s, rec in c["steps"].items():
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
                extra.append(f"{rec['conditionals']} conditionals, {rec['loops']} loops in the compiled program")
            if "lower_s" in rec:
                extra.append(f"trace+lower {rec['lower_s']:.1f} s, XLA {rec['xla_compile_s']:.1f} s")
            if "xla_noautotune_s" in rec:
                extra.append(f"XLA without autotuning {rec['xla_noautotune_s']:.1f} s")
            if "rounds" in rec:
                extra.append(f"{rec['rounds']} rounds")
            lines.append(f"  - {STEP_TITLES[s]}: " + "; ".join(extra))
        if "timing_error" in c:
            lines.append(f"  - timing failed: {c['timing_error']}")
        for setting, acc in c.get("product_accuracy", {}).items():
            if not isinstance(acc, dict):
                lines.append(f"  - product accuracy: {acc}")
            elif "error" in acc:
                lines.append(f"  - products at {setting}: accuracy check failed: {acc['error']}")
            else:
                lines.append(f"  - products at {setting} against HIGHEST: per-example norms within "
                             f"{acc['norm_rel_err']:.1e} relative, clipped sum within {acc['sum_rel_err']:.1e}")
    return "\n".join(lines) + "\n"


def parse_steps(wanted: str | None, variable: str, default: Sequence[str] = STEPS) -> tuple[str, ...]:
    """The steps named in ``wanted`` (comma-separated, as the environment variable ``variable``
    gives them), else ``default``; a ValueError naming ``variable`` for a step not in :data:`STEPS`."""
    steps = tuple(s.strip() for s in wanted.split(",")) if wanted else tuple(default)
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise ValueError(f"{variable}: unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    return steps


def _meta(tiny: bool) -> dict[str, Any]:
    import flax

    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
            "machine": f"{platform.machine()} {platform.system()}", "sizes": "tiny (smoke)" if tiny else "full",
            "date": time.strftime("%Y-%m-%d %H:%M")}


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


def write_results(out: pathlib.Path, meta: dict[str, Any], configs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merges ``configs`` into ``out/ghost_gpu.json`` (by config name, then by step: see
    :func:`merge_config`) when its sizes and device match (:func:`~benchmarks.common.same_measurement`),
    and rewrites both files."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_JSON
    known: dict[str, dict[str, Any]] = {}
    if path.exists():
        old = json.loads(path.read_text())
        if same_measurement(old.get("meta", {}), meta):
            known = {c["config"]: c for c in old.get("configs", [])}
    for c in configs:
        known[c["config"]] = merge_config(known[c["config"]], c) if c["config"] in known else c
    order = [c.name for c in CONFIGS]
    merged = sorted(known.values(), key=lambda c: order.index(c["config"]) if c["config"] in order else len(order))
    path.write_text(json.dumps({"meta": meta, "configs": merged}, indent=1))
    (out / RESULTS_MD).write_text(markdown(meta, merged))
    return merged


def rows_of(res: dict[str, Any]) -> list[dict]:
    """Rows for ``python -m benchmarks``: one per DP step with a time, ratio to the non-private step."""
    base = res["steps"].get("nonprivate", {})
    out = []
    for name, rec in res["steps"].items():
        if name == "nonprivate" or "ms" not in rec or "ms" not in base:
            continue
        note = (f"{res['label']}; temporaries {_fmt(rec.get('temp_x'), '.2f')}x ({rec['temp_mb']:.0f} MiB), "
                f"compile {_fmt(rec.get('compile_x'), '.2f')}x ({rec['compile_s']:.1f} s)")
        if "same_program_as" in rec:
            note += f"; same program as {rec['same_program_as']}"
        kind = "step" if name.startswith("nonprivate") else "DP step"
        out.append(row("ghost-gpu", f"{res['config']} {STEP_TITLES[name]} {kind} vs non-private step, "
                       f"B={res['batch']}", rec["ms"], base["ms"], note, temp_mb=rec["temp_mb"],
                       baseline_temp_mb=base.get("temp_mb"), compile_s=rec["compile_s"],
                       baseline_compile_s=base.get("compile_s")))
    return out


def _has_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def run(quick: bool = False, *, out: str | pathlib.Path | None = None, models: str | Sequence[str] | None = None,
        force: bool | None = None) -> list[dict]:
    """Runs the suite (see the module docstring); returns ``python -m benchmarks`` rows.

    Returns ``[]`` after printing why when there is no GPU and the run is not forced.
    """
    force = _env_flag("GHOST_GPU_FORCE") if force is None else force
    if not _has_gpu() and not force:
        print(f"ghost-gpu: skipped, no GPU (jax backend is {jax.default_backend()!r}); set GHOST_GPU_FORCE=1 "
              "or pass --force-cpu for a tiny smoke run", flush=True)
        return []
    tiny = not _has_gpu() or _env_flag("GHOST_GPU_TINY")
    configs = select(models if models is not None else os.environ.get("GHOST_GPU_MODELS"))
    steps = parse_steps(os.environ.get("GHOST_GPU_STEPS"), "GHOST_GPU_STEPS")
    budget = float(os.environ.get("GHOST_GPU_BUDGET_S", DEFAULT_BUDGET_S))
    deadline = time.perf_counter() + budget
    reps, max_s = (5, 20.0) if quick else (20, 120.0)
    out_dir = pathlib.Path(out) if out is not None else pathlib.Path(__file__).parent / "results"
    meta = _meta(tiny)
    print(f"ghost-gpu: {', '.join(c.name for c in configs)} on {meta['device']} ({meta['sizes']} sizes), "
          f"budget {budget:.0f} s, results in {out_dir}", flush=True)
    done: list[dict[str, Any]] = []
    merged: list[dict[str, Any]] = []
    rows: list[dict] = []
    clock: dict[str, float] = {}
    for cfg in configs:
        res = measure(cfg, tiny=tiny, reps=reps, max_s=max_s, deadline=deadline, wanted=steps, clock=clock,
                      on_update=lambda partial: write_results(out_dir, meta, [*done, partial]),
                      split_compile=_env_flag("GHOST_GPU_COMPILE_SPLIT"))
        done.append(res)
        rows += rows_of(res)
        merged = write_results(out_dir, meta, done)
    if done:
        print(markdown(meta, merged), flush=True)
        print(f"ghost-gpu: wrote {out_dir / RESULTS_MD} and {out_dir / RESULTS_JSON}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="5 timing rounds instead of 20")
    parser.add_argument("--models", default=None, help="configs: " + ", ".join(c.name for c in CONFIGS))
    parser.add_argument("--force-cpu", action="store_true", help="tiny smoke run without a GPU")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only merge these result files into --out")
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
