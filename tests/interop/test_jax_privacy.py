"""gradclip_jax.interop.jax_privacy: the contract of jax-privacy 2.0's clipping API, checked against
jax_privacy.clipping itself on small MLP, CNN and sequence models, keyword by keyword."""

from __future__ import annotations

import functools
import subprocess
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jp = pytest.importorskip("jax_privacy.clipping")
dp_accounting = pytest.importorskip("dp_accounting")

import gradclip_jax as gcx  # noqa: E402
from gradclip_jax.interop import jax_privacy as ours  # noqa: E402
from tests.per_example.models import assert_tree_close, cnn_setup, embed_setup, mlp_setup  # noqa: E402

REL = dp_accounting.NeighboringRelation
CLIP = 1.0


def seq_setup(seed=3, batch=7):
    """A sequence model: embeddings, a per-position dense layer, mean over positions."""
    r = np.random.default_rng(seed)
    params = {
        "emb": jnp.asarray(r.normal(size=(12, 6)), jnp.float32),
        "w": jnp.asarray(r.normal(size=(6, 6)) / 2, jnp.float32),
        "out": jnp.asarray(r.normal(size=(6, 3)), jnp.float32),
    }
    data = {
        "tokens": jnp.asarray(r.integers(0, 12, size=(batch, 5))),
        "y": jnp.asarray(r.integers(0, 3, size=batch)),
    }

    def loss(p, b):
        h = jnp.tanh(p["emb"][b["tokens"]] @ p["w"])  # (B, T, 6)
        logits = jnp.mean(h, axis=1) @ p["out"]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], axis=1)[:, 0]

    return loss, params, data


MODELS = {"mlp": mlp_setup, "cnn": cnn_setup, "embed": embed_setup, "seq": seq_setup}


def _scalar(loss):
    """jax-privacy's loss of a batch of one (keep_batch_dim=True): the mean of the per-example losses."""
    return lambda p, b: jnp.mean(loss(p, b))


def _close(a, b, rtol=2e-5, atol=2e-6):
    assert_tree_close(a, jax.tree.map(lambda x: np.asarray(x, np.float64), b), rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# Parity with jax_privacy.clipped_grad
# ----------------------------------------------------------------------------


PARITY_KW = {"l2_clip_norm": CLIP, "return_values": True, "return_grad_norms": True}


@functools.cache
def _parity_reference(model):
    """A model and jax-privacy's clipped sums on it: compiled once for the three methods."""
    loss, params, data = MODELS[model]()
    g_jp = jp.clipped_grad(_scalar(loss), **PARITY_KW)
    return loss, params, data, g_jp, jax.jit(g_jp)(params, data)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("method", ["vmap", "ghost", "auto"])
def test_parity_values_norms_and_sensitivity(model, method):
    loss, params, data, g_jp, (gj, aj) = _parity_reference(model)
    g_ours = ours.clipped_grad(_scalar(loss), method=method, **PARITY_KW)
    go, ao = jax.jit(g_ours)(params, data)
    _close(go, gj)
    _close(ao.values, aj.values)
    _close(ao.grad_norms, aj.grad_norms, rtol=1e-5)
    assert ao.aux is None and aj.aux is None
    assert (
        np.min(np.asarray(aj.grad_norms)) < CLIP < np.max(np.asarray(aj.grad_norms))
    )  # some clipped, some not
    for rel in REL:
        if rel in (REL.ADD_OR_REMOVE_ONE, REL.REPLACE_ONE, REL.REPLACE_SPECIAL):
            assert g_ours.sensitivity(rel) == g_jp.sensitivity(rel)
    assert g_ours.sensitivity() == CLIP and g_ours.sensitivity(REL.REPLACE_ONE) == 2 * CLIP


def test_returns_jax_privacy_types():
    loss, params, data = mlp_setup()
    g = ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP, return_values=True)
    assert isinstance(g, jp.BoundedSensitivityCallable) and g.has_aux and g.l2_norm_bound == CLIP
    _, aux = g(params, data)
    assert isinstance(aux, jp.AuxiliaryOutput) and aux.grad_norms is None
    assert ours.AuxiliaryOutput is jp.AuxiliaryOutput
    plain = ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP)
    assert not plain.has_aux and jax.tree.structure(plain(params, data)) == jax.tree.structure(
        params
    )


@pytest.mark.slow
def test_ghost_and_vmap_agree():
    loss, params, data = cnn_setup()
    kw = {"l2_clip_norm": 0.5, "return_grad_norms": True}
    go, ao = ours.clipped_grad(_scalar(loss), method="ghost", **kw)(params, data)
    gv, av = ours.clipped_grad(_scalar(loss), method="vmap", **kw)(params, data)
    _close(go, gv)
    _close(ao.grad_norms, av.grad_norms, rtol=1e-5)


# ----------------------------------------------------------------------------
# Each keyword
# ----------------------------------------------------------------------------


def _both(fun, *args, method="auto", jit=True, call_kw=None, **kw):
    wrap = jax.jit if jit else (lambda f: f)
    call_kw = call_kw or {}
    return (
        wrap(ours.clipped_grad(fun, method=method, **kw))(*args, **call_kw),
        wrap(jp.clipped_grad(fun, **kw))(*args, **call_kw),
    )


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_argnums_and_batch_argnums_tuples(method):
    """Two differentiated arguments (a tuple of gradients) and two batch arguments, a shared one between."""
    loss, params, data = mlp_setup()

    def fun(l1, scale, x, l2, y):
        return jnp.mean(loss({"l1": l1, "l2": l2}, {"x": x * scale, "y": y}))

    args = (params["l1"], jnp.float32(0.7), data["x"], params["l2"], data["y"])
    o, j = _both(fun, *args, method=method, argnums=(0, 3), batch_argnums=(2, 4), l2_clip_norm=CLIP)
    assert isinstance(o, tuple) and len(o) == 2
    _close(o, j)


