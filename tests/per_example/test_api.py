"""Tests for gradclip_jax.clipped_grad (the api module): the vmap strategy."""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from gradclip_jax import (
    ClippedGradInfo,
    GhostFallbackWarning,
    clipped_grad,
    dp_aggregate,
    per_example_global_norm_clip,
    per_example_layer_norm_clip,
    per_example_norms,
)
from tests.per_example.models import (
    MODELS,
    B,
    assert_tree_close,
    cnn_setup,
    loop_reference,
    median_clip,
    mlp_setup,
    random_per_example_grads,
)

# ----------------------------------------------------------------------------
# clipped_grad against the loop
# ----------------------------------------------------------------------------


@functools.cache
def _model(name):
    """One loss function per model: the loop reference's per-example gradient compiles once for
    the three microbatch sizes (it is cached by the loss function)."""
    return MODELS[name]()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("microbatch_size", [None, 1, 3])
def test_clipped_grad_matches_loop(model, microbatch_size):
    loss, params, data = _model(model)
    clip = median_clip(loss, params, data)
    grad_fn = clipped_grad(loss, clip, microbatch_size=microbatch_size)
    grads, info = jax.jit(grad_fn)(params, data)
    ref, ref_norms, ref_clipped = loop_reference(loss, params, data, clip)
    assert isinstance(info, ClippedGradInfo)
    assert_tree_close(grads, ref)
    np.testing.assert_allclose(info.norms, ref_norms, rtol=1e-5)
    assert int(info.num_clipped) == ref_clipped
    assert 0 < ref_clipped < B  # the test exercises both branches
    np.testing.assert_allclose(info.values, loss(params, data), rtol=1e-5, atol=1e-6)
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)


