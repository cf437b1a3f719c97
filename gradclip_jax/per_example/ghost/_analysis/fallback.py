"""The fallback warning: which leaves a clipped-grad function forms per-example gradients of,
and why, told once per function and message, at the user's line."""

from __future__ import annotations

import math
import os
import sys
import warnings
import weakref

import jax
import numpy as np

from gradclip_jax._core import norms as _norms
from gradclip_jax.per_example._batch import keystr
from gradclip_jax.per_example._config import Method
from gradclip_jax.per_example.ghost._analysis import policy
from gradclip_jax.per_example.ghost._analysis.plan import Plan


class GhostFallbackWarning(UserWarning):
    """Ghost clipping forms the per-example gradients of some leaves (the vmap fallback)."""


# Messages already given, per clipped-grad function (keyed by the id of its
# configuration's origin, dropped with it): each function tells its user once, also when another model's
# function gave the same message before.
_WARNED: dict[int, set[str]] = {}


# gradclip_jax's folder (four up from this file's) and jax's
_LIBRARY_DIRS = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    + os.sep,
    os.path.dirname(os.path.abspath(jax.__file__)) + os.sep,
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside gradclip_jax and jax: the user's line that
    called the clipped-grad function (directly, or through ``jax.jit`` tracing it)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    return level if frame is not None else 2


def warn_fallback(
    plan: Plan, pflat: _norms.FlatTree, bsize: int, method: Method, fn: str, owner: object = None
) -> None:
    """Tells the user once per clipped-grad function (``owner``: its configuration's origin) and distinct
    message which leaves fall back to vmap and why.

    Silent for ``method='auto'`` on a model too small for ghost clipping to be
    worth it (then vmap is the choice, not a fallback), and for a batch of one example
    (whose per-example gradient is the gradient: formed at the non-private step's cost).
    """
    sizes = {i: math.prod(np.shape(pflat.leaves[i])) for i in pflat.active}
    if method is Method.AUTO and bsize * sum(sizes.values()) < policy.AUTO_MIN_ELEMENTS:
        return
    if bsize == 1:  # one example's gradient is the gradient: the fallback costs nothing
        return
    fb = [i for i in pflat.active if i in plan.reasons]
    if not fb:
        return
    by_reason: dict[str, list[str]] = {}
    for i in fb:
        by_reason.setdefault(plan.reasons[i], []).append(keystr(pflat.paths[i]))
    parts = [
        f"{', '.join(paths[:6])}{f' and {len(paths) - 6} more' if len(paths) > 6 else ''} ({why})"
        for why, paths in by_reason.items()
    ]
    msg = (
        f"{fn}: ghost clipping forms the per-example gradients of {len(fb)} of {len(pflat.active)} "
        f"parameter leaves (vmap fallback): {'; '.join(parts)}. "
        "ghost_report(loss_fn, params, batch) lists every leaf."
    )
    key = id(owner)
    if key not in _WARNED:
        _WARNED[key] = set()
        if owner is not None:
            weakref.finalize(owner, _WARNED.pop, key, None)
    if msg not in _WARNED[key]:
        _WARNED[key].add(msg)
        warnings.warn(msg, GhostFallbackWarning, stacklevel=_user_stacklevel())
