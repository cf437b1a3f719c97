"""``method='auto'``: the path it takes on models on each side of its rule, the same path
``ghost_report`` states (with why), and the same clipped sums as the vmap path."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from gradclip_jax import GhostReport, clipped_grad, ghost_report
from gradclip_jax.per_example.ghost import AUTO_MIN_ELEMENTS, AUTO_MIN_ELEMENTS_NO_FALLBACK
from gradclip_jax.per_example.ghost._analysis import policy
from tests.per_example.models import mlp_setup, xent


def mlp(batch, sizes=(64, 256, 10), scale=False, seed=0):
    """An MLP; ``scale`` adds a leaf read through ``sin`` (it falls back to per-example gradients)."""
    r = np.random.default_rng(seed)
    params = {
        f"l{i}": {
            "w": jnp.asarray(r.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b),
        }
        for i, (a, b) in enumerate(itertools.pairwise(sizes))
    }
    if scale:
        params["s"] = jnp.ones(sizes[-1])
    data = {
        "x": jnp.asarray(r.normal(size=(batch, sizes[0])), jnp.float32),
        "y": jnp.asarray(r.integers(0, sizes[-1], batch)),
    }

    def loss(p, b):
        h = b["x"]
        for i in range(len(sizes) - 1):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            h = jnp.tanh(h) if i < len(sizes) - 2 else h
        return xent(h * jnp.sin(p["s"]) if scale else h, b["y"])

    return loss, params, data


def cnn(batch, seed=0):
    """Two small convolutions on 16x16 images: few parameters, large activations."""
    r = np.random.default_rng(seed)
    params = {
        "c1": jnp.asarray(r.normal(size=(3, 3, 1, 16)) / 3, jnp.float32),
        "b1": jnp.zeros(16),
        "c2": jnp.asarray(r.normal(size=(3, 3, 16, 32)) / 12, jnp.float32),
        "b2": jnp.zeros(32),
        "d": jnp.asarray(r.normal(size=(32, 10)) / 6, jnp.float32),
    }
    data = {
        "img": jnp.asarray(r.normal(size=(batch, 16, 16, 1)), jnp.float32),
        "y": jnp.asarray(r.integers(0, 10, batch)),
    }
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(p, b):
        h = jax.nn.relu(
            lax.conv_general_dilated(b["img"], p["c1"], (1, 1), "SAME", dimension_numbers=dn)
            + p["b1"]
        )
        h = jax.nn.relu(
            lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn) + p["b2"]
        )
        return xent(jnp.mean(h, (1, 2)) @ p["d"], b["y"])

    return loss, params, data


def mostly_fallback(batch=128):
    """A dense layer measured by ghost clipping, and a larger leaf read through ``sin`` (it falls back)."""
    r = np.random.default_rng(1)
    params = {
        "w": jnp.asarray(r.normal(size=(64, 256)) / 8, jnp.float32),
        "big": jnp.ones(30000) / 1000,
    }
    data = jnp.asarray(r.normal(size=(batch, 64)), jnp.float32)

    def loss(p, b):
        return jnp.sum(jnp.tanh(b @ p["w"]), -1) * jnp.sum(jnp.sin(p["big"]))

    return loss, params, data


def decoder(batch, seq=64, d=32, vocab=64, tied=True, seed=0):
    """A token decoder: embedding, a scan of two checkpointed residual layers, and a head that is
    the embedding transposed (``tied``: the leaf is read twice, so the streamed path does not
    apply) or a leaf of its own."""
    r = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(r.normal(size=(vocab, d)) / 4, jnp.float32),
        "w": jnp.asarray(r.normal(size=(2, d, d)) / np.sqrt(d), jnp.float32),
    }
    if not tied:
        params["head"] = jnp.asarray(r.normal(size=(d, vocab)) / np.sqrt(d), jnp.float32)
    tokens = jnp.asarray(r.integers(0, vocab, (batch, seq)))
    block = jax.checkpoint(lambda h, w: h + jnp.tanh(h @ w))

    def loss(p, b):
        h, _ = lax.scan(lambda h, w: (block(h, w), None), p["emb"][b], p["w"])
        logits = h @ (p["emb"].T if tied else p["head"])
        xent = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], b[:, 1:])
        return jnp.mean(xent, -1)

    return loss, params, tokens


def path_taken(loss, params, data):
    """``'ghost'`` or ``'vmap'``: the path ``method='auto'`` traced, read off its program."""

    def program(method):
        return str(jax.make_jaxpr(clipped_grad(loss, 1.0, method=method))(params, data))

    auto, ghost, vmap = program("auto"), program("ghost"), program("vmap")
    assert ghost != vmap
    return {ghost: "ghost", vmap: "vmap"}[auto]


# (model, the path 'auto' takes, words of the reason)
CASES = {
    "tiny mlp": (lambda: mlp_setup(batch=7), "vmap", "below AUTO_MIN_ELEMENTS_NO_FALLBACK"),
    "mlp, every leaf measured": (lambda: mlp(8), "ghost", "every leaf is measured"),
    "cnn, large activations": (lambda: cnn(16), "vmap", "smaller than the output cotangents"),
    "mlp with a fallback leaf": (lambda: mlp(8, scale=True), "vmap", "1 of 5 leaves fall back"),
    "a fallback leaf holding most parameters": (mostly_fallback, "vmap", "less than half"),
    "checkpointed decoder, tied head": (
        lambda: decoder(8),
        "vmap",
        "which the ghost path would store (a leaf is read more than once",
    ),
    "large mlp with a fallback leaf": (
        lambda: mlp(8, (256, 512, 10), scale=True),
        "ghost",
        "at least AUTO_MIN_ELEMENTS",
    ),
}


@pytest.mark.filterwarnings("ignore::gradclip_jax.GhostFallbackWarning")
@pytest.mark.parametrize("case", CASES)
def test_auto_takes_the_path_the_report_states(case):
    setup, path, why = CASES[case]
    loss, params, data = setup()
    rep = ghost_report(loss, params, data)
    assert rep.auto is not None and rep.auto[0] == path and why in rep.auto[1]
    assert path_taken(loss, params, data) == path
    # the report says it: its last line, and the one-line summary
    assert str(rep).splitlines()[-1] == f"method='auto' takes the {path} path: {rep.auto[1]}"
    assert rep.summary.endswith(f"; method='auto' takes the {path} path: {rep.auto[1]}")
    assert "\n" not in rep.summary
    assert rep == (rep.ghost, rep.fallback)  # still the pair


def test_auto_follows_the_thresholds(monkeypatch):
    """Each side of the rule: the no-fallback floor, and the cotangents' size beside the per-example
    gradients', move the MLP's path."""
    loss, params, data = mlp(8)
    formed = 8 * sum(x.size for x in jax.tree_util.tree_leaves(params))
    assert AUTO_MIN_ELEMENTS_NO_FALLBACK <= formed < AUTO_MIN_ELEMENTS
    monkeypatch.setattr(policy, "AUTO_MIN_ELEMENTS_NO_FALLBACK", formed + 1)
    assert ghost_report(loss, params, data).auto[0] == "vmap"
    assert path_taken(loss, params, data) == "vmap"
    monkeypatch.setattr(policy, "AUTO_MIN_ELEMENTS_NO_FALLBACK", 0)
    loss, params, data = cnn(4)  # below the floor, as the cnn of CASES still vmap: cotangents
    assert ghost_report(loss, params, data).auto[0] == "vmap"
    loss, params, data = mlp(2, (64, 2, 10))  # 2 examples x 160 parameters, 24 cotangents
    assert ghost_report(loss, params, data).auto[0] == "ghost"
    assert path_taken(loss, params, data) == "ghost"
    # one example: its per-example gradient is the gradient, which every step forms anyway
    assert ghost_report(*mlp(1, (64, 2, 10))).auto[0] == "vmap"


@pytest.mark.parametrize("case", ["mlp, every leaf measured", "cnn, large activations"])
def test_auto_sums_equal_the_vmap_paths(case):
    loss, params, data = CASES[case][0]()
    g, info = jax.jit(clipped_grad(loss, 0.5, method="auto"))(params, data)
    ref, ref_info = jax.jit(clipped_grad(loss, 0.5, method="vmap"))(params, data)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(info.norms, ref_info.norms, rtol=2e-5, atol=2e-6)


def test_auto_weighs_the_activations_the_ghost_path_would_store():
    """A checkpointed loss the streamed path cannot take: 'auto' takes the vmap path when one
    example's activations outweigh its gradient, and the compiled programs agree; with short
    sequences, or with the streamed path (an untied head), the memory rule does not apply."""
    loss, params, data = decoder(8)

    def temporaries(method):
        compiled = jax.jit(clipped_grad(loss, 1.0, method=method)).lower(params, data).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert "would store" in ghost_report(loss, params, data).auto[1]
    assert temporaries("vmap") < temporaries("ghost")
    for short in (decoder(8, seq=2, d=64), decoder(8, tied=False)):
        assert "would store" not in ghost_report(*short).auto[1]


def test_a_report_built_by_hand_has_no_auto_line():
    rep = GhostReport(([("['w']", "dense")], []))
    assert (
        rep.auto is None and "method='auto'" not in str(rep) and "method='auto'" not in rep.summary
    )
    assert str(rep).splitlines()[0] == rep.summary
