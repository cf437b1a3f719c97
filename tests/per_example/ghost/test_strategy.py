"""Tests for gradclip_jax.per_example.ghost: clipped_grad(method='ghost') against method='vmap'."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import benchmarks.hlo_program as hp
from gradclip_jax import clipped_grad, ghost_report
from gradclip_jax.per_example import PRODUCT_PRECISION
from gradclip_jax.per_example.ghost import _gram, _measure
from tests._backend import refuses_backward
from tests.per_example.models import (
    B,
    cnn_setup,
    embed_setup,
    mlp_setup,
    vmap_reference,
    xent,
)

# ----------------------------------------------------------------------------
# Models (plain JAX); every loss returns per-example losses of shape (B,)
# ----------------------------------------------------------------------------


def _scales(r, batch, ndim):
    return r.uniform(0.1, 3.0, size=(batch,) + (1,) * (ndim - 1))


def seq_setup(seq=3, seed=3, batch=B, dtype=jnp.float32):
    """Dense layers on a (B, T, d) input: Gram identity for T=3, materialized for T=8."""
    r = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(r.normal(size=(6, 8)) / 2, dtype),
        "b1": jnp.asarray(r.normal(size=8), dtype),
        "w2": jnp.asarray(r.normal(size=(8, 3)) / 3, dtype),
    }
    data = {
        "x": jnp.asarray(r.normal(size=(batch, seq, 6)) * _scales(r, batch, 3), dtype),
        "y": jnp.asarray(r.integers(0, 3, size=batch)),
    }

    def loss(p, b):
        h = jnp.tanh(jnp.einsum("btd,dp->btp", b["x"], p["w1"]) + p["b1"])
        return xent(jnp.mean(h @ p["w2"], axis=1), b["y"])

    return loss, params, data


def layernorm_setup(seed=4, batch=B):
    """Dense + LayerNorm (scale and bias) + tied-free head; sequence axis of 4."""
    r = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(r.normal(size=(5, 6)), jnp.float32),
        "scale": jnp.asarray(1 + 0.3 * r.normal(size=6), jnp.float32),
        "bias": jnp.asarray(0.3 * r.normal(size=6), jnp.float32),
        "head": jnp.asarray(r.normal(size=(6,)), jnp.float32),
    }
    data = {
        "x": jnp.asarray(r.normal(size=(batch, 4, 5)) * _scales(r, batch, 3), jnp.float32),
        "y": jnp.asarray(r.normal(size=batch), jnp.float32),
    }

    def loss(p, b):
        h = b["x"] @ p["w"]
        mu = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.var(h, axis=-1, keepdims=True)
        h = (h - mu) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
        return (jnp.mean(jnp.tanh(h) @ p["head"], axis=1) - b["y"]) ** 2

    return loss, params, data


def tied_setup(seed=5, batch=B):
    """Tied input/output embedding (used twice), plus an elementwise sin of a parameter."""
    r = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(r.normal(size=(6, 4)), jnp.float32),
        "freq": jnp.asarray(r.normal(size=4), jnp.float32),
    }
    data = {
        "tok": jnp.asarray(r.integers(0, 6, size=(batch, 5))),
        "y": jnp.asarray(r.integers(0, 6, size=batch)),
    }

    def loss(p, b):
        h = jnp.mean(p["emb"][b["tok"]], axis=1) * jnp.sin(p["freq"])
        return xent(h @ p["emb"].T, b["y"])

    return loss, params, data


def mixing_setup(seed=6, batch=B):
    """Batch-statistics normalization: examples interact (breaks the per-example contract)."""
    loss0, params, data = mlp_setup(seed, batch)

    def loss(p, b):
        x = b["x"] - jnp.mean(b["x"], axis=0)
        return loss0(p, {**b, "x": x})

    return loss, params, data


def embed_seq_setup(seed=7, batch=B):
    """Embedding lookup with repeated tokens in each sequence (small vocabulary)."""
    r = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(r.normal(size=(5, 3)), jnp.float32),
        "w": jnp.asarray(r.normal(size=(3, 2)), jnp.float32),
    }
    data = {
        "tok": jnp.asarray(r.integers(0, 5, size=(batch, 6))),
        "y": jnp.asarray(r.integers(0, 2, size=batch)),
    }

    def loss(p, b):
        return xent(jnp.sum(p["emb"][b["tok"]] @ p["w"], axis=1), b["y"])

    return loss, params, data


MODELS = {
    "mlp": mlp_setup,
    "seq_gram": seq_setup,
    "seq_materialized": lambda: seq_setup(seq=8),
    "cnn": cnn_setup,
    "embed": embed_setup,
    "embed_seq": embed_seq_setup,
    "layernorm": layernorm_setup,
    "tied": tied_setup,
    "not_row_wise": lambda: not_row_wise_setup(),
}


def not_row_wise_setup(seed=9, batch=B):
    """A per-example loss through an operation ghost clipping has no rule for (an FFT):
    every leaf takes the vmap path, exactly."""
    loss0, params, data = mlp_setup(seed, batch)

    def loss(p, b):
        return loss0(p, {**b, "x": jnp.fft.fft(b["x"], axis=-1).real})

    return loss, params, data


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


@functools.cache
def _model(name):
    """``MODELS[name]()``, built once: one loss function, so the programs built from it (the
    vmap reference) are traced and compiled once for every test and option that uses them."""
    return MODELS[name]()


def _clip_between_norms(loss, params, data):
    """A clip norm strictly between two middle per-example norms (no ties with a norm)."""
    _, info = vmap_reference(loss, params, data, 1.0)
    n = np.sort(np.asarray(info.norms))
    return float(np.sqrt(n[len(n) // 2 - 1] * n[len(n) // 2]))


def _close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _compare(loss, params, data, clip, rtol=1e-5, atol=1e-6, mask=None, **kw):
    """Ghost against vmap; ``None`` where this backend refuses ``ghost_sum='backward'`` (checked)."""
    per_layer = bool(kw.get("per_layer")) or not jax.tree_util.treedef_is_leaf(
        jax.tree.structure(clip)
    )
    if refuses_backward(
        kw.get("ghost_sum"),
        lambda: jax.make_jaxpr(clipped_grad(loss, clip, method="ghost", **kw))(
            params, data, mask=mask
        ),
        per_layer=per_layer,
    ):
        return None
    ref_g, ref_i = vmap_reference(loss, params, data, clip, mask=mask, **kw)
    g, i = jax.jit(clipped_grad(loss, clip, method="ghost", **kw))(params, data, mask=mask)
    assert jax.tree.structure(g) == jax.tree.structure(ref_g)
    _close(g, ref_g, rtol, atol)
    _close(i.norms, ref_i.norms, rtol, atol)
    assert jax.tree.structure(i.num_clipped) == jax.tree.structure(ref_i.num_clipped)
    _close(i.num_clipped, ref_i.num_clipped, 0, 0)
    np.testing.assert_allclose(np.asarray(i.values), np.asarray(ref_i.values), rtol=rtol, atol=atol)
    return g, i


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------


SUMS = ["backward", "bookkeeping"]


@pytest.mark.parametrize("ghost_sum", SUMS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_ghost_matches_vmap(model, ghost_sum):
    loss, params, data = _model(model)
    _compare(loss, params, data, _clip_between_norms(loss, params, data), ghost_sum=ghost_sum)


def test_report_classifies_leaves():
    kinds = dict(ghost_report(*mlp_setup()).ghost)
    assert kinds == {
        "['l1']['b']": "elementwise",
        "['l1']['w']": "dense",
        "['l2']['b']": "elementwise",
        "['l2']['w']": "dense",
    }
    rep = ghost_report(*cnn_setup())
    assert dict(rep.ghost) == {
        "['conv']": "conv",
        "['conv_b']": "elementwise",
        "['dense']": "dense",
    }
    assert rep.fallback == []
    rep = ghost_report(*layernorm_setup())
    assert dict(rep.ghost) == {
        "['w']": "dense",
        "['scale']": "elementwise",
        "['bias']": "elementwise",
        "['head']": "dense",
    }
    rep = ghost_report(*embed_seq_setup())
    assert dict(rep.ghost) == {"['emb']": "embedding", "['w']": "dense"}
    rep = ghost_report(*tied_setup())
    assert dict(rep.ghost) == {"['emb']": "tied:embedding+dense"}
    assert [p for p, _ in rep.fallback] == ["['freq']"]  # used through sin(): materialized
    rep = ghost_report(*mixing_setup())
    assert rep.ghost == [] and len(rep.fallback) == 4


def test_report_prints_as_a_table():
    """print(ghost_report(...)) lists every leaf: its kind, or why it falls back; repr stays a
    constructor-like one-liner, and IPython shows the table."""
    rep = ghost_report(*tied_setup())
    lines = str(rep).splitlines()
    assert (
        lines[0]
        == "ghost clipping measures 1 of 2 parameter leaves; 1 falls back to per-example gradients"
    )
    assert lines[1].split() == ["leaf", "clipping", "kind", "/", "why", "it", "falls", "back"]
    assert lines[3].split() == ["['emb']", "ghost", "tied:embedding+dense"]
    _, why = rep.fallback[0]
    assert lines[4].startswith("['freq']  fallback  ") and lines[4].endswith(why)
    assert lines[3].index("ghost") == lines[4].index("fallback")  # aligned columns
    assert repr(rep) == f"GhostReport(ghost={rep.ghost!r}, fallback={rep.fallback!r})"
    assert rep == (rep.ghost, rep.fallback)  # still the pair

    class Printer:
        text_seen = ""

        def text(self, t):
            self.text_seen += t

    printer = Printer()
    rep._repr_pretty_(printer, False)
    assert printer.text_seen == str(rep)


@pytest.mark.parametrize("method", ["vmap", "ghost", "auto"])
def test_loss_combining_examples_is_an_error(method):
    """Batch statistics would be computed per example (silently something else): refused."""
    loss, params, data = mixing_setup()
    with pytest.raises(ValueError, match=r"combines examples at 'reduce_sum'.*own example alone"):
        clipped_grad(loss, 1.0, method=method)(params, data)

    def scan_over_batch(p, b):
        c, _ = lax.scan(lambda c, x: (c + jnp.sum(x), None), 0.0, b["x"])
        return loss(p, b) * 0 + c * 0 + mlp_setup()[0](p, b)

    with pytest.raises(ValueError, match="combines examples"):
        jax.jit(clipped_grad(scan_over_batch, 1.0, method=method))(params, data)

    # a batch mean inside a nested jit or a remat'd block (flax/equinox wrap layers in both)
    @jax.jit
    def centred(x):
        return x - jnp.mean(x, axis=0)

    def nested(p, b):
        return mlp_setup()[0](p, {**b, "x": centred(b["x"])})

    for wrapped in (nested, jax.checkpoint(nested)):
        with pytest.raises(ValueError, match="combines examples at 'reduce_sum'"):
            clipped_grad(wrapped, 1.0, method=method)(params, data)


def _paired(p, b):  # in-batch contrastive logits (CLIP / InfoNCE): row i reads every example
    za, zb = b["x"] @ p["w"], b["x"][:, ::-1] @ p["w"]
    return -jnp.diagonal(jax.nn.log_softmax(za @ zb.T, axis=-1))


def _attended(p, b):  # attention across the batch axis
    h = b["x"] @ p["w"]
    return jnp.sum((jax.nn.softmax(h @ h.T, axis=-1) @ h) ** 2, axis=-1)


def _ranked(p, b):  # the batch's top value per feature
    h = b["x"] @ p["w"]
    return jnp.sum((h - lax.top_k(h.T, 1)[0].T) ** 2, axis=-1)


def _sorted(p, b):
    return jnp.sum(jnp.sort(b["x"] @ p["w"], axis=0) ** 2, axis=-1)


@pytest.mark.parametrize("method", ["vmap", "ghost", "auto"])
@pytest.mark.parametrize(
    "loss, where",
    [(_paired, "dot_general"), (_attended, "dot_general"), (_ranked, "top_k"), (_sorted, "sort")],
    ids=["contrastive", "attention", "top_k", "sort"],
)
def test_a_loss_pairing_or_ranking_examples_is_an_error(loss, where, method):
    """Each was run on batches of one in silence (the contrastive loss then trains nothing: every
    norm 0), or with only ghost's fallback warning: the loss written is not the one trained."""
    r = np.random.default_rng(3)
    params = {"w": jnp.asarray(r.normal(size=(4, 4)), jnp.float32)}
    data = {"x": jnp.asarray(r.normal(size=(6, 4)), jnp.float32)}
    with pytest.raises(ValueError, match=f"combines examples at '{where}'"):
        clipped_grad(loss, 1.0, method=method)(params, data)


