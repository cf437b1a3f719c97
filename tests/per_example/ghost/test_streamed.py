"""The streamed ghost path (``ghost/_streamed.py``): norms and clipped sums taken inside the
backward pass, a scan over checkpointed layers kept a loop whose steps are recomputed.
Checked against ``method='vmap'``, and its compiled temporaries against the non-private step's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import clipped_grad
from gradclip_jax.per_example.ghost import _strategy

pytest.importorskip("flax")
from benchmarks import models

TINY = dict(d=32, heads=4, kv_heads=2, seq=8, vocab=64)


@pytest.fixture
def streamed(monkeypatch):
    """Counts the chunks the streamed path computes (so a test knows which path ran)."""
    calls = []
    inner = _strategy._streamed_chunk

    def counted(*a, **k):
        calls.append(1)
        return inner(*a, **k)

    monkeypatch.setattr(_strategy, "_streamed_chunk", counted)
    return calls


def _compare(losses, params, data, per_layer=False, rtol=1e-4, atol=1e-6):
    # one vmap program (the clip norm its argument) gives the norms and the reference: the
    # decoder's vmap program is a third of a test's compile time
    vmap = jax.jit(
        lambda p, d, c: clipped_grad(losses, c, method="vmap", per_layer=per_layer)(p, d)
    )
    norms = vmap(params, data, 1e9)[1].norms  # per layer: the whole gradient's from its layers'
    total = np.sqrt(sum(np.asarray(n, np.float64) ** 2 for n in jax.tree.leaves(norms)))
    clip = 0.5 * float(np.median(total))
    g, gi = jax.jit(clipped_grad(losses, clip, method="ghost", per_layer=per_layer))(params, data)
    v, vi = vmap(params, data, clip)
    for a, b in zip(jax.tree.leaves(gi.norms), jax.tree.leaves(vi.norms), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol)
    assert sum(int(n) for n in jax.tree.leaves(vi.num_clipped)) >= 1  # the clip bites
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(v), strict=True):
        scale = float(np.max(np.abs(np.asarray(b, np.float64)))) or 1.0
        np.testing.assert_allclose(
            np.asarray(a, np.float64),
            np.asarray(b, np.float64),
            rtol=rtol,
            atol=atol + rtol * scale,
        )


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, False])
@pytest.mark.parametrize("per_layer", [False, True])
def test_scan_decoder_equals_vmap(streamed, per_layer, remat):
    losses, params, data = models.llama(0, 4, models.LlamaConfig(layers=2, remat=remat, **TINY))
    _compare(losses, params, data, per_layer=per_layer)
    assert streamed  # the streamed path ran


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, False])
def test_scan_decoder_bfloat16_within_rounding(streamed, remat):
    losses, params, data = models.llama(
        0, 4, models.LlamaConfig(layers=2, dtype=jnp.bfloat16, remat=remat, **TINY)
    )
    _compare(losses, params, data, rtol=1e-2)
    assert streamed


def _poisoned(cfg, bad):
    """The decoder with one token's embedding NaN, that token in the examples ``bad`` alone."""
    losses, params, data = models.llama(0, 4, cfg)
    poison = cfg.vocab - 1
    x = np.where(np.asarray(data["x"]) == poison, 0, np.asarray(data["x"]))
    x[list(bad), 1] = poison
    params = jax.tree.map(
        lambda a: a.at[poison].set(jnp.nan) if a.shape == (cfg.vocab, cfg.d) else a, params
    )
    return losses, params, {**data, "x": jnp.asarray(x)}


