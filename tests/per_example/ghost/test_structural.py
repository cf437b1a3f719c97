"""Ghost clipping through model structure: split/concatenate, layers stacked with
``lax.scan`` / ``flax.linen.scan``, ``jax.checkpoint``, and the fallback warning.
Every case is checked against ``method='vmap'`` (per-example gradients formed)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import GhostFallbackWarning, clipped_grad, ghost_report
from tests._backend import refuses_backward
from tests.per_example.models import vmap_reference, xent

B, T, D, L = 6, 5, 8, 3


def _data(seed=0, classes=4):
    r = np.random.default_rng(seed)
    x = r.normal(size=(B, T, D)) * r.uniform(0.2, 3.0, size=(B, 1, 1))
    return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(r.integers(0, classes, size=B))}


def _w(r, *shape):
    return jnp.asarray(
        r.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1.0), jnp.float32
    )


@functools.cache  # one loss function per setup: the tests of one setup share its vmap program
def block_setup(seed=0, layers=L, layer_scale=1.0):
    """Attention with a fused qkv projection split in three, heads joined by concatenate,
    then ``L`` residual layers stacked on axis 0 and run by ``lax.scan``, each a
    ``jax.checkpoint`` block."""
    r = np.random.default_rng(seed)
    params = {
        "qkv": _w(r, D, 3 * D),
        "o": _w(r, D, D),
        "stack_w": layer_scale * _w(r, layers, D, D),
        "stack_b": 0.1 * _w(r, layers, D),
        "head": _w(r, D, 4),
    }

    def loss(p, b):
        x = b["x"]
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        heads = []
        for h in range(2):  # two heads of width D/2, joined again
            s = slice(h * D // 2, (h + 1) * D // 2)
            att = jax.nn.softmax(
                jnp.einsum("btd,bsd->bts", q[..., s], k[..., s]) / np.sqrt(D / 2), axis=-1
            )
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
    ref, ref_info = vmap_reference(loss, params, data, clip, **kw)
    got, info = jax.jit(clipped_grad(loss, clip, method="ghost", **kw))(params, data)
    _close(info.norms, ref_info.norms)
    _close(got, ref)
    return info


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_split_concat_scan_checkpoint_keep_the_ghost_path(ghost_sum):
    loss, params, data = block_setup()
    if refuses_backward(
        ghost_sum,
        lambda: clipped_grad(loss, 1.0, method="ghost", ghost_sum=ghost_sum)(params, data),
    ):
        return
    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    kinds = dict(rep.ghost)
    assert kinds["['qkv']"] == "dense" and kinds["['o']"] == "dense"
    # the scan over stacked layers stays a loop: each stacked leaf is one site inside it
    assert kinds["['stack_w']"] == "scan:dense"
    assert kinds["['stack_b']"] == "scan:elementwise"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)  # nothing falls back
        info = _compare(
            loss,
            params,
            data,
            clip=float(np.median(np.asarray(vmap_reference(loss, params, data, 1.0)[1].norms))),
            ghost_sum=ghost_sum,
        )
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
            stack = nn.scan(
                Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
            )
            h, _ = stack()(nn.Dense(D)(x), None)
            return nn.Dense(4)(jnp.mean(h, axis=1))

    model, data = Model(), _data(seed=2)
    params = model.init(jax.random.key(0), data["x"][:1])

    def loss(p, b):
        return xent(model.apply(p, b["x"]), b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    assert any(kind == "scan:dense" for _, kind in rep.ghost)
    _compare(loss, params, data, clip=0.5)


def test_long_scan_over_stacked_layers_keeps_the_ghost_path():
    # more layers than MAX_UNROLL: the loop is measured inside, not unrolled; small weights keep
    # 129 residual layers finite
    loss, params, data = block_setup(seed=3, layers=129, layer_scale=0.05)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost)["['stack_w']"] == "scan:dense"
    _compare(loss, params, data, clip=0.7)


def _shared_weight_rnn(steps):
    """A recurrent layer: one weight read by every step of a scan over time (a constant of the loop)."""
    r = np.random.default_rng(4)
    params = {"w": 0.5 * _w(r, D, D), "head": _w(r, D, 4)}

    def loss(p, b):
        h, _ = jax.lax.scan(
            lambda h, x: (jnp.tanh(h @ p["w"] + x), None),
            b["x"][:, 0],
            jnp.swapaxes(b["x"], 0, 1)[:steps],
        )
        return xent(h @ p["head"], b["y"])

    return loss, params, _data(4)


@pytest.mark.parametrize("steps", [T, 129])
def test_shared_weight_scan_is_unrolled_when_short_and_falls_back_with_a_warning_when_long(steps):
    loss, params, data = _shared_weight_rnn(steps)
    if steps > 128:  # repeat the time axis past MAX_UNROLL
        data = {**data, "x": jnp.tile(data["x"], (1, -(-steps // T), 1))[:, :steps]}
    rep = ghost_report(loss, params, data)
    if steps <= 128:
        assert rep.fallback == [] and dict(rep.ghost)["['w']"].startswith("tied:")
    else:
        reasons = dict(rep.fallback)
        assert set(reasons) == {"['w']"} and "MAX_UNROLL=128" in reasons["['w']"]
        fn = clipped_grad(loss, 1.0, method="ghost")
        # traced, as a jitted step calls it (eagerly each of the fallback's operations compiles
        # alone): the warning comes from the trace
        with pytest.warns(GhostFallbackWarning, match=r"1 of 2 parameter leaves.*\['w'\].*'scan'"):
            jax.eval_shape(fn, params, data)
        with warnings.catch_warnings():
            warnings.simplefilter("error", GhostFallbackWarning)
            jax.eval_shape(fn, params, data)  # told once
    _compare(loss, params, data, clip=0.7)  # the fallback is exact too


def test_overlapping_slices_are_measured_and_unsupported_uses_fall_back_exactly():
    r = np.random.default_rng(4)
    params = {"w_overlap": _w(r, D, D), "w_sin": _w(r, D, 4)}

    def loss(p, b):
        h = (
            b["x"] @ p["w_overlap"][:, :6]
            + jnp.pad(b["x"] @ p["w_overlap"][:, 2:], ((0, 0), (0, 0), (2, 0)))[..., :6]
        )
        return xent(jnp.mean(h[..., : D // 2] @ jnp.sin(p["w_sin"][:4]), axis=1), b["y"])

    data = _data(seed=4)
    report = ghost_report(loss, params, data)
    reasons = dict(report.fallback)
    # overlapping slices: the per-example gradients of their uses, pulled back through each slice, added
    assert dict(report.ghost)["['w_overlap']"] == "tied:dense+dense"
    assert "'sin'" in reasons["['w_sin']"]
    with pytest.warns(GhostFallbackWarning, match=r"\['w_sin'\] \(used by 'sin'"):
        jax.eval_shape(clipped_grad(loss, 1.0, method="ghost"), params, data)  # warned when traced
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
        q, k, v = (
            a.reshape(*a.shape[:2], heads, D // heads) for a in jnp.split(x @ p["qkv"], 3, axis=-1)
        )
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(x.shape)
        return xent(jnp.mean(jax.nn.relu(att @ p["o"]), axis=1) @ p["head"], b["y"])

    data = _data(seed=6)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost) == {
        "['qkv']": "dense",
        "['o']": "dense",
        "['head']": "dense",
    }
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
    if refuses_backward(
        ghost_sum,
        lambda: clipped_grad(loss, 0.3, method="ghost", ghost_sum=ghost_sum)(params, data),
    ):
        return
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
    data = {
        "ids": jnp.asarray(r.integers(0, 11, size=(B, T))),
        "y": jnp.asarray(r.integers(0, 4, size=B)),
    }

    def loss(p, b):
        return xent(nnx.merge(graphdef, p)(b["ids"]), b["y"])

    rep = ghost_report(loss, params, data)
    assert rep.fallback == [], rep.fallback
    _compare(loss, params, data, clip=0.3)


def _fused_weight_setup(seed=7):
    r = np.random.default_rng(seed)
    return {"qkv": _w(r, D, 3 * D), "head": _w(r, D, 4)}


@pytest.mark.parametrize("how", ["split", "dynamic_slice", "dynamic_slice_clamped"])
def test_a_split_or_sliced_fused_weight_keeps_the_ghost_path(how):
    """A fused q/k/v *weight* cut in three (jnp.split, or lax.dynamic_slice at offsets known
    while tracing, which clamps as XLA does) is three blocks of one leaf, as ``W[:, :d]`` is."""

    def loss(p, b):
        w = p["qkv"]
        if how == "split":
            wq, wk, wv = jnp.split(w, 3, axis=-1)
        else:
            last = 2 * D + (5 if how == "dynamic_slice_clamped" else 0)  # clamped back to 2D
            wq, wk, wv = (jax.lax.dynamic_slice(w, (0, s), (D, D)) for s in (0, D, last))
        x = b["x"]
        att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", x @ wq, x @ wk), axis=-1)
        return xent(jnp.mean(jnp.einsum("bts,bsd->btd", att, x @ wv), axis=1) @ p["head"], b["y"])

    params, data = _fused_weight_setup(), _data(3)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    assert dict(rep.ghost)["['qkv']"] == "stacked:dense+dense+dense"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)
        _compare(loss, params, data, clip=0.5)


def test_dead_code_does_not_send_a_leaf_to_the_fallback():
    """A leftover product whose result is never used is not a use of the leaf."""
    params, data = _fused_weight_setup(), _data(4)

    def loss(p, b):
        _unused = b["x"] @ p["qkv"]  # overlaps every slice below, but feeds nothing
        w = p["qkv"]
        h = jnp.tanh(b["x"] @ w[:, :D]) * (b["x"] @ w[:, D : 2 * D]) + b["x"] @ w[:, 2 * D :]
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    assert ghost_report(loss, params, data).fallback == []
    _compare(loss, params, data, clip=0.5)


def test_equinox_embedding_lookup_under_vmap():
    """``eqx.nn.Embedding`` indexes ``W[i]`` per token under vmap: a gather whose index
    vectors hold ``(i, 0)`` and which keeps a size-1 row axis, still a row lookup (also tied)."""
    eqx = pytest.importorskip("equinox")
    vocab = 11
    emb = eqx.nn.Embedding(vocab, D, key=jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(5).integers(0, vocab, size=(B, T)), jnp.int32)

    def plain(p, i):
        return jax.vmap(lambda r: jnp.sum(jnp.tanh(jax.vmap(p)(r)) ** 2))(i)

    def tied(p, i):
        h = jax.vmap(jax.vmap(p))(i)
        return jnp.sum(jax.nn.log_softmax(h @ p.weight.T), axis=(1, 2))

    for loss, kind in ((plain, "embedding"), (tied, "tied:embedding+dense")):
        assert ghost_report(loss, emb, ids).ghost == [(".weight", kind)]
        _compare(loss, emb, ids, clip=0.3)


def test_fft_and_flip_of_features_keep_the_ghost_path_and_flipping_the_batch_raises():
    params, data = _fused_weight_setup(), _data(6)

    def features(p, b):
        h = (
            jnp.abs(jnp.fft.rfft(b["x"] @ p["qkv"][:, :D], axis=-1))
            + jnp.flip(b["x"], axis=-1)[..., :5]
        )
        return jnp.sum(h**2, axis=(1, 2)) + xent(jnp.mean(b["x"], axis=1) @ p["head"], b["y"])

    assert ghost_report(features, params, data).fallback == []
    _compare(features, params, data, clip=0.5)

    def pairs(p, b):  # example i meets example B-1-i: not a per-example loss
        h = b["x"] @ p["qkv"][:, :D]
        return jnp.sum(h * h[::-1], axis=(1, 2))

    for method in ("ghost", "vmap"):
        with pytest.raises(ValueError, match="combines examples at 'rev'"):
            clipped_grad(pairs, 1.0, method=method)(params, data)


def test_each_clipped_grad_function_warns_once_from_the_users_line():
    """Not repeated by one function (eagerly, jitted, per call with a key argument), but given
    again by a second function whose message is the same; attributed to the caller's line."""
    params, data = _fused_weight_setup(), _data(8)

    def loss(p, b, key=None):
        return xent(jnp.mean(b["x"] @ jnp.sin(p["qkv"][:, :D]), axis=1) @ p["head"], b["y"])

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f = clipped_grad(loss, 1.0, method="ghost")
        f(params, data)
        jax.jit(f)(params, data)
        clipped_grad(loss, 1.0, method="ghost")(params, data)
        k = clipped_grad(loss, 1.0, method="ghost", prng_argnum=2)
        k(params, data, jax.random.key(0))
        k(params, data, jax.random.key(1))
    ours = [w for w in seen if issubclass(w.category, GhostFallbackWarning)]
    assert len(ours) == 3
    assert all(w.filename == __file__ for w in ours)
    assert all("['qkv'] (used by 'sin'" in str(w.message) for w in ours)