@pytest.mark.parametrize("ghost_sum", SUMS)
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_microbatch_mask_normalize(model, ghost_sum):
    loss, params, data = _model(model)
    clip = _clip_between_norms(loss, params, data)
    mask = jnp.array([True, False, True, True, False, True, True])
    _compare(loss, params, data, clip, microbatch_size=3, mask=mask, ghost_sum=ghost_sum)
    _compare(loss, params, data, clip, normalize=True, mask=mask, ghost_sum=ghost_sum)


@pytest.mark.parametrize("ghost_sum", SUMS)
def test_all_padding_gives_zero(ghost_sum):
    loss, params, data = mlp_setup()
    grad_fn = clipped_grad(loss, 1.0, method="ghost", ghost_sum=ghost_sum)
    if refuses_backward(ghost_sum, lambda: grad_fn(params, data)):
        return
    g, i = jax.jit(grad_fn)(params, data, mask=jnp.zeros(B, bool))
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(g))
    assert int(i.num_clipped) == 0 and float(jnp.max(i.norms)) == 0.0


@pytest.mark.parametrize("ghost_sum", SUMS)
@pytest.mark.parametrize("model", ["mlp", "embed_seq", "cnn"])
def test_nan_example_is_dropped(model, ghost_sum):
    # A NaN input: the example's activations are NaN but (through relu's mask)
    # its cotangents may be finite, so only zeroing its operands keeps it out.
    # (Book-keeping zeroes them always for dense and embedding sites, and in a
    # conditional for convolutions.)
    loss, params, data = _model(model)
    if model == "mlp":
        data = {**data, "x": data["x"].at[2, 0].set(jnp.nan)}
    elif model == "cnn":
        data = {**data, "img": data["img"].at[2, 3, 3, 0].set(jnp.nan)}
    else:
        params = {
            **params,
            "emb": params["emb"].at[0, 0].set(jnp.inf),
        }  # token 0 poisons its examples
    grad_fn = clipped_grad(loss, 1.0, method="ghost", ghost_sum=ghost_sum)
    if refuses_backward(ghost_sum, lambda: grad_fn(params, data)):
        return
    g, i = jax.jit(grad_fn)(params, data)
    bad = ~np.isfinite(np.asarray(i.norms))
    assert bad.any() and not bad.all()
    ref, _ = vmap_reference(loss, params, data, 1.0, mask=jnp.asarray(~bad))
    _close(g, ref, 1e-5, 1e-6)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


