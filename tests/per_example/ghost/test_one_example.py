"""The one-example program (``_analysis/one_example.py``): where the rules cannot follow the
batched loss (a primitive they do not know, as each JAX release adds some), ghost clipping
analyses the loss on one example, vmapped, and measures every parameter it can. Checked
against ``method='vmap'``, with JAX releases simulated by removing rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import clipped_grad, ghost_report
from gradclip_jax._core import jaxcompat as jc, norms as _norms
from gradclip_jax.per_example.ghost._analysis.one_example import batch_states, vmapped_loss
from gradclip_jax.per_example.ghost._analysis.plan import trace_and_plan
from gradclip_jax.per_example.ghost.rules import CONST, MIXED, RULES
from tests.per_example.ghost.test_new_primitives import lstm_setup, rope_attention_setup
from tests.per_example.ghost.test_scan import B, D, _data, _w, stacked_transformer
from tests.per_example.models import assert_tree_close, cnn_setup, mlp_setup, xent


def _primitives(jaxpr):
    """The primitives of ``jaxpr`` and of the jaxprs nested in it."""
    return {e.primitive.name for e in jaxpr.eqns}.union(
        *(_primitives(j) for e in jaxpr.eqns for j in jc.sub_jaxprs(e))
    )


def _plan(loss, params, data):
    pflat = _norms.flatten(params, "test")
    bsize = jax.tree.leaves(data)[0].shape[0]
    return trace_and_plan(loss, False, "test", params, pflat, data, (), bsize, check=False).plan


def _ghost_equals_vmap(loss, params, data, ghost_sums=("bookkeeping", "backward"), **kw):
    want, want_info = jax.jit(clipped_grad(loss, 1.0, method="vmap", **kw))(params, data)
    for ghost_sum in ghost_sums:
        got, info = jax.jit(clipped_grad(loss, 1.0, method="ghost", ghost_sum=ghost_sum, **kw))(
            params, data
        )
        assert_tree_close(info.norms, want_info.norms, rtol=3e-5, atol=3e-6)
        assert_tree_close(got, want, rtol=3e-5, atol=3e-6)


def _head_loss(mix):
    """A tanh layer, ``mix`` applied to its (B, T, D) activations, a mean over positions, a head."""

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w"] + p["b"])
        return xent(jnp.mean(mix(h), axis=1) @ p["head"], b["y"])

    return loss


def _head_params(seed):
    r = np.random.default_rng(seed)
    return {"w": _w(r, D, D), "b": 0.1 * _w(r, D), "head": _w(r, D, 4)}


_TRI = jnp.tril(jnp.ones((D, D))) + D * jnp.eye(D)
# per-example computations through primitives no rule knows (each sends the batched loss to the
# vmap path whole: the rules cannot tell that they keep the examples apart)
MIXES = {
    "scatter-add": lambda h: h.at[:, :, jnp.array([0, 0, 3])].add(h[:, :, 1:4]),
    "segment_sum": lambda h: jax.vmap(
        jax.vmap(lambda r: jax.ops.segment_sum(r, jnp.arange(D) % 3, D))
    )(h),
    "triangular_solve": lambda h: jax.vmap(
        lambda m: jax.scipy.linalg.solve_triangular(_TRI, m.T, lower=True).T
    )(h),
}


@pytest.mark.parametrize("name", sorted(MIXES))
def test_a_primitive_without_a_rule_keeps_every_leaf_on_the_ghost_path(name):
    loss, params, data = _head_loss(MIXES[name]), _head_params(1), _data(1)
    assert _primitives(jax.make_jaxpr(loss)(params, data).jaxpr) - set(RULES), (
        "no primitive without a rule"
    )
    plan = _plan(loss, params, data)
    assert plan.one_example and plan.row_wise
    assert ghost_report(loss, params, data).fallback == []
    _ghost_equals_vmap(loss, params, data)


def test_a_parameter_read_by_such_a_primitive_falls_back_alone():
    """``w``'s product feeds the scatter-add (measured as a dense use); ``v`` is the update itself."""
    params = {**_head_params(2), "v": 0.3 * _w(np.random.default_rng(2), 3)}

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w"] + p["b"]).at[:, :, jnp.array([0, 0, 3])].add(p["v"])
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    data = _data(2)
    rep = ghost_report(loss, params, data)
    assert [path for path, _ in rep.fallback] == ["['v']"]
    assert "'scatter-add'" in rep.fallback[0][1] and "where each update lands" in rep.fallback[0][1]
    assert dict(rep.ghost)["['w']"] == "dense"
    _ghost_equals_vmap(loss, params, data)