def test_microbatch_size_does_not_change_result():
    loss, params, data = mlp_setup(batch=10)
    outs = [
        jax.jit(clipped_grad(loss, 1.0, microbatch_size=m))(params, data)
        for m in (None, 1, 3, 4, 64)
    ]
    for g, info in outs[1:]:
        assert_tree_close(g, outs[0][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(info.norms, outs[0][1].norms, rtol=1e-6)
        assert int(info.num_clipped) == int(outs[0][1].num_clipped)


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_padding_mask(microbatch_size):
    loss, params, data = mlp_setup()
    mask = np.array([True, False, True, True, False, True, True])
    # Padding rows may hold garbage, even NaN: they must contribute nothing.
    data = dict(data, x=data["x"].at[1].set(jnp.nan).at[4].set(1e30))
    clip = 0.8
    grads, info = jax.jit(clipped_grad(loss, clip, microbatch_size=microbatch_size))(
        params, data, mask=jnp.asarray(mask)
    )
    ref, ref_norms, ref_clipped = loop_reference(loss, params, data, clip, mask=mask)
    assert_tree_close(grads, ref)
    assert int(info.num_clipped) == ref_clipped
    np.testing.assert_allclose(np.asarray(info.norms)[mask], ref_norms[mask], rtol=1e-5)
    assert np.all(np.asarray(info.norms)[~mask] == 0)
    # all padding: exactly zero
    zeros, info0 = jax.jit(clipped_grad(loss, clip, microbatch_size=microbatch_size))(
        params, data, mask=jnp.zeros(B, bool)
    )
    assert all(float(jnp.max(jnp.abs(z))) == 0.0 for z in jax.tree.leaves(zeros))
    assert int(info0.num_clipped) == 0


def test_has_aux():
    loss, params, data = mlp_setup()

    def loss_aux(p, b):
        losses = loss(p, b)
        h = b["x"] @ p["l1"]["w"]
        return losses, {"h": h, "count": jnp.sum(b["y"]), "tag": jnp.ones((2, 2))}

    for mb in (None, 3):
        grads, info = jax.jit(clipped_grad(loss_aux, 0.5, has_aux=True, microbatch_size=mb))(
            params, data
        )
        ref, _, _ = loop_reference(loss, params, data, 0.5)
        assert_tree_close(grads, ref)
        np.testing.assert_allclose(
            info.aux["h"], data["x"] @ params["l1"]["w"], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(info.aux["count"], data["y"])
        assert info.aux["tag"].shape == (B, 2, 2)
    _, info = clipped_grad(loss, 0.5)(params, data)
    assert info.aux is None


@pytest.mark.parametrize("per_layer", [True, "size"])
def test_per_layer(per_layer):
    loss, params, data = mlp_setup()
    clip = 1.5
    grads, info = jax.jit(clipped_grad(loss, clip, per_layer=per_layer, microbatch_size=3))(
        params, data
    )
    leaves = jax.tree.leaves(params)
    if per_layer is True:
        clips = [clip / math.sqrt(len(leaves))] * len(leaves)
    else:
        total = sum(x.size for x in leaves)
        clips = [clip * math.sqrt(x.size / total) for x in leaves]
    ref, _, _ = loop_reference(loss, params, data, clip, layer_clips=clips)
    assert_tree_close(grads, ref)
    # per-leaf reports
    assert jax.tree.structure(info.num_clipped) == jax.tree.structure(params)
    assert all(n.shape == (B,) for n in jax.tree.leaves(info.norms))
    assert clipped_grad(loss, clip, per_layer=per_layer).sensitivity() == pytest.approx(clip)


def test_per_layer_tree_of_norms():
    loss, params, data = mlp_setup()
    clips = {"l1": {"w": 0.5, "b": 0.2}, "l2": {"w": 1.0, "b": 0.1}}
    grad_fn = clipped_grad(loss, clips)
    grads, _ = jax.jit(grad_fn)(params, data)
    ref, _, _ = loop_reference(loss, params, data, None, layer_clips=jax.tree.leaves(clips))
    assert_tree_close(grads, ref)
    assert grad_fn.sensitivity() == pytest.approx(math.sqrt(0.25 + 0.04 + 1.0 + 0.01))
    with pytest.raises(ValueError, match="must be a prefix of the structure of params"):
        clipped_grad(loss, {"l1": 1.0, "l3": 1.0})(params, data)
    for per_layer in (True, "size", "uniform"):  # it would be ignored: the tree decides
        with pytest.raises(ValueError, match=r"per_layer=.* with a tree of clip norms"):
            clipped_grad(loss, clips, per_layer=per_layer)


def test_per_layer_prefix_tree_clips_each_subtree_jointly():
    """A clip tree that stops at a subtree (jax-privacy's prefix layout) clips that subtree's leaves
    jointly: the same as clipping the subtree alone, on both paths; norms and counts per subtree."""
    loss, params, data = mlp_setup()
    clips = {"l1": 0.5, "l2": 1.0}
    for method in ("vmap", "ghost"):
        grads, info = jax.jit(clipped_grad(loss, clips, method=method))(params, data)
        for name, c in clips.items():

            def sub_loss(q, b, name=name):
                return loss({**params, name: q}, b)

            want, want_info = clipped_grad(sub_loss, c, method="vmap")(params[name], data)
            assert_tree_close(grads[name], want)
            np.testing.assert_allclose(info.norms[name], want_info.norms, rtol=1e-5)
            assert int(info.num_clipped[name]) == int(want_info.num_clipped)
    assert clipped_grad(loss, clips).sensitivity() == pytest.approx(math.sqrt(0.25 + 1.0))


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_normalize(microbatch_size):
    loss, params, data = cnn_setup()
    grads, info = jax.jit(
        clipped_grad(loss, 2.0, normalize=True, gamma=0.01, microbatch_size=microbatch_size)
    )(params, data)
    ref, ref_norms, _ = loop_reference(loss, params, data, 2.0, mode="normalize", gamma=0.01)
    assert_tree_close(grads, ref)
    np.testing.assert_allclose(info.norms, ref_norms, rtol=1e-5)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_an_invalid_run_time_gamma_or_clip_norm_gives_nan(method):
    """Python values are refused when the function is made; traced ones (inject_hyperparams, a
    sweep under vmap) were used as given: gamma = -0.59 scaled an example of norm 0.6 to 60
    with C = 1 (sensitivity() still 1), and a negative C flipped the sum's sign."""
    x = jnp.array([[0.6, 0.0], [0.0, 0.3]])

    def loss(w, b):
        return b @ w

    @jax.jit
    def run(c, gamma):
        grad_fn = clipped_grad(loss, c, normalize=True, gamma=gamma, method=method)
        return grad_fn(jnp.zeros(2), x)[0], grad_fn.sensitivity()

    ok, sens = run(1.0, 0.01)
    assert np.all(np.isfinite(ok)) and float(sens) == 1.0
    for c, gamma in ((1.0, -0.59), (1.0, jnp.nan), (-1.0, 0.01), (jnp.nan, 0.01)):
        out, _ = run(c, gamma)
        assert np.all(np.isnan(np.asarray(out))), (c, gamma, out)
    assert np.isnan(float(run(-1.0, 0.01)[1]))


def test_zero_gradient_examples_no_nan():
    def loss(w, b):  # linear: the gradient of example i is x_i
        return b["x"] @ w

    w = jnp.ones(3)
    x = jnp.array([[0.0, 0, 0], [3, 4, 0], [0, 0, 0], [0.1, 0, 0]])
    for kwargs in ({}, {"normalize": True}, {"normalize": True, "gamma": 0.0}, {"per_layer": True}):
        for clip in (0.0, 1.0):
            grads, info = jax.jit(clipped_grad(loss, clip, **kwargs))(w, {"x": x})
            assert np.all(np.isfinite(grads)), (kwargs, clip)
            assert np.all(np.isfinite(info.norms))
    grads, info = jax.jit(clipped_grad(loss, 1.0))(w, {"x": x})
    np.testing.assert_allclose(grads, [0.6 + 0.1, 0.8, 0.0], rtol=1e-6)
    assert int(info.num_clipped) == 1


def test_nan_safe():
    loss, params, data = mlp_setup()
    bad = dict(data, x=data["x"].at[2].set(jnp.nan))
    good_mask = np.arange(B) != 2
    grads, info = jax.jit(clipped_grad(loss, 0.7))(params, bad)
    ref, _, _ = loop_reference(loss, params, data, 0.7, mask=good_mask)
    assert_tree_close(grads, ref)
    assert np.isnan(np.asarray(info.norms)[2])
    grads_unsafe, _ = jax.jit(clipped_grad(loss, 0.7, nan_safe=False))(params, bad)
    assert all(np.any(np.isnan(g)) for g in jax.tree.leaves(grads_unsafe))


def test_bfloat16_params_accumulate_in_float32():
    loss, params, data = mlp_setup()
    params16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    def loss16(p, b):
        return loss(p, dict(b, x=b["x"].astype(jnp.bfloat16))).astype(jnp.float32)

    grads, info = jax.jit(clipped_grad(loss16, 0.5))(params16, data)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert info.norms.dtype == jnp.float32
    # each clipped contribution has norm <= C: check one example at a time
    one_fn = jax.jit(clipped_grad(loss16, 0.5))
    for i in range(B):
        one = jax.tree.map(lambda x: x[i : i + 1], data)
        g, _ = one_fn(params16, one)
        n = math.sqrt(
            sum(float(np.sum(np.asarray(leaf, np.float64) ** 2)) for leaf in jax.tree.leaves(g))
        )
        assert n <= 0.5 * (1 + 1e-5)


def test_extreme_scales_contribution_bounded():
    def loss(w, b):  # linear: the gradient of example i is x_i
        return b["x"] @ w

    w = jnp.ones(4)
    rows = [
        [1e30, 1e30, -1e30, 1e30],  # squares overflow float32; the norm (2e30) does not
        [1e-30, 2e-30, 0, 0],  # squares underflow
        [2e37, -2e37, 2e37, 2e37],  # near the top of the range, norm 4e37
        [1e38, 0, 0, 0],  # max|x| ~ 1e38: the norm still fits
        [3e38, 3e38, 3e38, 3e38],  # the norm (6e38) does not fit in float32
    ]
    x = jnp.array(rows, jnp.float32)
    grad_fn = jax.jit(clipped_grad(loss, 1.0))
    for i, row in enumerate(rows):
        g, info = grad_fn(w, {"x": x[i : i + 1]})
        true = float(np.linalg.norm(np.asarray(row, np.float64)))
        n = float(np.linalg.norm(np.asarray(g, np.float64)))
        assert np.all(np.isfinite(g))
        assert n <= 1.0 * (1 + 1e-6), (row, n)
        reported = float(info.norms[0])
        # the reported norm is right, or inf when it cannot be represented (never too small)
        assert reported == pytest.approx(true, rel=1e-6) or reported == np.inf, (row, reported)
    for i in (0, 1, 2):
        _, info = grad_fn(w, {"x": x[i : i + 1]})
        np.testing.assert_allclose(
            float(info.norms[0]), np.linalg.norm(np.asarray(rows[i], np.float64)), rtol=1e-6
        )
    # leaves near the top of the range whose squares (and sum of squares) overflow
    big = [jnp.array([[5e37, 0.0]]), jnp.array([[3e37]])]
    np.testing.assert_allclose(per_example_norms(big), [math.hypot(5e37, 3e37)], rtol=1e-6)
    out, n_clipped = jax.jit(per_example_global_norm_clip)(big, 1.0)
    assert int(n_clipped) == 1
    assert math.sqrt(sum(float(np.sum(np.asarray(o, np.float64) ** 2)) for o in out)) <= 1.0 + 1e-6
    # the same guarantees for the optax-style functions, all rows at once
    for fn in (per_example_global_norm_clip, per_example_layer_norm_clip):
        out, _ = jax.jit(fn)([x], 1.0)
        assert float(np.linalg.norm(np.asarray(out[0], np.float64))) <= 5.0


def test_extreme_scales_per_layer_each_leaf_bounded_and_its_norm_right_or_inf():
    """Per-layer clipping through the same guard: each leaf's norm is measured on its own (a
    norm that fits is reported exactly even when another leaf's does not)."""

    def loss(p, b):  # linear: example i's gradient is x_i for "a" and its first half for "b"
        return b["x"] @ p["a"] + b["x"][..., :2] @ p["b"]

    params = {"a": jnp.ones(4), "b": jnp.ones(2)}
    rows = [[1e30, 1e30, -1e30, 1e30], [1e-30, 2e-30, 0, 0], [1.0, 2.0, 3e38, 3e38]]
    grad_fn = jax.jit(clipped_grad(loss, 1.0, per_layer=True))
    for row in rows:
        g, info = grad_fn(params, {"x": jnp.array([row], jnp.float32)})
        for name, part in (("a", row), ("b", row[:2])):
            true = float(np.linalg.norm(np.asarray(part, np.float64)))
            got = np.asarray(g[name], np.float64)
            assert np.all(np.isfinite(got))
            assert np.linalg.norm(got) <= 2**-0.5 * (1 + 1e-6), (row, name)
            reported = float(info.norms[name][0])
            assert reported == pytest.approx(true, rel=1e-6) or reported == np.inf, (row, name)
            if true < 3e38:  # fits in float32: reported exactly
                assert reported == pytest.approx(true, rel=1e-6), (row, name)


def _overflowing_batch():
    """Two leaves (a tree prefix groups them as ``a`` and ``b``) and two examples: the first's
    gradient is finite, but its norm (8.5e38) does not fit in float32."""

    def loss(p, b):  # linear: example i's gradient is x_i (and its first half, twice)
        return b["x"] @ p["a"]["w"] + b["x"][..., :2] @ p["a"]["v"] + b["x"][..., :2] @ p["b"]

    params = {"a": {"w": jnp.ones(4), "v": jnp.ones(2)}, "b": jnp.ones(2)}
    x = jnp.array([[3e38, 3e38, 3e38, 3e38], [1.0, 2.0, 3.0, 4.0]], jnp.float32)
    return loss, params, {"x": x}


@pytest.mark.parametrize("method", ["vmap", "ghost", "grid"])
@pytest.mark.parametrize("ones", [1, 16])
def test_an_example_measured_at_the_clip_norm_stays_within_it(method, ones):
    """``[4096, 1, ..., 1]`` against ``C = 4096``: float32's sum of squares rounds the ones away,
    so the measured norm is ``C`` while the exact one is above it. Such an example was added
    unscaled (exact norm 4096.0020 with 16 ones; on the integer grid 4096.0001): an example is
    now left unscaled only when its measured norm is below ``C`` by the rounding margin."""
    from gradclip_jax.dp.hardened import grid_clipped_sum

    clip = 4096.0
    x = np.ones(ones + 1, np.float32)
    x[0] = clip
    if method == "grid":
        summed = grid_clipped_sum({"w": jnp.asarray(x)[None]}, clip, 1.0)["w"]
    else:
        fn = clipped_grad(lambda p, b: b["x"] @ p["w"], clip, method=method)
        summed = jax.jit(fn)({"w": jnp.zeros(ones + 1)}, {"x": jnp.asarray(x[None])})[0]["w"]
    assert np.linalg.norm(np.asarray(summed, np.float64)) <= clip


@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("nan_safe", [True, False])
@pytest.mark.parametrize("clip", ["global", "per_layer", "tree"])
def test_an_example_whose_norm_overflows_adds_nothing(method, nan_safe, clip):
    """A finite gradient whose norm is ``inf`` in float32 adds exactly zero: ``c / inf``, as in
    optax and jax-privacy. Its factor was 1 (a non-finite norm's) where no guard replaced it:
    the clip tree's groups on the vmap path and every clip on the ghost path with
    ``nan_safe=False`` let it into the sum unclipped, 8.5e38 against a bound of 1 or sqrt(2).
    """
    loss, params, batch = _overflowing_batch()
    clip_norm = {"a": 1.0, "b": 1.0} if clip == "tree" else 1.0
    f = clipped_grad(
        loss, clip_norm, per_layer=clip == "per_layer", method=method, nan_safe=nan_safe
    )
    g, info = jax.jit(f)(params, batch)
    alone, _ = jax.jit(f)(params, {"x": batch["x"][1:]})
    assert_tree_close(g, alone, rtol=0, atol=0)  # the first example added nothing
    assert _dist(g, jax.tree.map(jnp.zeros_like, g)) <= (
        math.sqrt(2) if clip == "tree" else 1.0
    ) * (1 + 1e-6)
    norms = jax.tree.leaves(info.norms)
    assert all(float(n[0]) == np.inf for n in norms), norms  # reported: does not fit


def test_the_optax_named_and_aggregate_clips_drop_an_overflowing_norm():
    """The same example through the optax-named per-example clips and ``dp_aggregate``."""
    rows = [jnp.array([[3e38, 3e38, 3e38, 3e38], [1.0, 2.0, 3.0, 4.0]], jnp.float32)]
    for fn in (per_example_global_norm_clip, per_example_layer_norm_clip):
        out, _ = jax.jit(fn)(rows, 1.0)
        alone, _ = jax.jit(fn)([rows[0][1:]], 1.0)
        np.testing.assert_array_equal(out[0], alone[0])
    tx = dp_aggregate(l2_clip_norm=1.0, noise_multiplier=0.0, seed=0, batch_size=1)
    updates, _ = jax.jit(tx.update)({"w": rows[0]}, tx.init({"w": jnp.zeros(4)}))
    alone, _ = jax.jit(tx.update)({"w": rows[0][1:]}, tx.init({"w": jnp.zeros(4)}))
    np.testing.assert_array_equal(updates["w"], alone["w"])


# ----------------------------------------------------------------------------
# Neighbouring datasets: the clipped sum moves by at most the sensitivity
# ----------------------------------------------------------------------------


def _dist(a, b):
    return math.sqrt(
        sum(
            float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )
    )


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"per_layer": True}, {"normalize": True}, {"microbatch_size": 3}],
    ids=["clip", "per_layer", "normalize", "microbatch"],
)
def test_neighbours_move_sum_by_at_most_sensitivity(kwargs):
    loss, params, data = mlp_setup()
    clip = 0.3  # small: every example is clipped
    grad_fn = clipped_grad(loss, clip, **kwargs)
    f = jax.jit(grad_fn)
    full, _ = f(params, data)
    tol = 1e-5
    for i in (0, 3, B - 1):
        # add / remove one example
        keep = np.arange(B) != i
        removed, _ = f(params, jax.tree.map(lambda x: x[keep], data))
        assert _dist(full, removed) <= grad_fn.sensitivity("add_or_remove") * (1 + tol)
        # zero-out (padding) one example
        zeroed, _ = f(params, data, mask=jnp.asarray(keep))
        assert _dist(full, zeroed) <= grad_fn.sensitivity("zero_out") * (1 + tol)
        # replace one example by an extreme one, and by a NaN one
        for value in (1e6, -1e30, jnp.nan):
            other = dict(
                data, x=data["x"].at[i].set(value), y=data["y"].at[i].set((data["y"][i] + 1) % 3)
            )
            replaced, _ = f(params, other)
            d = _dist(full, replaced)
            assert math.isfinite(d)
            assert d <= grad_fn.sensitivity("replace") * (1 + tol)
    assert grad_fn.sensitivity() == pytest.approx(clip)
    assert grad_fn.sensitivity("replace") == pytest.approx(2 * clip)


