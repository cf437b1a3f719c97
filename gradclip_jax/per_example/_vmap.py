"""The vmap strategy: per-example gradients materialized as rows, then clipped and summed."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax._core import norms as _norms
from gradclip_jax.per_example._batch import (
    Call,
    gathered_over_batch,
    match_batch_sharding,
    one_example_loss,
)
from gradclip_jax.per_example._chunks import run_chunks
from gradclip_jax.per_example._clip_sum import clip_and_sum, clip_flags
from gradclip_jax.per_example._config import ClipConfig, ClippedGradInfo
from gradclip_jax.per_example._example_norms import as_rows, clip_budgets, unrow
from gradclip_jax.per_example.ghost._analysis import check_per_example, loss_crossing


def per_example_grads(config: ClipConfig, call: Call, batch: Any) -> tuple:
    """``(values, grads, aux)`` of every example of ``batch``, from ``vmap(value_and_grad)``."""
    scalar_loss = one_example_loss(config.loss_fn, config.has_aux)

    transform = config.pre_clipping_transform

    def one(p: Any, example: Any, *a: Any) -> tuple:
        (val, aux), g = jax.value_and_grad(lambda q: scalar_loss(q, example, *a), has_aux=True)(p)
        return val, (g if transform is None else transform(g)), aux

    in_axes = (None, 0) + (None,) * len(call.args)
    return jax.vmap(one, in_axes=in_axes, spmd_axis_name=config.spmd_axis_name)(  # type: ignore[no-any-return]
        gathered_over_batch(call.params, batch), batch, *call.args
    )


def _chunk(
    config: ClipConfig, call: Call, clips: Any, batch: Any, valid: jax.Array | None
) -> tuple:
    vals, g, aux = per_example_grads(config, call, batch)
    arrays = _norms.flatten(g, config.fn).arrays
    if not arrays:  # params without a floating-point leaf: nothing to clip
        m = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if clips is None:
            return [], jnp.zeros((m,), jnp.float32), jnp.zeros((m,), bool), vals, aux
        return [], [], [], vals, aux
    rows = [as_rows(x) for x in arrays]
    if valid is not None:
        valid = match_batch_sharding(valid, rows[0])
    sums, w = clip_and_sum(
        rows,
        config.l2_clip_norm if clips is None else clips,
        factor_fn=config.factors,
        valid=valid,
        nan_safe=config.nan_safe,
    )
    flags, ns = clip_flags(w, valid, clips is not None)
    return unrow(sums, arrays), ns, flags, vals, aux


def run_vmap(
    config: ClipConfig, call: Call, *, checked: bool = False
) -> tuple[Any, ClippedGradInfo]:
    """``(grads, info)`` by the vmap strategy; ``checked``: the loss's shape is already known to be ``(B,)``."""
    params = call.params
    if (
        not checked
    ):  # one trace of the whole batch: losses of shape (B,), no example combined with another
        check_per_example(
            config.fn,
            loss_crossing(
                config.loss_fn,
                config.has_aux,
                config.fn,
                call.params,
                call.batch,
                call.args,
                call.bsize,
            ),
        )
    if config.pre_clipping_transform is not None:  # clip (and sum) what the transform returns
        shapes = jax.eval_shape(config.pre_clipping_transform, call.params)
        template = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        call = call._replace(params=template, pflat=_norms.flatten(template, config.fn))
        clips = clip_budgets(config, template, call.pflat)
        call = call._replace(params=params)
    else:
        clips = clip_budgets(config, call.params, call.pflat)

    def chunk(batch: Any, valid: jax.Array | None) -> tuple:
        return _chunk(config, call, clips, batch, valid)

    return run_chunks(chunk, config, call)