def test_static_shared_argument():
    """A Python flag among the shared arguments reaches ``fun`` as a Python value (jax-privacy does the same)."""
    loss, params, data = mlp_setup()

    def fun(p, b, double):
        assert isinstance(double, bool)
        return jnp.mean(loss(p, b)) * (2.0 if double else 1.0)

    o, j = _both(fun, params, data, True, jit=False, l2_clip_norm=CLIP)
    _close(o, j)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_keep_batch_dim_false_per_example_and_per_user(method):
    loss, params, data = mlp_setup()
    per_example = lambda p, b: loss(p, jax.tree.map(lambda x: x[None], b))[0]  # noqa: E731
    o, j = _both(per_example, params, data, method=method, l2_clip_norm=CLIP, keep_batch_dim=False)
    _close(o, j)
    users = jax.tree.map(lambda x: x[:6].reshape(3, 2, *x.shape[1:]), data)  # 3 users of 2 examples
    o, j = _both(
        _scalar(loss), params, users, method=method, l2_clip_norm=CLIP, keep_batch_dim=False
    )
    _close(o, j)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_has_aux_and_keep_batch_dim_aux_shapes(method):
    loss, params, data = mlp_setup()

    def fun(p, b):
        return jnp.mean(loss(p, b)), {"x0": b["x"][:, 0], "x": b["x"], "s": jnp.sum(b["x"])}

    (go, ao), (gj, aj) = _both(
        fun, params, data, has_aux=True, method=method, l2_clip_norm=CLIP, return_values=True
    )
    _close(go, gj)
    _close(ao.aux, aj.aux)
    assert ao.aux["x0"].shape == (7,) and ao.aux["x"].shape == (7, 6) and ao.aux["s"].shape == (7,)
    assert ao.grad_norms is None and ao.values.shape == (7,)


@pytest.mark.parametrize(
    "rescale,clip", [(True, 0.5), (True, 0.0), (False, 0.0), (False, np.inf), (True, np.inf)]
)
def test_rescale_and_clip_norm_edges(rescale, clip):
    loss, params, data = mlp_setup()
    kw = {"l2_clip_norm": clip, "rescale_to_unit_norm": rescale, "normalize_by": 4.0}
    o, j = _both(_scalar(loss), params, data, **kw)
    _close(o, j, rtol=1e-5)
    g = ours.clipped_grad(_scalar(loss), **kw)
    assert (
        g.sensitivity()
        == jp.clipped_grad(_scalar(loss), **kw).sensitivity()
        == (1.0 if rescale else clip) / 4.0
    )


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_padding_examples(method):
    """Padding examples contribute nothing; their values are reported, their norms are 0 (jax-privacy:
    their norms)."""
    loss, params, data = mlp_setup()
    pad = jnp.array([False, True, False, False, True, True, False])
    kw = {"l2_clip_norm": CLIP, "return_values": True, "return_grad_norms": True}
    (go, ao), (gj, aj) = _both(
        _scalar(loss), params, data, method=method, call_kw={"is_padding_example": pad}, **kw
    )
    _close(go, gj)
    _close(ao.values, aj.values)
    np.testing.assert_array_equal(np.asarray(ao.grad_norms)[np.asarray(pad)], 0.0)
    _close(
        np.asarray(ao.grad_norms)[~np.asarray(pad)],
        np.asarray(aj.grad_norms)[~np.asarray(pad)],
        rtol=1e-5,
    )
    real = jax.tree.map(lambda x: x[~np.asarray(pad)], data)
    plain = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP))  # eagerly: op by op
    _close(go, plain(params, real))
    all_pad = plain(params, data, is_padding_example=jnp.ones(7, bool))
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(all_pad))


@pytest.mark.parametrize("microbatch_size", [1, 3, 7])
def test_microbatch_size_any(microbatch_size):
    """Any positive size (jax-privacy needs one dividing the batch): the same sums."""
    loss, params, data = mlp_setup()
    got = jax.jit(
        ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP, microbatch_size=microbatch_size)
    )(params, data)
    _close(got, jax.jit(jp.clipped_grad(_scalar(loss), l2_clip_norm=CLIP))(params, data))


def test_pre_clipping_transform():
    loss, params, data = mlp_setup()
    scale = lambda g: jax.tree.map(lambda x: 0.1 * x, g)  # noqa: E731
    drop = lambda g: g["l2"]  # noqa: E731 (another structure)
    for t in (scale, drop):
        o, j = _both(_scalar(loss), params, data, l2_clip_norm=CLIP, pre_clipping_transform=t)
        _close(o, j)
    with pytest.raises(ValueError, match=r"pre_clipping_transform.*ghost"):
        ours.clipped_grad(
            _scalar(loss), l2_clip_norm=CLIP, pre_clipping_transform=scale, method="ghost"
        )


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_prng_argnum_per_example_keys(method):
    """Example i draws with jax.random.split(key, B)[i], as in jax-privacy: the same dropout, the same sums."""
    loss, params, data = mlp_setup()

    def fun(p, key, b):
        x = b["x"] * jax.random.bernoulli(key, 0.5, b["x"].shape) * 2.0
        return jnp.mean(loss(p, {**b, "x": x}))

    key = jax.random.key(5)
    kw = {"l2_clip_norm": CLIP, "batch_argnums": 2, "prng_argnum": 1, "return_values": True}
    (go, ao), (gj, aj) = _both(fun, params, key, data, method=method, **kw)
    _close(go, gj)
    _close(ao.values, aj.values)
    keys = {"a": key, "b": jax.random.key(6)}  # a pytree of keys: each one split
    o, j = _both(
        lambda p, ks, b: fun(p, ks["a"], b) + 0 * jax.random.normal(ks["b"]),
        params,
        keys,
        data,
        method=method,
        l2_clip_norm=CLIP,
        batch_argnums=2,
        prng_argnum=1,
    )
    _close(o, j)


