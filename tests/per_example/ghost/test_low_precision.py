"""Ghost clipping of 16-bit (bfloat16, float16) models: the ghost path is taken, norms
accumulate in float32, the clipped sum is book-kept in float32, and each example's
clipped contribution stays within the clip norm."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import GhostFallbackWarning, clipped_grad, ghost_report
from tests._backend import backend_default_precision, library_default_products, refuses_backward
from tests.jaxprs import equations
from tests.per_example.models import B, cnn_setup, mlp_setup, xent

# Unit roundoff of each 16-bit dtype.
U16 = {"bfloat16": 2.0**-9, "float16": 2.0**-12}
DTYPES = [jnp.bfloat16, jnp.float16]

# ----------------------------------------------------------------------------
# Models: parameters in `dt`, activations in the parameters' dtype, the loss
# head in float32 (as mixed-precision training does); `dt=float32` is the reference.
# ----------------------------------------------------------------------------


def _arrays(params, data, dt):
    cast = lambda x: jnp.asarray(x, dt)  # noqa: E731
    return jax.tree.map(cast, params), jax.tree.map(jnp.asarray, data)


def mlp16(dt, seed=0, batch=B):
    r = np.random.default_rng(seed)
    params = {
        "l1": {"w": r.normal(size=(6, 16)) / 2, "b": r.normal(size=16) * 0.1},
        "l2": {"w": r.normal(size=(16, 3)) / 4, "b": np.zeros(3)},
    }
    data = {
        "x": r.normal(size=(batch, 6)) * r.uniform(0.3, 3.0, size=(batch, 1)),
        "y": r.integers(0, 3, size=batch),
    }

    def loss(p, b):
        h = jnp.tanh(b["x"].astype(p["l1"]["w"].dtype) @ p["l1"]["w"] + p["l1"]["b"])
        return xent((h @ p["l2"]["w"] + p["l2"]["b"]).astype(jnp.float32), b["y"])

    return (loss, *_arrays(params, data, dt))


def lm16(dt, seed=3, batch=B, vocab=64, d=16, seq=6):
    """A pre-LN transformer block LM: tied token embedding (lookup and output projection,
    measured from factors), position embedding, fused qkv, layer norms, gelu MLP."""
    r = np.random.default_rng(seed)

    def dense(n_in, n_out):
        return r.normal(size=(n_in, n_out)) / np.sqrt(n_in)

    def norm():
        return {"scale": 1 + 0.1 * r.normal(size=d), "bias": 0.1 * r.normal(size=d)}

    params = {
        "wte": r.normal(size=(vocab, d)) * 0.5,
        "wpe": r.normal(size=(seq, d)) * 0.1,
        "ln1": norm(),
        "ln2": norm(),
        "lnf": norm(),
        "qkv": dense(d, 3 * d),
        "proj": dense(d, d),
        "up": dense(d, 2 * d),
        "up_b": 0.1 * r.normal(size=2 * d),
        "down": dense(2 * d, d),
    }
    tok = r.integers(0, vocab, size=(batch, seq + 1))
    data = {"x": tok[:, :-1], "y": tok[:, 1:]}

    def ln(h, p):  # statistics in float32, normalized values back in the activation dtype
        h32 = h.astype(jnp.float32)
        z = (h32 - jnp.mean(h32, -1, keepdims=True)) * lax.rsqrt(
            jnp.var(h32, -1, keepdims=True) + 1e-5
        )
        return z.astype(h.dtype) * p["scale"] + p["bias"]

    def loss(p, b):
        h = p["wte"][b["x"]] + p["wpe"][jnp.arange(seq)]
        q, k, v = jnp.split(ln(h, p["ln1"]) @ p["qkv"], 3, axis=-1)
        s = jnp.einsum("btd,bsd->bts", q, k).astype(jnp.float32) / np.sqrt(d)
        s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -1e9)
        h = (
            h
            + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1).astype(h.dtype), v) @ p["proj"]
        )
        h = h + jax.nn.gelu(ln(h, p["ln2"]) @ p["up"] + p["up_b"]) @ p["down"]
        logits = (ln(h, p["lnf"]) @ p["wte"].T).astype(jnp.float32)
        ll = jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], axis=-1)[..., 0]
        return -jnp.mean(ll, axis=-1)

    return (loss, *_arrays(params, data, dt))


def cnn16(dt, seed=2, batch=B):
    r = np.random.default_rng(seed)
    params = {
        "conv": r.normal(size=(3, 3, 2, 4)) * 0.4,
        "conv_b": r.normal(size=4) * 0.1,
        "dense": r.normal(size=(4, 3)),
    }
    data = {
        "img": r.normal(size=(batch, 8, 8, 2)) * r.uniform(0.3, 3.0, size=(batch, 1, 1, 1)),
        "y": r.integers(0, 3, size=batch),
    }

    def loss(p, b):
        h = lax.conv_general_dilated(
            b["img"].astype(p["conv"].dtype),
            p["conv"],
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        h = jax.nn.relu(h + p["conv_b"])
        return xent((jnp.mean(h, axis=(1, 2)) @ p["dense"]).astype(jnp.float32), b["y"])

    return (loss, *_arrays(params, data, dt))


MODELS = {"mlp": mlp16, "transformer": lm16, "cnn": cnn16}
# A per-example gradient the vmap path forms and the ghost path never does (the largest dense weight,
# measured by ||a|| ||g||, the Gram form, or from factors for the tied table).
NOT_FORMED = {"mlp": f"[{B},6,16]", "transformer": f"[{B},64,16]", "cnn": f"[{B},4,3]"}
CASES = [(m, dt) for m in sorted(MODELS) for dt in DTYPES]
IDS = [f"{m}-{np.dtype(dt).name}" for m, dt in CASES]

# ----------------------------------------------------------------------------
# Helpers: one compiled function per model, dtype and method (the clip norm and
# the mask are arguments), shared by the tests of a worker
# ----------------------------------------------------------------------------


@functools.cache
def _fn(model, dt, method):
    loss = MODELS[model](dt)[0]

    def run(params, data, mask, clip):
        return clipped_grad(loss, clip, method=method)(params, data, mask=mask)

    return jax.jit(run)


@functools.cache
def _clip(model):
    """The median per-example norm of the float32 model."""
    _, params, data = MODELS[model](jnp.float32)
    _, info = _fn(model, jnp.float32, "vmap")(params, data, jnp.ones(B, bool), 1.0)
    return float(np.median(np.asarray(info.norms)))


def _norm64(tree):
    return float(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    )


def _dist64(a, b):
    return _norm64(
        jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)
    )


def _budget(norms, clip):
    """:math:`\\sum_b \\min(\\|G_b\\|, C)`: the total norm of the clipped contributions."""
    return float(np.sum(np.minimum(np.asarray(norms, np.float64), clip)))


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "dt"), CASES, ids=IDS)
def test_ghost_path_is_taken(model, dt):
    loss, params, data = MODELS[model](dt)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and len(rep.ghost) == len(jax.tree.leaves(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GhostFallbackWarning)
        ghost = str(jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost"))(params, data))
    vmap = str(jax.make_jaxpr(clipped_grad(loss, 1.0, method="vmap"))(params, data))
    assert NOT_FORMED[model] in vmap and NOT_FORMED[model] not in ghost


# the float16 transformer (10 s) runs with the long tests: bfloat16's case covers the same code
_SUM_CASES = [
    pytest.param(m, dt, marks=pytest.mark.slow)
    if (m, np.dtype(dt)) == ("transformer", np.float16)
    else (m, dt)
    for m, dt in CASES
]


@pytest.mark.parametrize(("model", "dt"), _SUM_CASES, ids=IDS)
def test_norms_and_sums(model, dt):
    """Norms within 1e-2 of the float32 model's; sums and dtypes as the vmap path on the same model."""
    _, params, data = MODELS[model](dt)
    _, p32, _ = MODELS[model](jnp.float32)
    clip, everyone = _clip(model), jnp.ones(B, bool)
    g, info = _fn(model, dt, "ghost")(params, data, everyone, clip)
    g_vmap, info_vmap = _fn(model, dt, "vmap")(params, data, everyone, clip)
    _, info32 = _fn(model, jnp.float32, "vmap")(p32, data, everyone, clip)
    assert (
        [x.dtype for x in jax.tree.leaves(g)]
        == [x.dtype for x in jax.tree.leaves(g_vmap)]
        == ([jnp.float32] * len(jax.tree.leaves(params)))
    )
    assert info.norms.dtype == info_vmap.norms.dtype == jnp.float32
    # The gap to float32 is the 16-bit model's own (the vmap path's norms show the same gap).
    np.testing.assert_allclose(info.norms, info32.norms, rtol=1e-2)
    # Both paths differentiate the same 16-bit model: the ghost path forms a_b^T g_b in float32
    # from the 16-bit operands and cotangents; the vmap path rounds each per-example gradient
    # (and its per-example backward pass) in 16 bits. So norms differ by a few units of
    # roundoff u, and the sums by a few u of each clipped contribution: at most
    # 8 u sum_b min(||G_b||, C) (measured: below 1.2 u on these models).
    u = U16[np.dtype(dt).name]
    np.testing.assert_allclose(info.norms, info_vmap.norms, rtol=16 * u)
    assert int(info.num_clipped) == int(info_vmap.num_clipped)
    assert _dist64(g, g_vmap) <= 8 * u * _budget(info_vmap.norms, clip)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize(("model", "least"), [("transformer", 8), ("cnn", 2)])
