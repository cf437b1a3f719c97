"""The rule protocol of ghost clipping and the one table of rules, by primitive name.

A :class:`Rule` says, for the primitives it is registered under, how the
"row-wise" property propagates (:meth:`Rule.row`), which uses of a parameter
are measured without per-example gradients (:meth:`Rule.classify`), how
(:meth:`Rule.norm`), and how a use factors into per-position vectors for tied
leaves (:meth:`Rule.factors`). Adding a primitive is one :func:`register` call
in the file of its family.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.jaxcompat import is_literal, shape


class Tag(enum.Enum):
    """A value that does not depend on the batch (``CONST``), or mixes examples (``MIXED``)."""

    CONST = "const"
    MIXED = "mixed"


@dataclass(frozen=True)
class Merged:
    """The batch merged with the positions of each example into one axis: ``B * per_example``
    rows, those of example ``b`` contiguous and computed from it alone (a ``(B, T, V)``
    value reshaped to ``(B * T, V)``, as a flattened cross-entropy does). The merge happens on
    axis 0; an operation may then move that axis (``axis``: a mixture of experts' routing
    weights transposed to ``(E, B * T)``), and the rows stay in order along it."""

    per_example: int
    axis: int = 0


# A value's state: an int ``k`` (it carries the batch on axis ``k``, one example
# per slice, computed from that example alone), a Merged batch, or a Tag. ROW is
# the batch on axis 0.
State = int | Tag | Merged
ROW, CONST, MIXED = 0, Tag.CONST, Tag.MIXED

# The block of a leaf one use reads: ``None`` (the whole leaf), the box
# ``(start, limit)`` of a static unit-stride slice in the leaf's coordinates, or
# ``OPAQUE`` (a slice of a reshaped or broadcast leaf: not compared).
Box = tuple[tuple[int, ...], tuple[int, ...]] | None | str
OPAQUE = "opaque"

# A factor of a per-example gradient along one axis of a 2-D leaf: ("dense", X)
# with X of shape (B, T, n) (one vector per position), or ("onehot", ids) with
# ids of shape (B, T) (the basis vector e_id per position).
Factor = tuple[str, jax.Array]


@dataclass(frozen=True)
class RowCtx:
    """One equation and its input states, for :meth:`Rule.row`."""

    eqn: Any
    states: list[State]
    bsize: int

    def param(self, name: str, *default: Any) -> Any:
        """The equation's parameter ``name`` (see :func:`jaxcompat.param`)."""
        return jc.param(self.eqn, name, *default)

    @property
    def ins(self) -> list[tuple[int, ...]]:
        return [shape(v) for v in self.eqn.invars]

    @property
    def outs(self) -> list[tuple[int, ...]]:
        return [shape(v) for v in self.eqn.outvars]

    @property
    def rows(self) -> list[int]:
        """Operand positions that carry the batch (on some axis)."""
        return [i for i, s in enumerate(self.states) if isinstance(s, int)]

    @property
    def k0(self) -> int | None:
        """The batch axis when every batched operand has it on the same axis."""
        axes = {self.states[i] for i in self.rows}
        return int(next(iter(axes))) if len(axes) == 1 else None  # type: ignore[arg-type]

    def mixed(self) -> list[State]:
        return [MIXED] * len(self.eqn.outvars)

    def res(self, ok: bool) -> list[State]:
        """Row-wise on axis 0 if ``ok`` and every output has the batch on axis 0."""
        ok_out = all(len(o) >= 1 and o[0] == self.bsize for o in self.outs)
        return [ROW if (ok and ok_out) else MIXED] * len(self.eqn.outvars)

    def res_at(self, k: Any) -> list[State]:
        """Row-wise on axis ``k`` if every output has the batch there."""
        k = int(k)  # params may hold numpy integers
        ok = all(0 <= k < len(o) and o[k] == self.bsize for o in self.outs)
        return [k if ok else MIXED] * len(self.eqn.outvars)


@dataclass(frozen=True)
class Use:
    """One use of a parameter leaf (through its ``chain``) as operand ``pos`` of equation ``k``."""

    eqn: Any
    k: int
    pos: int
    leaf: int
    chain: list[int]
    bcast: bool  # the chain broadcasts the leaf
    in_states: list[State]
    out_states: list[State]
    box: Box = None  # the block of the leaf the chain selects
    through: bool = (
        False  # the chain computes with the leaf and constants (``1 + scale``, ``W @ h0``)
    )
    batch_axes: frozenset[int] = frozenset()  # axes the chain broadcasts its value along, B copies
    batch_step: int | None = None  # the chain's equation making those copies
    zeroed: tuple[
        tuple[int, int], ...
    ] = ()  # (chain step, the leaf's operand): the other operands' leaves zeroed

    def row_operands(self) -> tuple[int, ...] | None:
        """Operand positions with the batch on axis 0, if the output and every batched operand has it there."""
        if self.out_states[0] != ROW or any(isinstance(s, int) and s != 0 for s in self.in_states):
            return None
        return tuple(i for i, s in enumerate(self.in_states) if s == ROW)


