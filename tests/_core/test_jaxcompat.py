"""The one reader of JAX's internals, on every parameter layout it handles.

The installed JAX produces one layout of ``scan``'s parameters; jax >= 0.11 lays
them out as ``ft_in``/``ft_out`` FlatTrees (jax-ml/jax commit "Use FlatTree to
structure scan arguments instead of num_carry, num_consts"; ``jax/_src/flattree.py``
and ``jax/_src/lax/control_flow/loops.py`` of jax-v0.11.0). Equations of the other
layout are built here by hand from real ones, and the whole ghost pipeline runs on
them: its every read goes through :mod:`gradclip_jax._core.jaxcompat`.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

from gradclip_jax import clipped_grad, ghost_report
from gradclip_jax._core import jaxcompat as jc
from tests.per_example.ghost.test_scan import stacked_transformer
from tests.per_example.models import assert_tree_close, xent


class _FlatTree:
    """jax 0.11's FlatTree as scan's parameters use it: a tuple of groups, ``unpack()`` giving
    the groups and ``len()`` the number of flat operands (only leaves a filter keeps count)."""

    def __init__(self, *groups: int | _FlatTree, kept: int | None = None) -> None:
        self.groups, self.kept = groups, kept

    def unpack(self) -> tuple[Any, ...]:
        return tuple(g if isinstance(g, _FlatTree) else _FlatTree(kept=g) for g in self.groups)

    def __len__(self) -> int:
        if self.kept is not None:
            return self.kept
        return sum(len(g) if isinstance(g, _FlatTree) else g for g in self.groups)

    def __repr__(self) -> str:
        return f"FlatTree{self.groups if self.kept is None else self.kept}"


def _real_flattree(n_consts: int, n_carry: int, n_xs: int) -> Any | None:
    """jax's own FlatTree of scan's ``ft_in``, where the installed jax has one (jax >= 0.11)."""
    try:
        ft = importlib.import_module("jax._src.flattree")
    except ImportError:
        return None
    if not hasattr(ft, "nones"):
        return None
    # consts in two sub-groups, as jax's own transpose rule nests them
    return ft.pack(
        (
            (ft.nones(1), ft.nones(n_consts - 1)) if n_consts > 1 else ft.nones(n_consts),
            ft.nones(n_carry),
            ft.nones(n_xs),
        )
    )


def _to_v011(eqn: Any) -> Any:
    """A scan equation of the jax <= 0.10 layout in the jax >= 0.11 one (nested jaxprs too)."""
    p = {
        k: _closed_v011(v) if isinstance(v, jcore.ClosedJaxpr) else v for k, v in eqn.params.items()
    }
    if eqn.primitive.name == "scan" and "num_consts" in p:
        n_consts, n_carry = p.pop("num_consts"), p.pop("num_carry")
        p.pop("linear", None)
        n_xs = len(eqn.invars) - n_consts - n_carry
        # the consts group nested in two, as jax 0.11's own transpose rule builds it
        consts = _FlatTree(1, n_consts - 1) if n_consts > 1 else n_consts
        p["ft_in"] = _FlatTree(consts, n_carry, n_xs)
        p["ft_out"] = _FlatTree(n_carry, len(eqn.outvars) - n_carry)
    return eqn.replace(params=p)


def _closed_v011(closed: Any) -> Any:
    return jcore.ClosedJaxpr(
        closed.jaxpr.replace(eqns=[_to_v011(e) for e in closed.jaxpr.eqns]), closed.consts
    )


def _to_v010(params: dict[str, Any]) -> dict[str, Any]:
    """What jax 0.11's scan would bind, as the installed jax's scan takes it (the test's stand-in
    for a jax whose scan primitive reads ``ft_in``)."""
    if "ft_in" not in params:
        return params
    p = dict(params)
    consts, carry, _ = p.pop("ft_in").unpack()
    p.pop("ft_out")
    return {**p, "num_consts": len(consts), "num_carry": len(carry)}


@pytest.fixture
def jax_011_scans(monkeypatch):
    """Every jaxpr traced by the ghost pipeline has its scans in jax 0.11's layout."""
    make_jaxpr, bind = jax.make_jaxpr, jc.bind

    def make_jaxpr_v011(fun, *a, **k):
        return lambda *args, **kw: _closed_v011(make_jaxpr(fun, *a, **k)(*args, **kw))

    def bind_v011(eqn, invals, eqn_params=None):
        return bind(
            eqn, invals, _to_v010(jc.params(eqn) if eqn_params is None else dict(eqn_params))
        )

    monkeypatch.setattr(jax, "make_jaxpr", make_jaxpr_v011)
    monkeypatch.setattr(jc, "bind", bind_v011)


