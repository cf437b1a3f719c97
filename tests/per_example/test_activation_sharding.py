"""``gcx.with_sharding_constraint``: one activation annotation for the ghost and the vmap paths.

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
    with pytest.raises(TypeError, match=r"shardings\['b'\]"):
        gcx.with_sharding_constraint(x, {"a": P(), "b": bad})


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