@dataclass(frozen=True, eq=False)
class RowNorms:
    """A site's per-example norm as ``combine`` of the per-example L2 norms of ``arrays``
    (each ``(B, ...)``), which the caller measures together with every other site's and
    the formed leaves' rows: one call of the norm engine, one overflow conditional
    per step (each a host round trip on GPUs), where one per site would add up."""

    arrays: tuple[jax.Array, ...]
    combine: Callable[[list[jax.Array]], jax.Array]


@dataclass(frozen=True)
class Site:
    """A recognised use of one parameter leaf (by the top-level equation ``eqn``, or by equation
    ``eqn`` of the body of the scan ``scan``)."""

    kind: str  # the rule's kind: 'dense' | 'elementwise' | 'embedding' | 'conv'
    rule: Rule
    leaf: int  # index into the flattened params
    eqn: int
    pos: int  # operand position of the parameter (after its chain)
    chain: list[int]  # top-level equations from the parameter to the operand
    rows: tuple[int, ...] = ()  # operand positions carrying the batch on axis 0
    axis: int = 0  # dense: the batch axis of the batched operand (the others: 0)
    out_axis: int = 0  # the batch axis of the operation's output
    box: Box = None  # the block of the leaf this use reads (stacked layers: one layer's block)
    merged: int = 1  # rows per example on the batch axis (a Merged batch: its per_example), else 1
    # A use inside the body of the top-level ``scan`` equation ``scan`` (layers stacked on axis 0 of
    # the leaf, one read per step): ``eqn`` and ``chain`` index that body, and the site's operands and
    # output cotangent are stacked over the ``length`` steps on a new leading axis.
    scan: int | None = None
    length: int = 1
    # The chain's equation that copies the value over the batch (made for one example when the
    # site's leaf gradients are formed), and its steps that add or join other leaves' values
    # (those replayed as zeros: see ``_jaxpr.replay``).
    batch_step: int | None = None
    zeroed: tuple[tuple[int, int], ...] = ()
    # The axes along which the chain's value is B copies of one value, when no single broadcast
    # made them (an RNN's weight on its zero initial state): one example's replay slices one copy.
    cut_axes: frozenset[int] = frozenset()


class Rule:
    """How ghost clipping treats one family of primitives (defaults: unknown, mixes examples)."""

    primitives: tuple[str, ...] = ()
    kind: str = ""

    def row(self, c: RowCtx) -> list[State]:
        return c.mixed()

    def crosses(self, c: RowCtx) -> bool:
        """Whether the equation certainly combines examples (reduces, accumulates or contracts
        over the batch axis): the loss then breaks the per-example contract. ``False`` when
        unsure (an unknown primitive only makes the loss not row-wise)."""
        return False

    def classify(self, use: Use) -> Site | None:
        """A :class:`Site` when this use of a parameter is measured without its per-example gradients."""
        return None

    def site(self, use: Use, rows: tuple[int, ...], axis: int = 0, out_axis: int = 0) -> Site:
        return Site(
            self.kind,
            self,
            use.leaf,
            use.k,
            use.pos,
            use.chain,
            rows,
            axis,
            out_axis,
            use.box,
            batch_step=use.batch_step,
            zeroed=use.zeroed,
        )

    def norm(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any
    ) -> jax.Array | RowNorms | None:
        """Per-example norm of a once-used leaf's gradient, ``(B,)``, or :class:`RowNorms` to have
        it measured with the others; ``None``: form that leaf's gradients.

        A norm taken inside a loop body here is branch-free
        (``leaf_example_norms(..., branch_free=True)``): an overflow conditional there
        would cost a host round trip per iteration on GPUs.
        """
        return None

    def spread(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any
    ) -> jax.Array | None:
        """Per-example :math:`\\sum_t \\|x_t\\| \\|y_t\\|`, ``(B,)``, for a use whose per-example gradient
        is :math:`G_b = \\sum_t x_t y_t^\\top` (its operand and cotangent rows as measured): what
        bounds the change of :math:`G_b` when one factor of each term moves by a relative
        :math:`\\epsilon`, :math:`\\|\\Delta G_b\\| \\le \\epsilon \\sum_t \\|x_t\\| \\|y_t\\|`. ``None``
        where the kind has no such form. A book-kept sum in one pass
        (:func:`~gradclip_jax.per_example._products.rounds_weighted_once`) needs it."""
        return None

    def factors(
        self, site: Site, eqn: Any, ops: Sequence[Any], g: jax.Array, acc: Any, perm: list[int]
    ) -> tuple[Factor, Factor] | None:
        """This use of a 2-D leaf as ``sum_t x_t (x) y_t``: the factors along leaf axes 0 and 1, or ``None``.

        ``perm[i]`` is the leaf axis that is axis ``i`` of the operand.
        """
        return None