@pytest.mark.parametrize("products", ["tf32", "tf32x2"])
def test_nan_example_is_dropped_on_tf32_operands(products, monkeypatch):
    # On TF32-rounded operands the convolution's book-kept sum zeroes the dropped examples'
    # rounded copies on every step, with no conditional (counted below, in
    # test_bookkeeping_holds_a_conditional_only_for_convolutions_read_in_place): the NaN
    # example adds nothing, and the step equals the one that masks that example out.
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), products)
    loss, params, data = _model("cnn")
    bad_data = {**data, "img": data["img"].at[2, 3, 3, 0].set(jnp.nan)}
    grad_fn = jax.jit(clipped_grad(loss, 1.0, method="ghost", ghost_sum="bookkeeping"))
    g, i = grad_fn(params, bad_data)
    bad = ~np.isfinite(np.asarray(i.norms))
    assert bad.tolist() == [k == 2 for k in range(B)]
    ref, ref_info = grad_fn(params, data, mask=jnp.asarray(~bad))
    _close(g, ref, 1e-6, 1e-7)
    np.testing.assert_allclose(
        np.asarray(i.norms)[~bad], np.asarray(ref_info.norms)[~bad], rtol=1e-6
    )
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


@pytest.mark.cpu_only(
    reason="counts the conditionals of XLA:CPU's optimized program; other backends' "
    "compilers keep, merge or remove conditionals their own way"
)
@pytest.mark.parametrize(
    "model, products, conditionals",
    [
        ("mlp", "highest", 0),
        ("seq_gram", "highest", 0),
        ("embed_seq", "highest", 0),
        ("cnn", "highest", 1),
        ("mlp", "tf32", 0),
        ("cnn", "tf32", 0),
        ("cnn", "tf32x2", 0),
    ],
)
def test_bookkeeping_holds_a_conditional_only_for_convolutions_read_in_place(
    model, products, conditionals, monkeypatch
):
    # NaN-safe book-keeping zeroes the dropped examples' values in the one sum where that is
    # cheap, and the per-example norms are taken by Blue's algorithm (no overflow
    # conditional). Zeroing a convolution's input read in place is a pass of its own, so there
    # the zeroed sums stay in a branch; on TF32-rounded operands (GPUs' default) the zeroing
    # joins the rounded copy.
    # The small formed rows (biases) are zeroed by a select, not summed one example at a time:
    # no loop over the examples either.
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), products)
    # the step's own norms branch-free as on a GPU (the CPU's default takes the engine's conditional)
    monkeypatch.setitem(_measure.ROW_NORMS, jax.default_backend(), "branch-free")
    loss, params, data = _model(model)
    f = jax.jit(clipped_grad(loss, 1.0, method="ghost", ghost_sum="bookkeeping"))
    text = f.lower(params, data).compile().as_text()
    assert text.count(" conditional(") == conditionals
    assert text.count(" while(") == 0


