"""clipped_grad's jax-privacy options: per-example PRNG keys (prng_argnum), pre_clipping_transform,
rescale_to_unit_norm, dtype, the one-example loss contract, and the l2_norm_clip spelling."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import clipped_grad

B = 7


def _dropout_setup(seed=0):
    r = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(r.normal(size=(4, 16)), jnp.float32),
        "w2": jnp.asarray(r.normal(size=(16, 2)), jnp.float32),
    }
    batch = {
        "x": jnp.asarray(r.normal(size=(B, 4)), jnp.float32),
        "y": jnp.asarray(r.normal(size=(B, 2)), jnp.float32),
    }

    def loss(p, b, key):  # dropout drawn from `key` for the whole (per-example) batch
        h = jnp.tanh(b["x"] @ p["w1"])
        keep = jax.random.bernoulli(key, 0.5, h.shape)
        h = jnp.where(keep, h / 0.5, 0.0)
        return jnp.sum((h @ p["w2"] - b["y"]) ** 2, axis=-1)

    return loss, params, batch


def _loop(loss, params, batch, keys, clip, transform=lambda g: g):
    """Per-example Python loop: example i's gradient with key i, transformed, clipped, summed (float64)."""
    total = None
    for i in range(B):
        ex = jax.tree_util.tree_map(lambda x: x[i : i + 1], batch)
        g = transform(jax.grad(lambda p: loss(p, ex, keys[i])[0])(params))
        g = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), g)
        n = np.sqrt(sum(np.sum(x**2) for x in jax.tree_util.tree_leaves(g)))
        f = min(1.0, clip / n) if n > 0 else 1.0
        g = jax.tree_util.tree_map(lambda x: x * f, g)
        total = g if total is None else jax.tree_util.tree_map(np.add, total, g)
    return total


def _close(a, b, rtol=2e-5, atol=1e-6):
    jax.tree_util.tree_map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=rtol, atol=atol),
        a,
        b,
    )


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_per_example_keys_match_a_loop_with_split_keys(method):
    loss, params, batch = _dropout_setup()
    key = jax.random.key(3)
    got, info = jax.jit(clipped_grad(loss, 1.0, prng_argnum=2, method=method))(params, batch, key)
    _close(got, _loop(loss, params, batch, jax.random.split(key, B), 1.0))
    assert int(info.num_clipped) > 0


def test_per_example_dropout_masks_differ():
    def loss(p, b, key):  # the loss reveals the example's mask through its value
        mask = jax.random.bernoulli(key, 0.5, (b["x"].shape[0], 64)).astype(jnp.float32)
        return jnp.sum(mask * p, axis=-1) + 0.0 * b["x"][:, 0]

    batch = {"x": jnp.zeros((B, 1))}
    params = jnp.arange(64, dtype=jnp.float32)
    key = jax.random.key(0)
    _, info = clipped_grad(loss, 1e9, prng_argnum=2)(params, batch, key)
    assert len(set(np.asarray(info.values).tolist())) == B  # every example its own mask
    _, shared = clipped_grad(loss, 1e9)(params, batch, key)  # without prng_argnum: one key for all
    assert len(set(np.asarray(shared.values).tolist())) == 1


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_per_example_keys_do_not_depend_on_microbatching(method):
    loss, params, batch = _dropout_setup(1)
    key = jax.random.key(5)
    outs = [
        jax.jit(clipped_grad(loss, 1.0, prng_argnum=2, method=method, microbatch_size=mb))(
            params, batch, key
        )
        for mb in (None, 1, 3)
    ]
    for g, info in outs[1:]:
        _close(g, jax.tree_util.tree_map(np.asarray, outs[0][0]), rtol=1e-5)
        np.testing.assert_allclose(info.values, outs[0][1].values, rtol=1e-6)


