"""What the GPU DP-step suite measures: the step variants and the model configs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from benchmarks.models import LlamaConfig, gpt2, llama, wrn
from benchmarks.variants import PRODUCT_STEPS

STEPS = (
    "nonprivate",
    "ghost",
    "backward",
    "bookkeeping",
    "vmap",
    "jax_privacy",
    "nonprivate_highest",
    "ghost_highest",
    "ghost_tf32x2",
    "ghost_tf32x3",
    "ghost_bf16x6",
    "ghost_noise_shapes",
    "ghost_noise_leaves",
    "nonprivate_noise",
    "ghost_noise_unstored",
)
STEP_TITLES = {
    "nonprivate": "non-private",
    "ghost": "ghost (auto)",
    "backward": "ghost backward",
    "bookkeeping": "ghost bookkeeping",
    "vmap": "vmap",
    "jax_privacy": "jax-privacy",
    "nonprivate_highest": "non-private at HIGHEST",
    "ghost_highest": "ghost, products HIGHEST",
    "ghost_tf32x2": "ghost, book-kept sums in two exact TF32 passes",
    "ghost_tf32x3": "ghost, products 3xTF32",
    "ghost_bf16x6": "ghost, products 6xBF16",
    "ghost_noise_shapes": "ghost, noise drawn once per leaf shape",
    "ghost_noise_leaves": "ghost, noise drawn once per leaf",
    "nonprivate_noise": "non-private sum with the DP noise",
    "ghost_noise_unstored": "ghost, noise drawn as optax draws it (not stored)",
}


@dataclass(frozen=True)
class Config:
    """One measured setting: a model variant, a batch size and the steps timed."""

    name: str
    model: str  # 'gpt2' (fused qkv), 'gpt2-qkv' (separate q/k/v), 'gpt2-bf16', 'gpt2-scan', 'wrn', 'llama', 'llama-lora'
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
    Config("llama-b8", "llama", 8, ("nonprivate", "ghost", "vmap")),
    Config("llama-lora-b8", "llama-lora", 8, ("nonprivate", "ghost", "vmap")),
)
# The Llama configs: 0.42B parameters in bfloat16 at T=1024 (32 layers of width 1024, 16 heads,
# 4 kv-heads, SwiGLU 2752, vocabulary 32000, untied head; nnx.scan over nnx.remat'd blocks);
# LoRA: rank 16 adapters on q, v and the MLP. Tiny: 2 layers of width 32, T=8, vocabulary 64.
LLAMA = LlamaConfig(
    layers=32, d=1024, heads=16, kv_heads=4, seq=1024, vocab=32000, dtype=jnp.bfloat16
)
LLAMA_TINY = LlamaConfig(layers=2, d=32, heads=4, kv_heads=2, seq=8, vocab=64, dtype=jnp.bfloat16)
LLAMA_LORA_RANK = 16
TINY_BATCH = 4


def select(models: str | Sequence[str] | None) -> list[Config]:
    """The configs named by ``models``; all when empty.

    A name picks every config equal to it or starting with it and a dash (``gpt2`` = all
    GPT-2 configs, ``gpt2-qkv`` = both separate-q/k/v ones, ``wrn``).
    """
    if models is None or models == "" or models == []:
        return list(CONFIGS)
    names = [
        m.strip() for m in (models.split(",") if isinstance(models, str) else models) if m.strip()
    ]
    chosen = []
    for n in names:
        hits = [c for c in CONFIGS if c.name == n or c.name.startswith(n + "-")]
        if not hits:
            raise ValueError(
                f"models: unknown config {n!r}; known: {', '.join(c.name for c in CONFIGS)}"
            )
        chosen += [c for c in hits if c not in chosen]
    return chosen


def parse_steps(
    wanted: str | None, variable: str, default: Sequence[str] = STEPS
) -> tuple[str, ...]:
    """The steps named in ``wanted`` (comma-separated, as the environment variable ``variable``
    gives them), else ``default``; a ValueError naming ``variable`` for a step not in :data:`STEPS`."""
    steps = tuple(s.strip() for s in wanted.split(",")) if wanted else tuple(default)
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise ValueError(f"{variable}: unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    return steps


def build(cfg: Config, tiny: bool) -> tuple[Callable, Any, Any, str, int]:
    """``(losses, params, data, label, batch)`` of a config at full or tiny size."""
    batch = TINY_BATCH if tiny else cfg.batch
    if cfg.model == "wrn":
        return (*wrn(batch, tiny=tiny), batch)
    if cfg.model.startswith("llama"):
        lcfg = llama_config(cfg, tiny)
        label = (
            f"Llama nnx {lcfg.layers}x{lcfg.d}, {lcfg.heads}/{lcfg.kv_heads} heads, vocab {lcfg.vocab}, "
            f"T={lcfg.seq}, scan+remat, {'LoRA r=' + str(lcfg.lora) if lcfg.lora else 'full'}, bfloat16"
        )
        return (*llama(0, batch, lcfg), label, batch)
    dtype = jnp.bfloat16 if cfg.model == "gpt2-bf16" else jnp.float32
    return (
        *gpt2(
            batch,
            fused=cfg.model != "gpt2-qkv",
            dtype=dtype,
            tiny=tiny,
            scan=cfg.model == "gpt2-scan",
        ),
        batch,
    )


def llama_config(cfg: Config, tiny: bool) -> LlamaConfig:
    """The :class:`~benchmarks.models.LlamaConfig` of a ``llama`` config (LoRA for ``llama-lora``)."""
    base = LLAMA_TINY if tiny else LLAMA
    return base._replace(lora=LLAMA_LORA_RANK if cfg.model == "llama-lora" else 0)
