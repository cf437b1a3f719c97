"""Helpers of the transform tests: feeding updates of given norms to a transform."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def vec(norm: float) -> jax.Array:
    """A 2-vector with the given L2 norm (direction (0.6, 0.8))."""
    return jnp.array([0.6 * norm, 0.8 * norm])


def feed(tx, norms, dtype=jnp.float32, jit=True):
    """Runs ``tx`` on 2-vectors with the given norms; returns (output norms, states)."""
    state = tx.init(jnp.zeros(2, dtype))
    update = jax.jit(tx.update) if jit else tx.update
    outs, states = [], []
    for n in norms:
        out, state = update(vec(n).astype(dtype), state)
        outs.append(
            float(jnp.linalg.norm(out)) if np.all(np.isfinite(np.asarray(out))) else math.nan
        )
        states.append(state)
    return outs, states


def spiky_norms(n=40, seed=0):
    """``n`` norms around 1 with spikes (x5, x20, x3, x50) at steps 8, 15, 16 and 30."""
    rng = np.random.default_rng(seed)
    norms = 1.0 + 0.1 * rng.standard_normal(n)
    for i, s in ((8, 5.0), (15, 20.0), (16, 3.0), (30, 50.0)):
        if i < n:
            norms[i] *= s
    return [float(v) for v in norms]
