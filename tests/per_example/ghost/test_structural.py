"""Ghost clipping through model structure: split/concatenate, layers stacked with
``lax.scan`` / ``flax.linen.scan``, ``jax.checkpoint``, and the fallback warning.
Every case is checked against ``method='vmap'`` (per-example gradients formed)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax.ghost import GhostFallbackWarning, ghost_report
from gradclip_jax.per_example import clipped_grad
from tests.per_example.models import xent

B, T, D, L = 6, 5, 8, 3


def _data(seed=0, classes=4):
    r = np.random.default_rng(seed)
    x = r.normal(size=(B, T, D)) * r.uniform(0.2, 3.0, size=(B, 1, 1))
    return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(r.integers(0, classes, size=B))}


def _w(r, *shape):
    return jnp.asarray(r.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1.0), jnp.float32)


def block_setup(seed=0, layers=L, layer_scale=1.0):
    """Attention with a fused qkv projection split in three, heads joined by concatenate,
    then ``L`` residual layers stacked on axis 0 and run by ``lax.scan``, each a
    ``jax.checkpoint`` block."""
    r = np.random.default_rng(seed)
    params = {"qkv": _w(r, D, 3 * D), "o": _w(r, D, D), "stack_w": layer_scale * _w(r, layers, D, D),
              "stack_b": 0.1 * _w(r, layers, D), "head": _w(r, D, 4)}

    def loss(p, b):
        x = b["x"]
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        heads = []
        for h in range(2):  # two heads of width D/2, joined again
            s = slice(h * D // 2, (h + 1) * D // 2)
            att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q[..., s], k[..., s]) / np.sqrt(D / 2), axis=-1)
            heads.append(jnp.einsum("bts,bsd->btd", att, v[..., s]))
        h = x + jnp.concatenate(heads, axis=-1) @ p["o"]

        def layer(h, wb):
            w, bias = wb
            return h + jax.checkpoint(lambda h: jax.nn.gelu(h @ w + bias))(h), None

        h, _ = jax.lax.scan(layer, h, (p["stack_w"], p["stack_b"]))
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    return loss, params, _data(seed)


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _compare(loss, params, data, clip=1.0, **kw):
    ref, ref_info = jax.jit(clipped_grad(loss, clip, method="vmap", **kw))(params, data)
    got, info = jax.jit(clipped_grad(loss, clip, method="ghost", **kw))(params, data)
    _close(info.norms, ref_info.norms)
    _close(got, ref)
    return info


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_split_concat_scan_checkpoint_keep_the_ghost_path(ghost_sum):
    loss, params, data = block_setup()
    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    kinds = dict(rep.ghost)
    assert kinds["['qkv']"] == "dense" and kinds["['o']"] == "dense"
    assert kinds["['stack_w']"] == "stacked:" + "+".join(["dense"] * L)
    assert kinds["['stack_b']"] == "stacked:" + "+".join(["elementwise"] * L)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)  # nothing falls back
        info = _compare(loss, params, data, clip=float(np.median(np.asarray(
            clipped_grad(loss, 1.0, method="vmap")(params, data)[1].norms))), ghost_sum=ghost_sum)
    assert 0 < int(info.num_clipped) < B


def test_per_layer_clipping_of_a_stacked_leaf():
    loss, params, data = block_setup(seed=1)
    _compare(loss, params, data, clip=0.3, per_layer=True)


def test_flax_linen_scanned_layers():
    nn = pytest.importorskip("flax.linen")

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + jnp.tanh(nn.Dense(D)(nn.LayerNorm()(h))), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
            h, _ = stack()(nn.Dense(D)(x), None)
            return nn.Dense(4)(jnp.mean(h, axis=1))

    model, data = Model(), _data(seed=2)
    params = model.init(jax.random.key(0), data["x"][:1])

    def loss(p, b):
        return xent(model.apply(p, b["x"]), b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    assert any(kind.startswith("stacked:dense") for _, kind in rep.ghost)
    _compare(loss, params, data, clip=0.5)


@pytest.mark.slow  # 129 layers, compiled on both paths
def test_long_scan_falls_back_with_a_warning_naming_the_leaf():
    # one layer more than the documented limit of 128 unrolled steps; small weights keep 129 residual layers finite
    loss, params, data = block_setup(seed=3, layers=129, layer_scale=0.05)
    rep = ghost_report(loss, params, data)
    reasons = dict(rep.fallback)
    assert set(reasons) == {"['stack_w']", "['stack_b']"} and "'scan'" in reasons["['stack_w']"]
    fn = clipped_grad(loss, 1.0, method="ghost")
    with pytest.warns(GhostFallbackWarning, match=r"2 of 5 parameter leaves.*\['stack_b'\].*'scan'"):
        fn(params, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)
        fn(params, data)  # told once
    _compare(loss, params, data, clip=0.7)  # the fallback is still exact


def test_overlapping_slices_and_unsupported_uses_fall_back_exactly():
    r = np.random.default_rng(4)
    params = {"w_overlap": _w(r, D, D), "w_sin": _w(r, D, 4)}

    def loss(p, b):
        h = b["x"] @ p["w_overlap"][:, :6] + jnp.pad(b["x"] @ p["w_overlap"][:, 2:], ((0, 0), (0, 0), (2, 0)))[..., :6]
        return xent(jnp.mean(h[..., :D // 2] @ jnp.sin(p["w_sin"][:4]), axis=1), b["y"])

    data = _data(seed=4)
    reasons = dict(ghost_report(loss, params, data).fallback)
    assert "overlapping" in reasons["['w_overlap']"]
    assert "'sin'" in reasons["['w_sin']"]
    with pytest.warns(GhostFallbackWarning, match=r"\['w_sin'\] \(used by 'sin'"):
        clipped_grad(loss, 1.0, method="ghost")(params, data)
    _compare(loss, params, data, clip=0.4)


def test_mixing_reason_names_the_primitive():
    loss, params, data = block_setup(seed=5)

    def mixing(p, b):
        return loss(p, b) + jnp.cumsum(b["x"][:, 0, 0])  # sums across examples

    reasons = dict(ghost_report(mixing, params, data).fallback)
    assert all("mixes examples" in why and "'cumsum'" in why for why in reasons.values())


def test_dot_product_attention_and_custom_jvp_activations():
    """``jax.nn.dot_product_attention`` and ``jax.nn.relu`` (a custom_jvp) between dense layers."""
    r = np.random.default_rng(6)
    params = {"qkv": _w(r, D, 3 * D), "o": _w(r, D, D), "head": _w(r, D, 4)}
    heads = 2

    def loss(p, b):
        x = b["x"]
        q, k, v = (a.reshape(*a.shape[:2], heads, D // heads) for a in jnp.split(x @ p["qkv"], 3, axis=-1))
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)
        return xent(jnp.mean(jax.nn.relu(att @ p["o"]), axis=1) @ p["head"], b["y"])

    data = _data(seed=6)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost) == {"['qkv']": "dense", "['o']": "dense", "['head']": "dense"}
    _compare(loss, params, data, clip=0.5)


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_position_embedding_at_constant_positions(ghost_sum):
    """A table looked up at ``jnp.arange(T)`` (GPT-2's ``wpe``) and added to every example."""
    r = np.random.default_rng(7)
    vocab, t_max = 11, 2 * T
    params = {"wte": _w(r, vocab, D), "wpe": 0.1 * _w(r, t_max, D), "head": _w(r, D, 4)}
    ids = jnp.asarray(r.integers(0, vocab, size=(B, T)))
    data = {"ids": ids, "y": jnp.asarray(r.integers(0, 4, size=B))}

    def loss(p, b):
        pos = jnp.arange(b["ids"].shape[1])
        h = jnp.tanh(p["wte"][b["ids"]] + p["wpe"][pos])
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost)["['wpe']"] == "elementwise"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)
        _compare(loss, params, data, clip=0.3, ghost_sum=ghost_sum)


def test_flax_nnx_position_embedding():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(11, D, rngs=rngs)
            self.wpe = nnx.Embed(2 * T, D, rngs=rngs)
            self.head = nnx.Linear(D, 4, rngs=rngs)

        def __call__(self, ids):
            h = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))
            return self.head(jnp.mean(jnp.tanh(h), axis=1))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    r = np.random.default_rng(8)
    data = {"ids": jnp.asarray(r.integers(0, 11, size=(B, T))), "y": jnp.asarray(r.integers(0, 4, size=B))}

    def loss(p, b):
        return xent(nnx.merge(graphdef, p)(b["ids"]), b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == [], rep.fallback
    _compare(loss, params, data, clip=0.3)
