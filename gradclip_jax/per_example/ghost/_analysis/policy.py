"""How a plan runs: the ghost or the vmap path (``method='auto'``), and the clipped sum by
book-keeping or by a second backward pass (``ghost_sum``), which is refused where it would round
below float32."""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import jax
import numpy as np

from gradclip_jax._core import norms as _norms
from gradclip_jax.per_example._batch import keystr
from gradclip_jax.per_example._config import ClipConfig, GhostSum, Method
from gradclip_jax.per_example._products import product_setting, rounds_to_tf32
from gradclip_jax.per_example.ghost._analysis.plan import Plan, Traced

AUTO_MIN_ELEMENTS = 2**20
"""``method='auto'`` uses ghost clipping when the per-example gradients of the
ghost-measurable leaves would hold at least this many elements (``B`` times their
size) and those leaves hold at least half of the parameters; below that (and
unless :data:`AUTO_MIN_ELEMENTS_NO_FALLBACK` applies), the single backward pass
of the vmap path is as cheap and exact to the last bit."""

AUTO_MIN_ELEMENTS_NO_FALLBACK = 2**16
"""``method='auto'`` also uses ghost clipping, below :data:`AUTO_MIN_ELEMENTS`, when
no leaf falls back, the per-example gradients would hold at least this many
elements (``B`` times the parameters) and at least as many as the output
cotangents of the measured operations (what the ghost norms read).

Why, weighing compile and run time: the vmap path then writes and reads more than
the ghost path measures. On small MLPs its steps took 2 to 9 times as long as the
ghost path's, which compiled up to about 2 s longer, repaid within a thousand steps
or fewer; on a small transformer (the loss has many more operations, each vmapped
through its backward pass) the ghost path compiled faster too. Where the
cotangents outweigh the per-example gradients (a small CNN: few parameters, large
activations) the vmap path both compiled and ran faster, and with a fallback the
ghost path compiles the vmap path for those leaves as well. Below this floor the
difference is a fraction of a millisecond a step, and the vmap path is exact to
the last bit."""

BOOKKEEPING_MAX_SHARE = 0.5
"""``ghost_sum='auto'`` uses book-keeping when the output cotangents it holds
(the elements of every recognised operation's output) are at most this share
of the loss's batched intermediates (a proxy for the activations a backward
pass keeps): then holding them costs little beside the activations, and it
saves the second backward pass. Above it (plain MLPs, where the layer outputs
are most of the activations) the second backward pass keeps the peak memory
near a non-private step's."""


def narrow_values(plan: Plan, pflat: _norms.FlatTree) -> str | None:
    """What makes a backward pass round below the accumulation dtype (16-bit parameters or
    activations), in words; ``None`` when nothing does."""
    if plan.narrow_leaf is not None:
        i = plan.narrow_leaf
        return f"parameter leaf {keystr(pflat.paths[i])} is {np.dtype(pflat.leaves[i].dtype).name}"
    if plan.narrow_op is not None:
        return f"the loss computes {plan.narrow_op[1]} values from the parameters, first at {plan.narrow_op[0]!r}"
    return None


def reduced_matmul_precision() -> str | None:
    """Why float32 products are not computed in full precision by default here (``None``: they are).

    At ``Precision.DEFAULT`` NVIDIA GPUs from Ampere on multiply float32 in TF32
    (10-bit mantissas) and TPUs in bfloat16 passes, unless
    ``jax_default_matmul_precision`` asks for float32.
    """
    if str(getattr(jax.config, "jax_default_matmul_precision", None)).lower() in (
        "highest",
        "float32",
        "precision.highest",
    ):
        return None
    backend = jax.default_backend()
    if backend == "cpu":
        return None
    return (
        f"on the {backend} backend float32 products default to reduced precision (TF32 or "
        "bfloat16 passes; jax_default_matmul_precision is not 'float32')"
    )


def tf32_products() -> str | None:
    """Why a second backward pass cannot add what the norms measured at ``PRODUCT_PRECISION``
    ``"tf32"`` (``None`` at any other setting): they measure the per-example gradients of the
    TF32-rounded activations and cotangents, which only book-keeping adds."""
    if not rounds_to_tf32(np.float32):
        return None
    return (
        f"gradclip_jax.per_example.PRODUCT_PRECISION is {product_setting()!r} for this backend (the norms measure "
        "the per-example gradients of TF32-rounded activations and cotangents)"
    )


