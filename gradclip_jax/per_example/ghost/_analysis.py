"""Which parameter leaves ghost clipping measures how: the loss is traced once per
call and its jaxpr analysed once; the resulting :class:`Plan` is passed down."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from gradclip_jax import norms as _norms
from gradclip_jax.per_example._batch import batch_size_of, check_loss_out, keystr
from gradclip_jax.per_example._config import ClipConfig, GhostSum, Method
from gradclip_jax.per_example.ghost._jaxpr import is_literal, shape, trace
from gradclip_jax.per_example.ghost.rules import CONST, ROW, Site, State, Use, row_rule, rule_for

# Operations applied to a parameter that keep the gradient's norm: the gradient
# with respect to the parameter is a permutation/reshape/cast of the gradient with
# respect to the result.
_NORM_KEEPING = frozenset({"convert_element_type", "transpose", "reshape", "squeeze", "copy", "copy_p"})
# Operations allowed between a parameter and an elementwise use (bias broadcasting).
_CHAIN = _NORM_KEEPING | {"broadcast_in_dim"}

AUTO_MIN_ELEMENTS = 2**20
"""``method='auto'`` uses ghost clipping when the per-example gradients of the
ghost-measurable leaves would hold at least this many elements (``B`` times their
size) and those leaves hold at least half of the parameters; below that, the
single backward pass of the vmap path is as cheap and exact to the last bit."""

BOOKKEEPING_MAX_SHARE = 0.5
"""``ghost_sum='auto'`` uses book-keeping when the output cotangents it holds
(the elements of every recognised operation's output) are at most this share
of the loss's batched intermediates (a proxy for the activations a backward
pass keeps): then holding them costs little beside the activations, and it
saves the second backward pass. Above it (plain MLPs, where the layer outputs
are most of the activations) the second backward pass keeps the peak memory
near a non-private step's."""


@dataclass
class Plan:
    row_wise: bool
    sites: list[Site]
    ghost: set[int]  # leaf indices (flattened params) measured without materializing
    reasons: dict[int, str] = field(default_factory=dict)  # fallback leaf -> why
    act_elems: int = 0  # elements of the batched intermediates of the loss (a proxy for activations)

    def ct_elems(self, jaxpr: Any) -> int:
        """Elements of the site output cotangents that book-keeping holds at once."""
        return sum(math.prod(shape(jaxpr.eqns[s.eqn].outvars[0])) for s in self.sites)


class Traced(NamedTuple):
    """The loss's closed jaxpr (over flattened ``(params, batch, args)``) and its plan."""

    closed: Any
    plan: Plan


class _Walk(NamedTuple):
    uses: dict[int, list[Site | None]]  # per leaf: its recognised uses (None: an unrecognised one)
    row_wise: bool
    act_elems: int


def _classify(use: Use, n_aliased: int) -> Site | None:
    if n_aliased != 1 or not isinstance(use.out_states[0], int):
        return None
    return rule_for(use.eqn.primitive.name).classify(use)


def _walk(jaxpr: Any, n_params: int, n_batch: int, bsize: int) -> _Walk:
    """Row states of every value, and every use of every parameter leaf (through its chain)."""
    invars = jaxpr.invars
    states: dict[Any, State] = {v: ROW if n_params <= i < n_params + n_batch else CONST
                                for i, v in enumerate(invars)}
    alias: dict[Any, tuple[int, list[int], bool]] = {invars[i]: (i, [], False) for i in range(n_params)}
    uses: dict[int, list[Site | None]] = {i: [] for i in range(n_params)}
    act_elems = 0

    def state(v: Any) -> State:
        return CONST if is_literal(v) else states.get(v, CONST)

    for k, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        in_states = [state(v) for v in eqn.invars]
        aliased = [(pos, alias[v]) for pos, v in enumerate(eqn.invars) if not is_literal(v) and v in alias]
        if name in _CHAIN and len(eqn.invars) == 1 and aliased:
            leaf, chain, bcast = aliased[0][1]
            alias[eqn.outvars[0]] = (leaf, [*chain, k], bcast or name not in _NORM_KEEPING)
            states[eqn.outvars[0]] = CONST
            continue
        out_states = row_rule(eqn, in_states, bsize)
        for v, s in zip(eqn.outvars, out_states, strict=True):
            states[v] = s
            if isinstance(s, int) and name not in _CHAIN:
                act_elems += math.prod(shape(v))
        for pos, (leaf, chain, bcast) in aliased:
            use = Use(eqn, k, pos, leaf, chain, bcast, in_states, out_states)
            uses[leaf].append(_classify(use, len(aliased)))
    for v in jaxpr.outvars:
        if not is_literal(v) and v in alias:
            uses[alias[v][0]].append(None)
    return _Walk(uses, state(jaxpr.outvars[0]) in (ROW, CONST), act_elems)


def _leaf_verdict(u: list[Site | None]) -> tuple[list[Site], str | None]:
    """``(sites, None)`` for a leaf measured by ghost clipping, ``([], reason)`` otherwise."""
    if len(u) == 0:
        return [], None
    if len(u) > 1:
        if all(x is not None and x.axis == 0 for x in u):  # tied: every use recognised
            return [x for x in u if x is not None], None
        return [], f"used {len(u)} times, not all in a supported way"
    return ([], "unsupported use") if u[0] is None else ([u[0]], None)


