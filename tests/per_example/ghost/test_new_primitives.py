"""Ghost clipping through the primitives JAX added since our minimum version (``stack``,
``unstack`` and ``tile`` became primitives in jax 0.10; ``mulhi``, ``stage``, ...), and the
audit: every primitive of ``jax.lax`` has a rule or a stated reason. Models are checked
against ``method='vmap'``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import clipped_grad, ghost_report
from gradclip_jax.per_example.ghost.rules import CONST, MIXED, ROW, RULES, row_rule
from gradclip_jax.per_example.ghost.rules.unsupported import REASONS
from tests.per_example.ghost.test_scan import B, D, T, _data, _w
from tests.per_example.models import assert_tree_close, xent

H = 2  # heads


def rope(x):
    """Rotary position embedding as Llama and Gemma write it: each pair of features rotated by
    its position's angle, the rotated halves joined by ``jnp.stack`` (a primitive since jax 0.10)."""
    d = x.shape[-1] // 2
    ang = jnp.arange(x.shape[1])[:, None] / 10000.0 ** (jnp.arange(d) / d)  # (T, d)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def rope_attention_setup(seed=0):
    """A pre-norm attention block with rotary embeddings on queries and keys, then an MLP."""
    r = np.random.default_rng(seed)
    params = {
        "q": _w(r, D, H * D),
        "k": _w(r, D, H * D),
        "v": _w(r, D, H * D),
        "o": _w(r, H * D, D),
        "norm": 1.0 + 0.1 * _w(r, D),
        "up": _w(r, D, 2 * D),
        "down": _w(r, 2 * D, D),
        "head": _w(r, D, 4),
    }

    def loss(p, b):
        x = b["x"]
        n = x.shape[0]
        a = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["norm"]
        q = rope((a @ p["q"]).reshape(n, T, H, D))
        k = rope((a @ p["k"]).reshape(n, T, H, D))
        v = (a @ p["v"]).reshape(n, T, H, D)
        att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), axis=-1)
        h = x + jnp.einsum("bhts,bshd->bthd", att, v).reshape(n, T, H * D) @ p["o"]
        h = h + jax.nn.silu(h @ p["up"]) @ p["down"]
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    return loss, params, _data(seed)


