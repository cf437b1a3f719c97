"""Which parameter leaves ghost clipping measures how: the loss is traced once per
call and its jaxpr analysed once; the resulting :class:`Plan` is passed down.

Here: ``walk`` (the walk over the jaxpr: row states, and each leaf's uses through its chain),
``plan`` (the trace, the analysis and its :class:`Plan`), ``one_example`` (the loss on one
example, vmapped, read where the rules lose the batch in the batched loss), ``policy`` (ghost or vmap, book-keeping
or a second backward pass), ``fallback`` (the warning naming the leaves that fall back) and
``report`` (:func:`ghost_report`).
"""

from typing import TYPE_CHECKING

from gradclip_jax._core.settings import forward_settings
from gradclip_jax.per_example.ghost._analysis import policy
from gradclip_jax.per_example.ghost._analysis.fallback import GhostFallbackWarning, warn_fallback
from gradclip_jax.per_example.ghost._analysis.plan import (
    Plan,
    Traced,
    check_per_example,
    loss_crossing,
    trace_and_plan,
)
from gradclip_jax.per_example.ghost._analysis.policy import (
    AutoChoice,
    auto_choice,
    backward_refusal,
    check_sum_precision,
    memory_choice,
    own_uses,
    sum_mode,
    use_ghost,
)
from gradclip_jax.per_example.ghost._analysis.report import GhostReport, ghost_report

__all__ = [
    "AUTO_MIN_ELEMENTS",
    "AUTO_MIN_ELEMENTS_NO_FALLBACK",
    "AutoChoice",
    "BOOKKEEPING_MAX_SHARE",
    "GhostFallbackWarning",
    "GhostReport",
    "Plan",
    "Traced",
    "auto_choice",
    "backward_refusal",
    "check_per_example",
    "check_sum_precision",
    "memory_choice",
    "own_uses",
    "ghost_report",
    "loss_crossing",
    "sum_mode",
    "trace_and_plan",
    "use_ghost",
    "warn_fallback",
]

if (
    TYPE_CHECKING
):  # at run time forwarded: reading and assigning them here reads and assigns policy's
    from gradclip_jax.per_example.ghost._analysis.policy import (
        AUTO_MIN_ELEMENTS,
        AUTO_MIN_ELEMENTS_NO_FALLBACK,
        BOOKKEEPING_MAX_SHARE,
    )

forward_settings(
    __name__,
    policy,
    ("AUTO_MIN_ELEMENTS", "AUTO_MIN_ELEMENTS_NO_FALLBACK", "BOOKKEEPING_MAX_SHARE"),
)