def test_16bit_layers_are_measured_on_their_own_values(model, least, dt):
    """A 16-bit layer's per-example products multiply its 16-bit activations and cotangents as
    they are (their products are exact in float32) into float32: no widened copy of either, and
    on a GPU 16-bit tensor cores. Every dense layer of the transformer block (qkv, proj, up,
    down) is in Gram form (T = 6), two Grams each; the convolution's taps and cotangent are
    multiplied the same way."""
    loss, params, data = MODELS[model](dt)
    jaxpr = jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost"))(params, data).jaxpr
    products = [
        e
        for e in equations(jaxpr)
        if e.primitive is lax.dot_general_p
        and all(v.aval.dtype == dt for v in e.invars)
        and e.params["preferred_element_type"] == jnp.float32
    ]
    assert len(products) >= least


@pytest.mark.parametrize("dt", DTYPES)
def test_a_16bit_tied_table_is_measured_on_its_own_values(dt):
    """The tied table's norm from factors takes Grams of the lookup's cotangents with themselves
    and with the head's activations: 16-bit values as they are, as for every other Gram of the
    16-bit transformer (none multiplies a float32 copy)."""
    loss, params, data = MODELS["transformer"](dt)
    jaxpr = jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost"))(params, data).jaxpr
    grams = [
        e
        for e in equations(jaxpr)
        if e.primitive is lax.dot_general_p and e.outvars[0].aval.shape == (B, 6, 6)
    ]  # (B, T, T): the model's attention and ghost's Grams
    assert len(grams) >= 12 and all(v.aval.dtype == dt for e in grams for v in e.invars)


