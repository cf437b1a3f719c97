"""AdaGC (transforms.adagc): by hand, warm-up and floors."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import AdaGCState, adagc


def _tree(a, b):
    return {"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def test_adagc_by_hand():
    tx = adagc(clip_ratio=2.0, beta=0.5, warmup_steps=2, warmup_max_norm=1.0, min_gamma=0.0)
    state = tx.init(_tree([0.0, 0.0], [0.0]))
    assert isinstance(state, AdaGCState) and math.isinf(float(state.gamma["a"]))
    # step 1 (warm-up): global norm 5 -> factor 0.2; b's zero norm is not recorded
    out, state = tx.update(_tree([3.0, 4.0], [0.0]), state)
    np.testing.assert_allclose(out["a"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(float(state.gamma["a"]), 1.0, rtol=1e-6)
    assert math.isinf(float(state.gamma["b"]))
    # step 2 (warm-up): global norm sqrt(0.25 + 4); gamma = min of post-clip norms
    out, state = tx.update(_tree([0.3, 0.4], [2.0]), state)
    f = 1.0 / math.sqrt(4.25)
    ga, gb = 0.5 * f, 2.0 * f
    np.testing.assert_allclose(
        [float(state.gamma["a"]), float(state.gamma["b"])], [ga, gb], rtol=1e-6
    )
    assert bool(state.clipped["a"]) and float(state.clip_norm["a"]) == 1.0
    # step 3 (adaptive): a is clipped to 2 * gamma_a; b (1 <= 2 * gamma_b) passes
    out, state = tx.update(_tree([3.0, 4.0], [1.0]), state)
    np.testing.assert_allclose(float(jnp.linalg.norm(out["a"])), 2 * ga, rtol=1e-6)
    np.testing.assert_allclose(out["b"], [1.0])
    np.testing.assert_allclose(float(state.clip_norm["a"]), 2 * ga, rtol=1e-6)
    # the EMA tracks the clipped norm
    np.testing.assert_allclose(float(state.gamma["a"]), 0.5 * ga + 0.5 * 2 * ga, rtol=1e-6)
    np.testing.assert_allclose(float(state.gamma["b"]), 0.5 * gb + 0.5 * 1.0, rtol=1e-6)
    assert bool(state.clipped["a"]) and not bool(state.clipped["b"])
    np.testing.assert_allclose(float(state.norm["a"]), 5.0, rtol=1e-6)


def test_adagc_zero_gradient_in_warmup_does_not_freeze():
    """The reference sets gamma = 0 for a tensor with a zero warm-up gradient, freezing it."""
    tx = adagc(warmup_steps=2)
    state = tx.init(_tree([0.0], [0.0]))
    for b in (0.0, 0.5):
        _, state = tx.update(_tree([0.1], [b]), state)
    np.testing.assert_allclose(float(state.gamma["b"]), 0.5, rtol=1e-6)
    state = tx.init(_tree([0.0], [0.0]))
    for _ in range(2):  # 'b' has no gradient at all during warm-up
        _, state = tx.update(_tree([0.1], [0.0]), state)
    out, state = tx.update(_tree([0.1], [3.0]), state)
    np.testing.assert_allclose(out["b"], [3.0])  # starts from its first norm, not from 0
    np.testing.assert_allclose(float(state.gamma["b"]), 3.0, rtol=1e-6)
    # a zero gradient after warm-up leaves gamma alone
    _, state2 = tx.update(_tree([0.1], [0.0]), state)
    assert float(state2.gamma["b"]) == float(state.gamma["b"])


def test_adagc_no_warmup_and_floor():
    tx = adagc(warmup_steps=0, clip_ratio=1.5, beta=0.9)
    outs = [tx.update(_tree([2.0], [1.0]), tx.init(_tree([0.0], [0.0])))[0]]
    np.testing.assert_allclose(outs[0]["a"], [2.0])  # gamma starts at the current norm
    tx = adagc(warmup_steps=1, warmup_max_norm=None, min_gamma=0.01, clip_ratio=2.0)
    state = tx.init(_tree([0.0], [0.0]))
    _, state = tx.update(_tree([1e-6], [1.0]), state)
    out, state = tx.update(_tree([1.0], [1.0]), state)
    np.testing.assert_allclose(out["a"], [0.02], rtol=1e-6)  # bound 2 * max(1e-6, 0.01)


def test_adagc_invalid_arguments():
    for kwargs, name in (
        ({"clip_ratio": 0.0}, "clip_ratio"),
        ({"beta": 1.5}, "beta"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_max_norm": -2.0}, "warmup_max_norm"),
        ({"min_gamma": -1.0}, "min_gamma"),
    ):
        with pytest.raises(ValueError, match=name):
            adagc(**kwargs)