def test_sensitivity_relations():
    loss, _, _ = mlp_setup()
    g = clipped_grad(loss, 2.5)
    assert g.sensitivity() == 2.5
    assert g.sensitivity("replace_one") == 5.0
    assert g.sensitivity("zero_out") == 2.5
    with pytest.raises(ValueError, match="neighbouring relation"):
        g.sensitivity("swap")
    dp_accounting = pytest.importorskip("dp_accounting")
    assert g.sensitivity(dp_accounting.NeighboringRelation.REPLACE_ONE) == 5.0
    assert g.sensitivity(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE) == 2.5
    # a traced clip norm gives a traced sensitivity
    out = jax.jit(lambda c: clipped_grad(loss, c).sensitivity("replace"))(1.5)
    assert float(out) == 3.0


# ----------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------


def test_bad_batch_and_loss_errors():
    loss, params, data = mlp_setup()
    f = clipped_grad(loss, 1.0)
    with pytest.raises(ValueError, match=r"\['scale'\].*scalar"):
        f(params, dict(data, scale=jnp.ones(())))
    with pytest.raises(ValueError, match=r"\['y'\] has batch size 6.*\['x'\] has batch size 7"):
        f(params, dict(data, y=data["y"][:6]))
    with pytest.raises(
        ValueError,
        match=r"loss_fn must return per-example losses of shape \(B,\) = \(7,\).*got shape \(\)",
    ):
        clipped_grad(lambda p, b: jnp.mean(loss(p, b)), 1.0)(params, data)
    with pytest.raises(ValueError, match=r"got shape \(7, 1\)"):
        clipped_grad(lambda p, b: loss(p, b)[:, None], 1.0)(params, data)
    with pytest.raises(ValueError, match="pair"):
        clipped_grad(loss, 1.0, has_aux=True)(params, data)
    with pytest.raises(ValueError, match="`mask`"):
        f(params, data, mask=jnp.ones(5, bool))
    with pytest.raises(ValueError, match="no array leaf"):
        f(params, {})


