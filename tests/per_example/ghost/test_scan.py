"""Ghost clipping of layers stacked on axis 0 and run by ``lax.scan``: the loop is kept
(not unrolled) and each stacked leaf is measured inside it, from its operands and
cotangents stacked over the steps. Every case is checked against ``method='vmap'``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import clipped_grad, ghost_report
from tests._backend import refuses_backward
from tests.jaxprs import primitive_counts
from tests.per_example.models import vmap_reference, xent

B, T, D = 5, 4, 8


def _w(r, *shape, scale=1.0):
    return jnp.asarray(
        scale * r.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1.0), jnp.float32
    )


def _data(seed=0, classes=4, batch=B):
    r = np.random.default_rng(seed)
    x = r.normal(size=(batch, T, D)) * r.uniform(0.2, 3.0, size=(batch, 1, 1))
    return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(r.integers(0, classes, size=batch))}


@functools.cache  # one loss function per model: its tests share the vmap program
def stacked_transformer(layers=3, seed=0, reverse=False, dtype=jnp.float32, batch=B):
    """Pre-LN blocks stacked on axis 0 and run by ``lax.scan``: a fused qkv projection split in
    three, a layer-norm scale, an MLP applied to the rows merged across positions
    (``h.reshape(-1, D) @ w``), the block under ``jax.checkpoint``."""
    r = np.random.default_rng(seed)
    params = {
        "qkv": _w(r, layers, D, 3 * D),
        "o": _w(r, layers, D, D, scale=0.5),
        "scale": 1.0 + 0.1 * _w(r, layers, D),
        "up": _w(r, layers, D, 2 * D),
        "down": _w(r, layers, 2 * D, D, scale=0.5),
        "head": _w(r, D, 4),
    }
    params = jax.tree.map(lambda x: x.astype(dtype), params)

    def block(h, lp):
        a = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5) * lp["scale"]
        q, k, v = jnp.split(a @ lp["qkv"], 3, axis=-1)
        att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / float(np.sqrt(D)), axis=-1)
        h = h + jnp.einsum("bts,bsd->btd", att, v) @ lp["o"]
        up = jax.nn.gelu(h.reshape(-1, D) @ lp["up"])
        return h + (up @ lp["down"]).reshape(h.shape), None

    def loss(p, b):
        stack = {k: p[k] for k in ("qkv", "o", "scale", "up", "down")}
        h, _ = lax.scan(jax.checkpoint(block), b["x"].astype(dtype), stack, reverse=reverse)
        return xent(jnp.mean(h, axis=1).astype(jnp.float32) @ p["head"].astype(jnp.float32), b["y"])

    return loss, params, _data(seed, batch=batch)


def _close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
        )


def _compare(loss, params, data, clip=1.0, rtol=2e-5, atol=2e-6, **kw):
    """Ghost against vmap; ``None`` where this backend refuses ``ghost_sum='backward'`` (checked)."""
    if refuses_backward(
        kw.get("ghost_sum"),
        lambda: jax.make_jaxpr(clipped_grad(loss, clip, method="ghost", **kw))(params, data),
        per_layer=bool(kw.get("per_layer")),
    ):
        return None
    ref, ref_info = vmap_reference(loss, params, data, clip, **kw)
    got, info = jax.jit(clipped_grad(loss, clip, method="ghost", **kw))(params, data)
    _close(info.norms, ref_info.norms, rtol, atol)
    _close(got, ref, rtol, atol)
    return got, info


def test_stacked_leaves_are_measured_inside_the_loop():
    loss, params, data = stacked_transformer()
    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    assert dict(rep.ghost) == {
        "['down']": "scan:dense",
        "['head']": "dense",
        "['o']": "scan:dense",
        "['qkv']": "scan:dense",
        "['scale']": "scan:elementwise",
        "['up']": "scan:dense",
    }


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_matches_vmap(ghost_sum, per_layer):
    loss, params, data = stacked_transformer(seed=1)
    _compare(loss, params, data, clip=0.5, ghost_sum=ghost_sum, per_layer=per_layer)


@pytest.mark.slow
def test_reversed_scan_and_microbatches():
    loss, params, data = stacked_transformer(seed=2, reverse=True)
    _compare(loss, params, data, clip=0.5)
    _compare(loss, params, data, clip=0.5, microbatch_size=2 if B % 2 == 0 else 1)


def test_program_does_not_grow_with_the_number_of_layers():
    """The loop is kept: the traced program of 12 layers is that of 2 (unrolled, it grew with
    the layers, and so did the compile time: 9.6x jax.grad at 12 layers, 30x at 24)."""
    sizes = []
    for layers in (2, 12):
        loss, params, data = stacked_transformer(layers=layers)
        jaxpr = jax.make_jaxpr(clipped_grad(loss, 1.0, method="ghost"))(params, data)
        # equations, not printed lines: the printer wraps a line where a shape's digits lengthen it
        sizes.append(primitive_counts(jaxpr.jaxpr))
    assert sizes[1] == sizes[0]


def test_dropped_non_finite_example_adds_nothing():
    loss, params, data = stacked_transformer(seed=3)
    x = data["x"].at[1, 2, 3].set(jnp.inf)
    mask = jnp.ones((B,), bool).at[1].set(False)
    data = {**data, "x": x}
    fn = jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum="bookkeeping"))
    ref = jax.jit(clipped_grad(loss, 0.5, method="vmap"))
    got, info = fn(params, data, mask=mask)
    want, want_info = ref(params, data, mask=mask)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(got))
    _close(got, want)
    kept = np.asarray(mask)
    _close(np.asarray(info.norms)[kept], np.asarray(want_info.norms)[kept])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_stacked_layers_keep_the_ghost_path(dtype):
    """16-bit stacked leaves are measured inside the loop with norms accumulated in float32:
    within 1e-2 of the norms of the float32 model, and each example's contribution within the bound."""
    loss, params, data = stacked_transformer(seed=4, dtype=dtype)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == []
    got, info = jax.jit(clipped_grad(loss, 0.5, method="ghost"))(params, data)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
    loss32, params32, _ = stacked_transformer(seed=4)
    params32 = jax.tree.map(lambda x, y: x.astype(y.dtype).astype(jnp.float32), params, params32)
    _, info32 = jax.jit(clipped_grad(loss32, 0.5, method="vmap"))(params32, data)
    np.testing.assert_allclose(np.asarray(info.norms), np.asarray(info32.norms), rtol=1e-2)
    ref, _ = jax.jit(clipped_grad(loss, 0.5, method="vmap"))(params, data)
    _close(got, ref, rtol=2e-2, atol=2e-3)