def analyse(jaxpr: Any, n_params: int, active: Sequence[int], n_batch: int, bsize: int) -> Plan:
    """Classifies every active parameter leaf of the top-level ``jaxpr``.

    ``jaxpr.invars`` are the flattened ``(params, batch, args)``; the first output
    is the per-example loss.
    """
    walk = _walk(jaxpr, n_params, n_batch, bsize)
    plan = Plan(walk.row_wise, [], set(), {}, walk.act_elems)
    for leaf in active:
        if not walk.row_wise:
            plan.reasons[leaf] = "the loss mixes examples or uses an unsupported operation on batched data"
            continue
        sites, reason = _leaf_verdict(walk.uses[leaf])
        if reason is None:
            plan.sites.extend(sites)
            plan.ghost.add(leaf)
        else:
            plan.reasons[leaf] = reason
    return plan


def trace_and_plan(loss_fn: Callable[..., Any], has_aux: bool, fn: str, params: Any, pflat: _norms.FlatTree,
                   batch: Any, args: Sequence[Any], bsize: int, check: bool = True) -> Traced:
    """Traces ``loss_fn`` once (checking, with ``check``, that it returns losses of shape ``(B,)``)
    and analyses the jaxpr once."""

    def flat_loss(p: Any, b: Any, a: Any) -> Any:
        out = loss_fn(p, b, *a)
        if check:
            return check_loss_out(out, bsize, has_aux, fn)
        return out[0] if has_aux else out

    closed = trace(flat_loss, params, batch, args)
    n_batch = len(jax.tree_util.tree_leaves(batch))
    return Traced(closed, analyse(closed.jaxpr, len(pflat.leaves), pflat.active, n_batch, bsize))


def sum_mode(config: ClipConfig, traced: Traced) -> GhostSum:
    """``BACKWARD`` or ``BOOKKEEPING``: how the clipped sum is formed (per-layer clipping: book-keeping)."""
    if config.per_layer:
        return GhostSum.BOOKKEEPING
    if config.ghost_sum is not GhostSum.AUTO:
        return config.ghost_sum
    closed, plan = traced
    share = plan.ct_elems(closed.jaxpr) <= BOOKKEEPING_MAX_SHARE * plan.act_elems
    return GhostSum.BOOKKEEPING if share else GhostSum.BACKWARD


def use_ghost(plan: Plan, pflat: _norms.FlatTree, bsize: int, method: Method) -> bool:
    """Whether to take the ghost path (else the vmap path computes everything)."""
    if not plan.row_wise or not plan.ghost:
        return False
    # 16-bit parameters: the second pass or book-keeping would round each clipped
    # contribution in 16 bits (norm up to ~0.4% above C); the vmap path clips in float32.
    if any(np.dtype(pflat.leaves[i].dtype).itemsize < 4 for i in pflat.active):
        return False
    if method is Method.GHOST:
        return True
    sizes = {i: math.prod(np.shape(pflat.leaves[i])) for i in pflat.active}
    ghost_size = sum(sizes[i] for i in plan.ghost)
    return bsize * ghost_size >= AUTO_MIN_ELEMENTS and 2 * ghost_size >= sum(sizes.values())


class GhostReport(tuple):
    """Which parameter leaves ghost clipping measures directly.

    A pair ``(ghost, fallback)``: ``ghost`` lists ``(path, kind)`` for leaves whose
    per-example norms come from activations (``kind`` is ``'dense'``,
    ``'elementwise'``, ``'embedding'``, ``'conv'``, ``'tied:...'`` or ``'unused'``);
    ``fallback`` lists ``(path, reason)`` for leaves whose per-example gradients
    are materialized.
    """

    __slots__ = ()

    @property
    def ghost(self) -> list[tuple[str, str]]:
        return self[0]  # type: ignore[no-any-return]

    @property
    def fallback(self) -> list[tuple[str, str]]:
        return self[1]  # type: ignore[no-any-return]


def ghost_report(loss_fn: Callable[..., Any], params: Any, batch: Any, *args: Any, has_aux: bool = False) -> GhostReport:
    """Which leaves of ``params`` ghost clipping measures directly, and why others fall back.

    Static (nothing is computed); use it to check a model before training.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.ghost import ghost_report
      >>> def loss(p, b):
      ...     return jnp.sum((b @ p['w'] + p['b']) ** 2, axis=-1)
      >>> rep = ghost_report(loss, {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}, jnp.ones((4, 3)))
      >>> rep.ghost, rep.fallback
      ([("['b']", 'elementwise'), ("['w']", 'dense')], [])
    """
    fn = "ghost_report"
    pflat = _norms.flatten(params, fn)
    bsize = batch_size_of(batch, fn)
    plan = trace_and_plan(loss_fn, has_aux, fn, params, pflat, batch, args, bsize, check=False).plan
    by_leaf: dict[int, list[str]] = {}
    for site in plan.sites:
        by_leaf.setdefault(site.leaf, []).append(site.kind)
    kinds = {i: (k[0] if len(k) == 1 else "tied:" + "+".join(k)) for i, k in by_leaf.items()}
    ghost = [(keystr(pflat.paths[i]), kinds.get(i, "unused")) for i in pflat.active if i in plan.ghost]
    fallback = [(keystr(pflat.paths[i]), plan.reasons[i]) for i in pflat.active if i not in plan.ghost]
    return GhostReport((ghost, fallback))
