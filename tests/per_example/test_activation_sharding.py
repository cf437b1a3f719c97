"""``gcx.with_sharding_constraint`` and ``gcx.batch_sharding``: activation annotations for the ghost
and the vmap paths.

The model's hidden activation is constrained to the batch's mesh axes. The ghost path and the
non-private step run the model on the whole batch; the vmap path on one example at a time (a
batch of one, under ``jax.vmap``), where :func:`jax.lax.with_sharding_constraint` would shard
that example's axis of size 1 over the devices, or, with ``spmd_axis_name`` naming the same
axes, be rejected by ``vmap``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import gradclip_jax as gcx
from tests.per_example.models import assert_tree_close
from tests.per_example.token_model import BATCH, ROWS, fsdp_placed, mesh_of, token_model

_ALL_GATHER = re.compile(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(")


def _mesh(shape=(2, 4)):
    return mesh_of(shape, axis_types=(AxisType.Auto,) * 2)


METHODS = {
    "ghost": {"method": "ghost"},
    "vmap": {"method": "vmap"},
    "vmap-spmd": {"method": "vmap", "spmd_axis_name": ROWS},
}


def _run_annotated(make, make_ref=None):
    """``make(losses)``, a gradient function of ``(params, data)``, of the annotated token model
    compiled on the 2x4 mesh: checked to gather no per-example-sized array and to hold no more
    temporaries than on the unannotated model, then run. Returns its output and the one-device
    output of ``(make_ref or make)`` on the unannotated model."""
    mesh = _mesh()
    rows = NamedSharding(mesh, P(ROWS, None, None))
    annotated, params, data = token_model(lambda h: gcx.with_sharding_constraint(h, rows))
    plain, _, _ = token_model()
    ref = jax.jit((make_ref or make)(plain))(params, data)
    p_sh, d_sh = fsdp_placed(mesh, params, data)

    def compiled(losses):
        return jax.jit(make(losses)).lower(p_sh, d_sh).compile()

    step = compiled(annotated)
    gathered = [
        dims for dims in _ALL_GATHER.findall(step.as_text()) if str(BATCH) in dims.split(",")
    ]
    assert not gathered, f"all-gathers of per-example-sized arrays: {gathered}"
    temp = step.memory_analysis().temp_size_in_bytes
    assert temp <= 1.1 * compiled(plain).memory_analysis().temp_size_in_bytes
    return step(p_sh, d_sh), ref


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.cpu_only(reason="the compiled memory and collectives of XLA:CPU's programs")
@pytest.mark.reads_compiled_names
@pytest.mark.parametrize("kwargs", METHODS.values(), ids=METHODS.keys())
def test_annotated_model_runs_sharded_on_every_path_at_no_cost(kwargs):
    """Annotated, each path computes the one-device result, gathers no per-example-sized array
    and holds no more temporaries than the same model without the annotation (with which
    ``spmd_axis_name`` alone is accepted too)."""
    (grads, info), (ref, ref_info) = _run_annotated(
        lambda losses: gcx.clipped_grad(losses, 0.05, **kwargs),
        lambda losses: gcx.clipped_grad(losses, 0.05, method=kwargs["method"]),
    )
    assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info.norms, ref_info.norms, rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.cpu_only(reason="the compiled memory and collectives of XLA:CPU's programs")
@pytest.mark.reads_compiled_names
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_jax_privacy_drop_in_with_keep_batch_dim_runs_annotated_sharded(method):
    """The drop-in hands ``fun`` one example as a batch of one (``keep_batch_dim``) on every
    path, the ghost path's trace of the whole batch included: annotated, it computes the
    one-device result, gathers no per-example-sized array and holds no more temporaries than
    without the annotation (the ghost path held 8.3x, as with jax's constraint, when that
    trace ran outside ``one_example_scope``)."""
    from gradclip_jax.interop import jax_privacy as dropin

    def grad_fn(losses):
        return dropin.clipped_grad(
            lambda p, b: jnp.sum(losses(p, b)), l2_clip_norm=0.05, batch_argnums=1, method=method
        )

    out, ref = _run_annotated(grad_fn)
    assert_tree_close(out, ref, rtol=1e-5, atol=1e-6)


def test_vmap_with_spmd_axis_name_accepts_the_batch_axes_in_the_spec():
    """``jax.lax.with_sharding_constraint`` naming the batch's mesh axis is rejected under a vmap
    whose ``spmd_axis_name`` is that axis; ours gives the vmap path the ghost path's result."""
    mesh = _mesh((1, 1))
    rows = NamedSharding(mesh, P(ROWS, None, None))
    ours, params, data = token_model(lambda h: gcx.with_sharding_constraint(h, rows))
    theirs, _, _ = token_model(lambda h: jax.lax.with_sharding_constraint(h, rows))
    vmap = dict(method="vmap", spmd_axis_name=ROWS)
    with pytest.raises(ValueError, match="spmd_axis_name"):
        jax.jit(gcx.clipped_grad(theirs, 0.05, **vmap))(params, data)
    grads, info = jax.jit(gcx.clipped_grad(ours, 0.05, **vmap))(params, data)
    ghost, ghost_info = jax.jit(gcx.clipped_grad(ours, 0.05, method="ghost"))(params, data)
    assert_tree_close(grads, ghost, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info.norms, ghost_info.norms, rtol=1e-5)