@pytest.mark.slow
def test_stacked_convolutions():
    """Residual conv blocks stacked on axis 0 (kernels ``(L, 3, 3, C, C)``), run by a scan."""
    r = np.random.default_rng(5)
    c, layers = 4, 3
    params = {
        "stem": _w(r, 3, 3, 2, c),
        "k": _w(r, layers, 3, 3, c, c, scale=0.3),
        "head": _w(r, c, 4),
    }
    data = {
        "x": jnp.asarray(r.normal(size=(B, 6, 6, 2)), jnp.float32),
        "y": jnp.asarray(r.integers(0, 4, size=B)),
    }
    conv = lambda x, k: lax.conv_general_dilated(  # noqa: E731
        x,
        k,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )

    def loss(p, b):
        h = conv(b["x"], p["stem"])
        h, _ = lax.scan(lambda h, k: (h + jnp.tanh(conv(h, k)), None), h, p["k"])
        return xent(jnp.mean(h, axis=(1, 2)) @ p["head"], b["y"])

    assert dict(ghost_report(loss, params, data).ghost)["['k']"] == "scan:conv"
    for ghost_sum in ("backward", "bookkeeping"):
        _compare(loss, params, data, clip=0.5, rtol=1e-4, atol=1e-5, ghost_sum=ghost_sum)


def test_flax_nnx_scan():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)
            self.norm = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, h):
            return h + jnp.tanh(self.lin(self.norm(h)))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
        return Block(rngs)

    blocks = make(nnx.Rngs(0))
    graphdef, state = nnx.split(blocks)
    head = _w(np.random.default_rng(6), D, 4)
    params = {"blocks": state, "head": head}

    def loss(p, b):
        def step(h, s):
            return nnx.merge(graphdef, s)(h), None

        h, _ = lax.scan(step, b["x"], p["blocks"])
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    data = _data(6)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and all(k.startswith("scan:") for p, k in rep.ghost if "blocks" in p)
    _compare(loss, params, data, clip=0.5)


def test_equinox_filter_vmap_stack():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.key(7), 3)
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(keys)
    dynamic, static = eqx.partition(stack, eqx.is_array)
    params = {"stack": dynamic, "head": _w(np.random.default_rng(7), D, 4)}

    def loss(p, b):
        def step(h, layer):
            return h + jnp.tanh(jax.vmap(jax.vmap(eqx.combine(layer, static)))(h)), None

        h, _ = lax.scan(step, b["x"], p["stack"])
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    data = _data(7)
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and {k for p, k in rep.ghost if "stack" in p} == {
        "scan:dense",
        "scan:elementwise",
    }
    _compare(loss, params, data, clip=0.5)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_batch_matches_single_device():
    """The steps' operands leave the loop with the batch still sharded; measured as one batch of
    ``L * B`` rows they keep it (explicit sharding), and under ``shard_map`` each device measures its own."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    loss, params, data = stacked_transformer(seed=8, batch=16)
    mask = jnp.arange(16) % 3 != 0
    ref, ref_i = clipped_grad(loss, 0.5, method="vmap")(params, data, mask=mask)
    for ghost_sum in ("backward", "bookkeeping"):
        grad_fn = clipped_grad(loss, 0.5, method="ghost", ghost_sum=ghost_sum)
        if refuses_backward(ghost_sum, lambda grad_fn=grad_fn: grad_fn(params, data, mask=mask)):
            continue
        mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            p_rep = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), params)
            d_sh = jax.tree.map(lambda x: jax.sharding.reshard(x, P("x")), data)
            g, i = jax.jit(grad_fn)(p_rep, d_sh, mask=mask)
        _close(g, ref, 1e-5, 1e-6)
        _close(i.norms, ref_i.norms, 1e-5, 1e-6)

        def local(p, d, m, grad_fn=grad_fn):
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