def test_dtype_and_low_precision():
    loss, params, data = mlp_setup()
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    d16 = {**data, "x": data["x"].astype(jnp.bfloat16)}
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    got = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP))(p16, d16)
    # float32 sums (jax-privacy: bfloat16, which one example can move by more than the sensitivity)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got))
    got32 = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP, dtype=jnp.float32))(
        p16, d16
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got32))
    ref = jax.jit(jp.clipped_grad(_scalar(loss), l2_clip_norm=CLIP, dtype=jnp.float32))(p16, d16)
    _close(got32, ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "options",
    [
        {"method": "vmap"},
        {"method": "ghost"},
        {"normalize_by": 3.0},
        {"rescale_to_unit_norm": True},
    ],
    ids=["vmap", "ghost", "normalize_by", "rescale"],
)
def test_one_16_bit_example_stays_within_the_sensitivity(dtype, options):
    """16-bit parameters: one example's clipped gradient stays within the sensitivity (it came
    out 0.4% above it when the sum was rounded back to bfloat16 with float32's margin)."""
    rng = np.random.default_rng(0)
    w = jnp.zeros((5,), dtype)
    x = jnp.asarray(rng.normal(size=(64, 1, 5)) * 4, dtype)  # 64 examples, one at a time

    def loss(p, b):
        return jnp.sum(p * b)

    f = ours.clipped_grad(loss, l2_clip_norm=1.0, **options)
    norms = jax.jit(jax.vmap(lambda xi: jnp.linalg.norm(f(w, xi).astype(jnp.float32))))(x)
    assert f(w, x[0]).dtype == jnp.float32
    assert float(jnp.max(norms)) <= float(f.sensitivity()), float(jnp.max(norms))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_sum_is_not_rounded_before_the_noise(dtype):
    """jax-privacy returns the clipped sum of 16-bit gradients (or outputs) rounded to their
    dtype: removing one of 256 aligned examples clipped at 0.7 moved it by 1.25 in bfloat16
    (0.625 in float16). The drop-in sums and returns them in float32, and refuses a 16-bit
    ``dtype`` (as gcx.clipped_grad does)."""
    b, d, c = 256, 100, 0.7
    x = jnp.ones((b, d), jnp.float32) * 5 / np.sqrt(d)
    w = jnp.zeros(d, dtype)
    grad_fn = ours.clipped_grad(
        lambda p, xi: jnp.sum(xi @ p.astype(jnp.float32)), l2_clip_norm=c, batch_argnums=1
    )
    fun = ours.clipped_fun(lambda xi: (xi * 2).astype(dtype)[0], l2_clip_norm=c)
    for f, args in ((jax.jit(grad_fn), (w, x)), (jax.jit(fun), (x,))):
        full = np.asarray(f(*args), np.float64)
        assert full.dtype == np.float64 and f(*args).dtype == jnp.float32
        for i in (0, 101, 255):
            less = np.asarray(
                f(*args, is_padding_example=jnp.zeros(b, bool).at[i].set(True)), np.float64
            )
            assert np.linalg.norm(full - less) <= float(grad_fn.sensitivity()) * (1 + 1e-6)
    for make in (
        lambda: ours.clipped_grad(lambda p, xi: jnp.sum(xi @ p), l2_clip_norm=c, dtype=dtype),
        lambda: ours.clipped_fun(lambda xi: xi[0], l2_clip_norm=c, dtype=dtype),
        lambda: gcx.clipped_grad(lambda p, b_: b_ @ p, c, dtype=dtype),
    ):
        with pytest.raises(ValueError, match=r"dtype=.*before any noise"):
            make()


def test_a_tree_measured_at_the_clip_norm_stays_within_it():
    """``[4096, 1, ..., 1]`` (16 ones) measures 4096 in float32 (the ones round away) and was
    stored as it is, exact norm 4096.002 (as jax-privacy does); a tree further below is kept
    bit for bit."""
    tree = {"a": jnp.asarray([4096.0] + [1.0] * 16, jnp.float32)}
    out, norm = ours.clip_pytree(tree, 4096.0)
    assert float(norm) == 4096.0
    assert np.linalg.norm(np.asarray(out["a"], np.float64)) <= 4096.0
    kept, _ = ours.clip_pytree(tree, 4097.0)
    assert np.array_equal(np.asarray(kept["a"]), np.asarray(tree["a"]))
    summed = ours.clipped_fun(lambda x: x[0], l2_clip_norm=4096.0)(tree["a"][None])
    assert np.linalg.norm(np.asarray(summed, np.float64)) <= 4096.0


def test_nan_safe_example_contributes_zero():
    loss, params, data = mlp_setup()
    bad = {**data, "x": data["x"].at[2, 0].set(jnp.nan)}
    good = jax.tree.map(lambda x: jnp.delete(x, 2, axis=0), data)
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    got, aux = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP, return_grad_norms=True))(
        params, bad
    )
    _close(got, jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP))(params, good))
    assert not np.isfinite(float(aux.grad_norms[2]))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_spmd_axis_name_with_a_sharded_batch(method):
    """Under a mesh, the batch sharded over ``'b'`` and ``spmd_axis_name='b'``: the sums of the unsharded
    batch (jax-privacy 2.0.0 itself refuses this setup: its padding mask is not sharded like the batch)."""
    loss, params, data = mlp_setup(batch=8)
    mesh = jax.make_mesh((2,), ("b",))
    sharded = jax.device_put(data, jax.NamedSharding(mesh, jax.P("b")))
    g = ours.clipped_grad(_scalar(loss), l2_clip_norm=CLIP, method=method, spmd_axis_name="b")
    with jax.set_mesh(mesh):
        got = jax.jit(g)(params, sharded)
    _close(got, jax.jit(jp.clipped_grad(_scalar(loss), l2_clip_norm=CLIP))(params, data))


# ----------------------------------------------------------------------------
# clip_pytree and clipped_fun
# ----------------------------------------------------------------------------

TREE = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[0.0, 4.0]]), "c": jnp.array(2.0, jnp.bfloat16)}


@pytest.mark.parametrize("clip", [0.0, 0.5, 2.0, 100.0, np.inf])
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("nan_safe", [False, True])
def test_clip_pytree_matches_jax_privacy(clip, rescale, nan_safe):
    tree = {**TREE, "a": TREE["a"].at[1].set(jnp.inf)} if nan_safe else TREE
    o, no = ours.clip_pytree(tree, clip, rescale, nan_safe)
    j, nj = jp.clip_pytree(tree, clip, rescale, nan_safe)
    if (
        not nan_safe
    ):  # the float32 leaves to float32 rounding (ours: a margin of a few units below the bound)
        _close({k: o[k] for k in "ab"}, {k: j[k] for k in "ab"}, rtol=2e-6)
    _close(
        o["c"], j["c"], rtol=1e-2
    )  # bfloat16: jax-privacy scales in bfloat16, ours in float32, then rounds
    assert no.dtype == nj.dtype == jnp.float32 and float(no) == pytest.approx(float(nj))
    assert jax.tree.map(lambda x: x.dtype, o) == jax.tree.map(lambda x: x.dtype, tree)
    bound = 1.0 if rescale else clip
    assert (
        float(ours.clip_pytree(o, np.inf)[1]) <= bound
    )  # the bound, as stored (rounding included)


