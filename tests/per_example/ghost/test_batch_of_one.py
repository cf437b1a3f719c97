"""A batch of one example: JAX lowers some operations on a size-1 batch axis to forms the rules
cannot follow (``take_along_axis`` at B = 1 reshapes the batch away and gathers over the tokens).
One example mixes with no other, so the fallback is the right path there, at the non-private
step's cost: it is reported as such, ``'auto'`` takes it, and nothing warns that the loss mixes
examples."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx

VOCAB, D, T, CLIP = 11, 6, 5, 0.1


def _loss(p, b):
    """Token embedding, a dense head and optax's integer-label cross-entropy (a gather over the
    vocabulary at every position), averaged over each example's tokens."""
    h = jnp.tanh(p["embed"][b["x"]])
    logits = h @ p["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), axis=-1)


def _setup(batch: int):
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "embed": jax.random.normal(k[0], (VOCAB, D)),
        "head": jax.random.normal(k[1], (D, VOCAB)),
    }
    ids = jax.random.randint(k[2], (batch, T + 1), 0, VOCAB)
    return params, {"x": ids[:, :-1], "y": ids[:, 1:]}


def test_one_example_is_reported_as_one_not_as_mixing() -> None:
    params, batch = _setup(1)
    report = gcx.ghost_report(_loss, params, batch)
    assert report.fallback and all("a batch of one example" in why for _, why in report.fallback)
    assert not any("mixes examples" in why for _, why in report.fallback)
    assert report.auto[0] == "vmap" and "a batch of one example" in report.auto[1]
    # the same loss at two examples is measured leaf by leaf: the case is the batch's size alone
    assert [path for path, _ in gcx.ghost_report(_loss, params, _setup(2)[1]).ghost] == [
        "['embed']",
        "['head']",
    ]


def test_one_example_is_clipped_as_its_gradient_without_a_warning() -> None:
    params, batch = _setup(1)
    g = jax.grad(lambda p: _loss(p, batch)[0])(params)
    norm = optax.tree.norm(g)
    want = jax.tree.map(lambda x: x * jnp.minimum(1.0, CLIP / norm), g)
    assert norm > CLIP  # the clip applies
    for method in ("ghost", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", gcx.GhostFallbackWarning)
            got, info = jax.jit(gcx.clipped_grad(_loss, CLIP, method=method))(params, batch)
        np.testing.assert_allclose(np.asarray(info.norms), [norm], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