def test_fallback_reasons_say_why_for_long_scans_and_custom_derivatives():
    def scanned(
        p, b
    ):  # a stacked leaf reshaped before the loop: not one layer per step of the leaf itself
        h, _ = jax.lax.scan(
            lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["stack"].reshape(130, D, D)
        )
        return jnp.sum(h, axis=(1, 2))

    rep = ghost_report(scanned, {"stack": jnp.zeros((130 * D, D))}, _data())
    assert "MAX_UNROLL=128" in rep.fallback[0][1]

    @jax.custom_vjp
    def dense(x, w):
        return x @ w

    dense.defvjp(
        lambda x, w: (x @ w, (x, w)),
        lambda r, g: (g @ r[1].T, jnp.einsum("...i,...j->ij", r[0], g)),
    )
    rep = ghost_report(
        lambda p, b: jnp.sum(dense(b["x"], p["w"]), axis=(1, 2)), {"w": jnp.zeros((D, D))}, _data()
    )
    assert "custom derivative" in rep.fallback[0][1]


def test_flattened_cross_entropy_keeps_the_ghost_path():
    """``logits.reshape(-1, V)`` merges each example's positions into one axis (its rows stay
    one contiguous run per example): followed, and regrouped to ``(B, T)`` it is per-example
    again. Regrouping the rows any other way mixes examples and is not followed."""
    optax = pytest.importorskip("optax")
    r = np.random.default_rng(9)
    params = {"w": _w(r, D, D), "o": _w(r, D, 4)}
    data = _data(9)

    def flat_xent(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, 4), y.reshape(-1))

    def loss(p, b):
        logits = jnp.tanh(b["x"] @ p["w"]) @ p["o"]
        return (
            flat_xent(logits, jnp.broadcast_to(b["y"][:, None], b["x"].shape[:2]))
            .reshape(-1, T)
            .mean(-1)
        )

    assert ghost_report(loss, params, data).fallback == []
    _compare(loss, params, data, clip=0.3)

    def regrouped(p, b):  # (B*T,) -> (T, B) -> mean over T rows: row b no longer one example
        logits = jnp.tanh(b["x"] @ p["w"]) @ p["o"]
        ys = jnp.broadcast_to(b["y"][:, None], b["x"].shape[:2])
        return flat_xent(logits, ys).reshape(T, -1).mean(0)

    assert ghost_report(regrouped, params, data).ghost == []

    def batch_mean(p, b):  # every token of every example in one mean: not a per-example loss
        logits = jnp.tanh(b["x"] @ p["w"]) @ p["o"]
        ys = jnp.broadcast_to(b["y"][:, None], b["x"].shape[:2])
        return jnp.zeros(b["x"].shape[0]) + flat_xent(logits, ys).mean()

    for method in ("ghost", "vmap"):
        with pytest.raises(ValueError, match="combines examples at 'reduce_sum'"):
            clipped_grad(batch_mean, 1.0, method=method)(params, data)

    def merged_twice(p, b):  # (B, T, D) -> (B*T*D,) -> (B*T, D) -> (B, T*D): per example throughout
        h = jnp.tanh(b["x"] @ p["w"]).reshape(-1).reshape(-1, D)
        return jnp.sum(jnp.sin(h).reshape(b["x"].shape[0], -1), axis=1)

    assert ghost_report(merged_twice, params, data).fallback == []
    _compare(merged_twice, {"w": params["w"]}, data, clip=0.3)


