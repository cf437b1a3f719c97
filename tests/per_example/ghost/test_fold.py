"""Index arithmetic folded while tracing (ghost/_fold.py): NumPy's values are JAX's, bit for bit,
and a loss's index arithmetic compiles nothing while the ghost path traces it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import clipped_grad
from gradclip_jax.per_example.ghost import _fold

I32 = np.iinfo(np.int32)
x34 = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
y34 = np.array([[3, -3, 7, 1], [I32.max, 2, -1, 5], [I32.min, 0, 4, -2]], np.int32)
b34 = x34 % 3 == 0

CASES = {
    "iota": (lambda: lax.broadcasted_iota(jnp.int32, (3, 4), 1), ()),
    "broadcast_in_dim": (lambda x: lax.broadcast_in_dim(x, (3, 2, 4), (0, 2)), (x34,)),
    "reshape": (lambda x: jnp.reshape(x, (4, 3)), (x34,)),
    "squeeze": (lambda x: lax.squeeze(x[None], (0,)), (x34,)),
    "convert to bool": (lambda x: x.astype(jnp.bool_), (x34,)),
    "convert to uint8 (wraps)": (lambda x: lax.convert_element_type(x, jnp.uint8), (y34,)),
    "convert from bool": (lambda b: b.astype(jnp.int32), (b34,)),
    "concatenate": (lambda x, y: lax.concatenate([x, y], 1), (x34, y34)),
    "strided slice": (lambda x: lax.slice(x, (0, 1), (3, 4), (2, 2)), (x34,)),
    "add (wraps)": (lambda x, y: x + y, (y34, y34)),
    "sub (wraps)": (lambda x, y: x - y, (x34, y34)),
    "mul (wraps)": (lambda x, y: x * y, (y34, y34)),
    "neg": (lambda y: -y, (y34,)),
    "rem (sign of the dividend)": (lambda x: lax.rem(x, jnp.int32(-4)), (x34,)),
    "max": (lambda x, y: jnp.maximum(x, y), (x34, y34)),
    "min": (lambda x, y: jnp.minimum(x, y), (x34, y34)),
    "clamp": (lambda x: lax.clamp(jnp.int32(-2), x, jnp.int32(3)), (x34,)),
    "select_n, bool": (lambda b, x, y: lax.select_n(b, x, y), (b34, x34, y34)),
    "select_n, int": (
        lambda w, x, y: lax.select_n(w, x, y, x),
        (np.abs(x34) % 3, x34, y34),
    ),
    "lt": (lambda x, y: x < y, (x34, y34)),
    "le": (lambda x, y: x <= y, (x34, y34)),
    "gt": (lambda x, y: x > y, (x34, y34)),
    "ge": (lambda x, y: x >= y, (x34, y34)),
    "eq": (lambda x, y: x == y, (x34, x34.T.reshape(3, 4))),
    "ne": (lambda x, y: x != y, (x34, x34.T.reshape(3, 4))),
    "and": (lambda x, y: x & y, (x34, y34)),
    "or": (lambda b, c: b | c, (b34, ~b34.T.reshape(3, 4))),
    "not": (lambda x: ~x, (y34,)),
}


def _numpy_eval(jaxpr, args):
    """Every equation of ``jaxpr`` folded by NumPy alone (each one must be)."""
    env = dict(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        assert _fold.folds(eqn, invals), eqn
        outs = _fold._numpy(eqn, invals)
        assert outs is not None, eqn
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_folds_as_jax_computes(name):
    f, args = CASES[name]
    (got,) = _numpy_eval(jax.make_jaxpr(f)(*args).jaxpr, args)
    want = np.asarray(jax.jit(f)(*args))
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_what_numpy_is_not_given_is_left_to_jax():
    """A remainder by zero (XLA's value is not NumPy's) and float operands are JAX's to compute:
    ``fold`` binds them eagerly."""
    eqn = jax.make_jaxpr(lambda x, y: lax.rem(x, y))(x34, y34).jaxpr.eqns[-1]
    assert _fold._numpy(eqn, [x34, y34]) is None
    (out,) = _fold.fold(eqn, [x34, y34], lambda e, v: [lax.rem(*v)])
    np.testing.assert_array_equal(out, lax.rem(x34, y34))
    floats = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    eqn = jax.make_jaxpr(lambda a: a < 0)(floats).jaxpr.eqns[-1]
    assert _fold._numpy(eqn, [floats]) is None


def test_tracing_a_loss_with_position_ids_compiles_nothing():
    """Position ids and a causal mask computed from ``jnp.arange`` are folded while the ghost path
    traces the loss, without compiling a program for each operation."""
    compiles = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    r = np.random.default_rng(0)
    t, d = 6, 4
    params = {
        "pos": jnp.asarray(r.normal(size=(t, d)), jnp.float32),
        "w": jnp.asarray(r.normal(size=(d, d)), jnp.float32),
    }
    x = jnp.asarray(r.normal(size=(3, t, d)), jnp.float32)

    def loss(p, xb):
        pos = jnp.arange(t) % t  # folded: the table's rows at constant positions
        h = (xb + p["pos"][pos]) @ p["w"]
        mask = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
        scores = jnp.where(mask, h @ jnp.swapaxes(h, -1, -2), -1e9)
        return jnp.sum(jax.nn.softmax(scores, axis=-1), axis=(-1, -2)) + jnp.sum(h**2, (-1, -2))

    fn = clipped_grad(loss, 1.0, method="ghost")
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.jit(fn).trace(params, x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    g, _ = jax.jit(fn)(params, x)
    ref, _ = jax.jit(clipped_grad(loss, 1.0, method="vmap"))(params, x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