@pytest.mark.cpu_only(reason="XLA:CPU's reductions: the CPU's default ROW_NORMS")
@pytest.mark.reads_compiled_names  # the compiled program's computations (hlo_program)
@pytest.mark.parametrize("scale", [1.0, 1e22])
def test_cpu_row_norms_take_no_variadic_reduction(scale, monkeypatch):
    # XLA:CPU compiles Blue's three-sum variadic reduction as a scalar loop (the MLP ghost step
    # took a third longer): on the CPU the step's rows are summed plainly, Blue's sums only in
    # the conditional taken when a sum over- or underflowed, and the norms stay right where the
    # squares overflow float32.
    loss, params, data = mlp_setup()
    data = jax.tree.map(lambda x: x * scale if jnp.issubdtype(x.dtype, jnp.floating) else x, data)
    out = {}
    for setting in ("branch-free", "engine"):
        monkeypatch.setitem(_measure.ROW_NORMS, jax.default_backend(), setting)
        f = jax.jit(clipped_grad(loss, 1.0, method="ghost"))
        out[setting] = (
            hp.every_step_variadic_reductions(f.lower(params, data).compile().as_text()),
            f(params, data),
        )
    monkeypatch.undo()
    assert _measure.ROW_NORMS.get("cpu") == "engine"
    assert out["branch-free"][0] > 0 and out["engine"][0] == 0
    norms = [np.asarray(o[1][1].norms) for o in out.values()]
    assert np.all(np.isfinite(norms[1]))
    np.testing.assert_allclose(norms[1], norms[0], rtol=1e-5)
    _close(out["engine"][1][0], out["branch-free"][1][0], 1e-5, 1e-6)


def test_has_aux_and_per_layer():
    loss0, params, data = _model("mlp")

    def loss(p, b):
        out = loss0(p, b)
        return out, {"twice": 2 * out}

    clip = _clip_between_norms(loss0, params, data)
    _, i = _compare(loss, params, data, clip, has_aux=True)
    np.testing.assert_allclose(i.aux["twice"], 2 * i.values, rtol=1e-6)


def test_float64_tight():
    with jax.enable_x64(True):
        loss, params, data = seq_setup(dtype=jnp.float64)
        _compare(
            loss, params, data, _clip_between_norms(loss, params, data), rtol=1e-12, atol=1e-13
        )


