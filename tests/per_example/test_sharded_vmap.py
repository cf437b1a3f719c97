"""The vmap and ghost paths' NaN-safe steps sharded FSDP-style on 8 simulated CPU devices (automatic sharding).

Parameters are sharded over ``fsdp`` on their largest axis that it divides, the batch over
``(data, fsdp)``, on meshes ``(data, fsdp)`` of 8x1, 2x4 and 1x8. Dropping an example whose
gradient is not finite (``nan_safe``, the default) must not gather per-example gradients across
devices (nothing at trace time says the batch is sharded, so a loop over examples would be run on
gathered rows), nor cost memory beyond what the per-example gradients themselves take.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import clipped_grad
from tests.per_example.models import assert_tree_close
from tests.per_example.token_model import BATCH, fsdp_placed, mesh_of, token_model

pytestmark = pytest.mark.cpu_only(
    reason="the compiled memory and collectives of XLA:CPU's programs"
)

MESHES = ((8, 1), (2, 4), (1, 8))
_ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(")


def _place(params, data, shape):
    return fsdp_placed(mesh_of(shape), params, data)


def _gathered(text: str) -> list[tuple[int, ...]]:
    """The result shapes of the all-gathers of a compiled HLO text."""
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ALL_GATHER.findall(text)]


def _per_example_sized(shape: tuple[int, ...], largest_leaf: int) -> bool:
    """Whether a gathered array carries the batch: the batch on an axis, or more elements than a leaf
    (rows of several examples)."""
    return BATCH in shape or int(np.prod(shape)) > largest_leaf


def _temp(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_dropping_non_finite_examples_costs_no_memory_on_one_device():
    """The dropped examples' rows are zeroed where the rows were: no second copy of the
    per-example gradients (which are most of the step's temporaries here)."""
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.normal(size=(128, 256)), jnp.float32), "b": jnp.zeros((256,))}
    data = {"x": jnp.asarray(r.normal(size=(32, 128)), jnp.float32)}

    def losses(p, b):
        return jnp.sum(jnp.tanh(b["x"] @ p["w"] + p["b"]), axis=-1)

    def step(nan_safe):
        return clipped_grad(losses, 1.0, method="vmap", nan_safe=nan_safe)

    safe, unsafe = _temp(step(True), params, data), _temp(step(False), params, data)
    assert unsafe >= 32 * 128 * 256 * 4  # the per-example gradients
    assert safe <= 1.02 * unsafe, (safe, unsafe)


def _sharded_without_gathers(grad_fn, shape):
    """``grad_fn`` on one device (example 5 dropped: its norm is not finite), and compiled on the
    mesh ``shape``, checked to gather no per-example-sized array:
    ``(ref, ref_info, sharded params, sharded data, compiled)``."""
    _, params, data = token_model(nan_example=5)
    ref, ref_info = jax.jit(grad_fn)(params, data)
    assert not np.isfinite(np.asarray(ref_info.norms)[5])
    p_sh, d_sh = _place(params, data, shape)
    compiled = jax.jit(grad_fn).lower(p_sh, d_sh).compile()
    largest = max(v.size for v in params.values())
    bad = [s for s in _gathered(compiled.as_text()) if _per_example_sized(s, largest)]
    assert not bad, f"all-gathers of per-example-sized arrays: {bad}"
    return ref, ref_info, p_sh, d_sh, compiled


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.reads_compiled_names
@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{f}" for d, f in MESHES])
def test_nan_safe_vmap_step_stays_sharded(shape):
    losses, _, _ = token_model(nan_example=5)
    grad_fn = clipped_grad(losses, 0.05, method="vmap")  # nan_safe=True: example 5 is dropped
    ref, ref_info, p_sh, d_sh, compiled = _sharded_without_gathers(grad_fn, shape)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(ref))

    def nonprivate(p, b):
        return jax.grad(lambda q: jnp.sum(losses(q, b)))(p)

    base = jax.jit(nonprivate).lower(p_sh, d_sh).compile().memory_analysis().temp_size_in_bytes
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 1.5 * base, (temp, base)
    grads, info = compiled(p_sh, d_sh)
    assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info.norms, ref_info.norms, rtol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.reads_compiled_names
@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{f}" for d, f in MESHES])
def test_nan_safe_ghost_step_stays_sharded(shape):
    """The ghost path's rare NaN-safe sum (a dropped example is not finite: each kept example's
    gradient formed in turn) reads one example per device at a time: nothing of the batch is
    gathered, and the fallback costs little beyond the step without it."""
    losses, _, _ = token_model(nan_example=5)
    grad_fn = clipped_grad(losses, 0.05, method="ghost")  # example 5 is dropped
    ref, ref_info, p_sh, d_sh, compiled = _sharded_without_gathers(grad_fn, shape)
    unsafe = clipped_grad(losses, 0.05, method="ghost", nan_safe=False)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 1.2 * _temp(unsafe, p_sh, d_sh), temp
    grads, info = compiled(p_sh, d_sh)
    assert_tree_close(grads, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(info.norms, ref_info.norms, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{f}" for d, f in MESHES])
def test_llama_clipped_sums_per_device_memory(shape):
    """Issue 42 item 2, per device: the Llama decoder's clipped sums (remat + scan, B=16, FSDP
    params, the batch over every device) hold at most what its summed gradient holds on the ghost
    path (10x on 8x1 when the partitioner gathered per-example Grams) and 1.5x on the vmap path,
    which forms each of its own examples' gradients."""
    models = pytest.importorskip("benchmarks.models")
    cfg = models.LlamaConfig(layers=2, d=64, heads=4, kv_heads=2, seq=64, vocab=128)
    losses, params, data = models.llama(0, 16, cfg)
    p_sh, d_sh = _place(params, data, shape)

    def grad(p, b):
        return jax.grad(lambda q: jnp.sum(losses(q, b)))(p)

    base = _temp(grad, p_sh, d_sh)
    assert _temp(clipped_grad(losses, 1.0, method="ghost"), p_sh, d_sh) <= 1.0 * base
    assert _temp(clipped_grad(losses, 1.0, method="vmap"), p_sh, d_sh) <= 1.5 * base