def test_pytrees_of_specs_under_a_context_mesh():
    mesh = _mesh((1, 1))
    x = {"a": jnp.ones((4, 3)), "b": jnp.ones((4,))}
    with jax.set_mesh(mesh):
        out = jax.jit(lambda t: gcx.with_sharding_constraint(t, {"a": P(ROWS), "b": P("data")}))(x)
    assert_tree_close(out, x)


@pytest.mark.parametrize("bad", ["data", ("data", None), 3])
def test_a_sharding_of_another_kind_is_a_type_error_naming_the_leaf(bad):
    x = {"a": jnp.ones((4, 3)), "b": jnp.ones((4,))}
    with pytest.raises(TypeError, match=r"with_sharding_constraint: shardings\['b'\]"):
        gcx.with_sharding_constraint(x, {"a": P(), "b": bad})
    with pytest.raises(TypeError, match=r"batch_sharding: shardings\['b'\]"):
        gcx.batch_sharding({"a": P(), "b": bad})


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_explicit_axes_every_path_equals_one_device():
    """With ``Explicit`` mesh axes a constraint is an assertion of the array's sharding: the vmap
    path's batch of one is asserted unsharded on axis 0 (its examples' axis is vmap's)."""
    rows = P(ROWS, None, None)
    annotated, params, data = token_model(lambda h: gcx.with_sharding_constraint(h, rows))
    plain, _, _ = token_model()
    ref, ref_info = jax.jit(gcx.clipped_grad(plain, 0.05))(params, data)
    mesh = jax.make_mesh((2, 4), ROWS, axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        d_sh = jax.device_put(data, NamedSharding(mesh, P(ROWS)))
        p_sh = jax.device_put(params, NamedSharding(mesh, P()))
        for kwargs in METHODS.values():
            grads, info = jax.jit(gcx.clipped_grad(annotated, 0.05, **kwargs))(p_sh, d_sh)
            assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(info.norms, ref_info.norms, rtol=1e-5)


# Tensor parallelism under Explicit axes: a hidden layer whose units are split over "model", so
# that the second matmul contracts a sharded axis and must state its output's sharding.
_TP = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}


def _tp_model(out_spec):
    """``(losses, params, data)``: a two-layer regression whose second matmul's ``out_sharding`` is
    ``out_spec()`` (called while tracing) under a mesh, none without one."""

    def losses(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        sh = None if jax.sharding.get_abstract_mesh().empty else out_spec()
        return jnp.sum((jnp.matmul(h, p["w2"], out_sharding=sh) - b["y"]) ** 2, axis=1)

    r = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(r.normal(size=(16, 64)) / 4, jnp.float32),
        "b1": jnp.asarray(r.normal(size=(64,)) / 4, jnp.float32),
        "w2": jnp.asarray(r.normal(size=(64, 8)) / 8, jnp.float32),
    }
    data = {
        "x": jnp.asarray(r.normal(size=(24, 16)), jnp.float32),
        "y": jnp.asarray(r.normal(size=(24, 8)), jnp.float32),
    }
    return losses, params, data


def _tp_mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _tp_placed(mesh, params, data):
    return (
        {k: jax.device_put(v, NamedSharding(mesh, _TP[k])) for k, v in params.items()},
        jax.device_put(data, NamedSharding(mesh, P("data"))),
    )