def test_ghost_equals_vmap_with_dropout_and_key_after_other_args():
    loss, params, batch = _dropout_setup(2)

    def loss2(p, b, scale, key):  # the key is loss_fn's argument 3, after a shared argument
        return scale * loss(p, b, key)

    key = jax.random.key(9)
    # jitted (eagerly, each operation compiles alone)
    gv, iv = jax.jit(clipped_grad(loss2, 0.5, prng_argnum=3, method="vmap"))(
        params, batch, 2.0, key
    )
    gg, ig = jax.jit(clipped_grad(loss2, 0.5, prng_argnum=3, method="ghost"))(
        params, batch, 2.0, key
    )
    _close(gg, jax.tree_util.tree_map(np.asarray, gv), rtol=1e-5)
    np.testing.assert_allclose(ig.norms, iv.norms, rtol=1e-5)


def test_prng_argnum_errors():
    loss, params, batch = _dropout_setup()
    with pytest.raises(ValueError, match="prng_argnum"):
        clipped_grad(loss, 1.0, prng_argnum=1)
    with pytest.raises(TypeError, match="prng_argnum"):
        clipped_grad(loss, 1.0, prng_argnum="2")
    with pytest.raises(ValueError, match="prng_argnum=3"):
        clipped_grad(loss, 1.0, prng_argnum=3)(params, batch, jax.random.key(0))
    with pytest.raises(TypeError, match="PRNG key"):
        clipped_grad(loss, 1.0, prng_argnum=2)(params, batch, jnp.ones(3))


def _mlp():
    r = np.random.default_rng(0)
    params = {
        "a": jnp.asarray(r.normal(size=(5, 4)), jnp.float32),
        "b": jnp.asarray(r.normal(size=4), jnp.float32),
        "c": jnp.asarray(r.normal(size=(4, 1)), jnp.float32),
    }
    batch = jnp.asarray(r.normal(size=(B, 5)) * 3, jnp.float32)

    def loss(p, x, key=None):
        return jnp.sum(jnp.tanh(x @ p["a"] + p["b"]) @ p["c"], axis=-1) ** 2

    return loss, params, batch


@pytest.mark.parametrize(
    "name,transform",
    [
        ("project", lambda g: {**g, "a": g["a"].at[:, :2].set(0.0)}),
        (
            "per-layer normalize",
            lambda g: jax.tree_util.tree_map(lambda x: x / (jnp.linalg.norm(x) + 1.0), g),
        ),
        ("drop part of the tree", lambda g: {"a": g["a"], "c": g["c"]}),
    ],
)
def test_pre_clipping_transform_matches_a_loop(name, transform):
    loss, params, batch = _mlp()
    keys = [None] * B
    fn = clipped_grad(loss, 0.7, pre_clipping_transform=transform)  # method='auto' -> vmap
    got, info = jax.jit(fn)(params, batch)
    want = _loop(lambda p, x, k: loss(p, x), params, batch, keys, 0.7, transform)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want), name
    _close(got, want)
    assert fn.sensitivity() == 0.7 and info.norms.shape == (B,)
    g_mb, _ = clipped_grad(loss, 0.7, pre_clipping_transform=transform, microbatch_size=3)(
        params, batch
    )
    _close(g_mb, jax.tree_util.tree_map(np.asarray, got), rtol=1e-5)


def test_pre_clipping_transform_is_refused_by_ghost():
    loss, _, _ = _mlp()
    with pytest.raises(ValueError, match=r"pre_clipping_transform.*ghost"):
        clipped_grad(loss, 1.0, method="ghost", pre_clipping_transform=lambda g: g)
    with pytest.raises(TypeError, match="pre_clipping_transform"):
        clipped_grad(loss, 1.0, pre_clipping_transform=3)