@functools.cache  # one loss function: both sum modes share its vmap programs
def _flattened_tokens_setup():
    """Dense and bias layers on the batch's tokens merged into one axis, the weight used twice."""
    r = np.random.default_rng(10)
    params = {
        "w": _w(r, D, D),
        "b": 0.1 * _w(r, D),
        "s": jnp.asarray(1.3, jnp.float32),
        "head": _w(r, D, 4),
    }
    data = _data(10)

    def loss(p, b):
        h = jnp.tanh(b["x"].reshape(-1, D) @ p["w"] + p["b"]) * p["s"]
        back = (h @ p["w"].T).reshape(-1, T, D)  # the same weight again: tied
        return xent(jnp.mean(back, axis=1) @ p["head"], b["y"])

    return loss, params, data


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_layers_on_flattened_tokens_keep_the_ghost_path(ghost_sum):
    """``x.reshape(-1, d) @ w + b`` on every token of the batch at once: dense and bias sites on a
    merged batch (each example's rows regrouped as positions), tied too; a dropped example that
    holds NaN contributes nothing."""
    loss, params, data = _flattened_tokens_setup()
    kinds = dict(ghost_report(loss, params, data).ghost)
    assert kinds == {
        "['w']": "tied:dense+dense",
        "['b']": "elementwise",
        "['s']": "elementwise",
        "['head']": "dense",
    }
    if refuses_backward(
        ghost_sum,
        lambda: clipped_grad(loss, 0.5, method="ghost", ghost_sum=ghost_sum)(params, data),
    ):
        return
    _compare(loss, params, data, clip=0.5, ghost_sum=ghost_sum)
    mask = jnp.arange(B) != 2
    bad = {**data, "x": data["x"].at[2].set(jnp.nan)}
    ref, _ = vmap_reference(loss, params, bad, 0.5, mask=mask)
    got, _ = clipped_grad(loss, 0.5, method="ghost", ghost_sum=ghost_sum)(params, bad, mask=mask)
    _close(got, ref)


