"""The training steps every suite measures, one table: a step's name to its builder.

Each variant is a full step of :mod:`benchmarks.steps` (``(state, batch) -> state``, the same
clip norm, noise and adamw) over one model's per-example ``losses``; :func:`make_steps` builds the
named ones. A builder returns a string instead of a step when the step cannot run here (its
package is not importable, or it needs a GPU): the suites record the reason.

* ``nonprivate``: ``jax.grad`` of the mean loss, the baseline; ``nonprivate_highest`` traced at
  ``Precision.HIGHEST``; ``nonprivate_noise`` the summed gradient with the DP noise (no clipping).
* ``ghost`` / ``backward`` / ``bookkeeping``: ``gcx.clipped_grad(method='ghost')`` with
  ``ghost_sum`` ``'auto'``, ``'backward'`` or ``'bookkeeping'``; ``vmap`` and ``auto``: with
  ``method='vmap'`` and ``'auto'``.
* ``hand``: a hand-written ``vmap(grad)`` + clip + sum (:func:`benchmarks.steps.hand_clipped_grad`).
* ``jax_privacy``: ``jax_privacy.clipped_grad`` with the same noise and optimizer.
* :data:`PRODUCT_STEPS`: ghost at another ``gcx.per_example.PRODUCT_PRECISION`` setting.
* ``ghost_noise_shapes``: ghost with the noise drawn once per leaf shape (the GPU default);
  ``ghost_noise_leaves``: ghost with one draw per leaf; ``ghost_noise_unstored``:
  ghost with the noise drawn as optax draws it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

import gradclip_jax as gcx
from benchmarks.steps import (
    CLIP,
    LEARNING_RATE,
    NOISE_MULTIPLIER,
    dp_step,
    hand_clipped_grad,
    jax_privacy_grad,
    nonprivate_step,
    optax_noise,
    traced_within,
)
from gradclip_jax._core.backend import backend_setting
from gradclip_jax.dp.noise import NOISE_STRATEGY

GHOST_SUM = {"ghost": "auto", "backward": "backward", "bookkeeping": "bookkeeping"}
# Ghost (auto) with the per-example products at another gcx.per_example.PRODUCT_PRECISION
# setting than the backend's default ("tf32" on GPUs): HIGHEST, or a reduced-pass algorithm.
PRODUCT_STEPS = {
    "ghost_highest": "highest",
    "ghost_tf32x2": "tf32x2",
    "ghost_tf32x3": "tf32x3",
    "ghost_bf16x6": "bf16x6",
}


def has_gpu() -> bool:
    """Whether JAX runs on a GPU."""
    return jax.default_backend() == "gpu"


@dataclass(frozen=True)
class StepParts:
    """What every variant of one model is built from."""

    losses: Callable
    batch_size: int
    opt: optax.GradientTransformation
    stddev: float

    def dp(self, summed_grad: Callable, noise: Callable | None = None) -> Callable:
        """The DP step over ``summed_grad`` (see :func:`benchmarks.steps.dp_step`)."""
        return dp_step(summed_grad, self.stddev, self.batch_size, self.opt, noise)

    def clipped_sum(self, method: str = "ghost", ghost_sum: str = "auto") -> Callable:
        """``gcx.clipped_grad``'s sum alone, at the suites' clip norm."""
        grad_fn = gcx.clipped_grad(self.losses, CLIP, method=method, ghost_sum=ghost_sum)
        return lambda p, b: grad_fn(p, b)[0]


def _nonprivate(s: StepParts, name: str) -> Callable | str:
    return nonprivate_step(s.losses, s.opt)


def _nonprivate_highest(s: StepParts, name: str) -> Callable | str:
    return traced_within(_nonprivate(s, name), lambda: jax.default_matmul_precision("highest"))  # type: ignore[arg-type]


def _clipped(s: StepParts, name: str) -> Callable | str:
    method, ghost_sum = ("ghost", GHOST_SUM[name]) if name in GHOST_SUM else (name, "auto")
    return s.dp(s.clipped_sum(method, ghost_sum))


def _hand(s: StepParts, name: str) -> Callable | str:
    return s.dp(hand_clipped_grad(s.losses))


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


def _noise_leaves(s: StepParts, name: str) -> Callable | str:
    return traced_within(
        s.dp(s.clipped_sum()), functools.partial(backend_setting, NOISE_STRATEGY, "leaves")
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
    "auto": _clipped,
    "hand": _hand,
    "jax_privacy": _jax_privacy,
    "nonprivate_highest": _nonprivate_highest,
    **dict.fromkeys(PRODUCT_STEPS, _products),
    "ghost_noise_shapes": _noise_shapes,
    "ghost_noise_leaves": _noise_leaves,
    "nonprivate_noise": _nonprivate_noise,
    "ghost_noise_unstored": _noise_unstored,
}


def parts_of(losses: Callable, batch_size: int) -> StepParts:
    """The suites' :class:`StepParts` of a model: adamw at ``LEARNING_RATE``, noise at
    ``NOISE_MULTIPLIER * CLIP``."""
    return StepParts(losses, batch_size, optax.adamw(LEARNING_RATE), NOISE_MULTIPLIER * CLIP)


def make_steps(
    losses: Callable, batch_size: int, names: Sequence[str]
) -> dict[str, Callable | str]:
    """The steps ``names`` of :data:`VARIANTS` over ``losses`` (a string for one that cannot
    run here, saying why), in that order; a ValueError naming an unknown step."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"steps: unknown {unknown}; known: {', '.join(VARIANTS)}")
    parts = parts_of(losses, batch_size)
    return {n: VARIANTS[n](parts, n) for n in names}