def lstm_setup(seed=1, stacked_gates=False):
    """An LSTM over time under ``lax.scan`` whose gates are cut by ``jnp.unstack`` (as Keras and
    haiku LSTMs do with a split), or computed one by one and joined by ``jnp.stack``."""
    r = np.random.default_rng(seed)
    params = {
        "wx": _w(r, D, 4 * D),
        "wh": _w(r, D, 4 * D, scale=0.5),
        "b": 0.1 * _w(r, 4 * D),
        "w0": _w(r, D, D),
        "head": _w(r, D, 4),
    }

    def step(p, carry, x):
        h, c = carry
        z = x @ p["wx"] + h @ p["wh"] + p["b"]
        if stacked_gates:
            z = jnp.stack(
                [z[:, j * D : (j + 1) * D] for j in range(4)], axis=0
            )  # (4, B, D): batch on axis 1
            i, f, g, o = jnp.unstack(z, axis=0)
        else:
            i, f, g, o = jnp.unstack(z.reshape(z.shape[0], 4, D), axis=1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        return (jax.nn.sigmoid(o) * jnp.tanh(c), c), None

    def loss(p, b):
        h0 = jnp.tanh(b["x"][:, 0] @ p["w0"])
        (h, _), _ = lax.scan(
            lambda carry, x: step(p, carry, x), (h0, h0), jnp.swapaxes(b["x"][:, 1:], 0, 1)
        )
        return xent(h @ p["head"], b["y"])

    return loss, params, _data(seed)


def _ghost_equals_vmap(loss, params, data, **kw):
    report = ghost_report(loss, params, data)
    assert not report.fallback, report.fallback
    got = jax.jit(clipped_grad(loss, 1.0, method="ghost", **kw))(params, data)
    want = jax.jit(clipped_grad(loss, 1.0, method="vmap", **kw))(params, data)
    assert_tree_close(got, want, rtol=3e-5, atol=3e-6)
    return report


def test_rotary_embedding_keeps_every_leaf_on_the_ghost_path():
    loss, params, data = rope_attention_setup()
    assert "stack" in str(jax.make_jaxpr(loss)(params, data))
    report = _ghost_equals_vmap(loss, params, data)
    assert dict(report.ghost)["['q']"] == "dense"


@pytest.mark.parametrize("stacked_gates", [False, True])
def test_lstm_with_unstacked_gates_keeps_every_leaf_on_the_ghost_path(stacked_gates):
    loss, params, data = lstm_setup(stacked_gates=stacked_gates)
    assert "unstack" in str(jax.make_jaxpr(loss)(params, data))
    _ghost_equals_vmap(loss, params, data)


@pytest.mark.parametrize("ghost_sum", ["bookkeeping", "auto"])
def test_rotary_embedding_both_sums(ghost_sum):
    loss, params, data = rope_attention_setup(seed=3)
    _ghost_equals_vmap(loss, params, data, ghost_sum=ghost_sum)


def test_tile_reduce_update_and_barrier_on_batched_values():
    """``tile`` along a feature axis, a variadic ``lax.reduce``, ``approx_max_k``, a dynamic update
    at offsets shared by the batch and an optimization barrier: each row-wise, so every leaf stays."""
    r = np.random.default_rng(4)
    params = {"w": _w(r, D, D), "u": _w(r, D, D), "head": _w(r, 3 * D + 2, 4)}

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w"])  # (B, T, D)
        h, g = lax.optimization_barrier((h, h @ p["u"]))
        tiled = jnp.tile(h, (1, 1, 2))  # (B, T, 2D)
        upd = lax.dynamic_update_slice(tiled, g[:, :2], (0, 1, 3))
        mx, mn = lax.reduce(
            (upd, -upd),
            (-jnp.inf, -jnp.inf),
            lambda a, c: (jnp.maximum(a[0], c[0]), jnp.maximum(a[1], c[1])),
            (1,),
        )
        top, _ = lax.approx_max_k(jnp.mean(g, axis=1), 2)
        feats = jnp.concatenate([mx[..., :D], mn[..., : 2 * D], top], axis=-1)
        return xent(feats @ p["head"], b["y"])

    _ghost_equals_vmap(loss, params, _data(4))


def _eqn(f, *args):
    return next(
        e
        for e in jax.make_jaxpr(f)(*args).jaxpr.eqns
        if e.primitive.name in ("stack", "unstack", "tile")
    )


@pytest.mark.parametrize(
    ("axis", "batch_axis", "want"), [(0, 0, 1), (1, 0, 0), (-1, 0, 0), (0, 1, 2), (2, 1, 1)]
)
def test_stack_moves_the_batch_axis(axis, batch_axis, want):
    x = jnp.ones((B, 3) if batch_axis == 0 else (3, B))
    eqn = _eqn(lambda a, c: jnp.stack([a, c], axis=axis), x, x)
    assert row_rule(eqn, [batch_axis, batch_axis], B) == [want]
    assert row_rule(eqn, [batch_axis, CONST], B) == [
        want
    ]  # stacked with a value shared by the batch


@pytest.mark.parametrize(
    ("axis", "batch_axis", "want"), [(1, 0, 0), (0, 1, 0), (2, 1, 1), (0, 0, MIXED), (-2, 1, MIXED)]
)
def test_unstack_moves_the_batch_axis(axis, batch_axis, want):
    shape = [3, 4, 2]
    shape[batch_axis] = B
    eqn = _eqn(lambda a: jnp.unstack(a, axis=axis), jnp.ones(shape))
    assert set(row_rule(eqn, [batch_axis], B)) == {want}


def test_tile_along_the_batch_axis_mixes():
    eqn = _eqn(lambda a: jnp.tile(a, (2, 3)), jnp.ones((B, 4)))
    assert row_rule(eqn, [ROW], B) == [MIXED]
    eqn = _eqn(lambda a: jnp.tile(a, (1, 3)), jnp.ones((B, 4)))
    assert row_rule(eqn, [ROW], B) == [ROW]


def test_a_loss_unstacking_the_batch_falls_back_with_a_reason():
    """Examples unstacked one by one and combined: not row-wise, so no leaf is measured by ghost
    clipping, and the report says the loss mixes examples at 'unstack'."""
    r = np.random.default_rng(5)
    params = {"w": _w(r, D, 4)}

    def loss(p, b):
        rows = jnp.unstack(b["x"].mean(axis=1) @ p["w"], axis=0)
        return jnp.stack(
            [xent(rows[i][None] + rows[0][None], b["y"][i : i + 1])[0] for i in range(B)]
        )

    report = ghost_report(loss, params, _data(5))
    assert [p for p, _ in report.fallback] == ["['w']"] and "'unstack'" in report.fallback[0][1]


# Primitives of jax.lax added since jax 0.5.3 (the names of jax/lax/__init__.py's ``*_p`` objects
# of jax-v0.10.2 that jax-v0.5.3 lacks), and call primitives added in jax 0.11.
ADDED_SINCE_MINIMUM = (
    "dce_sink",
    "mulhi",
    "stack",
    "stage",
    "tile",
    "unstack",
    "xla_metadata_call",
    "log2",
    "one_minus_square",
)  # the last two: jax 0.11 (run on 0.11.2, CPU and GPU)


@pytest.mark.parametrize("name", ADDED_SINCE_MINIMUM)
def test_primitives_added_since_the_minimum_have_a_rule_or_a_reason(name):
    assert (name in RULES) != (name in REASONS), name


def test_every_lax_primitive_of_the_installed_jax_has_a_rule_or_a_reason():
    """A JAX release that adds a primitive to jax.lax fails here until it gets a rule or a reason."""
    names = {p.name for n in dir(lax) if n.endswith("_p") and hasattr(p := getattr(lax, n), "bind")}
    missing = sorted(n for n in names if n not in RULES and n not in REASONS)
    assert missing == []
    assert not set(RULES) & set(REASONS)