def backward_refusal() -> str | None:
    """Why this backend refuses ``ghost_sum='backward'`` for float32 models, now (``None``: it
    runs it): the products of the norms at ``PRODUCT_PRECISION`` ``"tf32"`` (:func:`tf32_products`),
    or the model's float32 products at reduced precision (:func:`reduced_matmul_precision`).
    16-bit parameters or activations are refused everywhere (:func:`check_sum_precision`)."""
    return tf32_products() or reduced_matmul_precision()


def check_sum_precision(config: ClipConfig, plan: Plan, pflat: _norms.FlatTree) -> None:
    """ValueError for ``ghost_sum='backward'`` where its second pass would round below float32.

    With 16-bit parameters or activations that pass carries every reweighted
    cotangent :math:`c_b g_b` in 16 bits (each rounding up to ``2**-9`` relative in
    bfloat16); on a backend whose float32 products default to TF32 or bfloat16
    passes, it multiplies at that precision (up to ``2**-11`` relative). Either
    way an example's clipped contribution could exceed :math:`C` by far more than
    the stored-bound margin. Book-keeping forms the sum in float32 at full
    precision, from the values whose norms were measured.
    """
    if config.per_layer or config.ghost_sum is not GhostSum.BACKWARD:
        return
    narrow, tf32 = narrow_values(plan, pflat), tf32_products()
    why = narrow or backward_refusal()
    if why is not None:
        fix = (
            ""
            if narrow
            else ", or set PRODUCT_PRECISION[jax.default_backend()] = 'highest'"
            if tf32
            else ", or set jax.config.update('jax_default_matmul_precision', 'float32')"
        )
        raise ValueError(
            f"{config.fn}: ghost_sum='backward' cannot be used here: {why}, and a second backward "
            "pass would round each example's clipped contribution at that precision (its norm could "
            "exceed the clip norm). Use ghost_sum='bookkeeping' or 'auto' (book-keeping forms the sum "
            f"in float32 at full precision from the stored activations and cotangents), method='vmap'{fix}."
        )


def sum_mode(config: ClipConfig, traced: Traced) -> GhostSum:
    """``BACKWARD`` or ``BOOKKEEPING``: how the clipped sum is formed (per-layer clipping, 16-bit
    parameters or activations, or a backend whose default float32 products are not full precision:
    book-keeping, see :func:`check_sum_precision`)."""
    closed, plan = traced
    if config.per_layer or plan.narrow_leaf is not None or plan.narrow_op is not None:
        return GhostSum.BOOKKEEPING
    if config.ghost_sum is GhostSum.AUTO and backward_refusal() is not None:
        return GhostSum.BOOKKEEPING
    if config.ghost_sum is not GhostSum.AUTO:
        return config.ghost_sum
    share = plan.ct_elems(closed.jaxpr) <= BOOKKEEPING_MAX_SHARE * plan.act_elems
    return GhostSum.BOOKKEEPING if share else GhostSum.BACKWARD


class AutoChoice(NamedTuple):
    """The path ``method='auto'`` takes (``method``: ``'ghost'`` or ``'vmap'``) and why, in words."""

    method: str
    why: str


def own_uses(plan: Plan, pflat: _norms.FlatTree) -> bool:
    """Whether every active leaf is measured by its own uses alone, on the batched loss's plan:
    used once, once per layer of a scan, or in disjoint blocks (no cross terms between uses).
    The streamed path's condition on the model (``_streamed.streams`` adds the configuration's)."""
    if plan.one_example or not plan.row_wise or any(i not in plan.ghost for i in pflat.active):
        return False
    uses = Counter(s.leaf for s in plan.sites)
    # several uses: disjoint blocks of the leaf, not two uses of one layer's block in a step
    return all(uses[s.leaf] == 1 or (s.leaf in plan.blocks and s.scan is None) for s in plan.sites)


