""":func:`ghost_report`: which parameter leaves ghost clipping measures directly, and why the
others fall back, as a table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradclip_jax._core import norms as _norms
from gradclip_jax.per_example._batch import batch_size_of, batchnorm_error, keystr
from gradclip_jax.per_example.ghost._analysis.plan import trace_and_plan
from gradclip_jax.per_example.ghost._analysis.policy import auto_choice
from gradclip_jax.per_example.ghost.rules import Formed


class GhostReport(tuple):
    """Which parameter leaves ghost clipping measures directly.

    A pair ``(ghost, fallback)``: ``ghost`` lists ``(path, kind)`` for leaves whose
    per-example norms come from activations (``kind`` is ``'dense'``,
    ``'elementwise'``, ``'embedding'``, ``'conv'``, ``'tied:...'`` (one leaf used
    several times), ``'stacked:...'`` (a stacked-layers leaf, one block per use),
    ``'scan:...'`` (a stacked-layers leaf read one layer per step of a ``lax.scan``,
    measured inside the loop) or ``'unused'``);
    ``fallback`` lists ``(path, reason)`` for leaves whose per-example gradients
    are materialized. ``auto`` (not part of the pair) is the path ``method='auto'``
    takes at the batch size reported, ``(method, why)`` with ``method`` ``'ghost'`` or
    ``'vmap'`` (``None`` for a report built by hand).
    """

    auto: tuple[str, str] | None

    def __new__(cls, pair: tuple[list, list], auto: tuple[str, str] | None = None) -> GhostReport:
        self = super().__new__(cls, pair)
        self.auto = None if auto is None else (auto[0], auto[1])
        return self

    def __reduce__(self) -> tuple:  # pickles with ``auto``
        return (GhostReport, (tuple(self), self.auto))

    @property
    def ghost(self) -> list[tuple[str, str]]:
        return self[0]  # type: ignore[no-any-return]

    @property
    def fallback(self) -> list[tuple[str, str]]:
        return self[1]  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"GhostReport(ghost={self.ghost!r}, fallback={self.fallback!r})"

    @property
    def summary(self) -> str:
        """One line: how many leaves ghost clipping measures, and the path ``method='auto'`` takes and why.

        Example:
          >>> from gradclip_jax import GhostReport
          >>> GhostReport(([("['w']", 'dense')], []), ('vmap', 'tiny')).summary
          "ghost clipping measures 1 of 1 parameter leaves; 0 fall back to per-example gradients; method='auto' takes the vmap path: tiny"
        """
        n = len(self.ghost) + len(self.fallback)
        line = (
            f"ghost clipping measures {len(self.ghost)} of {n} parameter leaves; "
            f"{len(self.fallback)} fall{'s' if len(self.fallback) == 1 else ''} back to per-example gradients"
        )
        return line if self.auto is None else f"{line}; {self._auto_line()}"

    def _auto_line(self) -> str:
        assert self.auto is not None
        return f"method='auto' takes the {self.auto[0]} path: {self.auto[1]}"

    def __str__(self) -> str:
        """A table: one row per parameter leaf, its kind (ghost) or why it falls back, then the
        path ``method='auto'`` takes and why.

        Example:
          >>> from gradclip_jax import GhostReport
          >>> print(GhostReport(([("['w']", 'dense')], [("['s']", "used by 'mul'")])))
          ghost clipping measures 1 of 2 parameter leaves; 1 falls back to per-example gradients
          leaf   clipping  kind / why it falls back
          -----  --------  ------------------------
          ['w']  ghost     dense
          ['s']  fallback  used by 'mul'
        """
        rows = [(path, "ghost", kind) for path, kind in self.ghost]
        rows += [(path, "fallback", why) for path, why in self.fallback]
        head = ("leaf", "clipping", "kind / why it falls back")
        width = [max(len(r[i]) for r in (head, *rows)) for i in range(2)]
        lines = [GhostReport(tuple(self)).summary]
        for r in (
            head,
            tuple("-" * len(h) if i == 2 else "-" * width[i] for i, h in enumerate(head)),
            *rows,
        ):
            lines.append(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}".rstrip())
        if self.auto is not None:
            lines.append(self._auto_line())
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython/Jupyter shows the table of :meth:`__str__`."""
        printer.text("GhostReport(...)" if cycle else str(self))


def ghost_report(
    loss_fn: Callable[..., Any], params: Any, batch: Any, *args: Any, has_aux: bool = False
) -> GhostReport:
    """Which leaves of ``params`` ghost clipping measures directly, why others fall back, and the
    path ``method='auto'`` takes for this batch size (``report.auto``, and the last line of the
    table ``print(report)`` shows; ``report.summary`` is one line).

    Static (nothing is computed); use it to check a model before training.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax import ghost_report
      >>> def loss(p, b):
      ...     return jnp.sum((b @ p['w'] + p['b']) ** 2, axis=-1)
      >>> rep = ghost_report(loss, {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}, jnp.ones((4, 3)))
      >>> rep.ghost, rep.fallback
      ([("['b']", 'elementwise'), ("['w']", 'dense')], [])
      >>> rep.auto[0]  # 4 examples x 8 parameters: tiny, the vmap path
      'vmap'
    """
    fn = "ghost_report"
    pflat = _norms.flatten(params, fn)
    bsize = batch_size_of(batch, fn)
    try:
        traced = trace_and_plan(
            loss_fn, has_aux, fn, params, pflat, batch, args, bsize, check=False
        )
    except (
        Exception
    ) as err:  # as clipped_grad: a loss updating BatchNorm statistics gets the remedies
        bn = batchnorm_error(err, fn)
        if bn is not None:
            raise bn from err
        raise
    plan = traced.plan
    by_leaf: dict[int, list[str]] = {}
    for site in plan.sites:
        kind = f"formed:{site.kind}" if isinstance(site.rule, Formed) else site.kind
        by_leaf.setdefault(site.leaf, []).append(kind if site.scan is None else f"scan:{kind}")
    kinds = {
        i: (k[0] if len(k) == 1 else ("stacked:" if i in plan.blocks else "tied:") + "+".join(k))
        for i, k in by_leaf.items()
    }
    ghost = [
        (keystr(pflat.paths[i]), kinds.get(i, "unused")) for i in pflat.active if i in plan.ghost
    ]
    fallback = [
        (keystr(pflat.paths[i]), plan.reasons[i]) for i in pflat.active if i not in plan.ghost
    ]
    return GhostReport((ghost, fallback), auto_choice(traced, pflat, bsize))
