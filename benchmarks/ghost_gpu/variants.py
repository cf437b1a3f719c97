"""The step variants of the GPU DP-step suite, one table: a step's name to its builder."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx
from benchmarks.ghost_gpu.configs import GHOST_SUM, PRODUCT_STEPS, Config
from benchmarks.steps import (
    CLIP,
    LEARNING_RATE,
    NOISE_MULTIPLIER,
    dp_step,
    jax_privacy_grad,
    nonprivate_step,
    optax_noise,
    traced_within,
)
from gradclip_jax._core.backend import backend_setting
from gradclip_jax.dp.noise import NOISE_STRATEGY


def has_gpu() -> bool:
    """Whether JAX runs on a GPU."""
    return jax.default_backend() == "gpu"


def error_text(err: BaseException) -> str:
    """One line (at most 300 characters) naming an error, for a results record."""
    return f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


@dataclass(frozen=True)
class StepParts:
    """What every variant of one config is built from."""

    losses: Callable
    batch_size: int
    opt: optax.GradientTransformation
    stddev: float

    def dp(self, summed_grad: Callable, noise: Callable | None = None) -> Callable:
        """The DP step over ``summed_grad`` (see :func:`benchmarks.steps.dp_step`)."""
        return dp_step(summed_grad, self.stddev, self.batch_size, self.opt, noise)

    def clipped_sum(self, method: str = "ghost", ghost_sum: str = "auto") -> Callable:
        """``gcx.clipped_grad``'s sum alone, at the suite's clip norm."""
        grad_fn = gcx.clipped_grad(self.losses, CLIP, method=method, ghost_sum=ghost_sum)
        return lambda p, b: grad_fn(p, b)[0]


def _nonprivate(s: StepParts, name: str) -> Callable | str:
    return nonprivate_step(s.losses, s.opt)


def _nonprivate_highest(s: StepParts, name: str) -> Callable | str:
    return traced_within(_nonprivate(s, name), lambda: jax.default_matmul_precision("highest"))  # type: ignore[arg-type]


def _clipped(s: StepParts, name: str) -> Callable | str:
    method, ghost_sum = ("ghost", GHOST_SUM[name]) if name in GHOST_SUM else ("vmap", "auto")
    return s.dp(s.clipped_sum(method, ghost_sum))


def _products(s: StepParts, name: str) -> Callable | str:
    if name == "ghost_tf32x3" and not has_gpu():
        return "skipped: TF32 products need an NVIDIA GPU (Ampere or later)"
    setting = functools.partial(
        backend_setting, gcx.per_example.PRODUCT_PRECISION, PRODUCT_STEPS[name]
    )
    return traced_within(s.dp(s.clipped_sum()), setting)


def _noise_shapes(s: StepParts, name: str) -> Callable | str:
    return traced_within(
        s.dp(s.clipped_sum()), functools.partial(backend_setting, NOISE_STRATEGY, "shapes")
    )


def _nonprivate_noise(s: StepParts, name: str) -> Callable | str:
    return s.dp(jax.grad(lambda p, b: jnp.sum(s.losses(p, b))))


def _noise_unstored(s: StepParts, name: str) -> Callable | str:
    return s.dp(s.clipped_sum(), noise=optax_noise)


def _jax_privacy(s: StepParts, name: str) -> Callable | str:
    jp = jax_privacy_grad(s.losses)
    return "skipped: jax_privacy is not importable" if jp is None else s.dp(jp)


VARIANTS: dict[str, Callable[[StepParts, str], Callable | str]] = {
    "nonprivate": _nonprivate,
    "ghost": _clipped,
    "backward": _clipped,
    "bookkeeping": _clipped,
    "vmap": _clipped,
    "jax_privacy": _jax_privacy,
    "nonprivate_highest": _nonprivate_highest,
    **dict.fromkeys(PRODUCT_STEPS, _products),
    "ghost_noise_shapes": _noise_shapes,
    "nonprivate_noise": _nonprivate_noise,
    "ghost_noise_unstored": _noise_unstored,
}


def step_variants(
    cfg: Config, losses: Callable, batch_size: int, wanted: Sequence[str]
) -> dict[str, Callable | str]:
    """Each step function of ``cfg``, or a string saying why the step is skipped.

    ``nonprivate`` comes first, then the ``wanted`` steps in the order asked for (a run cut
    short by its budget measured those), then the config's other steps, marked skipped.
    """
    parts = StepParts(losses, batch_size, optax.adamw(LEARNING_RATE), NOISE_MULTIPLIER * CLIP)
    out: dict[str, Callable | str] = {"nonprivate": _nonprivate(parts, "nonprivate")}
    order = [n for n in wanted if n in cfg.steps[1:]] + [
        n for n in cfg.steps[1:] if n not in wanted
    ]
    for name in order:
        out[name] = (
            VARIANTS[name](parts, name)
            if name in wanted
            else "skipped: not selected (GHOST_GPU_STEPS)"
        )
    return out


def product_accuracy(
    losses: Callable, params: Any, data: Any, settings: Sequence[str]
) -> dict[str, Any]:
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
            out[setting] = {"error": error_text(err)}
            continue
        diff = sum(
            np.sum((np.asarray(a, np.float64) - b) ** 2)
            for a, b in zip(jax.tree.leaves(g), ref_leaves)
        )
        out[setting] = {
            "norm_rel_err": float(np.max(np.abs(np.asarray(n, np.float64) / ref_n - 1))),
            "sum_rel_err": float(np.sqrt(diff)) / ref_norm,
        }
    return out
