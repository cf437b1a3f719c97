"""Inside ``shard_map``, one example's loss must not read other devices' values.

``clipped_grad`` called inside ``shard_map`` clips the examples of the local batch. Its
per-example gradients are taken on each device at once, so a collective over a mesh axis
the batch is split over ties example ``b`` of one device to example ``b`` of the others:
with the parameters split FSDP-style and gathered in the loss (``all_gather``), the
gradient's transpose (a reduce-scatter) sums the gradients of examples of different devices
before they are clipped. Nothing fails and the result is silently wrong (an audit measured
a clipped sum off by 0.46 per element, its norm 3.16 against 3.43), so the loss is read once
for such collectives before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax.per_example._batch import Call, batch_axes, one_example_loss


def _first_transfer(jaxpr: Any, axes: frozenset) -> tuple[str, tuple[str, ...]] | None:
    """``(primitive, mesh axes)`` of the first equation (nested ones too) that brings in other
    devices' values over ``axes``; None if none does."""
    for eqn in jaxpr.eqns:
        over = jc.cross_device_axes(eqn) & axes
        if over:
            return eqn.primitive.name, tuple(sorted(over))
        for sub in jc.sub_jaxprs(eqn):
            found = _first_transfer(sub, axes)
            if found is not None:
                return found
    return None


def check_loss_on_device(fn: str, loss_fn: Callable[..., Any], has_aux: bool, call: Call) -> None:
    """ValueError when, inside ``shard_map``, the loss of one example of ``call`` communicates
    over a mesh axis the batch is split over (does nothing outside ``shard_map``: no trace)."""
    axes = batch_axes(call.batch)
    if not axes:
        return
    example = jax.tree_util.tree_map(lambda x: x[0], call.batch)
    one = one_example_loss(loss_fn, has_aux)
    closed = jax.make_jaxpr(one)(call.params, example, *call.args)
    found = _first_transfer(jc.open_jaxpr(closed)[0], axes)
    if found is None:
        return
    name, over = found
    raise ValueError(
        f"{fn}: loss_fn calls {name!r} over the mesh axis {over[0]!r} inside shard_map, and the "
        f"batch is split over {over[0]!r}: each example's gradient would take in other devices' "
        "examples (parameters gathered FSDP-style in the loss sum their gradients back across "
        "devices), so per-example clipping could not bound it. Gather the parameters before "
        "calling the clipped-gradient function inside shard_map (its clipped sum is then of "
        "whole parameters: psum_scatter it), or call it outside shard_map under jax.jit with "
        "the parameters sharded (NamedSharding)"
    )