@pytest.mark.parametrize(("model", "dt"), CASES, ids=IDS)
def test_clipped_contribution_within_clip_norm(model, dt):
    """One example at a time (the others masked out), clipped hard: the float32 sum has norm <= C."""
    _, params, data = MODELS[model](dt)
    clip = 1e-3 * _clip(model)
    for i in range(B):
        g, info = _fn(model, dt, "ghost")(params, data, jnp.arange(B) == i, clip)
        assert int(info.num_clipped) == 1
        assert _norm64(g) <= clip


@pytest.mark.parametrize("dt", DTYPES)
def test_explicit_backward_is_an_error(dt):
    loss, params, data = mlp16(dt)
    name = np.dtype(dt).name
    with pytest.raises(
        ValueError,
        match=rf"ghost_sum='backward'.*\['l1'\]\['b'\] is {name}.*'bookkeeping' or 'auto'",
    ):
        clipped_grad(loss, 1.0, method="ghost", ghost_sum="backward")(params, data)
    with pytest.raises(
        ValueError, match="ghost_sum='backward'"
    ):  # 'auto' too: the choice must not depend on size
        clipped_grad(loss, 1.0, method="auto", ghost_sum="backward")(params, data)
    programs = {
        gs: str(jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost", ghost_sum=gs))(params, data))
        for gs in ("auto", "bookkeeping")
    }
    assert programs["auto"] == programs["bookkeeping"]
    jax.make_jaxpr(clipped_grad(loss, 1.0, method="vmap", ghost_sum="backward"))(
        params, data
    )  # ignored by vmap
    # per-layer clipping always book-keeps: nothing to refuse
    jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost", ghost_sum="backward", per_layer=True))(
        params, data
    )