@pytest.mark.parametrize(
    "remat", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["scan", "remat_scan"]
)
@pytest.mark.parametrize("bad", [(2,), (0, 1, 2, 3)], ids=["one_nan", "all_nan"])
def test_nan_example_is_dropped_exactly(streamed, remat, bad):
    """An example whose gradient is NaN contributes exactly zero, the others as without it: the
    sum pass runs on the batch with that example replaced by a kept one, weighted 0 (none kept:
    the sums are 0)."""
    cfg = models.LlamaConfig(layers=2, remat=remat, **TINY)
    losses, params, data = _poisoned(cfg, bad)
    g, info = jax.jit(clipped_grad(losses, 0.05, method="ghost"))(params, data)
    assert streamed
    dropped = ~np.isfinite(np.asarray(info.norms))
    np.testing.assert_array_equal(np.flatnonzero(dropped), bad)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    if len(bad) == len(dropped):
        assert all(not np.asarray(x).any() for x in jax.tree.leaves(g))
        return
    ref, ref_info = jax.jit(clipped_grad(losses, 0.05, method="vmap"))(
        params, data, mask=jnp.asarray(~dropped)
    )
    assert int(ref_info.num_clipped) >= 1  # the clip bites
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_huge_gradients_stay_in_range(streamed):
    """A use's norm leaves the backward pass as a norm, not a square: gradients near 1e22
    (squares beyond float32) give the float64 norms."""
    r = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(r.normal(size=(3, 4, 4)) / 2, jnp.float32),
        "head": jnp.asarray(r.normal(size=(4,)), jnp.float32),
    }
    x = r.normal(size=(5, 6, 4)) * r.uniform(0.5, 2.0, size=(5, 1, 1)) * 1e22

    def loss(p, b):  # linear in every weight: per-example gradients ~1e22
        def step(h, w):
            return h @ w, None

        h, _ = lax.scan(jax.checkpoint(step), b, p["w"])
        return jnp.mean(h, axis=1) @ p["head"]

    _, info = jax.jit(clipped_grad(loss, 1.0, method="ghost"))(params, jnp.asarray(x, jnp.float32))
    assert streamed
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        _, ref = clipped_grad(loss, 1.0, method="vmap")(p64, jnp.asarray(x, jnp.float64))
    got, want = np.asarray(info.norms, np.float64), np.asarray(ref.norms)
    assert np.all(want > 1e19) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.filterwarnings("ignore::gradclip_jax.GhostFallbackWarning")
def test_step_used_twice_is_not_streamed(streamed):
    """A stacked leaf read twice in a step (cross terms between the uses): not streamed, and exact."""
    r = np.random.default_rng(1)
    params = {"w": jnp.asarray(r.normal(size=(2, 4, 4)) / 2, jnp.float32)}
    x = jnp.asarray(r.normal(size=(5, 3, 4)), jnp.float32)

    def loss(p, b):
        def step(h, w):
            return jnp.tanh(jnp.tanh(h @ w) @ w), None

        h, _ = lax.scan(jax.checkpoint(step), b, p["w"])
        return jnp.sum(h**2, axis=(1, 2))

    _compare(loss, params, x)
    assert not streamed


def _temps(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("layers", [2, 8])
def test_remat_scan_temporaries_near_the_nonprivate_step(streamed, layers):
    """Compiled temporaries of the clipped sum within 1.25x of ``jax.grad``'s of the mean loss on the
    same nnx.remat + nnx.scan decoder (the probed path: 3x at 2 layers, 9x at 8, on this size)."""
    cfg = models.LlamaConfig(layers=layers, d=64, heads=4, kv_heads=2, seq=64, vocab=128)
    losses, params, data = models.llama(0, 4, cfg)
    base = _temps(lambda p, b: jax.grad(lambda q: jnp.mean(losses(q, b)))(p), params, data)
    ghost = _temps(clipped_grad(losses, 1.0, method="ghost"), params, data)
    assert streamed
    assert ghost <= 1.25 * base, (ghost, base)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_no_remat_temporaries_near_the_nonprivate_step(streamed, scan):
    """Without remat, NaN-safe (the default): within 1.1x of the non-private step's temporaries,
    scanned (streamed: the probed path stacks every layer's operands and cotangents, 1.4x) or
    unrolled (probed: its one forward pass stores what the non-private step stores)."""
    cfg = models.LlamaConfig(
        layers=2, d=64, heads=4, kv_heads=2, seq=64, vocab=128, remat=False, scan=scan
    )
    losses, params, data = models.llama(0, 4, cfg)
    base = _temps(lambda p, b: jax.grad(lambda q: jnp.mean(losses(q, b)))(p), params, data)
    ghost = _temps(clipped_grad(losses, 1.0, method="ghost"), params, data)
    assert bool(streamed) == scan
    assert ghost <= 1.1 * base, (ghost, base)


def _flops(f, *args):
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_remat_scan_flops_one_extra_backward(streamed):
    """The clipped sum (NaN-safe, the default) on an nnx.remat + nnx.scan decoder: one forward pass
    pulled back twice, at most 1.75x the FLOPs of ``jax.grad`` of the mean loss (1 forward + 2 x
    (recomputed forward + backward) = 7 units against 4; a second forward pass for the sums, or a
    patched pass in a conditional, counts 8 or more: 1.86x here). The scan's body counts once in
    both (XLA's cost analysis), a proxy that moves with the step's work."""
    losses, params, data = models.llama(0, 4, models.LlamaConfig(layers=2, **TINY))
    base = _flops(lambda p, b: jax.grad(lambda q: jnp.mean(losses(q, b)))(p), params, data)
    ghost = _flops(lambda p, b: clipped_grad(losses, 1.0, method="ghost")(p, b)[0], params, data)
    assert streamed
    assert ghost <= 1.75 * base, ghost / base