def _scan_eqn(n_consts: int = 1):
    """A real scan equation: ``n_consts`` constants, one carry, two xs, two outputs (carry, y)."""

    def f(w, x, c, *consts):
        def body(h, xs):
            wi, xi = xs
            h = jnp.tanh(h @ wi + xi + sum(consts))
            return h, h.sum()

        return lax.scan(body, x, (w, c))

    args = (
        jnp.ones((3, 4, 4)),
        jnp.ones((2, 4)),
        jnp.ones((3, 2, 4)),
        *[jnp.full((4,), i + 1.0) for i in range(n_consts)],
    )
    closed = jax.make_jaxpr(f)(*args)
    return next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")


@pytest.mark.parametrize("n_consts", [0, 1, 3])
def test_scan_info_reads_both_layouts(n_consts):
    old = _scan_eqn(n_consts)
    new = _to_v011(old)
    assert "num_consts" not in new.params and "ft_in" in new.params
    a, b = jc.scan_info(old), jc.scan_info(new)
    assert (a.n_consts, a.n_carry, a.length, a.reverse, a.unroll) == (n_consts, 1, 3, False, 1)
    assert (b.n_consts, b.n_carry, b.length, b.reverse, b.unroll) == (n_consts, 1, 3, False, 1)
    assert b.n_fixed == n_consts + 1 and len(old.invars) - b.n_fixed == 2
    assert a.body is old.params["jaxpr"]


@pytest.mark.skipif(
    _real_flattree(2, 1, 2) is None,
    reason="the installed jax has no FlatTree scan layout (jax < 0.11)",
)
def test_scan_info_reads_jax_flattree():
    eqn = _scan_eqn(2)
    p = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry", "linear")}
    p["ft_in"] = _real_flattree(2, 1, 2)
    info = jc.scan_info(eqn.replace(params=p))
    assert (info.n_consts, info.n_carry) == (2, 1)


def test_unknown_layout_is_a_layout_error_naming_the_parameter():
    eqn = _scan_eqn(1)
    layouts = ("num_consts", "num_carry", "ft_in", "ft_out")  # jax <= 0.10's and jax >= 0.11's
    stripped = eqn.replace(params={k: v for k, v in eqn.params.items() if k not in layouts})
    with pytest.raises(
        jc.LayoutError, match=r"'scan' equations of jax .* no parameter 'num_consts'"
    ):
        jc.scan_info(stripped)
    assert jc.scan_or_none(stripped) is None
    assert jc.scan_or_none(_scan_eqn(1)) is not None
    dot = jax.make_jaxpr(jnp.dot)(jnp.ones((2, 3)), jnp.ones((3,))).jaxpr.eqns[0]
    assert jc.scan_or_none(dot) is None
    with pytest.raises(jc.LayoutError, match=r"'dot_general'.*'no_such'"):
        jc.param(dot, "no_such")
    assert jc.param(dot, "no_such", 7) == 7
    with pytest.raises(jc.LayoutError, match="'no_such'"):
        jc.params(dot)["no_such"]