class Formed(Rule):
    """A use measured by forming its leaf's per-example gradients (``_measure.local_grads``: the
    pull-back of each example's cotangent through the use and the leaf's chain), not by its own
    rule's norm or factors: the chain computes with the leaf (``x @ (2 * w)``, a concatenation of
    leaves), so that norm would be the one of the gradient with respect to the computed value."""

    def __init__(self, inner: Rule) -> None:
        self.inner = inner
        self.kind = inner.kind


RULES: dict[str, Rule] = {}
_UNKNOWN = Rule()


def register(rule: Rule) -> Rule:
    """Adds ``rule`` to the table under each of its primitive names."""
    for name in rule.primitives:
        if name in RULES:
            raise ValueError(f"ghost rules: primitive {name!r} registered twice")
        RULES[name] = rule
    return rule


def rule_for(name: str) -> Rule:
    return RULES.get(name, _UNKNOWN)


def row_rule(eqn: Any, states: list[State], bsize: int) -> list[State]:
    """Output states of one equation given its input states (row-wise propagation)."""
    n_out = len(eqn.outvars)
    if all(s == CONST for s in states):
        return [CONST] * n_out
    if any(s == MIXED for s in states):
        return [MIXED] * n_out
    if any(isinstance(s, Merged) for s in states):
        return _merged_rule(eqn, states, bsize)
    return rule_for(eqn.primitive.name).row(RowCtx(eqn, states, bsize))


def leading_batch(out_rows: int, bsize: int) -> State:
    """The state of a reshape's output whose ``out_rows`` leading rows come from a value with
    the batch leading (in row-major order each example's elements stay one contiguous run)."""
    if out_rows == bsize:
        return ROW
    if out_rows > bsize and out_rows % bsize == 0:
        return Merged(out_rows // bsize)
    return MIXED


def unmerged(states: Sequence[State], bsize: int) -> tuple[list[State], int, int] | None:
    """Operand states with one merged batch shared by every batched operand seen as a batch of
    ``B * per_example`` rows (on the merged axis): ``(states, B * per_example, per_example)``;
    ``None`` when the batched operands do not share one merge (another merge or axis, or a batch
    not merged)."""
    merged = {s for s in states if isinstance(s, Merged)}
    if len(merged) != 1 or any(isinstance(s, int) for s in states):
        return None
    n = next(iter(merged)).per_example
    return [s.axis if isinstance(s, Merged) else s for s in states], bsize * n, n


def _merged_rule(eqn: Any, states: list[State], bsize: int) -> list[State]:
    """Propagation through values with a merged batch: a reshape keeping the batch leading
    (to ``(B, ...)`` again, or another merge); any other equation whose batched operands share one
    merge is followed by the rules for a batch of ``B * per_example`` rows: rows computed from
    their own rows alone are computed from their own example alone, wherever the rules move
    the rows' axis (the rows keep their order along it)."""
    rows = unmerged(states, bsize)
    if rows is None:
        return [MIXED] * len(eqn.outvars)
    as_rows, n_rows, n = rows
    if (
        eqn.primitive.name == "reshape"
        and jc.param(eqn, "dimensions", None) is None
        and all(s == 0 for s in as_rows if isinstance(s, int))
    ):
        out = shape(eqn.outvars[0])
        return [leading_batch(out[0], bsize) if out else MIXED]
    inner = row_rule(eqn, as_rows, n_rows)
    return [Merged(n, s) if isinstance(s, int) else s if s == CONST else MIXED for s in inner]


def row_states(jaxpr: Any, in_states: Sequence[State], bsize: int) -> list[State]:
    """Propagates the row-wise property through ``jaxpr`` (constvars are constant)."""
    env: dict[Any, State] = dict(zip(jaxpr.invars, in_states, strict=True))

    def read(v: Any) -> State:
        return CONST if is_literal(v) else env.get(v, CONST)

    for eqn in jaxpr.eqns:
        env.update(
            zip(eqn.outvars, row_rule(eqn, [read(v) for v in eqn.invars], bsize), strict=True)
        )
    return [read(v) for v in jaxpr.outvars]


def axis0_only(c: RowCtx) -> bool:
    """Every batched operand has the batch on axis 0 (the rules that only follow axis 0)."""
    return {c.states[i] for i in c.rows} == {0}
