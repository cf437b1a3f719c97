"""The old paths of the everyday API: ``gradclip_jax.transforms.X``, ``gradclip_jax.dp.X``,
``gradclip_jax.per_example.X`` (and the subpackages and modules that also showed some of them)
for a name whose home is now ``gradclip_jax`` warn for one
release (CHANGELOG.md) and give the very object ``gradclip_jax.X`` gives."""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest

import gradclip_jax

#: What each package showed of the top-level API before the top level became its home.
OLD_PATHS = {
    "gradclip_jax.transforms": [
        "AdaGCState",
        "AdaptiveGradClipState",
        "AutoClipState",
        "CentralizeState",
        "ClipByBlockRmsState",
        "ClipByGlobalNormState",
        "ClipByNormState",
        "ClipByValueState",
        "ClipNormGrowthState",
        "ClipValueByEMAState",
        "ClipValueGrowthState",
        "NormByEMAState",
        "NormalizeState",
        "QuantileClipState",
        "SkipOnSpikeState",
        "ZClipState",
        "adaptive_grad_clip",
        "clip",
        "clip_by_block_rms",
        "clip_by_global_norm",
        "clip_by_norm",
        "clip_by_value",
        "clip_norm_by_ema",
        "clip_norm_growth",
        "clip_value_by_ema",
        "clip_value_growth",
        "normalize",
        "normalize_by_ema",
        "quantile_clip",
        "skip_on_spike",
        "unit_axes",
    ],
    "gradclip_jax.dp": [
        "BatchOverflowError",
        "DPAggregateState",
        "DPNoiseState",
        "DPQuantileAggregateState",
        "PoissonBatch",
        "PoissonSampler",
        "PrivacyBudgetError",
        "PrivacyBudgetWarning",
        "PrivateStepMetrics",
        "PrivateTraining",
        "dp_aggregate",
        "dp_noise",
        "dp_quantile_aggregate",
        "dpsgd",
        "make_private",
        "noise_multiplier_for_gradient",
    ],
    "gradclip_jax.per_example": [
        "ClippedGradFn",
        "ClippedGradInfo",
        "clipped_grad",
        "per_example_global_norm_clip",
        "per_example_layer_norm_clip",
        "per_example_norms",
    ],
    "gradclip_jax.per_example.ghost": ["GhostFallbackWarning", "GhostReport", "ghost_report"],
    "gradclip_jax.dp.sampling": ["BatchOverflowError", "PoissonBatch", "PoissonSampler"],
    "gradclip_jax.functional": ["leaf_norms", "tree_norm"],
}

#: Transform families named like their function: the package attribute stays the function.
SHARED_NAMES = ("adagc", "autoclip", "centralize", "zclip")


@pytest.mark.parametrize("package,name", [(p, n) for p, names in OLD_PATHS.items() for n in names])
def test_old_path_warns_and_gives_the_same_object(package, name):
    module = importlib.import_module(package)
    assert name not in vars(module)
    with pytest.warns(
        DeprecationWarning,
        match=rf"{package}\.{name} is deprecated.*import from gradclip_jax\.{name} ",
    ):
        obj = getattr(module, name)
    assert obj is getattr(gradclip_jax, name)
    with pytest.warns(DeprecationWarning, match=rf"gradclip_jax\.{name} instead"):
        imported = getattr(__import__(package, fromlist=[name]), name)
    assert imported is obj


def test_every_top_level_name_is_served_or_absent():
    """No package shows a top-level name silently, the four shared names and the names a module
    defines (its own functions: the code's place, CONTRIBUTING.md) aside."""
    for package in OLD_PATHS:
        module = importlib.import_module(package)
        silent = sorted(n for n in gradclip_jax.__all__ if n in vars(module))
        silent = [
            n
            for n in silent
            if not isinstance(vars(module)[n], types.ModuleType)
            and getattr(vars(module)[n], "__module__", None) != package
        ]
        assert silent == (list(SHARED_NAMES) if package == "gradclip_jax.transforms" else [])


def test_unknown_names_still_raise():
    for package in OLD_PATHS:
        with pytest.raises(AttributeError, match="no_such_name"):
            importlib.import_module(package).no_such_name  # noqa: B018


@pytest.mark.parametrize("name", SHARED_NAMES)
def test_a_family_named_like_its_function_imports_the_function(name):
    """``from gradclip_jax.transforms import zclip`` gives the function, as it did; the family
    module is still importable by its path."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn = getattr(__import__("gradclip_jax.transforms", fromlist=[name]), name)
        importlib.import_module(f"gradclip_jax.transforms.{name}")
    assert fn is getattr(gradclip_jax, name) and callable(fn)
    family = sys.modules[f"gradclip_jax.transforms.{name}"]
    assert isinstance(family, types.ModuleType) and getattr(family, name) is fn
    assert getattr(gradclip_jax.transforms, name) is fn