def test_rescale_to_unit_norm_divides_by_the_clip_norm():
    loss, params, batch = _mlp()
    plain = clipped_grad(loss, 0.25)
    unit = clipped_grad(loss, 0.25, rescale_to_unit_norm=True)
    g, _ = plain(params, batch)
    u, _ = unit(params, batch)
    _close(u, jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64) / 0.25, g), rtol=1e-6)
    assert (
        unit.sensitivity() == 1.0
        and unit.sensitivity("replace") == 2.0
        and plain.sensitivity() == 0.25
    )
    one = jax.tree_util.tree_map(lambda x: x[:1], batch)  # a single example: norm <= 1 as stored
    u1, _ = unit(params, one)
    assert (
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree_util.tree_leaves(u1)))
        <= 1.0
    )
    with pytest.raises(ValueError, match="rescale_to_unit_norm"):
        clipped_grad(loss, 0.0, rescale_to_unit_norm=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_dtype_sets_the_output_dtype(dtype):
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        dtype = jnp.float32
    loss, params, batch = _mlp()
    ref, _ = clipped_grad(loss, 1.0)(params, batch)
    for narrow in (jnp.bfloat16, jnp.float16):  # a sum rounded to 16 bits before the noise
        with pytest.raises(ValueError, match="before any noise"):
            clipped_grad(loss, 1.0, dtype=narrow)
    for mb in (None, 3):
        got, _ = clipped_grad(loss, 1.0, dtype=dtype, microbatch_size=mb)(params, batch)
        assert all(x.dtype == dtype for x in jax.tree_util.tree_leaves(got))
        # a few units of the output dtype, and at least float32 summation-order noise (microbatches)
        tol = max(float(jnp.finfo(dtype).eps) * 4, 16 * float(jnp.finfo(jnp.float32).eps))
        _close(got, jax.tree_util.tree_map(np.asarray, ref), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="dtype"):
        clipped_grad(loss, 1.0, dtype=jnp.int32)


def test_loss_closing_over_a_batch_length_array_gets_the_contract():
    loss, params, batch = _mlp()
    weights = jnp.arange(B, dtype=jnp.float32)

    def bad(p, x):
        return loss(p, x) * weights  # shape (B,) for the full batch only

    with pytest.raises(ValueError, match="each computed from its own example alone"):
        clipped_grad(bad, 1.0)(params, batch)

    def bad_shape(p, x):
        return (
            jnp.broadcast_to(jnp.sum(loss(p, x)), (x.shape[0],)) + 0.0 * weights
        )  # (B,) broadcasts from (B,)

    with pytest.raises(ValueError, match="own example alone"):
        jax.jit(clipped_grad(bad_shape, 1.0, method="ghost"))(params, batch)


def test_both_spellings_of_the_clip_norm_are_accepted_without_a_warning():
    loss, params, batch = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = clipped_grad(loss, l2_norm_clip=0.3)(params, batch)[0]
        canonical = clipped_grad(loss, l2_clip_norm=0.3)(params, batch)[0]
    want = clipped_grad(loss, 0.3)(params, batch)[0]
    for g in (got, canonical):
        jax.tree.map(np.testing.assert_array_equal, g, want)
    with pytest.raises(
        TypeError, match=r"clipped_grad: got both `l2_clip_norm` and `l2_norm_clip`"
    ):
        clipped_grad(loss, 0.3, l2_norm_clip=0.3)
    with pytest.raises(TypeError, match="l2_clip_norm"):
        clipped_grad(loss)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_rescaled_example_just_below_the_clip_norm_stays_within_norm_one(method):
    """An example whose norm is a few units below C is not clipped; divided by C and stored, its
    norm (float64 of the stored values) must still be at most 1: the division is lowered by the
    rounding margin (before, about 1 in 200 such examples came out an ulp above 1)."""
    r = np.random.default_rng(7)
    d, clip = 5, 1.7

    def loss(p, b):
        return b["x"] @ p["w"]  # per-example gradient: x

    f = jax.jit(clipped_grad(loss, clip, method=method, rescale_to_unit_norm=True))
    worst = 0.0
    for _ in range(300):
        v = r.normal(size=d)
        x = np.asarray(v / np.linalg.norm(v) * clip * (1 - r.integers(0, 4) * 2.0**-24), np.float32)
        g, _ = f({"w": jnp.zeros(d, jnp.float32)}, {"x": jnp.asarray(x[None])})
        worst = max(worst, float(np.linalg.norm(np.asarray(g["w"], np.float64))))
    assert worst <= 1.0
    assert worst > 1.0 - 2e-6  # lowered by a few units only (the factor's margin, the division's)
