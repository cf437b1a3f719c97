"""The ending shared by the global-norm adaptive clippers (autoclip, zclip, quantile_clip)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gradclip_jax import _stateful as _st
from gradclip_jax._core import norms as _norms
from gradclip_jax.hyperparams import (
    counts,
    increment,
    poison,
)


def finish(
    flat: _norms.FlatTree, f: jax.Array, n: jax.Array, thr: jax.Array, state: Any, skip: bool,
    invalid: jax.Array | None,
) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """The shared ending of the global-norm clippers (autoclip, zclip, quantile_clip).

    Scales the update by ``f`` (by 1 when ``skip`` and the norm ``n`` is not
    finite; NaN when a hyperparameter is ``invalid``) and returns
    ``(out, ok, fields)``: ``ok`` says whether the step counts, and ``fields`` are
    the state's monitoring fields ``count``, ``norm``, ``clip_norm`` (``thr``, or
    the previous one on a skipped step) and ``clipped``.
    """
    ok = (jnp.isfinite(n) if skip else jnp.ones((), bool)) & counts(invalid)
    out = _st.scale_all(flat, poison(jnp.where(ok, f, jnp.ones_like(f)), invalid))
    fields = {
        "count": jnp.where(ok, increment(state.count), state.count),
        "norm": n,
        "clip_norm": jnp.where(ok, thr, state.clip_norm),
        "clipped": ok & (f < 1),
    }
    return out, ok, fields