def _exact_sq_norm(tree):
    """The stored tree's squared 2-norm in exact rational arithmetic (no rounding at all)."""
    return sum(
        Fraction(float(v)) ** 2
        for x in jax.tree.leaves(tree)
        for v in np.asarray(x, np.float64).ravel()
    )


@pytest.mark.slow
def test_clip_pytree_rescaled_output_is_within_the_unit_bound_as_stored_when_just_below_the_clip_norm():
    """rescale_to_unit_norm with a norm just below the clip norm: nothing is clipped, the output x / C
    has norm n / C < 1, but each element's rounding could push the stored norm above 1 (it did in 15
    of these 3000 float32 trees before the stored output was checked; jax-privacy's in about 40% of
    the mixed ones)."""
    rng = np.random.default_rng(0)
    clip = jax.jit(ours.clip_pytree, static_argnums=2)
    for i in range(3000):
        tree = {"a": jnp.asarray(rng.normal(size=7), jnp.float32)}
        if i % 3 == 0:  # 16-bit leaves take the margin: the same bound
            tree["b"] = jnp.asarray(rng.normal(size=3), jnp.bfloat16)
        n = np.float32(ours.clip_pytree(tree, np.inf)[1])
        c = np.nextafter(n, np.float32(np.inf)) * np.float32(1 + int(rng.integers(0, 3)) * 1e-7)
        out, _ = clip(tree, c, True)
        assert _exact_sq_norm(out) <= 1


@pytest.mark.parametrize("rescale", [False, True])
def test_clip_pytree_stores_within_the_bound_exactly_and_keeps_the_plain_factor_where_that_is_within(
    rescale,
):
    """Clipped trees of random norms: the stored norm, in exact arithmetic, is at most the bound
    (C, or 1 rescaled); where jax-privacy's plain factor already stores within it, ours is the same
    tree, bit for bit, unless the two norms rounded apart (the exact check of gradclip_jax._core.stored keeps
    the factor unlowered there). jax-privacy's own outputs exceed the bound in about half the trees."""
    rng = np.random.default_rng(1)
    ours_clip, jp_clip = (
        jax.jit(ours.clip_pytree, static_argnums=2),
        jax.jit(jp.clip_pytree, static_argnums=2),
    )
    within = same = 0
    for _ in range(200):
        tree = {
            "a": jnp.asarray(rng.normal(size=5) * 3, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
        }
        c = np.float32(rng.uniform(0.1, 2.0))
        o, _ = ours_clip(tree, c, rescale)
        j, _ = jp_clip(tree, c, rescale)
        bound = 1 if rescale else Fraction(float(c))
        assert _exact_sq_norm(o) <= bound * bound
        if _exact_sq_norm(j) <= bound * bound:
            within += 1
            same += all(np.array_equal(o[k], j[k]) for k in o)
    assert 50 < within < 150 and same >= 0.8 * within


def test_clip_pytree_cannot_meet_jax_privacys_unit_norm_test_within_the_bound():
    """Why jax-privacy's test_clip_pytree_clip_norm_zero_rescale fails on the drop-in: {a: [3, 0],
    b: [0, 4]} rescaled to unit norm must have optax.global_norm 1 to 7 places, and no float32
    factor does that within the bound. The factors that pass (0.2 and the next float32 up) store
    0.6 and 0.8 rounded up, of exact norm above 1; every factor whose stored norm is at most 1 gives
    optax.global_norm <= 0.99999994, which fails. Ours stores within the bound."""
    import optax

    x = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([0.0, 4.0])}
    g, passing = np.float32(0.2), []
    for _ in range(6):
        g = np.nextafter(g, np.float32(0), dtype=np.float32)  # 6 factors below 0.2 ...
    for _ in range(13):  # ... 0.2 and 6 above
        stored = jax.tree.map(lambda v, g=g: (v * g).astype(jnp.float32), x)
        passes = (
            round(abs(float(optax.tree.norm(stored)) - 1.0), 7) == 0
        )  # the test's assertAlmostEqual
        within = _exact_sq_norm(stored) <= 1
        assert not (passes and within)
        passing += [passes]
        g = np.nextafter(g, np.float32(1), dtype=np.float32)
    assert sum(passing) >= 1  # the test is passable at all: by jax-privacy's own factor
    clipped, norm = ours.clip_pytree(x, 0.0, rescale_to_unit_norm=True)
    assert float(norm) == 5.0 and _exact_sq_norm(clipped) <= 1
    assert 1 - 2e-7 < float(optax.tree.norm(clipped)) < 1.0


def test_clip_pytree_traced_and_return_zero():
    f = jax.jit(ours.clip_pytree, static_argnums=(2, 3))
    out, _ = f(TREE, jnp.float32(-1.0))  # a negative traced clip norm: zero, as jax-privacy
    assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(out))
    out, norm = f(TREE, 1.0, return_zero=jnp.bool_(True))
    assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(out)) and float(norm) > 0
    nan_kept, _ = ours.clip_pytree(jnp.array([1.0, jnp.nan]), 1.0, nan_safe=False)
    np.testing.assert_array_equal(
        nan_kept, jp.clip_pytree(jnp.array([1.0, jnp.nan]), 1.0, nan_safe=False)[0]
    )
    assert np.isnan(float(nan_kept[1]))