def test_open_and_closed_jaxprs():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))
    j, consts = jc.open_jaxpr(closed)
    assert j is closed.jaxpr and consts == list(closed.consts)
    if closed.jaxpr is closed:  # jax >= 0.11: Jaxpr and ClosedJaxpr are one class
        assert jc.open_jaxpr(closed.jaxpr) == (closed, list(closed.consts))
    else:
        assert jc.open_jaxpr(closed.jaxpr) == (closed.jaxpr, None)

    class MergedOpen:  # jax >= 0.11: one Jaxpr class, closed only when it holds its consts
        jaxpr = property(lambda self: self)
        consts = ()
        constvars = ("c",)
        eqns = ()
        is_closed = False

    m = MergedOpen()
    assert jc.open_jaxpr(m) == (m, None)
    remat = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x)))(jnp.ones(3)).jaxpr.eqns[0]
    assert jc.sub_jaxpr(remat) is not None and len(jc.sub_jaxprs(remat)) == 1


def test_bind_runs_an_equation_in_its_context():
    closed = jax.make_jaxpr(lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ()))))(
        jnp.ones((2, 3)), jnp.ones((3, 4))
    )
    eqn = closed.jaxpr.eqns[0]
    a, b = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4))
    (out,) = jc.bind(eqn, [a, b])
    np.testing.assert_allclose(out, a @ b)
    changed = jc.params(eqn)
    changed["precision"] = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    np.testing.assert_allclose(jc.bind(eqn, [a, b], changed)[0], a @ b)
    assert (
        jc.with_params(eqn, precision=changed["precision"]).params["precision"]
        == changed["precision"]
    )


def _rnn(seed=0, steps=5):
    """One weight shared by every step (the scan is unrolled for the analysis)."""
    r = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(r.normal(size=(6, 6)) / 3, jnp.float32),
        "head": jnp.asarray(r.normal(size=(6, 3)), jnp.float32),
    }
    data = {
        "x": jnp.asarray(r.normal(size=(4, steps, 6)), jnp.float32),
        "y": jnp.asarray(r.integers(0, 3, 4)),
    }

    def loss(p, b):
        h, _ = lax.scan(
            lambda h, x: (jnp.tanh(h @ p["w"] + x), None),
            jnp.tanh(b["x"][:, 0]),
            jnp.swapaxes(b["x"][:, 1:], 0, 1),
        )
        return xent(h @ p["head"], b["y"])

    return loss, params, data


@pytest.mark.parametrize("model", ["stacked", "rnn"])
def test_ghost_pipeline_on_jax_011_scans(jax_011_scans, model):
    """The scanned models keep the ghost path with scans laid out as jax 0.11 does, and match vmap."""
    loss, params, data = stacked_transformer(layers=3) if model == "stacked" else _rnn()
    probe = jax.make_jaxpr(loss)(params, data)
    scans = [e for e in probe.jaxpr.eqns if e.primitive.name == "scan"]
    assert scans and all("ft_in" in e.params and "num_consts" not in e.params for e in scans)
    report = ghost_report(loss, params, data)
    assert not report.fallback, report.fallback
    got = jax.jit(clipped_grad(loss, 1.0, method="ghost"))(params, data)
    want = jax.jit(clipped_grad(loss, 1.0, method="vmap"))(params, data)
    assert_tree_close(got, want, rtol=2e-5, atol=2e-6)


def test_loss_combining_examples_in_a_jax_011_scan_is_an_error(jax_011_scans):
    _, params, data = _rnn()

    def batch_mixing(p, b):  # the carry is normalized over the batch at every step
        h, _ = lax.scan(
            lambda h, x: (jnp.tanh(h @ p["w"] + x) / jnp.mean(h * h + 1.0), None),
            jnp.ones_like(b["x"][:, 0]),
            jnp.swapaxes(b["x"], 0, 1),
        )
        return xent(h @ p["head"], b["y"])

    for method in ("vmap", "ghost"):
        with pytest.raises(ValueError, match="combines examples"):
            clipped_grad(batch_mixing, 1.0, method=method)(params, data)