def test_bad_construction_errors():
    loss, _, _ = mlp_setup()
    clipped_grad(loss, 1.0, method="ghost")  # available since the ghost module landed
    with pytest.raises(ValueError, match="unknown method"):
        clipped_grad(loss, 1.0, method="magic")
    for mb in (0, -2):
        with pytest.raises(ValueError, match="`microbatch_size` must be >= 1"):
            clipped_grad(loss, 1.0, microbatch_size=mb)
    for mb in (
        1.5,
        True,
    ):  # not an int: TypeError, as every int argument (one check, _core.validation)
        with pytest.raises(TypeError, match="`microbatch_size` must be an int"):
            clipped_grad(loss, 1.0, microbatch_size=mb)
    for c in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="l2_clip_norm"):
            clipped_grad(loss, c)
    with pytest.raises(ValueError, match="gamma"):
        clipped_grad(loss, 1.0, normalize=True, gamma=-1.0)
    with pytest.raises(ValueError, match="per_layer"):
        clipped_grad(loss, 1.0, per_layer="bogus")
    # 'auto' and 'vmap' are accepted
    clipped_grad(loss, 1.0, method="auto")
    clipped_grad(loss, 1.0, method="vmap")


# ----------------------------------------------------------------------------
# Data parallel: explicit, automatic and shard_map sharding of the batch
# ----------------------------------------------------------------------------

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