def test_extra_args_and_closure_under_jit():
    loss0, params, data = mlp_setup()

    @jax.jit
    def step(p, d, temp):
        def loss(q, b, t):
            return loss0(q, b) * t * temp  # closes over a tracer, takes an extra arg

        return clipped_grad(loss, 1.0, method="ghost")(p, d, 2.0)

    g, i = step(params, data, 0.5)

    def loss_ref(q, b, t):
        return loss0(q, b) * t * 0.5

    ref_g, ref_i = clipped_grad(loss_ref, 1.0, method="vmap")(params, data, 2.0)
    _close(g, ref_g, 1e-5, 1e-6)
    _close(i.norms, ref_i.norms, 1e-5, 1e-6)


def test_auto_and_errors():
    loss, params, data = _model("mlp")
    g, _ = clipped_grad(loss, 1.0, method="auto")(params, data)
    ref, _ = vmap_reference(loss, params, data, 1.0)
    _close(g, ref, 1e-5, 1e-6)
    with pytest.raises(ValueError, match="unknown method"):
        clipped_grad(loss, 1.0, method="magic")
    with pytest.raises(ValueError, match="unknown ghost_sum 'twice'"):
        clipped_grad(loss, 1.0, method="ghost", ghost_sum="twice")
    with pytest.raises(ValueError, match="shape"):
        clipped_grad(lambda p, b: jnp.sum(loss(p, b)), 1.0, method="ghost")(params, data)


def lhs_param_setup(seed=8, batch=B):
    """``W @ x.T`` (the parameter on the left, the batch on axis 1 of the product)."""
    r = np.random.default_rng(seed)
    params = {"w": jnp.asarray(r.normal(size=(3, 4)), jnp.float32)}
    data = {
        "x": jnp.asarray(r.normal(size=(batch, 4)) * _scales(r, batch, 2), jnp.float32),
        "y": jnp.asarray(r.integers(0, 3, size=batch)),
    }

    def loss(p, b):
        return xent(jnp.tanh(p["w"] @ b["x"].T).T, b["y"])

    return loss, params, data


@pytest.mark.parametrize("mode", ["fill", "clip", "index"])
def test_embedding_out_of_range_ids(mode):
    """``table[ids]`` (``mode='index'``) clamps an out-of-range id in the lookup, but its
    gradient (XLA's scatter) drops it: the norms measure the gradient the sum adds (an id
    past the table beside its last row, opposite cotangents, measured 0 for a norm of 3.7)."""
    r = np.random.default_rng(9)
    table = jnp.asarray(r.normal(size=(5, 3)), jnp.float32)
    data = {
        "ids": jnp.array([[0, 1, 7, 1], [2, 9, 2, 3], [4, 4, 4, -1], [4, 5, 1, -9]]),
        "sign": jnp.asarray([[1.0, 1.0, 1.0, 1.0]] * 3 + [[1.0, -1.0, 1.0, 1.0]]),
    }
    w = jnp.asarray([1.0, -2.0, 0.5])

    def loss(p, b):
        ids = b["ids"]
        rows = p[ids] if mode == "index" else jnp.take(p, ids, axis=0, mode=mode)
        return jnp.sum(b["sign"][:, :, None] * rows * w + rows**2, axis=(1, 2))

    assert dict(ghost_report(loss, table, data).ghost) == {"<root>": "embedding"}
    _compare(loss, table, data, 10.0)
    _compare(loss, table, data, 1.0)


def test_param_on_left_and_scan_over_batch():
    loss, params, data = lhs_param_setup()
    assert dict(ghost_report(loss, params, data).ghost) == {"['w']": "dense"}
    _compare(loss, params, data, _clip_between_norms(loss, params, data))

    def mixing(p, b):  # a scan over the batch axis carries state across examples
        c, _ = lax.scan(lambda c, x: (c + jnp.sum(x @ p["w"].T), None), 0.0, b["x"])
        return loss(p, b) + c

    rep = ghost_report(mixing, params, data)
    assert rep.ghost == [] and "mixes examples" in rep.fallback[0][1]


def test_auto_uses_ghost_above_threshold(monkeypatch):
    import gradclip_jax.per_example.ghost as ghost_mod

    loss, params, data = _model("seq_gram")
    clip = _clip_between_norms(loss, params, data)
    ref, _ = vmap_reference(loss, params, data, clip)
    monkeypatch.setattr(ghost_mod, "AUTO_MIN_ELEMENTS", 0)
    g, _ = jax.jit(clipped_grad(loss, clip, method="auto"))(params, data)
    _close(g, ref, 1e-5, 1e-6)