@pytest.mark.parametrize("how", ["tile", "broadcast_to"])
def test_class_token_joined_to_the_patches_keeps_the_ghost_path(how):
    """A ViT's class token, copied to every example (``jnp.tile`` as in the reference ViT, or
    ``broadcast_to``) and concatenated before the tokens: a ``concatenate`` site whose per-example
    gradient is that example's slice of the cotangent (no per-example forward/backward pass)."""
    r = np.random.default_rng(11)
    params = {"cls": _w(r, 1, 1, D), "w": _w(r, D, D), "head": _w(r, D, 4)}
    data = _data(11)

    def loss(p, b):
        x = b["x"]
        n = x.shape[0]
        cls = (
            jnp.tile(p["cls"], (n, 1, 1))
            if how == "tile"
            else jnp.broadcast_to(p["cls"], (n, 1, D))
        )
        h = jnp.tanh(jnp.concatenate([cls, x], axis=1) @ p["w"])
        return xent(h[:, 0] @ p["head"], b["y"])

    assert dict(ghost_report(loss, params, data).ghost)["['cls']"] == "concatenate"
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)
        _compare(loss, params, data, clip=0.5)
    mask = jnp.arange(B) != 1
    bad = {**data, "x": data["x"].at[1].set(jnp.inf)}
    ref, _ = vmap_reference(loss, params, bad, 0.5, mask=mask)
    got, _ = clipped_grad(loss, 0.5, method="ghost")(params, bad, mask=mask)
    _close(got, ref)