def test_an_unreadable_layout_falls_back_with_the_reason(monkeypatch):
    """A scan laid out as no supported JAX does (here: its counts renamed, as a future release
    might): its parameter falls back, saying why; the head, outside it, is measured on the
    one-example program; nothing crashes, and the result is the vmap path's."""
    make_jaxpr, bind = jax.make_jaxpr, jc.bind
    # both supported layouts renamed (jax <= 0.10's counts, jax >= 0.11's FlatTrees)
    future = {
        "num_consts": "consts_count",
        "num_carry": "carry_count",
        "ft_in": "groups_in",
        "ft_out": "groups_out",
    }

    def eq(e):
        if e.primitive.name != "scan":
            return e
        return e.replace(params={future.get(k, k): v for k, v in e.params.items()})

    def strip(closed):
        return jcore.ClosedJaxpr(
            closed.jaxpr.replace(eqns=[eq(e) for e in closed.jaxpr.eqns]), closed.consts
        )

    def bind_future(eqn, invals, eqn_params=None):  # the stand-in for that JAX's own scan
        back = {v: k for k, v in future.items()}
        p = jc.params(eqn) if eqn_params is None else dict(eqn_params)
        return bind(eqn, invals, {back.get(k, k): v for k, v in p.items()})

    monkeypatch.setattr(
        jax,
        "make_jaxpr",
        lambda f, *a, **k: lambda *x, **kw: strip(make_jaxpr(f, *a, **k)(*x, **kw)),
    )
    monkeypatch.setattr(jc, "bind", bind_future)
    loss, params, data = _rnn()
    report = ghost_report(loss, params, data)
    assert {p for p, _ in report.fallback} == {"['w']"} and dict(report.ghost) == {
        "['head']": "dense"
    }
    assert all("could not be analysed" in why and "num_consts" in why for _, why in report.fallback)
    with pytest.warns(UserWarning, match="could not be analysed"):
        got = clipped_grad(loss, 1.0, method="ghost")(params, data)
    monkeypatch.undo()
    assert_tree_close(got, clipped_grad(loss, 1.0, method="vmap")(params, data))


def test_bind_takes_both_forms_of_get_bind_params(monkeypatch):
    """jax <= 0.9.1 returned ``(subfuns, params)`` from ``get_bind_params``; later ones the params."""
    closed = jax.make_jaxpr(lambda a: jnp.sin(a) * 2.0)(jnp.ones(3))
    eqn = closed.jaxpr.eqns[0]
    x = jnp.arange(3.0)

    class OldPrimitive:  # the installed primitive, answering as jax 0.9.1 did
        def __init__(self, prim):
            self.prim, self.name, self.multiple_results = prim, prim.name, prim.multiple_results

        def get_bind_params(self, params):
            return [], self.prim.get_bind_params(params)

        def bind(self, *args, **params):
            return self.prim.bind(*args, **params)

    old = eqn.replace(primitive=OldPrimitive(eqn.primitive))
    np.testing.assert_allclose(jc.bind(old, [x])[0], jnp.sin(x))
    np.testing.assert_allclose(jc.bind(eqn, [x])[0], jnp.sin(x))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="swaps the CPU's lowering of threefry")
def test_gpu_threefry_on_cpu_unrolls_the_rounds_for_a_while_and_draws_the_same_bits():
    def draw(key):
        return jax.random.normal(key, (40, 3))

    key = jax.random.key(7)
    rolled = jax.jit(draw).lower(key).compile()
    with jc.gpu_threefry_on_cpu() as swapped:
        assert swapped
        unrolled = jax.jit(lambda k: draw(k)).lower(key).compile()  # a new function: a new lowering
    again = jax.jit(lambda k: draw(k)).lower(key).compile()
    assert " while(" in rolled.as_text() and " while(" in again.as_text()
    assert " while(" not in unrolled.as_text() and unrolled.as_text().count(" xor(") >= 20
    np.testing.assert_array_equal(np.asarray(unrolled(key)), np.asarray(rolled(key)))