def test_float32_params_with_bfloat16_activations():
    """Mixed precision (float32 master weights cast to bfloat16 inside the loss): a second
    backward pass would carry the reweighted cotangents in bfloat16, so 'auto' book-keeps
    and 'backward' is refused, naming the first bfloat16 operation."""
    loss16, params, data = lm16(jnp.float32)

    def loss(p, b):
        return loss16(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), b)

    with pytest.raises(
        ValueError, match=r"computes bfloat16 values .*first at 'convert_element_type'"
    ):
        clipped_grad(loss, 1.0, method="ghost", ghost_sum="backward")(params, data)
    auto = str(jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost"))(params, data))
    assert auto == str(
        jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost", ghost_sum="bookkeeping"))(
            params, data
        )
    )

    def run(method):
        return jax.jit(lambda p, d, m, c: clipped_grad(loss, c, method=method)(p, d, mask=m))

    ghost, vmap = run("ghost"), run("vmap")
    clip, everyone = _clip("transformer"), jnp.ones(B, bool)
    g, _ = ghost(params, data, everyone, clip)
    g_vmap, info_vmap = vmap(params, data, everyone, clip)
    assert _dist64(g, g_vmap) <= 8 * U16["bfloat16"] * _budget(info_vmap.norms, clip)
    for i in range(B):
        assert _norm64(ghost(params, data, jnp.arange(B) == i, 1e-3 * clip)[0]) <= 1e-3 * clip


def test_nan_example_microbatches_per_layer():
    """A dropped NaN example contributes exactly zero (book-keeping with its rows zeroed),
    also in microbatches and with per-layer clipping; the rest agrees with the vmap path."""
    loss, params, data = mlp16(jnp.bfloat16)
    bad = {**data, "x": data["x"].at[2].set(jnp.nan)}
    mask = jnp.array([True, True, True, False, True, False, True])
    keep = mask & (jnp.arange(B) != 2)
    clip = _clip("mlp")
    for kw in ({}, {"microbatch_size": 3, "per_layer": True}):
        g, info = jax.jit(clipped_grad(loss, clip, method="ghost", **kw))(params, bad, mask=mask)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
        assert not np.isfinite(np.asarray(jax.tree.leaves(info.norms)[0])[2])
        g_vmap, info_vmap = jax.jit(clipped_grad(loss, clip, method="vmap", **kw))(
            params, data, mask=keep
        )
        # per-layer: each example's contribution is within C too
        budget = _budget(info_vmap.norms, clip) if not kw else float(B * clip)
        assert _dist64(g, g_vmap) <= 8 * U16["bfloat16"] * budget


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.slow  # a whole model (or 8 devices): long to compile on 2 cores
def test_nan_example_sharded_batch():
    """The zeroing of dropped examples' rows under an explicitly sharded batch axis."""
    from jax.sharding import AxisType, PartitionSpec as P

    loss, params, data = mlp16(jnp.bfloat16, batch=16)
    bad = {**data, "x": data["x"].at[2].set(jnp.nan)}
    mask = jnp.arange(16) % 3 != 1
    g_vmap, info_vmap = jax.jit(clipped_grad(loss, 1.0, method="vmap"))(
        params, data, mask=mask & (jnp.arange(16) != 2)
    )
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        p_rep = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), params)
        d_sh = jax.tree.map(lambda x: jax.sharding.reshard(x, P("x")), bad)
        g, info = jax.jit(clipped_grad(loss, 1.0, method="ghost"))(p_rep, d_sh, mask=mask)
    assert not np.isfinite(np.asarray(info.norms)[2])
    assert _dist64(g, g_vmap) <= 8 * U16["bfloat16"] * _budget(info_vmap.norms, 1.0)