@pytest.mark.slow
@needs_8
def test_explicit_sharding_matches_single_device():
    loss, params, data = mlp_setup(batch=16)
    grads16 = random_per_example_grads(3, [(3, 4), (5,)], batch=16)
    ref_sum, ref_n = per_example_global_norm_clip(grads16, 1.0)
    ref_layer, _ = per_example_layer_norm_clip(grads16, 1.0)
    ref_cg, ref_info = clipped_grad(loss, 0.5)(params, data)
    mask = jnp.arange(16) % 3 != 0
    ref_masked, _ = clipped_grad(loss, 0.5)(params, data, mask=mask)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        g_sh = [jax.sharding.reshard(g, P("x")) for g in grads16]
        # optax fails here (tensordot over a sharded contracting axis); we do not
        with pytest.raises(Exception, match=r"(?i)shard"):
            jax.jit(optax.per_example_global_norm_clip)(g_sh, 1.0)
        out, n = jax.jit(per_example_global_norm_clip)(g_sh, 1.0)
        assert_tree_close(out, ref_sum, rtol=1e-6, atol=1e-6)
        assert int(n) == int(ref_n)
        out_l, _ = jax.jit(per_example_layer_norm_clip)(g_sh, 1.0)
        assert_tree_close(out_l, ref_layer, rtol=1e-6, atol=1e-6)
        p_rep = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), params)
        d_sh = jax.tree.map(lambda x: jax.sharding.reshard(x, P("x")), data)
        for mb in (None, 8):
            cg, info = jax.jit(clipped_grad(loss, 0.5, microbatch_size=mb))(p_rep, d_sh)
            assert_tree_close(cg, ref_cg)
            np.testing.assert_allclose(info.norms, ref_info.norms, rtol=1e-5)
            assert int(info.num_clipped) == int(ref_info.num_clipped)
            cgm, _ = jax.jit(clipped_grad(loss, 0.5, microbatch_size=mb))(p_rep, d_sh, mask=mask)
            assert_tree_close(cgm, ref_masked)
        with pytest.raises(ValueError, match="multiple of 8"):
            jax.jit(clipped_grad(loss, 0.5, microbatch_size=4))(p_rep, d_sh)