TP_PATHS = {
    "ghost": {"method": "ghost"},
    "vmap": {"method": "vmap"},
    "ghost-microbatches": {"method": "ghost", "microbatch_size": 4},
    "vmap-microbatches": {"method": "vmap", "microbatch_size": 4},
}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("kwargs", TP_PATHS.values(), ids=TP_PATHS.keys())
def test_tensor_parallel_weights_on_explicit_axes_equal_one_device(kwargs):
    """Weights split over a model axis: ghost's per-example gradients of the split bias are pulled
    back with cotangents of the bias's sharding, the microbatches' running sums carry the
    parameters' sharding, and the vmap path's batch of one takes ``batch_sharding``'s spec."""
    losses, params, data = _tp_model(lambda: gcx.batch_sharding(P("data", None)))
    ref, ref_info = jax.jit(gcx.clipped_grad(losses, 0.5, **kwargs))(params, data)
    mesh = _tp_mesh()
    with jax.set_mesh(mesh):
        p_sh, d_sh = _tp_placed(mesh, params, data)
        grads, info = jax.jit(gcx.clipped_grad(losses, 0.5, **kwargs))(p_sh, d_sh)
    assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info.norms, ref_info.norms, rtol=1e-5)
    assert int(ref_info.num_clipped) > 0
    assert {k: tuple(v.sharding.spec) for k, v in grads.items()} == {
        k: tuple(s) for k, s in _TP.items()
    }


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_a_batch_spec_applied_to_a_batch_of_one_names_batch_sharding():
    losses, params, data = _tp_model(lambda: P("data", None))
    mesh = _tp_mesh()
    with jax.set_mesh(mesh):
        p_sh, d_sh = _tp_placed(mesh, params, data)
        with pytest.raises(ValueError, match=r"batch of one.*gradclip_jax\.batch_sharding\(spec\)"):
            jax.jit(gcx.clipped_grad(losses, 0.5, method="vmap"))(p_sh, d_sh)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_make_private_on_tensor_parallel_weights_equals_one_device(method, monkeypatch):
    """The DP step (clipped sum, noise, adamw) on explicitly split weights: the same parameters as
    on one device, where each leaf draws its own noise as an explicitly sharded leaf does."""
    import optax

    from gradclip_jax.dp import noise

    monkeypatch.setitem(noise.NOISE_STRATEGY, jax.default_backend(), "leaves")
    losses, params, data = _tp_model(lambda: gcx.batch_sharding(P("data", None)))
    priv = gcx.make_private(
        losses,
        optax.adamw(1e-2),
        dataset_size=240,
        expected_batch_size=24,
        max_batch_size=32,
        steps=2,
        target_epsilon=2.0,
        delta=1e-5,
        l2_clip_norm=0.5,
        process_index=0,
        process_count=1,
        method=method,
        seed=0,
        accountant="rdp",
    )
    full = jax.tree.map(lambda x: np.concatenate([x] * 10), data)
    batches = list(priv.batches(full))

    def run(p, place):
        state = priv.init(p)
        for i, (batch, mask) in enumerate(batches):
            batch, mask = place(batch), place(mask)
            p, state, _ = jax.jit(priv.step)(p, state, batch, mask, jax.random.key(i))
        return p

    ref = run(params, lambda x: x)
    mesh = _tp_mesh()
    with jax.set_mesh(mesh):
        p_sh, _ = _tp_placed(mesh, params, data)
        out = run(p_sh, lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert_tree_close(out, ref, rtol=1e-5, atol=1e-6)
    assert tuple(out["w2"].sharding.spec) == tuple(_TP["w2"])


def _scanned_tp_decoder():
    """``(losses, params, data, specs)``: a token model whose ``jax.checkpoint``'d blocks run
    under ``lax.scan`` (the ghost path streams their norms and sums through the loop), each
    block's hidden units split over ``"model"``; the (one-hot) embedding and the blocks' output
    projection state their batch-leading outputs' shardings."""
    layers, d, hidden, vocab, seq, batch = 2, 16, 64, 32, 8, 8
    r = np.random.default_rng(1)

    def w(*shape, scale):
        return jnp.asarray(r.normal(size=shape) * scale, jnp.float32)

    params = {
        "emb": w(vocab, d, scale=0.25),
        "up": w(layers, d, hidden, scale=0.25),
        "bias": w(layers, hidden, scale=0.1),
        "down": w(layers, hidden, d, scale=0.125),
        "head": w(d, vocab, scale=0.25),
    }
    specs = {
        "emb": P(),
        "up": P(None, None, "model"),
        "bias": P(None, "model"),
        "down": P(None, "model", None),
        "head": P(),
    }
    data = {
        "x": jnp.asarray(r.integers(0, vocab, (batch, seq))),
        "y": jnp.asarray(r.integers(0, vocab, (batch, seq))),
    }

    def losses(p, b):
        on_mesh = not jax.sharding.get_abstract_mesh().empty
        rows = gcx.batch_sharding(P("data", None, None)) if on_mesh else None
        # one-hot, which ghost measures (JAX writes `.at[ids].get(out_sharding=...)` with
        # reshards, and ghost forms that table's per-example gradients instead)
        h = jnp.einsum("btv,vd->btd", jax.nn.one_hot(b["x"], vocab), p["emb"], out_sharding=rows)

        @jax.checkpoint
        def block(h, blk):
            u = jax.nn.gelu(h @ blk["up"] + blk["bias"])
            return h + jnp.einsum("bth,hd->btd", u, blk["down"], out_sharding=rows), None

        h, _ = jax.lax.scan(block, h, {k: p[k] for k in ("up", "bias", "down")})
        logp = jax.nn.log_softmax(h @ p["head"])
        return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], -1)[..., 0], -1)

    return losses, params, data, specs


