"""Primitives ghost clipping has no rule for, each with the reason ``ghost_report`` gives.

Together with :data:`RULES` this covers every primitive of ``jax.lax`` (a test
checks it on the installed JAX, so a JAX release that adds one is audited).
A parameter used by one of these, or a loss whose batched values pass through
one, falls back to per-example gradients with the reason below.
"""

from __future__ import annotations

_COLLECTIVE = (
    " (a collective over a named mesh axis, inside shard_map or pmap: values of other "
    "devices' examples flow in, which per-example clipping cannot follow)"
)
_SCATTER = (
    " (a scatter: where each update lands depends on its indices, so one example's values can "
    "reach another's rows; gathers and dynamic updates at offsets shared by the batch are followed)"
)
_POOL_GRAD = " (part of max pooling's gradient: it appears in backward passes, not in a loss)"
_TOKEN = " (an ordering token for side effects: no values flow through it)"
_RNG = " (random bits from a generator state: no parameter's gradient flows through them)"

REASONS: dict[str, str] = {
    "cond": (
        " (a conditional: its branches are not analysed; lax.cond on a batched predicate is a "
        "select under vmap, which the rules follow when written as jnp.where)"
    ),
    "while": " (a loop of unknown length)",
    "custom_linear_solve": " (a linear solve with a custom derivative: its gradient is the solver's rule)",
    "scatter": _SCATTER,
    "scatter-add": _SCATTER,
    "scatter-sub": _SCATTER,
    "scatter-mul": _SCATTER,
    "scatter-min": _SCATTER,
    "scatter-max": _SCATTER,
    "select_and_gather_add": _POOL_GRAD,
    "select_and_scatter": _POOL_GRAD,
    "select_and_scatter_add": _POOL_GRAD,
    "all_gather": _COLLECTIVE,
    "all_to_all": _COLLECTIVE,
    "ragged_all_to_all": _COLLECTIVE,
    "axis_index": _COLLECTIVE,
    "pmax": _COLLECTIVE,
    "pmin": _COLLECTIVE,
    "ppermute": _COLLECTIVE,
    "psum": _COLLECTIVE,
    "after_all": _TOKEN,
    "create_token": _TOKEN,
    "rng_bit_generator": _RNG,
    "rng_uniform": _RNG,
    "dce_sink": " (keeps a value alive for its side effects; it has no outputs)",
}