@needs_8
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_explicitly_sharded_arrays_need_no_mesh_context(method):
    """Arrays placed on an explicit mesh carry it: a jitted step on them, outside
    ``jax.set_mesh``, gives the one-device sums (the internal reshards and dot outputs name
    the arrays' mesh; a bare PartitionSpec there raised "not under a mesh context")."""
    loss, params, data = mlp_setup(batch=16)
    mask = jnp.arange(16) % 3 != 0
    ref, _ = clipped_grad(loss, 0.5, method=method)(params, data, mask=mask)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    d_sh = jax.device_put(data, NamedSharding(mesh, P("x")))
    p_rep = jax.device_put(params, NamedSharding(mesh, P()))
    out, _ = jax.jit(clipped_grad(loss, 0.5, method=method))(p_rep, d_sh, mask=mask)
    assert_tree_close(out, ref)
    # params left where they are: the ghost path's per-row gradients vmap the sharded batch,
    # which JAX resolved against an empty mesh ("Resource axis: x ... not found in mesh"); jax
    # 0.9 refuses the sums' contraction over the sharded batch there (ShardingTypeError), left
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 10):
        out, _ = jax.jit(clipped_grad(loss, 0.5, method=method))(params, d_sh, mask=mask)
        assert_tree_close(out, ref)


@needs_8
def test_automatic_sharding_matches_single_device():
    loss, params, data = mlp_setup(batch=16)
    ref, ref_info = jax.jit(clipped_grad(loss, 0.5))(params, data)  # eagerly: op by op
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    d_sh = jax.device_put(data, NamedSharding(mesh, P("x")))
    for mb in (None, 3):
        cg, info = jax.jit(clipped_grad(loss, 0.5, microbatch_size=mb))(params, d_sh)
        assert_tree_close(cg, ref)
        assert int(info.num_clipped) == int(ref_info.num_clipped)
    g = jax.device_put(random_per_example_grads(4, [(3, 4)], batch=16), NamedSharding(mesh, P("x")))
    out, _ = jax.jit(per_example_global_norm_clip)(g, 1.0)
    ref_o, _ = optax.per_example_global_norm_clip(jax.device_get(g), 1.0)
    assert_tree_close(out, ref_o, rtol=1e-6, atol=1e-6)


