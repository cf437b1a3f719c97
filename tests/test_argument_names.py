"""Renamed arguments and the DP API's two spellings of the clip norm (CONTRIBUTING.md, "Naming")."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

import gradclip_jax as gcx


def _clip_norms(tx, norms, set_hyperparams=None):
    """The threshold ``tx`` records at each step for updates of the given norms."""
    state = tx.init(jnp.zeros(2))
    if set_hyperparams:
        state.hyperparams.update(set_hyperparams)
    out = []
    for n in norms:
        _, state = tx.update(jnp.array([n, 0.0]), state)
        inner = state.inner_state if hasattr(state, "inner_state") else state
        out.append(float(inner.clip_norm))
    return out


def test_autoclip_min_norm_floors_the_threshold():
    assert _clip_norms(gcx.autoclip(percentile=0.0, min_norm=1.5), [1.0, 2.0]) == [1.5, 1.5]
    assert _clip_norms(gcx.autoclip(percentile=0.0), [1.0, 2.0]) == [1.0, 1.0]


def test_autoclip_min_clip_norm_warns_and_means_min_norm():
    with pytest.warns(
        DeprecationWarning, match="autoclip: `min_clip_norm` is deprecated, use `min_norm`"
    ):
        tx = gcx.autoclip(percentile=0.0, min_clip_norm=1.5)
    assert _clip_norms(tx, [1.0, 2.0]) == [1.5, 1.5]


def test_autoclip_both_spellings_is_an_error():
    with pytest.raises(TypeError, match=r"`min_norm`.*`min_clip_norm`"):
        gcx.autoclip(min_norm=1.0, min_clip_norm=1.0)


@pytest.mark.parametrize("inject", [optax.inject_hyperparams, gcx.inject_hyperparams])
def test_autoclip_min_norm_is_injectable(inject):
    tx = inject(gcx.autoclip)(percentile=0.0, min_norm=1.5)
    assert _clip_norms(tx, [1.0, 2.0]) == [1.5, 1.5]
    assert _clip_norms(tx, [1.0, 2.0], {"min_norm": jnp.asarray(3.0)}) == [3.0, 3.0]


@pytest.mark.parametrize("inject", [optax.inject_hyperparams, gcx.inject_hyperparams])
def test_autoclip_min_clip_norm_is_injectable_under_its_old_name(inject):
    """Code that injected the old spelling keeps its ``state.hyperparams`` key, with a warning."""
    with pytest.warns(DeprecationWarning, match="min_clip_norm"):
        tx = inject(gcx.autoclip)(percentile=0.0, min_clip_norm=1.5)
        assert _clip_norms(tx, [1.0, 2.0]) == [1.5, 1.5]
        assert _clip_norms(tx, [1.0, 2.0], {"min_clip_norm": jnp.asarray(3.0)}) == [3.0, 3.0]


def test_autoclip_invalid_old_spelling_is_named():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="min_clip_norm"):
        gcx.autoclip(min_clip_norm=-1.0)


# ---------------------------------------------------------------------------
# The DP API takes the clip norm as `l2_clip_norm` or optax's `l2_norm_clip`, without a warning
# ---------------------------------------------------------------------------


class _Reached(Exception):
    """Raised in place of a run, carrying the arguments it was given."""


def _stop_at_make_private(monkeypatch, module):
    def fake(*args, **kwargs):
        raise _Reached(kwargs)

    monkeypatch.setattr(module, "make_private", fake)


def _audit_calls():
    from gradclip_jax.dp.audit import audit_epsilon, audit_sampling

    def epsilon(**clip):
        return audit_epsilon(
            lambda w, b: (b @ w) ** 2,
            jnp.zeros(2),
            jnp.ones((8, 2)),
            num_canaries=4,
            target_epsilon=1.0,
            delta=1e-5,
            expected_batch_size=4,
            steps=2,
            **clip,
        )

    def sampling(**clip):
        return audit_sampling(
            lambda seed: gcx.PoissonSampler(16, steps=2, expected_batch_size=4, seed=seed),
            target_epsilon=1.0,
            delta=1e-5,
            runs=2,
            **clip,
        )

    return {"epsilon": epsilon, "sampling": sampling}


@pytest.mark.parametrize("which", ["epsilon", "sampling"])
def test_audits_take_either_spelling(which, monkeypatch, recwarn):
    from gradclip_jax.dp.audit import _canaries, _sampling_audit

    _stop_at_make_private(monkeypatch, _canaries if which == "epsilon" else _sampling_audit)
    call = _audit_calls()[which]
    for clip in ({"l2_clip_norm": 0.5}, {"l2_norm_clip": 0.5}):
        with pytest.raises(_Reached) as reached:
            call(**clip)
        assert reached.value.args[0]["l2_clip_norm"] == 0.5
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    with pytest.raises(TypeError, match="`l2_clip_norm` and `l2_norm_clip`"):
        call(l2_clip_norm=0.5, l2_norm_clip=0.5)


def test_audit_sampling_defaults_to_a_unit_clip_norm(monkeypatch):
    from gradclip_jax.dp.audit import _sampling_audit

    _stop_at_make_private(monkeypatch, _sampling_audit)
    with pytest.raises(_Reached) as reached:
        _audit_calls()["sampling"]()
    assert reached.value.args[0]["l2_clip_norm"] == 1.0


def test_audit_epsilon_needs_a_clip_norm():
    with pytest.raises(TypeError, match="missing the required argument `l2_clip_norm`"):
        _audit_calls()["epsilon"]()


def test_grid_functions_take_either_spelling():
    from gradclip_jax.dp import hardened

    g = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4]])}
    ours = hardened.grid_clipped_sum(g, 1.0, 256.0)["w"]
    assert (hardened.grid_clipped_sum(g, l2_norm_clip=1.0, grid_scale=256.0)["w"] == ours).all()
    assert hardened.grid_sensitivity(l2_norm_clip=2.0, grid_scale=4.0) == 8.0
    assert hardened.grid_sensitivity(2.0, 4.0) == 8.0
    assert hardened.grid_noise_multiplier(16.0, l2_norm_clip=2.0, grid_scale=4.0) == 2.0
    for call in (
        lambda: hardened.grid_clipped_sum(g, 1.0, 256.0, l2_norm_clip=1.0),
        lambda: hardened.grid_sensitivity(1.0, 4.0, l2_norm_clip=1.0),
        lambda: hardened.grid_noise_multiplier(16.0, 1.0, 4.0, l2_norm_clip=1.0),
    ):
        with pytest.raises(TypeError, match="`l2_clip_norm` and `l2_norm_clip`"):
            call()
    with pytest.raises(TypeError, match="missing the required argument `l2_clip_norm`"):
        hardened.grid_sensitivity(grid_scale=4.0)
    with pytest.raises(TypeError, match="missing the required argument `grid_scale`"):
        hardened.grid_sensitivity(1.0)


@pytest.mark.parametrize("plan", ["bandmf_plan", "blt_plan"])
def test_correlated_noise_plans_take_either_spelling(plan, monkeypatch):
    pytest.importorskip("jax_privacy")
    from gradclip_jax.interop import correlated_noise

    def checked(*args):  # the plan's argument check sees the clip norm, 7th
        raise _Reached(args[6])

    monkeypatch.setattr(correlated_noise, "_check", checked)
    make = getattr(correlated_noise, plan)
    kw = {"num_examples": 1000, "expected_batch_size": 100, "iterations": 10, "epsilon": 4.0}
    kw |= {"delta": 1e-5} | ({"num_bands": 1} if plan == "bandmf_plan" else {})
    for clip, expected in (({"l2_clip_norm": 2.0}, 2.0), ({"l2_norm_clip": 2.0}, 2.0), ({}, 1.0)):
        with pytest.raises(_Reached) as reached:
            make(**kw, **clip)
        assert reached.value.args[0] == expected
    with pytest.raises(TypeError, match="`l2_clip_norm` and `l2_norm_clip`"):
        make(**kw, l2_clip_norm=2.0, l2_norm_clip=2.0)


def test_autoclip_warning_points_at_the_caller():
    with pytest.warns(DeprecationWarning) as record:
        gcx.autoclip(min_clip_norm=1.0)
    assert record[0].filename == __file__
