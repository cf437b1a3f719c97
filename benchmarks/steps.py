"""The training steps and clipped-gradient functions the benchmark suites share.

A step maps ``(state, batch)`` to the next ``state``, with ``state = (params, opt_state, key)``,
so that a suite can jit it with the state donated. The DP steps are full steps: the clipped sum,
Gaussian noise of standard deviation ``NOISE_MULTIPLIER * CLIP``, division by the batch size,
then ``optax.adamw(LEARNING_RATE)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradclip_jax.dp.noise import add_gaussian_noise

CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 1e-4


def fresh_state(params: Any, seed: int) -> Any:
    """A new ``(params, adamw state, key)`` training state (the parameters copied: steps donate it)."""
    p = jax.tree.map(lambda x: x.copy(), params)
    return p, optax.adamw(LEARNING_RATE).init(p), jax.random.key(seed)


def nonprivate_step(losses: Callable, opt: optax.GradientTransformation) -> Callable:
    """``jax.grad`` of the mean loss, then ``opt``: the baseline every DP step is measured against."""

    def step(state: Any, batch: Any) -> Any:
        params, opt_state, key = state
        key, _ = jax.random.split(key)
        grads = jax.grad(lambda p: jnp.mean(losses(p, batch)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key

    return step


def dp_step(
    summed_grad: Callable,
    stddev: float,
    batch_size: int,
    opt: optax.GradientTransformation,
    noise: Callable[[Any, Any, Any], Any] | None = None,
) -> Callable:
    """A DP step over ``summed_grad(params, batch)`` (the clipped sum).

    Args:
      summed_grad: the sum over the batch of the clipped per-example gradients.
      stddev: the noise's standard deviation.
      batch_size: the sum is divided by it.
      opt: the optimizer applied to the noised mean.
      noise: ``noise(tree, stddev, key)``; by default :func:`gradclip_jax.dp.noise.add_gaussian_noise`.
    """
    add_noise = add_gaussian_noise if noise is None else noise

    def step(state: Any, batch: Any) -> Any:
        params, opt_state, key = state
        key, noise_key = jax.random.split(key)
        noisy = add_noise(summed_grad(params, batch), stddev, noise_key)
        grads = jax.tree.map(lambda g, p: (g / batch_size).astype(p.dtype), noisy, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key

    return step


def traced_within(
    step: Callable, context: Callable[[], contextlib.AbstractContextManager]
) -> Callable:
    """``step`` traced inside ``context()`` (e.g. every matmul at ``Precision.HIGHEST``, or another
    ``PRODUCT_PRECISION`` through :func:`gradclip_jax._core.backend.backend_setting`)."""

    def run(state: Any, batch: Any) -> Any:
        with context():
            return step(state, batch)

    return run


def optax_noise(tree: Any, stddev: float, key: jax.Array) -> Any:
    """The per-leaf draw of ``optax.contrib.differentially_private_aggregate`` (nothing stored)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noised = [
        x + stddev * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, noised)


def jax_privacy_grad(losses: Callable[..., Any]) -> Callable[..., Any] | None:
    """``jax_privacy.clipped_grad`` of the summed loss at ``CLIP``; None when jax-privacy is not importable."""
    try:
        import jax_privacy
    except Exception:  # not installed (or broken): skip
        return None
    return jax_privacy.clipped_grad(
        lambda p, b: jnp.sum(losses(p, b)), l2_clip_norm=CLIP, batch_argnums=1
    )


def dropin_grad(losses: Callable[..., Any]) -> Callable[..., Any] | None:
    """jax-privacy's call, word for word, on ``gradclip_jax.interop.jax_privacy`` (None without the extra)."""
    try:
        from gradclip_jax.interop import jax_privacy as dropin
    except ImportError:
        return None
    return dropin.clipped_grad(
        lambda p, b: jnp.sum(losses(p, b)), l2_clip_norm=CLIP, batch_argnums=1
    )


def hand_clipped_grad(losses: Callable[..., Any]) -> Callable[..., Any]:
    """The hand-written baseline: ``vmap(grad)`` then ``optax.per_example_global_norm_clip`` at ``CLIP``."""

    def one(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return losses(p, {"x": x[None], "y": y[None]})[0]

    def f(p: Any, b: Any) -> Any:
        g = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(p, b["x"], b["y"])
        leaves, treedef = jax.tree.flatten(g)
        summed, _ = optax.per_example_global_norm_clip(leaves, CLIP)
        return jax.tree.unflatten(treedef, summed)

    return f