@needs_8
@pytest.mark.parametrize("microbatch_size", [None, 1])
def test_shard_map_psum_matches_single_device(microbatch_size):
    loss, params, data = mlp_setup(batch=16)
    ref, ref_info = jax.jit(clipped_grad(loss, 0.5))(params, data)
    mesh = jax.make_mesh((8,), ("x",))
    # replicated params inside shard_map: each device clips its own examples only
    grad_fn = clipped_grad(loss, 0.5, microbatch_size=microbatch_size)

    def local(p, d):
        g, info = grad_fn(p, d)
        return jax.lax.psum(g, "x"), jax.lax.psum(info.num_clipped, "x"), info.norms

    f = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P(), P("x")))
    )
    d_sh = jax.device_put(data, NamedSharding(mesh, P("x")))
    p_rep = jax.device_put(params, NamedSharding(mesh, P()))
    g, n, norms = f(p_rep, d_sh)
    assert_tree_close(g, ref)
    assert int(n) == int(ref_info.num_clipped)
    np.testing.assert_allclose(norms, ref_info.norms, rtol=1e-5)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_parameter_sharded_inside_shard_map_is_refused(method):
    """A (data, model) mesh, w1 split by columns over 'model' inside shard_map (tensor
    parallelism by hand): each device measured the norms of its shard only, and an example
    added 1.86 against a clip norm of 1 (silently with nan_safe=False)."""
    r = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(r.normal(size=(4, 8)), jnp.float32),
        "w2": jnp.asarray(r.normal(size=(8, 2)), jnp.float32),
    }
    data = jnp.asarray(r.normal(size=(8, 4)), jnp.float32)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    grad_fn = clipped_grad(
        lambda p, x: jnp.sum(jax.lax.psum(jnp.tanh(x @ p["w1"]) @ p["w2"], "model") ** 2, -1),
        1.0,
        method=method,
        nan_safe=False,
    )

    def local(p, x):
        return jax.lax.psum(grad_fn(p, x)[0], "data")

    f = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=({"w1": P(None, "model"), "w2": P("model", None)}, P("data")),
        out_specs={"w1": P(None, "model"), "w2": P("model", None)},
    )
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    data = jax.device_put(data, NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"parameter leaf \['w1'\] differs across the manual mesh"):
        jax.jit(f)(params, data)


@needs_8
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_parameters_gathered_in_the_loss_inside_shard_map_are_refused(method):
    """FSDP by hand: w1's rows split over 'data' like the batch and gathered in the loss. The
    gathered gradient's transpose summed example b of every device before clipping: the clipped
    sum was off by 0.46 an element (norm 3.16 against 3.43), silently. Gathering the
    parameters first, as the error says, gives the unsharded clipped sum."""
    r = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(r.normal(size=(8, 8)), jnp.float32),
        "w2": jnp.asarray(r.normal(size=(8, 2)), jnp.float32),
    }
    data = jnp.asarray(r.normal(size=(8, 8)), jnp.float32)
    mesh = jax.make_mesh((4,), ("data",))

    def net(w1, w2, x):
        return jnp.sum((jnp.tanh(x @ w1) @ w2) ** 2, -1)

    ref, _ = jax.jit(clipped_grad(lambda p, x: net(p["w1"], p["w2"], x), 1.0, method=method))(
        params, data
    )
    gathered_in_loss = clipped_grad(
        lambda p, x: net(jax.lax.all_gather(p["w1"], "data", tiled=True), p["w2"], x),
        1.0,
        method=method,
    )
    whole = clipped_grad(lambda p, x: net(p["w1"], p["w2"], x), 1.0, method=method)

    def refused(p, x):
        return gathered_in_loss(p, x)[0]

    def gathered_first(p, x):
        g, _ = whole({"w1": jax.lax.all_gather(p["w1"], "data", tiled=True), "w2": p["w2"]}, x)
        return {
            "w1": jax.lax.psum_scatter(g["w1"], "data", tiled=True),
            "w2": jax.lax.psum(g["w2"], "data"),
        }

    specs = {"w1": P("data"), "w2": P()}
    p_sh = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    d_sh = jax.device_put(data, NamedSharding(mesh, P("data")))

    def run(local):
        return jax.jit(
            jax.shard_map(local, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs)
        )(p_sh, d_sh)

    with pytest.raises(ValueError, match=r"calls 'all_gather' over the mesh axis 'data'"):
        run(refused)
    assert_tree_close(run(gathered_first), ref)


# ----------------------------------------------------------------------------
# Memory: microbatching bounds the compiled temporary memory
# ----------------------------------------------------------------------------


