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
