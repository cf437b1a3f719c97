"""Sharded inputs on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS).

Results must equal the single-device ones, and output shardings must match the
inputs', for explicit (typed) sharding, automatic sharding and hand-sharded
leaves inside ``shard_map`` with ``axis_name``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import gradclip_jax as gcx

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")

SPECS = {"w": P("x", None), "v": P(None, "x"), "b": P("x"), "r": P(), "s": P()}


def _tree(seed=0, scale=3.0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    return {
        "w": scale * jax.random.normal(k[0], (16, 6)),
        "v": scale * jax.random.normal(k[1], (5, 8)),
        "b": scale * jax.random.normal(k[2], (8,)),
        "r": scale * jax.random.normal(k[3], (3,)),
        "s": scale * jax.random.normal(k[4], (4,)),
    }


TRANSFORMS = {
    "global": lambda: gcx.clip_by_global_norm(1.0),
    "global_inf": lambda: gcx.clip_by_global_norm(1.0, ord="inf"),
    "global_std": lambda: gcx.clip_by_global_norm(0.5, ord="std"),
    "norm_dim0": lambda: gcx.clip_by_norm(1.0, dim=0),
    "norm_dim1": lambda: gcx.clip_by_norm(1.0, dim=1),
    "normalize": lambda: gcx.normalize(2.0),
    "block_rms": lambda: gcx.clip_by_block_rms(0.5),
    "agc": lambda: gcx.adaptive_grad_clip(0.05),
    "centralize": lambda: gcx.centralize(dim=0),
    "value": lambda: gcx.clip(1.0),
}


def _spec(s):
    """A PartitionSpec without trailing Nones (P(None,) and P() both mean replicated)."""
    t = tuple(s)
    while t and t[-1] is None:
        t = t[:-1]
    return t


def _check(out, ref, shardings=None):
    for k in ref:
        np.testing.assert_allclose(np.asarray(out[k]), np.asarray(ref[k]), rtol=2e-6, atol=1e-6)
        if shardings is not None:
            assert _spec(out[k].sharding.spec) == _spec(shardings[k].spec), k


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_explicit_sharding(name):
    tx = TRANSFORMS[name]()
    g, p = _tree(0), _tree(1, 1.0)
    ref, ref_state = tx.update(g, tx.init(p), p)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        gs = {k: jax.device_put(v, SPECS[k]) for k, v in g.items()}
        ps = {k: jax.device_put(v, SPECS[k]) for k, v in p.items()}
        out, state = jax.jit(tx.update)(gs, tx.init(ps), ps)
        for k in g:
            assert _spec(jax.typeof(out[k]).sharding.spec) == _spec(jax.typeof(gs[k]).sharding.spec)
    _check(out, ref, {k: gs[k].sharding for k in g})
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)


def test_optax_agc_fails_under_explicit_sharding_ours_does_not():
    g, p = _tree(0), _tree(1, 1.0)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        gs = {k: jax.device_put(v, SPECS[k]) for k, v in g.items()}
        ps = {k: jax.device_put(v, SPECS[k]) for k, v in p.items()}
        with pytest.raises(Exception, match=r"[Ss]harding"):
            optax.adaptive_grad_clip(0.05).update(gs, None, ps)
        tx = gcx.adaptive_grad_clip(0.05)
        tx.update(gs, tx.init(ps), ps)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_automatic_sharding(name):
    tx = TRANSFORMS[name]()
    g, p = _tree(2), _tree(3, 1.0)
    ref, _ = tx.update(g, tx.init(p), p)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    sh = {k: NamedSharding(mesh, SPECS[k]) for k in g}
    gs = {k: jax.device_put(v, sh[k]) for k, v in g.items()}
    ps = {k: jax.device_put(v, sh[k]) for k, v in p.items()}
    out, _ = jax.jit(tx.update, out_shardings=(sh, None))(gs, tx.init(ps), ps)
    _check(out, ref, sh)
    out2, _ = jax.jit(tx.update)(gs, tx.init(ps), ps)  # propagation alone
    _check(out2, ref)


@pytest.mark.parametrize("ord_", [2, 1, "inf", 3, "rms", "std", "sum", -1])
def test_shard_map_axis_name_equals_global_norm(ord_):
    g = {
        "w": jax.random.normal(jax.random.PRNGKey(0), (32, 5)),
        "b": jax.random.normal(jax.random.PRNGKey(1), (16,)),
    }
    tx = gcx.clip_by_global_norm(0.7, ord=ord_)
    ref, ref_state = tx.update(g, tx.init(g))
    mesh = jax.make_mesh((8,), ("x",))
    spec = {"w": P("x", None), "b": P("x")}

    def local(gl):
        t = gcx.clip_by_global_norm(0.7, ord=ord_, axis_name="x")
        out, state = t.update(gl, t.init(gl))
        return out, state.norm

    gs = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in g.items()}
    out, norm = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=(spec, P())))(
        gs
    )
    np.testing.assert_allclose(float(norm), float(ref_state.norm), rtol=2e-6)
    _check(out, ref)


def test_shard_map_without_axis_name_uses_local_norms():
    """Documented behaviour: without axis_name each shard sees only its own part.

    Jitted: run eagerly, shard_map dispatches each of the norm's primitives as its own
    8-device program (over a minute on XLA:CPU) for the same result.
    """
    g = {"w": jnp.ones((8, 2))}
    mesh = jax.make_mesh((8,), ("x",))

    def local(gl):
        t = gcx.clip_by_global_norm(1.0)
        return t.update(gl, t.init(gl))[0]

    g = {"w": jax.device_put(g["w"], NamedSharding(mesh, P("x", None)))}
    out = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=({"w": P("x", None)},), out_specs={"w": P("x", None)}
        )
    )(g)
    np.testing.assert_allclose(np.asarray(out["w"]), np.full((8, 2), 2**-0.5), rtol=1e-6)
