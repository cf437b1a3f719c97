""":func:`clip_and_round_to_grid`: one example's output clipped and rounded onto an integer grid,
jax-privacy's ``grid_scale`` (its current source's rule and rounding), for an exact integer sum."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core.validation import is_traced
from gradclip_jax.interop.jax_privacy._clip_norms import check_grid_scale
from gradclip_jax.interop.jax_privacy._clip_pytree import PyTree, clip_pytree


def adjusted_clip_norm(fn: str, l2_clip_norm: Any, grid_scale: int, num_params: int) -> Any:
    """``l2_clip_norm`` lowered by the most that rounding to the grid can add to the norm.

    Rounding each of ``num_params`` coordinates to the nearest grid point (a step is
    ``l2_clip_norm / grid_scale``) moves it by at most half a step, so the norm grows by at most
    ``sqrt(num_params) / 2`` steps: clipped to the lowered norm, the rounded output has norm at
    most ``grid_scale`` steps. The arithmetic is jax-privacy's (the same float).

    Example:
      >>> adjusted_clip_norm('clipped_fun', 1.0, 1000, 100)
      0.995
    """
    step = l2_clip_norm / grid_scale
    rounding = num_params**0.5 * step * 0.5
    adjusted = l2_clip_norm - rounding
    if not is_traced(adjusted) and float(adjusted) <= 0:
        raise ValueError(
            f"{fn}: grid_scale={grid_scale} is too small for {num_params} parameters: rounding can add "
            f"sqrt({num_params}) / 2 = {math.sqrt(num_params) / 2:.4g} grid steps to the norm, all of the "
            f"grid_scale; use grid_scale > {math.sqrt(num_params) / 2:.4g}"
        )
    return adjusted


def clip_and_round_to_grid(
    gradient: PyTree,
    l2_clip_norm: float,
    grid_scale: int,
    *,
    nan_safe: bool = True,
    return_zero: Any = False,
) -> tuple[PyTree, jax.Array]:
    """One example's tree clipped and rounded to the integer grid: ``jax_privacy.clipping.clip_and_round_to_grid``.

    The tree is clipped (:func:`clip_pytree`) to :func:`adjusted_clip_norm`, multiplied by
    ``grid_scale / l2_clip_norm`` in float64 (jax-privacy's current source multiplies in the
    tree's own dtype, whose rounding can take the result past the bound), rounded to the
    nearest integer (ties to even, ``jnp.round``) and stored as int64: the rounded tree's L2
    norm is at most ``grid_scale``, so a sum of such trees has sensitivity
    ``grid_scale`` (in grid units: multiply by ``l2_clip_norm / grid_scale`` for the
    original units). The clip stores within the lowered norm exactly (see :func:`clip_pytree`).

    Args:
      gradient: a pytree of floating-point arrays (one example).
      l2_clip_norm: the clip norm in the original units (> 0, finite).
      grid_scale: grid steps per ``l2_clip_norm`` (a positive int).
      nan_safe: see :func:`clip_pytree`.
      return_zero: return zeros (padding examples; a bool, traced too).

    Returns:
      ``(rounded, norm)``: an int64 tree shaped like ``gradient`` and the float32 L2 norm of
      the input.

    Raises:
      ValueError: naming the argument: a ``grid_scale`` below 1 or too small for the number of
        parameters, a clip norm that is not positive and finite, 64-bit mode off.
      TypeError: a ``grid_scale`` that is not an int.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax.interop.jax_privacy import clip_and_round_to_grid
      >>> with jax.enable_x64(True):
      ...     rounded, norm = clip_and_round_to_grid({'w': jnp.array([0.3, -0.4])}, 1.0, 100)
      >>> rounded['w'], float(norm)
      (Array([ 30, -40], dtype=int64), 0.5)
    """
    fn = "clip_and_round_to_grid"
    check_grid_scale(fn, grid_scale, l2_clip_norm, False, 1.0)
    num_params = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(gradient))
    adjusted = adjusted_clip_norm(fn, l2_clip_norm, grid_scale, num_params)
    clipped, norm = clip_pytree(gradient, adjusted, nan_safe=nan_safe, return_zero=return_zero)
    # scaled in float64 (64-bit mode is on): in the gradient's dtype the product rounds too,
    # which the adjustment leaves no room for (bfloat16's spacing is 4 between 512 and 1024:
    # one example reached norm 1000.9 at grid_scale 1000), and so does a float32 scale above 2**24
    scale = jnp.asarray(grid_scale, jnp.float64) / jnp.asarray(l2_clip_norm, jnp.float64)
    return jax.tree.map(
        lambda g: jnp.round(g.astype(jnp.float64) * scale).astype(jnp.int64), clipped
    ), norm