@pytest.mark.parametrize(
    "removed", [("stack",), pytest.param(("split", "reshape"), marks=pytest.mark.slow)]
)
def test_a_jax_release_adding_primitives_does_not_send_a_model_to_the_fallback(
    monkeypatch, removed
):
    """As jax 0.10 made ``jnp.stack`` a primitive: with the rules of the rotary embedding's
    ``stack`` (or of ``split`` and ``reshape``) removed, the rules cannot follow the batched loss;
    the one-example program keeps every leaf measured, with the same kinds."""
    loss, params, data = rope_attention_setup(seed=4)
    before = dict(ghost_report(loss, params, data).ghost)
    for name in removed:
        monkeypatch.delitem(RULES, name)
    plan = _plan(loss, params, data)
    assert plan.one_example
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost) == before
    _ghost_equals_vmap(loss, params, data)


def test_scanned_layers_unreadable_to_the_rules_are_still_measured_inside_the_loop(monkeypatch):
    """A scan whose row rule cannot read its parameters (as jax 0.11's new layout was to an
    older rule): the one-example program still measures the stacked leaves inside the loop."""
    loss, params, data = stacked_transformer(layers=2, seed=3)

    def unreadable(self, c):
        raise jc.LayoutError("scan: 'num_consts' (a simulated new layout)")

    monkeypatch.setattr(type(RULES["scan"]), "row", unreadable)
    plan = _plan(loss, params, data)
    assert plan.one_example
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost)["['qkv']"] == "scan:dense"
    _ghost_equals_vmap(loss, params, data, ghost_sums=("bookkeeping",))


def test_the_batched_loss_is_analysed_first():
    """A loss the rules follow keeps its own program (the one the user wrote)."""
    loss, params, data = mlp_setup()
    plan = _plan(loss, params, data)
    assert not plan.one_example and plan.row_wise


def test_a_loss_combining_examples_is_still_refused():
    """A batch statistic (certainly combining examples) is an error, whatever the other
    primitives: the one-example program would compute something else."""
    params, data = _head_params(3), _data(3)
    loss = _head_loss(lambda h: MIXES["scatter-add"](h - jnp.mean(h, axis=0)))
    with pytest.raises(ValueError, match="combines examples"):
        clipped_grad(loss, 1.0, method="ghost")(params, data)


def test_a_loss_failing_on_one_example_keeps_the_batched_plan():
    """A loss that indexes examples by a fixed count fails on one example: the batched plan (the
    fallback, with its reason) stands."""
    params = {"w": _w(np.random.default_rng(5), D, 4)}

    def loss(p, b):
        rows = jnp.unstack(b["x"].mean(axis=1) @ p["w"], axis=0)
        return jnp.stack(
            [xent(rows[i][None] + rows[0][None], b["y"][i : i + 1])[0] for i in range(B)]
        )

    data = _data(5)
    assert not _plan(loss, params, data).one_example
    assert "'unstack'" in ghost_report(loss, params, data).fallback[0][1]


def test_batch_states_read_the_batch_axis_of_every_value():
    def one(p, x):  # x: (1, 3, D) for one example
        h = jnp.swapaxes(x, 1, 2) @ p  # (1, D, D)
        return jnp.sum(h.reshape(-1)), jnp.sum(p)

    def per_example(p, xs):
        return jax.vmap(lambda x: one(p, x[None]))(xs)

    p = jnp.ones((3, D))
    at5 = jax.make_jaxpr(per_example)(p, jnp.ones((5, 3, D))).jaxpr
    at6 = jax.make_jaxpr(per_example)(p, jnp.ones((6, 3, D))).jaxpr
    states = batch_states(at5, at6, 5, 6)
    assert states is not None
    assert states[at5.invars[0]] == CONST and states[at5.invars[1]] == 0
    out = at5.outvars
    assert states[out[0]] == 0 and states[out[1]] == 0  # (vmap broadcasts the unbatched sum)
    dot = next(e for e in at5.eqns if e.primitive.name == "dot_general")
    assert jc.shape(dot.outvars[0]).count(5) == 1 and isinstance(states[dot.outvars[0]], int)


