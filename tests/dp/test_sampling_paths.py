"""The samplers' one folder (``gradclip_jax.dp.sampling``) and the old module paths kept as
deprecation shims: importing one warns naming the new path, and its names are the same objects."""

from __future__ import annotations

import importlib
import pickle
import sys

import pytest

import gradclip_jax as gcx
from gradclip_jax.dp import sampling
from gradclip_jax.dp.sampling import poisson

#: each old module, and the names it served (their home: gradclip_jax.dp.sampling)
MOVED = {
    "gradclip_jax.dp.batch_selection": [
        "NEIGHBORING",
        "BatchSampler",
        "IndexSampler",
        "SampledBatch",
        "check_sampler",
        "processes",
    ],
    "gradclip_jax.dp.user_sampling": ["UserBatch", "UserPoissonSampler", "user_loss"],
}


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize("old,new", MOVED.items(), ids=list(MOVED))
def test_old_module_warns_naming_the_new_path_and_serves_the_same_objects(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(
        DeprecationWarning, match=f"{old} is deprecated .* import from gradclip_jax.dp.sampling"
    ):
        shim = importlib.import_module(old)
    assert sorted(dir(shim)) == sorted(new)
    for name in new:
        with pytest.warns(
            DeprecationWarning,
            match=f"{old}.{name} is deprecated .* gradclip_jax.dp.sampling.{name}",
        ):
            assert getattr(shim, name) is getattr(sampling, name)
        assert name in sampling.__all__
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = shim.nothing


def test_from_import_of_an_old_path_still_works():
    with pytest.warns(DeprecationWarning):
        from gradclip_jax.dp.batch_selection import BatchSampler, IndexSampler
        from gradclip_jax.dp.user_sampling import UserPoissonSampler
    assert BatchSampler is gcx.dp.BatchSampler and IndexSampler is gcx.dp.IndexSampler
    assert UserPoissonSampler is gcx.dp.UserPoissonSampler


def test_public_names_through_gcx_dp_are_unchanged():
    for name in (
        "BatchOverflowError",
        "BatchSampler",
        "IndexSampler",
        "SampledBatch",
        "PoissonBatch",
        "PoissonSampler",
        "UserBatch",
        "UserPoissonSampler",
        "user_loss",
    ):
        assert name in sampling.__all__ or name in gcx.__all__  # each name's one home
        if name in gcx.__all__:  # a top-level name read through gcx.dp: the same object, warned
            with pytest.warns(DeprecationWarning, match=f"gradclip_jax.{name}"):
                assert getattr(gcx.dp, name) is getattr(gcx, name), name
        else:
            assert getattr(gcx.dp, name) is getattr(sampling, name), name
    assert sampling.overflow_probability is poisson.overflow_probability


def test_a_pickle_naming_an_old_path_loads_the_moved_class():
    """A sampler pickled before the move names its class by its old module: it still loads."""
    s = gcx.PoissonSampler(100, expected_batch_size=10, steps=3, seed=1)
    assert type(pickle.loads(pickle.dumps(s))) is gcx.PoissonSampler
    new = pickle.dumps(sampling.UserPoissonSampler, protocol=0)
    assert new == b"cgradclip_jax.dp.sampling.users\nUserPoissonSampler\np0\n."
    old = new.replace(b"gradclip_jax.dp.sampling.users", b"gradclip_jax.dp.user_sampling")
    with pytest.warns(DeprecationWarning):
        assert pickle.loads(old) is sampling.UserPoissonSampler