def test_reduced_precision_backend_book_keeps(monkeypatch):
    """Where float32 products default to TF32/bf16 passes (GPU, TPU), a second backward pass
    would multiply at that precision: 'auto' book-keeps (at full precision) and an explicit
    'backward' is refused, unless jax_default_matmul_precision asks for float32."""
    loss, params, data = cnn_setup()

    def jaxpr(ghost_sum):
        return str(
            jax.make_jaxpr(clipped_grad(loss, 0.5, method="ghost", ghost_sum=ghost_sum))(
                params, data
            )
        )

    with jax.default_matmul_precision("float32"):  # full-precision products (a CPU's), any backend
        full = {g: jaxpr(g) for g in ("auto", "backward", "bookkeeping")}
    assert full["auto"] == full["backward"] != full["bookkeeping"]  # a CNN: the second pass
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # on a GPU: what it is
    with backend_default_precision():
        with library_default_products():  # 'tf32': the norms measure TF32-rounded operands
            assert jaxpr("auto") == jaxpr("bookkeeping")
            with pytest.raises(
                ValueError, match=r"ghost_sum='backward'.*PRODUCT_PRECISION is 'tf32'"
            ):
                jaxpr("backward")
        with library_default_products("highest"):  # products at HIGHEST: the model's TF32 remains
            assert jaxpr("auto") == jaxpr("bookkeeping")
            with pytest.raises(
                ValueError, match=r"ghost_sum='backward'.*gpu backend.*jax_default_matmul_precision"
            ):
                jaxpr("backward")
    with jax.default_matmul_precision("float32"), library_default_products("highest"):
        jaxpr("backward")  # full-precision products, HIGHEST norms: the second pass is allowed


@pytest.mark.parametrize("setup", [mlp_setup, cnn_setup], ids=["mlp", "cnn"])
def test_the_backends_default_precision(setup):
    """What a user's float32 step gets on this backend, at its default precision (TF32
    products on NVIDIA GPUs): 'auto' keeps each example's clipped contribution within the
    clip norm, and an explicit 'backward' runs on a CPU and is refused where products are
    reduced (the library's rule: not on a CPU)."""
    loss, params, data = setup()
    with backend_default_precision(), library_default_products():
        refused = refuses_backward(
            "backward",
            lambda: clipped_grad(loss, 1.0, method="ghost", ghost_sum="backward")(params, data),
        )
        assert refused == (jax.default_backend() != "cpu")
        if not refused:
            jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost", ghost_sum="backward"))(
                params, data
            )
        step = jax.jit(lambda m, c: clipped_grad(loss, c, method="ghost")(params, data, mask=m))
        _, info = step(jnp.ones(B, bool), 1.0)
        clip = 1e-3 * float(np.min(np.asarray(info.norms)))  # every example clipped hard
        for i in range(B):
            g, info = step(jnp.arange(B) == i, clip)
            assert int(info.num_clipped) == 1
            assert _norm64(g) <= clip