@pytest.mark.parametrize("keep_batch_dim", [True, False])
@pytest.mark.parametrize(
    "has_aux,return_norms", [(False, False), (True, True), (True, False), (False, True)]
)
def test_clipped_fun_matches_jax_privacy(keep_batch_dim, has_aux, return_norms):
    data = jax.random.normal(jax.random.key(0), (6, 4)) * jnp.arange(1, 7)[:, None]

    def fun(x):
        v = jnp.mean(x, axis=0) if keep_batch_dim else x + 1.0
        return (v, jnp.sum(x)) if has_aux else v

    kw = {
        "has_aux": has_aux,
        "keep_batch_dim": keep_batch_dim,
        "l2_clip_norm": 2.0,
        "return_norms": return_norms,
        "normalize_by": 3.0,
        "microbatch_size": 2,
    }
    pad = jnp.array([False, False, True, False, False, False])
    o = ours.clipped_fun(fun, **kw)
    j = jp.clipped_fun(fun, **kw)
    _close(jax.jit(o)(data, is_padding_example=pad), jax.jit(j)(data, is_padding_example=pad))
    assert o.sensitivity(REL.REPLACE_ONE) == j.sensitivity(REL.REPLACE_ONE) == 4.0 / 3.0
    assert o.has_aux == j.has_aux


def test_clipped_fun_prng_and_dtype():
    data = jnp.ones((5, 3), jnp.bfloat16)
    fun = lambda x, key: x + jax.random.normal(key, x.shape, x.dtype)  # noqa: E731
    kw = {"keep_batch_dim": False, "prng_argnum": 1, "dtype": jnp.float32}
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    o = jax.jit(ours.clipped_fun(fun, **kw))(data, jax.random.key(1))
    assert o.dtype == jnp.float32
    _close(o, jax.jit(jp.clipped_fun(fun, **kw))(data, jax.random.key(1)), rtol=1e-5)


# ----------------------------------------------------------------------------
# jax-privacy's current source (GitHub): per-layer clip norms, grid_scale
# ----------------------------------------------------------------------------

LAYERS = {
    "l1": 0.5,
    "l2": 2.0,
}  # a prefix of mlp_setup's params: each layer's w and b clipped jointly


def _layer_loop(loss, params, data, clips, rescale=False):
    """Per-example loop in float64: each layer (subtree) of each gradient clipped to its own norm
    (divided by it when rescaled), summed; and the layers' norms."""
    total = jax.tree.map(lambda x: np.zeros(x.shape), params)
    norms = {k: [] for k in clips}
    grad = jax.jit(jax.grad(_scalar(loss)))  # one program for every example
    for i in range(jax.tree.leaves(data)[0].shape[0]):
        g = grad(params, jax.tree.map(lambda x: x[i : i + 1], data))
        for k, c in clips.items():
            n = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(g[k])))
            f = min(1.0, c / n) / (c if rescale else 1.0)
            total[k] = jax.tree.map(
                lambda t, v, f=f: t + f * np.asarray(v, np.float64), total[k], g[k]
            )
            norms[k].append(n)
    return total, norms


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("rescale", [False, True])
def test_per_layer_prefix_clips_each_subtree_to_its_norm(method, rescale):
    """A clip-norm tree that stops at each layer: the layer's leaves are clipped jointly (jax-privacy's
    prefix semantics), on both paths; grad_norms is a tree of the layers' norms; the sensitivity is
    sqrt(sum C_i**2) / normalize_by (sqrt(K) / normalize_by rescaled)."""
    loss, params, data = mlp_setup()
    g = ours.clipped_grad(
        _scalar(loss),
        l2_clip_norm=LAYERS,
        rescale_to_unit_norm=rescale,
        normalize_by=2.0,
        return_grad_norms=True,
        method=method,
    )
    got, aux = jax.jit(g)(params, data)
    want, norms = _layer_loop(loss, params, data, LAYERS, rescale)
    _close(got, jax.tree.map(lambda x: x / 2.0, want), atol=1e-5)
    assert jax.tree.structure(aux.grad_norms) == jax.tree.structure(LAYERS)
    for k in LAYERS:
        _close(aux.grad_norms[k], np.array(norms[k]), rtol=1e-5)
        assert min(norms[k]) < LAYERS[k] < max(norms[k])  # some clipped, some not, in every layer
    want_bound = (np.sqrt(2.0) if rescale else np.sqrt(0.5**2 + 2.0**2)) / 2.0
    assert g.sensitivity() == pytest.approx(want_bound) and g.l2_norm_bound == pytest.approx(
        want_bound
    )
    assert g.sensitivity(REL.REPLACE_ONE) == pytest.approx(2 * want_bound)


def test_per_layer_ghost_equals_vmap_and_full_tree_equals_per_leaf():
    """Ghost == vmap with a prefix tree on a CNN; a full tree (one clip norm per leaf) clips each leaf
    alone: the same as the prefix whose subtrees are single leaves."""
    loss, params, data = cnn_setup()
    prefix = {k: 0.3 for k in params}
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    go = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=prefix, method="ghost"))(
        params, data
    )
    gv = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=prefix, method="vmap"))(params, data)
    _close(go, gv, atol=1e-5)
    full = jax.tree.map(lambda _: 0.2, params)
    per_leaf = jax.jit(ours.clipped_grad(_scalar(loss), l2_clip_norm=full, method="ghost"))(
        params, data
    )
    got = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_flatten_with_path(per_leaf)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:

        def leaf_loss(q, b, path=path):  # the loss as a function of this leaf alone
            return _scalar(loss)(
                jax.tree_util.tree_map_with_path(lambda p, x: q if p == path else x, params), b
            )

        alone = jax.jit(ours.clipped_grad(leaf_loss, l2_clip_norm=0.2, method="vmap"))(leaf, data)
        _close(got[jax.tree_util.keystr(path)], alone, atol=1e-5)