SCANNED_PATHS = {
    "ghost": {"method": "ghost"},
    "ghost-microbatches-per-layer": {"method": "ghost", "microbatch_size": 4, "per_layer": True},
    "vmap": {"method": "vmap"},
}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("kwargs", SCANNED_PATHS.values(), ids=SCANNED_PATHS.keys())
def test_a_scanned_rematerialized_decoder_split_over_a_model_axis_equals_one_device(kwargs):
    """The Gram products contract model-split axes (their output's sharding stated), the scan's
    steps merge into one batch of the batch's sharding, and the per-site sums are pulled back
    with cotangents of their output's sharding."""
    losses, params, data, specs = _scanned_tp_decoder()
    ref, ref_info = jax.jit(gcx.clipped_grad(losses, 0.1, **kwargs))(params, data)
    mesh = _tp_mesh()
    with jax.set_mesh(mesh):
        p_sh = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        d_sh = jax.device_put(data, NamedSharding(mesh, P("data")))
        grads, info = jax.jit(gcx.clipped_grad(losses, 0.1, **kwargs))(p_sh, d_sh)
    assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
    assert_tree_close(info.norms, ref_info.norms, rtol=1e-5, atol=1e-6)
    assert {k: _entries(v.sharding.spec) for k, v in grads.items()} == {
        k: _entries(s) for k, s in specs.items()
    }


def _entries(spec):
    """A spec's entries without trailing ``None``s (``P()`` and ``P(None, None)`` alike)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


FSDP_PATHS = {
    "ghost": {"method": "ghost"},
    "ghost-microbatches": {"method": "ghost", "microbatch_size": 8},
    "vmap": {"method": "vmap"},
}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("kwargs", FSDP_PATHS.values(), ids=FSDP_PATHS.keys())
def test_fsdp_under_explicit_axes_equals_one_device(kwargs):
    """Parameters split over the batch's own mesh axis and gathered in the loss by
    ``jax.sharding.reshard``: the per-example paths gather them before their ``vmap`` (which
    refuses an unmapped argument split over the mapped axis; ghost forms the gathered leaves'
    per-example gradients, as it does for an operation it does not measure), and a dropped
    non-finite example's safe sums keep the fast sums' sharding."""
    losses, params, data = _tp_model(lambda: gcx.batch_sharding(P("data", None)))
    data["x"] = data["x"].at[5, 2].set(jnp.nan)

    def gathering(p, b):
        if not jax.sharding.get_abstract_mesh().empty:
            p = {k: jax.sharding.reshard(v, P()) for k, v in p.items()}
        return losses(p, b)

    specs = {k: P(*[("data" if e == "model" else e) for e in s]) for k, s in _TP.items()}
    ref, ref_info = jax.jit(gcx.clipped_grad(gathering, 0.5, **kwargs))(params, data)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        p_sh = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        d_sh = jax.device_put(data, NamedSharding(mesh, P("data")))
        grads, info = jax.jit(gcx.clipped_grad(gathering, 0.5, **kwargs))(p_sh, d_sh)
    assert not np.isfinite(np.asarray(info.norms)[5])
    assert np.all(np.isfinite(np.asarray(grads["w1"])))
    assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
    assert_tree_close(info.norms, ref_info.norms, rtol=1e-5, atol=1e-6)
    assert {k: _entries(v.sharding.spec) for k, v in grads.items()} == {
        k: _entries(s) for k, s in specs.items()
    }
