"""The jit-able functions of a private run: the clipped sum of a batch, the noised and
averaged update, and the step that chains them (with its metrics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradclip_jax._core import norms as _norms
from gradclip_jax._core.validation import check_mask
from gradclip_jax.dp.noise import add_gaussian_noise
from gradclip_jax.dp.private_step._counted import CountedUpdate
from gradclip_jax.dp.private_step._releases import ReleaseLog
from gradclip_jax.per_example.api import ClippedGradFn, ClippedGradInfo


class PrivateStepMetrics(NamedTuple):
    """What the private step reports. **Not privatized**: do not release these.

    Attributes:
      loss: mean loss over the real (unmasked) examples of the batch.
      num_clipped: the number of real examples whose gradient was clipped.
      grad_norm: the L2 norm of the noised, averaged gradient (a function of
        the released gradient only: this one may be released).
      num_nonfinite: the number of real examples whose gradient norm is NaN
        or inf. Such an example is **dropped**: it adds nothing to the
        clipped sum (``clipped_grad``'s ``nan_safe``), so the parameters stay
        finite while ``loss`` can show NaN; the divisor is still the expected
        batch size. An example whose elements are finite but whose norm
        overflows the float32 range counts here too, though it is kept
        (clipped with an upper bound of its norm).
    """

    loss: jax.Array
    num_clipped: jax.Array
    grad_norm: jax.Array
    num_nonfinite: jax.Array


def _num_nonfinite(norms: Any, mask: jax.Array) -> jax.Array:
    """The real examples (``mask``) with a non-finite norm in any leaf of ``norms`` (``(B,)`` arrays)."""
    finite = [jnp.isfinite(n) for n in jax.tree_util.tree_leaves(norms)]
    bad = ~jnp.all(jnp.stack(finite), axis=0) if finite else jnp.zeros(mask.shape, bool)
    return jnp.sum(bad & mask).astype(jnp.int32)


def _batch_rows(batch: Any) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves or not all(getattr(x, "ndim", 0) >= 1 for x in leaves):
        raise ValueError("make_private step: every leaf of `batch` needs a leading batch axis")
    return int(leaves[0].shape[0])


class _StepFunctions(NamedTuple):
    init: Callable[[Any], Any]
    step: Callable[..., tuple[Any, Any, PrivateStepMetrics]]
    clipped_sum: Callable[..., tuple[Any, ClippedGradInfo]]
    noisy_update: Callable[..., tuple[Any, Any, jax.Array]]


def step_functions(
    grad_fn: ClippedGradFn,
    optimizer: optax.GradientTransformation,
    std: float,
    divisor: float,
    noise: Callable[..., Any] | None = None,
    summed_by: Callable[..., tuple[Any, ClippedGradInfo]] | None = None,
    releases: ReleaseLog | None = None,
) -> _StepFunctions:
    """The jit-able functions of a run: noise of standard deviation ``std``, sum over ``divisor``.

    ``noise(summed, stddev, key)`` adds the noise (default :func:`add_gaussian_noise`); ``summed_by``
    replaces ``grad_fn`` for the clipped sum (the hardened integer grid: its ``noise`` ignores ``std``);
    ``releases`` hears of each executed ``noisy_update`` (:mod:`._releases`): ``step`` and
    ``noisy_update`` are then :class:`._counted.CountedUpdate`\\ s, jitted when called directly.
    """
    add_noise = add_gaussian_noise if noise is None else noise
    sum_fn = grad_fn if summed_by is None else summed_by

    def init(params: Any) -> Any:
        return optimizer.init(params)

    def clipped_sum(params: Any, batch: Any, mask: Any) -> tuple[Any, ClippedGradInfo]:
        if mask is None:  # the sampler's padding mask: a step without one would count padding rows
            raise TypeError(
                "make_private step: `mask` is required (the mask of the sampler's batch)"
            )
        mask = check_mask("make_private step", mask, _batch_rows(batch))
        return sum_fn(params, batch, mask=mask)

    def updates(report: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``(noisy_update, step)``; ``report``: each execution reports its key to ``releases``."""

        def noisy_update(
            params: Any, opt_state: Any, summed: Any, key: jax.Array
        ) -> tuple[Any, Any, jax.Array]:
            if report and releases is not None:
                releases.mark(key, summed)
            noised = add_noise(summed, std, key)
            grads = jax.tree.map(
                lambda g, p: (g / jnp.asarray(divisor, g.dtype)).astype(jnp.asarray(p).dtype),
                noised,
                params,
            )
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, _norms.tree_norm(grads)

        def step(
            params: Any, opt_state: Any, batch: Any, mask: Any, key: jax.Array
        ) -> tuple[Any, Any, PrivateStepMetrics]:
            summed, info = clipped_sum(params, batch, mask)
            params, opt_state, gnorm = noisy_update(params, opt_state, summed, key)
            m = jnp.asarray(mask).astype(bool)
            real = jnp.maximum(jnp.sum(m), 1)
            loss = jnp.sum(jnp.where(m, info.values, 0)) / real
            metrics = PrivateStepMetrics(
                loss=loss,
                num_clipped=info.num_clipped,
                grad_norm=gnorm,
                num_nonfinite=_num_nonfinite(info.norms, m),
            )
            return params, opt_state, metrics

        return noisy_update, step

    noisy_update, step = updates(report=True)
    # called directly: a program without the callback, its calls counted on the host
    if releases is not None:
        plain_update, plain_step = updates(report=False)
        noisy_update = CountedUpdate(noisy_update, plain_update, releases)
        step = CountedUpdate(step, plain_step, releases)
    return _StepFunctions(init, step, clipped_sum, noisy_update)