def test_clip_pytree_and_clipped_fun_per_layer_prefix():
    """clip_pytree with a prefix tree clips each subtree as a whole tree; clipped_fun sums those."""
    tree = {
        "layer1": {"w": jnp.array([0.0, 3.0]), "b": jnp.array([4.0])},
        "layer2": {"w": jnp.array([0.0, 8.0]), "b": jnp.array([6.0])},
    }
    clips = {"layer1": 2.0, "layer2": 5.0}
    out, norms = ours.clip_pytree(tree, clips)
    for k, c in clips.items():
        alone, n = ours.clip_pytree(tree[k], c)
        assert jax.tree.all(jax.tree.map(np.array_equal, out[k], alone)) and float(
            norms[k]
        ) == float(n)
    scales = {"layer1": 0.4, "layer2": 0.5}  # 2 / 5 and 5 / 10
    _close(out, {k: jax.tree.map(lambda v, k=k: v * scales[k], tree[k]) for k in tree}, rtol=1e-6)
    cf = ours.clipped_fun(
        lambda x: jax.tree.map(lambda v: v * x, tree),
        keep_batch_dim=False,
        l2_clip_norm=clips,
        return_norms=True,
        normalize_by=4.0,
    )
    value, (_, per_example) = cf(
        jnp.array([1.0, 2.0, 3.0])
    )  # x times the layer: the same clipped layer, 3 times
    _close(
        value,
        {k: jax.tree.map(lambda v, k=k: v * 3 * scales[k] / 4.0, tree[k]) for k in tree},
        rtol=1e-6,
    )
    _close(
        per_example, {"layer1": np.array([5.0, 10.0, 15.0]), "layer2": np.array([10.0, 20.0, 30.0])}
    )
    assert cf.sensitivity() == pytest.approx(np.sqrt(4 + 25) / 4)
    rescaled = ours.clipped_fun(
        jnp.square,
        keep_batch_dim=False,
        l2_clip_norm={"a": 1.0, "b": 2.0, "c": 3.0},
        rescale_to_unit_norm=True,
        normalize_by=5.0,
    )
    assert rescaled.sensitivity() == pytest.approx(np.sqrt(3) / 5)


def test_grid_scale_rounds_ties_to_even_and_sums_exactly():
    """clip_and_round_to_grid: clip to C - sqrt(d) C / (2 s), scale by s / C, round to nearest (ties to
    even, as jax-privacy's jnp.round), int64; clipped_grad / clipped_fun sum those exactly."""
    with jax.enable_x64(True):
        x = {
            "w": jnp.array([12.5, 13.5, -2.5, 700.0], jnp.float32) / 1024
        }  # exact halves on the grid
        rounded, norm = ours.clip_and_round_to_grid(x, 1.0, 1024)
        assert rounded["w"].dtype == jnp.int64 and float(norm) == pytest.approx(
            np.linalg.norm(x["w"]), rel=1e-6
        )
        np.testing.assert_array_equal(rounded["w"], [12, 14, -2, 700])
        big = {"w": jnp.asarray(np.random.default_rng(0).normal(size=50) * 10, jnp.float32)}
        r, _ = ours.clip_and_round_to_grid(big, 2.0, 300)
        adjusted = 2.0 - np.sqrt(50) * (2.0 / 300) * 0.5
        clipped, _ = ours.clip_pytree(big, adjusted)
        np.testing.assert_array_equal(
            r["w"], np.round(np.asarray(clipped["w"], np.float64) * (300 / 2.0))
        )
        assert np.sum(np.asarray(r["w"], np.int64) ** 2) <= 300**2

        loss = lambda p, d: jnp.mean((d - p) ** 2)  # noqa: E731
        data = jax.random.normal(jax.random.key(0), (10, 4)) * 3
        pad = jnp.arange(10) >= 8
        g = ours.clipped_grad(loss, l2_clip_norm=1.0, grid_scale=1000, return_grad_norms=True)
        total, aux = jax.jit(g)(jnp.zeros(4), data, is_padding_example=pad)
        # one program for every example (eagerly, op by op, each x64 operation compiles)
        one = jax.jit(
            lambda d: ours.clip_and_round_to_grid(jax.grad(loss)(jnp.zeros(4), d), 1.0, 1000)[0]
        )
        per_example = [one(data[i : i + 1]) for i in range(8)]
        assert total.dtype == jnp.int64
        np.testing.assert_array_equal(total, np.sum(np.stack(per_example), axis=0))
        assert g.sensitivity() == 1000.0 and g.sensitivity(REL.REPLACE_ONE) == 2000.0
        assert aux.grad_norms.shape == (10,)
        cf = ours.clipped_fun(
            lambda v: v * 3.0, keep_batch_dim=False, l2_clip_norm=1.0, grid_scale=1000
        )
        cf = jax.jit(cf)  # one program for the five draws
        for i in range(5):
            out = cf(jax.random.normal(jax.random.key(i), (1, 20)))
            assert out.dtype == jnp.int64 and np.sum(np.asarray(out) ** 2) <= 1000**2


@pytest.fixture
def later_jax_privacy(monkeypatch):
    """The drop-in as beside a jax-privacy after 2.0.0 (its GitHub source)."""
    from gradclip_jax.interop.jax_privacy import _version

    monkeypatch.setattr(_version, "AFTER_2_0_0", True)


def test_installed_version_is_read():
    import jax_privacy

    from gradclip_jax.interop.jax_privacy import _version

    assert _version.after_2_0_0(jax_privacy.__version__) == _version.AFTER_2_0_0
    assert (
        not _version.after_2_0_0("2.0.0")
        and _version.after_2_0_0("2.0.1")
        and _version.after_2_0_0("2.3.0.dev0")
    )


def test_beside_a_later_jax_privacy_return_norms_and_nan_safe_follow_it(later_jax_privacy):
    """A later jax-privacy returns (value, norms) for return_norms alone, its clip_pytree has no
    nan_safe step (a non-finite input: a non-finite norm), and clipped_fun drops an example whose norm
    is not finite (2.0.0: zeroes its non-finite elements)."""
    cf = ours.clipped_fun(jnp.square, keep_batch_dim=False, l2_clip_norm=jnp.inf, return_norms=True)
    value, norms = cf(jnp.array([1.0, 2.0, 3.0]))
    assert float(value) == 14.0 and norms.shape == (3,)
    _, norm = ours.clip_pytree(jnp.array([3.0, jnp.nan]), 1.0)
    assert not np.isfinite(float(norm))
    add = ours.clipped_fun(lambda x: x, keep_batch_dim=False, l2_clip_norm=10.0)
    data = jnp.array([[1.0, 2.0], [jnp.nan, 5.0], [3.0, 4.0]])
    np.testing.assert_array_equal(
        add(data), [4.0, 6.0]
    )  # the example with a NaN contributes nothing