def test_microbatching_reduces_compiled_memory():
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.normal(size=(64, 64)), jnp.float32)}
    data = {"x": jnp.asarray(r.normal(size=(64, 64)), jnp.float32)}

    def loss(p, b):
        return jnp.sum(jnp.tanh(b["x"] @ p["w"]), axis=-1)

    def temp(mb):
        # the vmap path's per-example gradients are what microbatching bounds ('auto' takes the
        # ghost path here: no leaf falls back, and B x P outweighs the cotangents)
        f = jax.jit(clipped_grad(loss, 1.0, microbatch_size=mb, method="vmap"))
        return f.lower(params, data).compile().memory_analysis().temp_size_in_bytes

    sizes = [temp(mb) for mb in (None, 16, 4)]
    assert sizes[0] > sizes[1] > sizes[2], sizes
    assert sizes[0] >= 64 * 64 * 64 * 4  # the full batch materializes B x P floats


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_complex_parameters_get_complex_clipped_sums(method):
    """A complex leaf's clipped sum keeps its imaginary part; ghost clipping leaves complex
    operations to the per-example fallback (its rules measure real values)."""
    import warnings

    from gradclip_jax import clipped_grad, ghost_report

    def loss(p, b):
        y = jnp.sum(p["w"] * b, -1)
        return jnp.real(y * jnp.conj(y)) + jnp.sum(jnp.real(b) @ p["v"], -1)

    r = np.random.default_rng(1)
    b = jnp.asarray(r.standard_normal((5, 2)) + 1j * r.standard_normal((5, 2)), jnp.complex64)
    p = {"w": jnp.asarray([1 + 0.5j, -0.3j], jnp.complex64), "v": jnp.ones((2, 3))}
    clip = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # jitted: called eagerly, each operation is dispatched (and compiled) on its own
        got, _ = jax.jit(clipped_grad(loss, clip, method=method))(p, b)
    want = jax.tree.map(jnp.zeros_like, p)
    grad_one = jax.jit(jax.grad(lambda q, bi: loss(q, bi)[0]))  # one program for every example
    for i in range(5):
        gi = grad_one(p, b[i : i + 1])
        norm = np.sqrt(sum(float(jnp.sum(jnp.abs(x) ** 2)) for x in jax.tree.leaves(gi)))
        scale = min(1.0, clip / norm)
        want = jax.tree.map(lambda w, x, s=scale: w + s * x, want, gi)
    assert got["w"].dtype == jnp.complex64
    for k in p:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        as_f32, _ = jax.jit(clipped_grad(loss, clip, method=method, dtype=jnp.float32))(p, b)
    assert (
        as_f32["w"].dtype == jnp.complex64 and as_f32["v"].dtype == jnp.float32
    )  # a real dtype= keeps complex
    np.testing.assert_allclose(np.asarray(as_f32["w"]), np.asarray(want["w"]), rtol=1e-5, atol=1e-6)
    if method == "ghost":
        rep = ghost_report(loss, p, b)
        assert [k for k, _ in rep.ghost] == ["['v']"]
        assert "complex" in dict(rep.fallback)["['w']"]


def _bn_batch():
    r = np.random.default_rng(0)
    return {"x": r.normal(size=(8, 3)).astype(np.float32), "y": np.zeros(8, np.float32)}


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_flax_nnx_batchnorm_in_training_mode_is_named_with_its_remedies(method):
    """nnx's BatchNorm updates its BatchStat inside the traced loss: the error names BatchNorm and
    the remedies (was: a generic message around 'Cannot mutate BatchStat from a different trace level')."""
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.bn = nnx.Linear(3, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x)).sum(-1)

    model = Net(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, b):
        return (nnx.merge(graphdef, p, rest)(b["x"]) - b["y"]) ** 2

    with pytest.raises(
        ValueError,
        match=r"updates BatchNorm statistics.*GroupNorm or LayerNorm.*"
        r"use_running_average=True",
    ) as info:
        clipped_grad(loss_fn, 1.0, method=method)(params, _bn_batch())
    assert type(info.value.__cause__).__name__ == "TraceContextError"
    assert "BatchStat" in str(info.value.__cause__)
    model.eval()  # the remedy: statistics frozen outside the step
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)  # BatchNorm's scale: a vmap fallback
        grads, _ = clipped_grad(loss_fn, 1.0, method=method)(params, _bn_batch())
    assert jax.tree.structure(grads) == jax.tree.structure(params)


@pytest.mark.parametrize("mutable", [True, False])
def test_flax_linen_batchnorm_with_batch_statistics_is_named_with_its_remedies(mutable):
    """linen's BatchNorm(use_running_average=False): with mutable=['batch_stats'] it normalizes with
    statistics of the batch (a crossing, named as BatchNorm); without, flax refuses the update."""
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        train: bool = True

        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=not self.train)(nn.Dense(4)(x)).sum(-1)

    batch = _bn_batch()
    variables = Net().init(jax.random.key(0), batch["x"])

    model = Net()

    def loss_fn(p, b):
        v = {"params": p, "batch_stats": variables["batch_stats"]}
        out = (
            model.apply(v, b["x"], mutable=["batch_stats"])[0]
            if mutable
            else model.apply(v, b["x"])
        )
        return (out - b["y"]) ** 2

    with pytest.raises(
        ValueError, match=r"BatchNorm.*GroupNorm or LayerNorm.*use_running_average=True"
    ) as info:
        clipped_grad(loss_fn, 1.0)(variables["params"], batch)
    assert info.value.__cause__ is not None
    if not mutable:
        assert "batch_stats" in str(info.value.__cause__)

    def frozen(p, b):
        return (
            Net(train=False).apply({"params": p, "batch_stats": variables["batch_stats"]}, b["x"])
            - b["y"]
        ) ** 2

    grads, _ = clipped_grad(frozen, 1.0)(variables["params"], batch)
    assert jax.tree.structure(grads) == jax.tree.structure(variables["params"])
