"""Models and references shared by the per_example tests: plain JAX parameter dicts whose losses
return per-example losses (B,), and a float64 Python-loop reference of clipped_grad."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

B = 7  # not a multiple of 3: the last microbatch is padded

# ----------------------------------------------------------------------------
# Models (plain JAX parameter dicts); every loss returns per-example losses (B,)
# ----------------------------------------------------------------------------


def xent(logits, y):
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), axis=-1)


def mlp_setup(seed=0, batch=B):
    r = np.random.default_rng(seed)
    params = {
        "l1": {
            "w": jnp.asarray(r.normal(size=(6, 8)), jnp.float32),
            "b": jnp.asarray(r.normal(size=8), jnp.float32),
        },
        "l2": {
            "w": jnp.asarray(r.normal(size=(8, 3)), jnp.float32),
            "b": jnp.zeros(3, jnp.float32),
        },
    }
    data = {
        "x": jnp.asarray(
            r.normal(size=(batch, 6)) * r.uniform(0.1, 3.0, size=(batch, 1)), jnp.float32
        ),
        "y": jnp.asarray(r.integers(0, 3, size=batch)),
    }

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["l1"]["w"] + p["l1"]["b"])
        return xent(h @ p["l2"]["w"] + p["l2"]["b"], b["y"])

    return loss, params, data


def cnn_setup(seed=1, batch=B):
    r = np.random.default_rng(seed)
    params = {
        "conv": jnp.asarray(r.normal(size=(3, 3, 1, 4)) * 0.5, jnp.float32),
        "conv_b": jnp.asarray(r.normal(size=4) * 0.1, jnp.float32),
        "dense": jnp.asarray(r.normal(size=(4, 3)), jnp.float32),
    }
    data = {
        "img": jnp.asarray(
            r.normal(size=(batch, 8, 8, 1)) * r.uniform(0.2, 3.0, size=(batch, 1, 1, 1)),
            jnp.float32,
        ),
        "y": jnp.asarray(r.integers(0, 3, size=batch)),
    }

    def loss(p, b):
        h = lax.conv_general_dilated(
            b["img"],
            p["conv"],
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        h = jax.nn.relu(h + p["conv_b"])
        return xent(jnp.mean(h, axis=(1, 2)) @ p["dense"], b["y"])

    return loss, params, data


def embed_setup(seed=2, batch=B):
    r = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(r.normal(size=(20, 5)), jnp.float32),
        "w": jnp.asarray(r.normal(size=(5,)), jnp.float32),
        "b": jnp.zeros((), jnp.float32),
    }
    data = {
        "tokens": jnp.asarray(r.integers(0, 20, size=(batch, 4))),
        "y": jnp.asarray(r.normal(size=batch) * 3.0, jnp.float32),
    }

    def loss(p, b):
        e = jnp.mean(p["emb"][b["tokens"]], axis=1)
        return 0.5 * (e @ p["w"] + p["b"] - b["y"]) ** 2

    return loss, params, data


MODELS = {"mlp": mlp_setup, "cnn": cnn_setup, "embed": embed_setup}

# ----------------------------------------------------------------------------
# Reference: a Python loop over examples, float64 clipping and summation
# ----------------------------------------------------------------------------

_GRAD_CACHE: dict = {}


def per_example_grads_loop(loss, params, data):
    """Each example's gradient (as float64 numpy leaves), one jax.grad call per example."""
    key = id(loss)
    if key not in _GRAD_CACHE:
        _GRAD_CACHE[key] = jax.jit(jax.grad(lambda p, ex: loss(p, ex)[0]))
    g1 = _GRAD_CACHE[key]
    n = jax.tree.leaves(data)[0].shape[0]
    out = []
    for i in range(n):
        ex = jax.tree.map(lambda x: x[i : i + 1], data)
        out.append([np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(g1(params, ex))])
    return out


def loop_reference(
    loss, params, data, clip, *, mask=None, mode="clip", gamma=0.01, layer_clips=None
):
    grads = per_example_grads_loop(loss, params, data)
    treedef = jax.tree.structure(params)
    total = [np.zeros_like(leaf) for leaf in grads[0]]
    norms, clipped = [], 0
    for i, g in enumerate(grads):
        n = math.sqrt(sum(float(np.sum(leaf**2)) for leaf in g))
        if mask is not None and not mask[i]:
            norms.append(0.0)
            continue
        norms.append(n)
        if layer_clips is not None:
            for k, (leaf, c) in enumerate(zip(g, layer_clips, strict=True)):
                ln = math.sqrt(float(np.sum(leaf**2)))
                total[k] += leaf * (min(1.0, c / ln) if ln > 0 else 1.0)
            continue
        f = (min(1.0, clip / n) if n > 0 else 1.0) if mode == "clip" else clip / (n + gamma)
        clipped += f < 1
        for k, leaf in enumerate(g):
            total[k] += f * leaf
    return jax.tree.unflatten(treedef, total), np.asarray(norms), clipped


def assert_tree_close(a, b, rtol=2e-5, atol=2e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(1.0, float(np.max(np.abs(y))))
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol * scale)


@functools.cache
def _vmap_program(loss, kw_items):
    """``clipped_grad(loss, clip, method='vmap', **kw)`` jitted with the clip norm and the mask as
    arguments: one program for every clip norm and mask a test passes with these keywords."""
    from gradclip_jax import clipped_grad

    kw = dict(kw_items)

    def step(params, data, clip, mask):
        return clipped_grad(loss, clip, method="vmap", **kw)(params, data, mask=mask)

    return jax.jit(step)


def vmap_reference(loss, params, data, clip, mask=None, **kw):
    """``clipped_grad(loss, clip, method='vmap', **kw)(params, data, mask=mask)``, compiled once per
    ``loss`` and keywords (build a model once to share it between tests): no mask is a mask that
    keeps every example, so masked and unmasked calls share the program too. ``ghost_sum`` is
    dropped: only the ghost path reads it."""
    kw.pop("ghost_sum", None)
    if mask is None:
        mask = np.ones(jax.tree.leaves(data)[0].shape[0], bool)
    return _vmap_program(loss, tuple(sorted(kw.items())))(params, data, clip, mask)


def median_clip(loss, params, data):
    """A clip norm between the two middle per-example norms (the lower median and the next one):
    both branches of clipping taken, and no example at the clip norm itself, where a
    norm measured a few units off decides the branch (the library scales an example whose
    measured norm is within the rounding margin of ``C``)."""
    grads = per_example_grads_loop(loss, params, data)
    norms = sorted(math.sqrt(sum(float(np.sum(leaf**2)) for leaf in g)) for g in grads)
    k = (len(norms) - 1) // 2
    return math.sqrt(norms[k] * norms[k + 1])


def random_per_example_grads(seed, shapes, batch=6, zero_row=2):
    r = np.random.default_rng(seed)
    scales = r.uniform(0.1, 5.0, size=(batch,))
    out = []
    for s in shapes:
        g = r.normal(size=(batch, *s)) * scales.reshape((-1,) + (1,) * len(s))
        g[zero_row] = 0.0  # a zero example: no division by zero
        out.append(jnp.asarray(g, jnp.float32))
    return out