def test_beside_jax_privacy_2_0_0_nan_safe_zeroes_elements():
    from gradclip_jax.interop.jax_privacy import _version

    if _version.AFTER_2_0_0:
        pytest.skip("a later jax-privacy is installed")
    add = ours.clipped_fun(lambda x: x, keep_batch_dim=False, l2_clip_norm=10.0)
    np.testing.assert_array_equal(add(jnp.array([[1.0, 2.0], [jnp.nan, 5.0]])), [1.0, 7.0])
    _, (_, norms) = ours.clipped_fun(jnp.square, keep_batch_dim=False, return_norms=True)(
        jnp.ones(3)
    )
    assert norms.shape == (3,)


_GRID_ERRORS = [
    ({"grid_scale": 0}, ValueError, "`grid_scale` must be >= 1"),
    ({"grid_scale": 2.5}, TypeError, "`grid_scale` must be an int"),
    ({"grid_scale": True}, TypeError, "`grid_scale` must be an int"),
    (
        {"grid_scale": 100, "rescale_to_unit_norm": True},
        ValueError,
        "grid_scale=100 cannot be combined with resc",
    ),
    ({"grid_scale": 100, "normalize_by": 2.0}, ValueError, "grid_scale=100 needs normalize_by=1"),
    ({"grid_scale": 100, "l2_clip_norm": {"a": 1.0}}, ValueError, "grid_scale needs one clip norm"),
    ({"grid_scale": 100, "l2_clip_norm": 0.0}, ValueError, "`l2_clip_norm` must be > 0"),
    ({"grid_scale": 100, "l2_clip_norm": np.inf}, ValueError, "`l2_clip_norm` must be finite"),
]


@pytest.mark.parametrize(
    ("dtype", "grid_scale", "x"),
    [
        (jnp.bfloat16, 1000, [-75.0, 75.5, 73.5, 16.375]),
        (jnp.float16, 4099, [0.3447265625, 0.49951171875, 0.7919921875, 0.061126708984375]),
        (jnp.float32, 16777219, [1.0]),
    ],
)
def test_grid_scale_rounded_example_stays_within_the_grid_scale(dtype, grid_scale, x):
    """The scaling onto the grid is in float64: in the gradient's dtype it rounded too (bfloat16's
    spacing is 4 between 512 and 1024; a float32 scale above 2**24 rounds up), and one example
    reached a norm of 1000.9 at grid_scale 1000 (4099.2 at 4099; 16777220 at 16777219)."""

    def fun(w, ex):
        return jnp.sum(w * ex[0])

    with jax.enable_x64(True):
        g = ours.clipped_grad(fun, l2_clip_norm=1.0, grid_scale=grid_scale, method="vmap")
        out = np.asarray(jax.jit(g)(jnp.zeros(len(x), dtype), jnp.asarray(x, dtype)[None]))
    assert out.dtype == np.int64
    assert np.sum(out.astype(object) ** 2) <= grid_scale**2, out  # exact, in integers


@pytest.mark.parametrize("kw,err,match", _GRID_ERRORS)
def test_grid_scale_bad_arguments(kw, err, match):
    with jax.enable_x64(True):
        for make in (
            lambda **k: ours.clipped_grad(_f, **k),
            lambda **k: ours.clipped_fun(jnp.square, **k),
        ):
            with pytest.raises(err, match=match):
                make(**{"l2_clip_norm": 1.0, **kw})


def test_grid_scale_needs_x64_per_example_gradients_and_a_fine_enough_grid():
    with pytest.raises(ValueError, match="grid_scale needs 64-bit mode"):
        ours.clipped_grad(_f, l2_clip_norm=1.0, grid_scale=100)
    with jax.enable_x64(True):
        with pytest.raises(
            ValueError, match=r"grid_scale rounds each example's gradient.*method='ghost'"
        ):
            ours.clipped_grad(_f, l2_clip_norm=1.0, grid_scale=100, method="ghost")
        with pytest.raises(
            ValueError, match=r"grid_scale=3 is too small for 100 parameters.*grid_scale > 5"
        ):
            ours.clip_and_round_to_grid(jnp.ones(100), 1.0, 3)
        with pytest.raises(ValueError, match="grid_scale=3 is too small"):
            ours.clipped_grad(_f, l2_clip_norm=1.0, grid_scale=3)(
                jnp.zeros(100), jnp.zeros((2, 100))
            )


@pytest.mark.parametrize(
    "clips,match",
    [
        ({"l1": 1.0, "l3": 1.0}, "must be a prefix of the structure of params"),
        (
            {"l1": 1.0, "l2": {"w": 1.0, "b": 1.0, "c": 1.0}},
            "must be a prefix of the structure of params",
        ),
    ],
)
def test_per_layer_tree_that_is_not_a_prefix(clips, match):
    loss, params, data = mlp_setup()
    for method in ("vmap", "ghost"):
        with pytest.raises(ValueError, match=match):
            ours.clipped_grad(_scalar(loss), l2_clip_norm=clips, method=method)(params, data)
    with pytest.raises(ValueError, match="clip_pytree: `clip_norm` must be a prefix"):
        ours.clip_pytree(params, clips)
    with pytest.raises(ValueError, match="clipped_fun: `l2_clip_norm` must be a prefix"):
        ours.clipped_fun(
            lambda x: jax.tree.map(lambda p: p * jnp.sum(x), params), l2_clip_norm=clips
        )(data["x"])


@pytest.mark.parametrize(
    "clips,err,match",
    [
        ({"a": 1.0, "b": -1.0}, ValueError, r"`l2_clip_norm\['b'\]` must be >= 0"),
        ({"a": 1.0, "b": float("nan")}, ValueError, r"`l2_clip_norm\['b'\]` must not be NaN"),
        ({"a": "1"}, TypeError, r"`l2_clip_norm\['a'\]` must be a number"),
        ({}, ValueError, "`l2_clip_norm` is an empty tree"),
    ],
)
def test_per_layer_bad_clip_norms_name_the_leaf(clips, err, match):
    for make in (
        lambda: ours.clipped_grad(_f, l2_clip_norm=clips),
        lambda: ours.clipped_fun(jnp.square, l2_clip_norm=clips),
    ):
        with pytest.raises(err, match=match):
            make()
    with pytest.raises(err, match=match.replace("l2_clip_norm", "clip_norm")):
        ours.clip_pytree({"a": jnp.ones(2), "b": jnp.ones(2)}, clips)