def memory_choice(
    plan: Plan, pflat: _norms.FlatTree, bsize: int, streamed: bool | None = None
) -> AutoChoice | None:
    """The vmap path, where the ghost path would hold more memory; else ``None``.

    A loss that checkpoints (``jax.checkpoint``, ``nnx.remat``) asks for its activations to be
    recomputed. The streamed ghost path keeps that (scans over checkpointed layers); otherwise
    (a leaf read twice, such as tied embeddings; a checkpoint outside a scan) the ghost path
    stores the activations, about ``plan.act_elems / B`` elements an example (the loss's
    batched intermediates: longer sequences and more layers weigh more), where the vmap path
    holds one gradient an example beside the checkpointed step's memory. Both scale with the
    examples taken at once, so microbatching does not change which is smaller.

    ``streamed``: whether the ghost path streams (``None``: as with the default configuration,
    which streams scans over layers).
    """
    own = own_uses(plan, pflat)
    if streamed is None:
        streamed = own and any(s.scan is not None for s in plan.sites)
    if not plan.checkpointed or streamed:
        return None
    params = sum(_sizes(pflat).values())
    acts = plan.act_elems // max(bsize, 1)
    if acts <= params:
        return None
    where = (
        "its checkpoint is not on a scan of layers"
        if own
        else "a leaf is read more than once, as tied weights are"
    )
    return AutoChoice(
        "vmap",
        f"the loss checkpoints its activations, which the ghost path would store ({where}): about "
        f"{acts:,} elements an example, against one per-example gradient of {params:,} elements on "
        "the vmap path",
    )


def _sizes(pflat: _norms.FlatTree) -> dict[int, int]:
    return {i: math.prod(np.shape(pflat.leaves[i])) for i in pflat.active}


def auto_choice(
    traced: Traced, pflat: _norms.FlatTree, bsize: int, streamed: bool | None = None
) -> AutoChoice:
    """The path ``method='auto'`` takes, from shapes alone (see :data:`AUTO_MIN_ELEMENTS`,
    :data:`AUTO_MIN_ELEMENTS_NO_FALLBACK` and :func:`memory_choice`), and why."""
    closed, plan = traced
    if bsize == 1:
        return AutoChoice(
            "vmap",
            "a batch of one example: its per-example gradient is the gradient, formed at the "
            "non-private step's cost (ghost clipping would add its norms pass for no saving)",
        )
    if not plan.row_wise:
        return AutoChoice("vmap", "the analysis cannot show that no operation mixes examples")
    if not plan.ghost:
        return AutoChoice("vmap", "no parameter leaf is measured without its per-example gradients")
    lighter = memory_choice(plan, pflat, bsize, streamed)
    if lighter is not None:
        return lighter
    sizes = _sizes(pflat)
    total, ghost_size = sum(sizes.values()), sum(sizes[i] for i in plan.ghost)
    formed = bsize * ghost_size
    if formed >= AUTO_MIN_ELEMENTS and 2 * ghost_size >= total:
        return AutoChoice(
            "ghost",
            f"the measured leaves' per-example gradients would hold B x {ghost_size:,} = "
            f"{formed:,} elements, at least AUTO_MIN_ELEMENTS = {AUTO_MIN_ELEMENTS:,}",
        )
    if plan.reasons:
        small = (
            f"' per-example gradients hold {formed:,} elements, below AUTO_MIN_ELEMENTS = {AUTO_MIN_ELEMENTS:,}"
            if formed < AUTO_MIN_ELEMENTS
            else f" hold {ghost_size:,} of the {total:,} parameters, less than half"
        )
        return AutoChoice(
            "vmap",
            f"{len(plan.reasons)} of {len(sizes)} leaves fall back (the ghost path would "
            f"compile the vmap path for them too) and the measured leaves{small}",
        )
    cts = plan.ct_elems(closed.jaxpr)
    if formed < AUTO_MIN_ELEMENTS_NO_FALLBACK:
        return AutoChoice(
            "vmap",
            f"the per-example gradients hold B x {ghost_size:,} = {formed:,} elements, below "
            f"AUTO_MIN_ELEMENTS_NO_FALLBACK = {AUTO_MIN_ELEMENTS_NO_FALLBACK:,}: tiny either way",
        )
    if formed < cts:
        return AutoChoice(
            "vmap",
            f"the per-example gradients ({formed:,} elements) are smaller than the output "
            f"cotangents the ghost norms read ({cts:,}): the vmap path runs and compiles faster",
        )
    return AutoChoice(
        "ghost",
        f"every leaf is measured, and the per-example gradients ({formed:,} elements) are at "
        f"least the output cotangents the ghost norms read ({cts:,}): the vmap path would write and "
        "read more than the ghost path measures (slower steps, which repay any extra compile "
        "time in a short run)",
    )


def use_ghost(
    traced: Traced, pflat: _norms.FlatTree, bsize: int, method: Method, streamed: bool
) -> bool:
    """Whether to take the ghost path (else the vmap path computes everything); ``streamed``:
    whether the ghost path would stream (``_streamed.streams``)."""
    if not traced.plan.row_wise or not traced.plan.ghost:
        return False
    return method is Method.GHOST or auto_choice(traced, pflat, bsize, streamed).method == "ghost"