@pytest.mark.slow
def test_flax_model_unchanged():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, tok):
            h = nn.Embed(11, 8)(tok)
            h = nn.gelu(nn.LayerNorm()(nn.Dense(16)(h)))
            h = nn.RMSNorm()(nn.Conv(4, (3,))(h))
            return nn.Dense(3)(jnp.mean(h, axis=1))

    net = Net()
    r = np.random.default_rng(10)
    data = {"tok": jnp.asarray(r.integers(0, 11, (B, 5))), "y": jnp.asarray(r.integers(0, 3, B))}
    params = net.init(jax.random.key(0), data["tok"])

    def loss(p, b):
        return xent(net.apply(p, b["tok"]), b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and len(rep.ghost) == 10
    _compare(loss, params, data, _clip_between_norms(loss, params, data))


def test_equinox_model_unchanged():
    eqx = pytest.importorskip("equinox")

    class Mlp(eqx.Module):
        l1: eqx.nn.Linear
        ln: eqx.nn.LayerNorm
        l2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.l1, self.ln, self.l2 = (
                eqx.nn.Linear(6, 8, key=k1),
                eqx.nn.LayerNorm(8),
                eqx.nn.Linear(8, 3, key=k2),
            )

        def __call__(self, x):
            return self.l2(jnp.tanh(self.ln(self.l1(x))))

    params, static = eqx.partition(Mlp(jax.random.key(1)), eqx.is_inexact_array)
    _, _, data = mlp_setup()

    def loss(p, b):
        return xent(jax.vmap(eqx.combine(p, static))(b["x"]), b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and len(rep.ghost) == 6
    _compare(loss, params, data, _clip_between_norms(loss, params, data))


def _nnx_lm(vocab, d=16, heads=2, seq=6, seed=0):
    """A flax nnx pre-LN transformer block LM whose output projection is the tied embedding."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.att = nnx.MultiHeadAttention(
                num_heads=heads, in_features=d, decode=False, rngs=rngs
            )
            self.ln2 = nnx.RMSNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 2 * d, rngs=rngs)
            self.down = nnx.Linear(2 * d, d, rngs=rngs)

        def __call__(self, h, mask):
            h = h + self.att(self.ln1(h), mask=mask)
            return h + self.down(nnx.gelu(self.up(self.ln2(h))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.block = Block(rngs)
            self.ln = nnx.LayerNorm(d, rngs=rngs)

        def __call__(self, tok):
            h = self.block(self.embed(tok), nnx.make_causal_mask(tok))
            return self.embed.attend(self.ln(h))  # tied input/output embedding

    graphdef, params = nnx.split(LM(nnx.Rngs(seed)), nnx.Param)
    tok = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (B, seq + 1)))
    data = {"x": tok[:, :-1], "y": tok[:, 1:]}

    def loss(p, b):
        logits = nnx.merge(graphdef, p)(b["x"])
        ll = jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], axis=-1)[..., 0]
        return -jnp.mean(ll, axis=-1)

    return loss, params, data


# with the slow tests: these whole-transformer runs are among the longest (each sum mode and each
# tied form is tested above on smaller models in the default suite). Both sum modes run on one
# model: they share its report, clip norm and compiled vmap references.
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("vocab", [13, 64])
def test_flax_nnx_transformer_tied_embedding(vocab):
    # vocab 13: the tied table's per-example gradients are cheaper to form;
    # vocab 64: its norm comes from factors, nothing of shape (B, vocab, d) exists.
    loss, params, data = _nnx_lm(vocab)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    kinds = dict(rep.ghost)
    assert kinds["['embed']['embedding'].value"] == "tied:embedding+dense"
    assert kinds["['block']['att']['query']['kernel'].value"] == "dense"
    clip = _clip_between_norms(loss, params, data)
    for ghost_sum in SUMS:
        _compare(loss, params, data, clip, ghost_sum=ghost_sum)
        _compare(
            loss, params, data, jax.tree.map(lambda _: clip / 3, params), ghost_sum=ghost_sum
        )  # per-layer
        jaxpr = str(
            jax.make_jaxpr(clipped_grad(loss, clip, method="ghost", ghost_sum=ghost_sum))(
                params, data
            )
        )
        assert (f"[{B},{vocab},16]" in jaxpr) == (vocab == 13), ghost_sum


def test_auto_sum_mode_follows_cotangent_share():
    """'auto' keeps the second backward pass where layer outputs are most of the
    activations (an MLP) and book-keeps where they are a small share (norms, attention)."""

    def mode(setup):
        loss, params, data = setup

        def program(ghost_sum):
            return str(
                jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost", ghost_sum=ghost_sum))(
                    params, data
                )
            )

        auto, backward, bookkeeping = program("auto"), program("backward"), program("bookkeeping")
        assert backward != bookkeeping
        return {backward: "backward", bookkeeping: "bookkeeping"}.get(auto)

    loss, params, data = mlp_setup()
    if refuses_backward(
        "backward",
        lambda: clipped_grad(loss, 1.0, method="ghost", ghost_sum="backward")(params, data),
    ):
        pytest.skip(
            "float32 products at reduced precision here: 'auto' always book-keeps "
            "(test_low_precision.py::test_reduced_precision_backend_book_keeps)"
        )
    assert mode(MODELS["seq_materialized"]()) == "backward"
    assert mode(MODELS["layernorm"]()) == "bookkeeping"
    assert mode(_nnx_lm(64)) == "bookkeeping"
    assert mode(MODELS["cnn"]()) == "backward"


def test_weight_shared_twice_cross_terms():
    """One square matrix applied twice: its norm needs the cross term of the two uses."""
    r = np.random.default_rng(11)
    params = {"w": jnp.asarray(r.normal(size=(6, 6)) / 2, jnp.float32)}
    data = {
        "x": jnp.asarray(r.normal(size=(B, 6)) * _scales(r, B, 2), jnp.float32),
        "y": jnp.asarray(r.integers(0, 6, size=B)),
    }

    def loss(p, b):
        return xent(jnp.tanh(b["x"] @ p["w"]) @ p["w"].T, b["y"])

    assert dict(ghost_report(loss, params, data).ghost) == {"['w']": "tied:dense+dense"}
    clip = _clip_between_norms(loss, params, data)
    for gs in SUMS:
        _compare(loss, params, data, clip, ghost_sum=gs)
    jaxpr = str(jax.make_jaxpr(clipped_grad(loss, clip, method="ghost"))(params, data))
    assert f"[{B},6,6]" not in jaxpr  # measured from factors, not per-example gradients


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_batch_matches_single_device():
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    loss, params, data = mlp_setup(batch=16)
    mask = jnp.arange(16) % 3 != 0
    ref, ref_i = vmap_reference(loss, params, data, 0.5, mask=mask)  # compiled (eagerly: op by op)
    grad_fn = clipped_grad(loss, 0.5, method="ghost")
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):  # explicit sharding of the batch axis
        p_rep = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), params)
        d_sh = jax.tree.map(lambda x: jax.sharding.reshard(x, P("x")), data)
        g, i = jax.jit(grad_fn)(p_rep, d_sh, mask=mask)
    _close(g, ref, 1e-5, 1e-6)
    _close(i.norms, ref_i.norms, 1e-5, 1e-6)

    def local(p, d, m):  # shard_map: each device clips its own examples
        g, info = grad_fn(p, d, mask=m)
        return jax.lax.psum(g, "x"), info.norms

    mesh = jax.make_mesh((8,), ("x",))
    f = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x"), P("x")), out_specs=(P(), P("x")))
    )
    g, norms = f(
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(data, NamedSharding(mesh, P("x"))),
        jax.device_put(mask, NamedSharding(mesh, P("x"))),
    )
    _close(g, ref, 1e-5, 1e-6)
    _close(norms, ref_i.norms, 1e-5, 1e-6)


@pytest.mark.parametrize("model", ["seq_materialized", "cnn", "embed_seq", "tied"])
def test_per_layer(model):
    loss, params, data = _model(model)
    clip = _clip_between_norms(loss, params, data)
    mask = jnp.array([True, False, True, True, False, True, True])
    _compare(loss, params, data, clip, per_layer=True, mask=mask)
    _compare(loss, params, data, clip, per_layer="size", microbatch_size=3)
    tree_clip = jax.tree.map(lambda x: clip * (1.0 + 0.1 * x.ndim), params)
    _compare(loss, params, data, tree_clip, normalize=True)


def _shared_component_layer(ratio, zero_sum, seq=32, width=64, seed=0):
    """One dense layer measured in Gram form (2 T^2 < D P) whose output cotangent is the data's
    ``c``: inputs that share a component ``ratio`` times what varies over the positions, and,
    with ``zero_sum``, cotangents that sum to zero over the positions. Returns the ghost norms
    and the exact (float64) norms of the per-example gradients of the stored operands."""
    r = np.random.default_rng(seed)
    x = (r.normal(size=(4, seq, width)) + ratio * r.normal(size=(1, 1, width))).astype(np.float32)
    c = r.normal(size=(4, seq, width))
    c = (c - c.mean(axis=1, keepdims=True) if zero_sum else c).astype(np.float32)
    params = {"w": jnp.asarray(r.normal(size=(width, width)) / 8, jnp.float32)}

    def loss(prm, b):
        return jnp.sum(jnp.einsum("btd,dp->btp", b["x"], prm["w"]) * b["c"], axis=(1, 2))

    assert ghost_report(loss, params, {"x": x[:1], "c": c[:1]}) == ([("['w']", "dense")], [])
    _, info = jax.jit(clipped_grad(loss, 1.0, method="ghost"))(
        params, {"x": jnp.asarray(x), "c": jnp.asarray(c)}
    )
    exact = np.sqrt(
        (np.einsum("btd,btp->bdp", x.astype(np.float64), c.astype(np.float64)) ** 2).sum(
            axis=(1, 2)
        )
    )
    return np.asarray(info.norms, np.float64), exact


@pytest.mark.parametrize("diagonal", ["rows", "gram"])  # "gram": as on GPUs
@pytest.mark.parametrize("ratio", [50.0, 500.0])
def test_gram_norms_cover_cancellation(ratio, diagonal, monkeypatch):
    """A shared input component meeting cotangents that sum to zero over the positions: the plain
    float32 Gram sum came out 5e-5 (50x) and 2e-2 (500x) below the exact norm, so a clipped
    contribution exceeded the clip norm; the norm raised by its rounding bound is not below it,
    whichever way the row norms are read."""
    monkeypatch.setitem(_gram.DIAGONAL_FROM, jax.default_backend(), diagonal)
    ghost, exact = _shared_component_layer(ratio, zero_sum=True)
    assert np.all(ghost >= exact), ghost / exact - 1


@pytest.mark.parametrize("ratio", [0.0, 5.0, 50.0])
def test_gram_norms_raised_little_without_cancellation(ratio):
    """Independent rows, or a shared input component with cotangents that do not cancel: the
    rounding bound raises the norm by little (measured: 5e-6 to 1e-5 relative), and not below the
    exact norm."""
    ghost, exact = _shared_component_layer(ratio, zero_sum=False)
    assert np.all(ghost >= exact) and np.all(ghost <= exact * (1 + 3e-5)), ghost / exact - 1


def _gram_site(x_scale: float, c_scale: float, nan_at=None):
    """A dense layer over 4 positions, ``sum_t <x_t W, c_t>``, measured in Gram form (2 T^2 <
    D P), one example (the sum is its contribution) or three with ``nan_at`` an example whose
    input holds a NaN."""
    r = np.random.default_rng(0)
    b = 1 if nan_at is None else 3
    x = (r.normal(size=(b, 4, 32)) * x_scale).astype(np.float32)
    if nan_at is not None:
        x[nan_at, 0, 0] = np.nan
    c = (r.normal(size=(b, 4, 32)) * c_scale).astype(np.float32)

    def loss(p, batch):
        return jnp.sum((batch["x"] @ p["w"]) * batch["c"], axis=(-1, -2))

    exact = np.sqrt(
        (np.einsum("btd,btp->bdp", x.astype(np.float64), c.astype(np.float64)) ** 2).sum(
            axis=(1, 2)
        )
    )
    return loss, {"w": jnp.zeros((32, 32))}, {"x": jnp.asarray(x), "c": jnp.asarray(c)}, exact


@pytest.mark.parametrize(
    ("x_scale", "c_scale", "clip"),
    [
        (1e19, 1.0, 1.0),  # the activations' Gram overflows: inf - inf
        (1e-30, 1e30, 1e-3),  # one Gram underflows, the other overflows: 0 * inf
        (1e-20, 1.0, 1e-30),  # the activations' Gram underflows to zero
        (3e-21, 1e18, 1e-2),  # it does, while the cotangents' Gram is large
    ],
)
@pytest.mark.parametrize("nan_safe", [True, False])
def test_gram_norms_out_of_range_never_let_an_example_through_unclipped(
    x_scale, c_scale, clip, nan_safe
):
    """The squared Gram norm was NaN where an inner product overflowed, and 0 where the inner
    products underflowed; the square root read both as 0, so the example (norm 6.5e20, or 6e-19
    against a clip norm of 1e-30) was added unclipped. NaN now stays NaN (the example is
    dropped, or the sum is NaN), and the norm is raised by what underflow may have taken off."""
    loss, params, batch, exact = _gram_site(x_scale, c_scale)
    g, info = jax.jit(clipped_grad(loss, clip, method="ghost", nan_safe=nan_safe))(params, batch)
    n = float(np.linalg.norm(np.asarray(g["w"], np.float64)))
    reported = float(info.norms[0])
    if np.isnan(reported):  # not measurable: dropped, or a non-finite sum
        assert n == 0.0 if nan_safe else np.isnan(n)
    else:
        assert reported >= exact[0] and n <= clip * (1 + 1e-6), (reported, exact[0], n)


def test_gram_norm_of_an_example_holding_nan_is_nan_and_the_example_dropped():
    """``nan_safe``: an example whose input holds a NaN is dropped on the Gram path as on the
    vmap path (its norm was reported as 0, the example kept, the sum NaN)."""
    loss, params, batch, _ = _gram_site(1.0, 1.0, nan_at=1)
    g, info = jax.jit(clipped_grad(loss, 1.0, method="ghost"))(params, batch)
    assert np.isnan(info.norms[1]) and np.all(np.isfinite(info.norms[::2]))
    assert np.all(np.isfinite(g["w"]))
    kept = {k: v[::2] for k, v in batch.items()}
    np.testing.assert_allclose(
        g["w"], clipped_grad(loss, 1.0, method="ghost")(params, kept)[0]["w"], rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize(
    "scale", [1.0, 1e20]
)  # 1e20: squares past float32's range, the engine's fallback
def test_global_clipping_measures_small_formed_rows_together(scale, monkeypatch):
    """Global clipping needs only each example's norm over all leaves: the small per-example
    gradients ghost forms (a LayerNorm's scale and bias) are laid side by side and measured as
    one row, one norm standing for both (read out of a stacked result one by one, each leaf's
    norm is a slice XLA compiles as a kernel of its own). Per-layer clipping measures them
    one by one. Either way the result is vmap's, also past float32's range of a sum of squares."""
    from gradclip_jax.per_example.ghost import _strategy

    seen = []
    orig = _strategy.leaf_norms

    def spy(config, *args):
        out = orig(config, *args)
        seen.append((config.per_layer, len(out.joint), len(out.norms)))
        return out

    monkeypatch.setattr(_strategy, "leaf_norms", spy)
    loss0, params, data = layernorm_setup()

    def loss(p, b):
        return scale * loss0(p, b)

    _, info = vmap_reference(loss, params, data, 1.0)
    n = np.sort(np.asarray(info.norms, np.float64))
    assert np.all(np.isfinite(n)) and n[0] > (1e19 if scale > 1 else 0)
    clip = float(np.sqrt(n[B // 2 - 1] * n[B // 2]))  # between two norms: some examples clipped
    _compare(loss, params, data, clip, rtol=2e-5)
    assert seen[-1] == (False, 1, 2)  # scale and bias together; w and head on their own
    _compare(loss, params, data, clip, rtol=2e-5, per_layer=True)
    assert seen[-1] == (True, 0, 4)