def test_per_layer_rescale_with_a_zero_layer_is_refused():
    with pytest.raises(ValueError, match=r"`l2_clip_norm\['b'\]` is 0 with rescale_to_unit_norm"):
        ours.clipped_grad(_f, l2_clip_norm={"a": 1.0, "b": 0.0}, rescale_to_unit_norm=True)


# ----------------------------------------------------------------------------
# Bad inputs: clear errors naming the argument
# ----------------------------------------------------------------------------

_f = lambda p, x: jnp.mean((x - p) ** 2)  # noqa: E731


@pytest.mark.parametrize(
    "kw,err,match",
    [
        ({"argnums": 1, "batch_argnums": 1}, ValueError, "overlap"),
        ({"batch_argnums": ()}, ValueError, "`batch_argnums` must not be empty"),
        ({"argnums": ()}, ValueError, "`argnums` must not be empty"),
        ({"argnums": -1}, ValueError, "`argnums`.*>= 0"),
        ({"batch_argnums": (1, 1)}, ValueError, "`batch_argnums`.*twice"),
        ({"argnums": "w"}, TypeError, "`argnums` must be an int"),
        ({"argnums": True}, TypeError, "`argnums` must be an int"),
        ({"prng_argnum": 1}, ValueError, "prng_argnum=1 is also in batch_argnums"),
        ({"prng_argnum": 1.5}, TypeError, "`prng_argnum` must be None or an int"),
        ({"normalize_by": 0.0}, ValueError, "`normalize_by` must be > 0"),
        ({"l2_clip_norm": -1.0}, ValueError, "`l2_clip_norm` must be >= 0"),
        ({"l2_clip_norm": float("nan")}, ValueError, "`l2_clip_norm` must not be NaN"),
        ({"l2_clip_norm": "1"}, TypeError, "`l2_clip_norm` must be a number"),
        ({"microbatch_size": 0}, ValueError, "microbatch_size"),
        ({"method": "fast"}, ValueError, "unknown method 'fast'"),
        ({"dtype": jnp.int32}, ValueError, "dtype must be a floating-point dtype"),
        ({"pre_clipping_transform": 3}, TypeError, "pre_clipping_transform must be callable"),
    ],
)
def test_bad_arguments_at_construction(kw, err, match):
    with pytest.raises(err, match=match):
        ours.clipped_grad(_f, **{"l2_clip_norm": 1.0, **kw})


def test_missing_clip_norm_and_bad_fun():
    with pytest.raises(TypeError, match="l2_clip_norm"):
        ours.clipped_grad(_f)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="`fun` must be callable"):
        ours.clipped_grad(3, l2_clip_norm=1.0)
    with pytest.raises(TypeError, match="`fun` must be callable"):
        ours.clipped_fun(3)


def test_bad_arguments_at_call():
    g = ours.clipped_grad(lambda p, x, y: _f(p, x + y), l2_clip_norm=1.0, batch_argnums=(1, 2))
    x = jnp.zeros((4, 2))
    with pytest.raises(
        ValueError, match=r"Batch axis sizes differ \(argument 1: 4, argument 2: 3\)"
    ):
        g(jnp.zeros(2), x, jnp.zeros((3, 2)))
    with pytest.raises(
        ValueError, match=r"batch_argnums=\(1, 2\) names argument 2, but .* 2 positional"
    ):
        g(jnp.zeros(2), x)
    with pytest.raises(ValueError, match=r"`is_padding_example` must have shape \(B,\) = \(4,\)"):
        g(jnp.zeros(2), x, x, is_padding_example=jnp.zeros(3, bool))
    with pytest.raises(ValueError, match=r"argument 1 \(in batch_argnums\).*scalar"):
        g(jnp.zeros(2), jnp.float32(1.0), x)
    vector_loss = ours.clipped_grad(lambda p, x: (x - p) ** 2, l2_clip_norm=1.0, method="vmap")
    with pytest.raises((TypeError, ValueError), match="scalar loss"):
        vector_loss(jnp.zeros(2), x)
    keyed = ours.clipped_grad(lambda p, x, k: _f(p, x), l2_clip_norm=1.0, prng_argnum=2)
    with pytest.raises(TypeError, match="prng_argnum=2 must be a single PRNG key"):
        keyed(jnp.zeros(2), x, jnp.zeros(3))
    with pytest.raises(ValueError, match="microbatch_size=3 must divide the batch size 4"):
        ours.clipped_fun(jnp.mean, microbatch_size=3)(x)


def test_clip_pytree_bad_arguments():
    with pytest.raises(ValueError, match="clip_pytree: `clip_norm` must be >= 0"):
        ours.clip_pytree(TREE, -1.0)
    with pytest.raises(TypeError, match="rescale_to_unit_norm"):
        jax.jit(ours.clip_pytree)(TREE, 1.0, True)
    with pytest.raises(TypeError, match=r"clip_pytree: leaf \['n'\] has dtype int32"):
        ours.clip_pytree({"n": jnp.arange(3)}, 1.0)


def test_import_error_names_the_extra():
    code = (
        "import sys; sys.modules['jax_privacy'] = None\n"
        "try:\n    import gradclip_jax.interop.jax_privacy\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install 'gradclip_jax[jax-privacy]'" in out


def test_guide_runs():
    """docs/guides/jax-privacy.md: its python blocks, run in order, give jax-privacy's sum."""
    import pathlib
    import re

    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "jax-privacy.md"
    ns: dict = {"__name__": "jax_privacy_guide"}
    for code in re.findall(r"^```python\n(.*?)^```", guide.read_text(), flags=re.S | re.M):
        exec(compile(code, guide.name, "exec"), ns)
    assert ns["max_diff"] < 1e-5
    np.testing.assert_array_equal(np.asarray(ns["aux"].grad_norms)[12:], 0.0)
    assert ns["sensitivity"] == 1.0 and isinstance(ns["grad_fn"], jp.BoundedSensitivityCallable)