def test_batch_states_refuse_programs_that_differ_beyond_their_shapes():
    def f(x):
        return jnp.sum(x) if x.shape[0] % 2 else jnp.sum(jnp.sin(x))

    at5, at6 = (jax.make_jaxpr(f)(jnp.ones((n, 2))).jaxpr for n in (5, 6))
    assert batch_states(at5, at6, 5, 6) is None


def test_a_batch_merged_with_other_axes_is_not_followed():
    at5, at6 = (jax.make_jaxpr(lambda x: x.reshape(-1))(jnp.ones((n, 3))).jaxpr for n in (5, 6))
    states = batch_states(at5, at6, 5, 6)
    assert states is not None and states[at5.outvars[0]] == MIXED


def test_vmapped_loss_is_the_loss_on_each_example_alone():
    loss, params, data = mlp_setup()
    n = data["y"].shape[0]
    want = jnp.stack(
        [loss(params, jax.tree.map(lambda x, i=i: x[i : i + 1], data))[0] for i in range(n)]
    )
    np.testing.assert_allclose(
        vmapped_loss(loss, False)(params, data, ()), want, rtol=1e-6, atol=1e-6
    )


def test_under_jit_and_microbatches():
    loss, params, data = _head_loss(MIXES["scatter-add"]), _head_params(6), _data(6)
    _ghost_equals_vmap(loss, params, data, ghost_sums=("auto",), microbatch_size=1)


def test_convolutions_in_the_one_example_program(monkeypatch):
    """A CNN whose ``relu`` (``max``) no rule follows: the convolution, batched by ``vmap``'s
    rule for it, is measured as in the batched loss."""
    loss, params, data = cnn_setup()
    before = dict(ghost_report(loss, params, data).ghost)
    monkeypatch.delitem(RULES, "max")
    assert _plan(loss, params, data).one_example
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost) == before and before["['conv']"] == "conv"
    _ghost_equals_vmap(loss, params, data)


def test_an_unknown_primitive_inside_a_scan_over_time(monkeypatch):
    """An LSTM under ``lax.scan`` whose gates' ``unstack`` no rule knows: the scan's body cannot
    be followed, so the scan mixes for the rules; the one-example program measures every leaf."""
    loss, params, data = lstm_setup()
    before = dict(ghost_report(loss, params, data).ghost)
    monkeypatch.delitem(RULES, "unstack")
    assert _plan(loss, params, data).one_example
    rep = ghost_report(loss, params, data)
    assert rep.fallback == [] and dict(rep.ghost) == before
    _ghost_equals_vmap(loss, params, data, ghost_sums=("bookkeeping",))


def test_a_loss_the_rules_find_mixing_keeps_its_warning():
    """Regrouping the flattened rows as ``(T, B)``: a known rule finds examples mixed, so the
    batched plan and its reason stand (the one-example program would silently differ)."""
    params, data = _head_params(7), _data(7)

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w"] + p["b"]) @ p["head"]  # (B, T, 4)
        return jnp.mean(h.reshape(-1, B), axis=0)

    plan = _plan(loss, params, data)
    assert not plan.one_example and plan.unknown is None and not plan.row_wise
    assert "mixes examples" in ghost_report(loss, params, data).fallback[0][1]


def test_a_primitive_without_a_rule_elsewhere_does_not_hide_mixing():
    """The rules find the examples mixed (rows regrouped across the batch); a primitive with no
    rule on the parameters alone (a Cholesky factor of a weight's Gram) is not where they lost
    the batch: the batched plan and its reason stand."""
    params, data = _head_params(8), _data(8)

    def loss(p, b):
        w = p["w"] @ jnp.linalg.cholesky(p["w"].T @ p["w"] + jnp.eye(D))
        h = jnp.tanh(b["x"] @ w) @ p["head"]  # (B, T, 4)
        return jnp.mean(h.reshape(-1, B), axis=0)

    assert {"cholesky"} <= _primitives(jax.make_jaxpr(loss)(params, data).jaxpr) - set(RULES)
    plan = _plan(loss, params, data)
    assert not plan.one_example and plan.unknown is None and not plan.row_wise
