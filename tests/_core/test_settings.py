"""Settings are read from the one module that defines them: assigning one through any of its
public paths changes what the package does (``gradclip_jax._core.settings``)."""

from __future__ import annotations

import types

import jax
import pytest

from gradclip_jax import clipped_grad
from gradclip_jax._core import norms as core_norms
from gradclip_jax._core.norms import _reduce
from gradclip_jax._core.settings import forward_settings
from gradclip_jax.dp import hardened, noise
from gradclip_jax.dp.hardened import _discrete_gaussian
from gradclip_jax.per_example import ghost as ghost_pkg
from gradclip_jax.per_example.ghost._analysis import policy
from tests.moved import import_moved
from tests.per_example.models import mlp_setup

OLD_GHOST = import_moved("ghost")  # the deprecated path still forwards the settings
OLD_PRIVACY = import_moved("privacy")


def test_a_forwarded_name_reads_and_assigns_its_home(monkeypatch):
    home = types.ModuleType("home")
    home.LIMIT = 3
    shown = types.ModuleType("shown")
    shown.LIMIT = 3  # the copy an import would have made: dropped
    shown.OTHER = 1
    monkeypatch.setitem(__import__("sys").modules, "shown", shown)
    forward_settings("shown", home, ("LIMIT",))
    assert shown.LIMIT == 3 and "LIMIT" in dir(shown)
    home.LIMIT = 4
    assert shown.LIMIT == 4
    shown.LIMIT = 5
    assert home.LIMIT == 5
    shown.OTHER = 2  # the other names stay the module's own
    assert shown.OTHER == 2 and not hasattr(home, "OTHER")
    with pytest.raises(AttributeError):
        forward_settings("shown", home, ("MISPELT",))


def _program(method: str, nan_safe: bool = False, **kw):
    loss, params, data = mlp_setup()
    return str(
        jax.make_jaxpr(clipped_grad(loss, 1.0, method=method, nan_safe=nan_safe, **kw))(
            params, data
        )
    )


@pytest.mark.parametrize("public", [ghost_pkg, OLD_GHOST], ids=["per_example.ghost", "gcx.ghost"])
def test_auto_min_elements_set_from_its_public_path_takes_effect(public, monkeypatch):
    """The small MLP is below the threshold: ``method='auto'`` takes the vmap path; with the
    threshold set to 0 through the public module, the ghost path."""
    assert public.AUTO_MIN_ELEMENTS == policy.AUTO_MIN_ELEMENTS
    assert _program("auto") == _program("vmap")
    monkeypatch.setattr(public, "AUTO_MIN_ELEMENTS", 0)
    assert policy.AUTO_MIN_ELEMENTS == 0 and ghost_pkg.AUTO_MIN_ELEMENTS == 0
    assert _program("auto") == _program("ghost")
    assert _program("auto") != _program("vmap")


@pytest.mark.parametrize("public", [ghost_pkg, OLD_GHOST], ids=["per_example.ghost", "gcx.ghost"])
def test_bookkeeping_max_share_set_from_its_public_path_takes_effect(public, monkeypatch):
    """``ghost_sum='auto'`` follows the share: 0 (never book-keeping) gives the second backward
    pass, a share no plan exceeds gives book-keeping. (The MLP has no scan or checkpoint: the
    probed path, NaN-safe or not; the streamed path book-keeps inside the backward pass whatever
    the share.)"""
    from tests._backend import refuses_backward

    if refuses_backward("backward", lambda: _program("ghost", ghost_sum="backward")):
        pytest.skip("this backend refuses the second backward pass")
    monkeypatch.setattr(public, "BOOKKEEPING_MAX_SHARE", 0.0)
    assert policy.BOOKKEEPING_MAX_SHARE == 0.0
    assert _program("ghost", True) == _program("ghost", True, ghost_sum="backward")
    monkeypatch.setattr(public, "BOOKKEEPING_MAX_SHARE", 1e9)
    assert _program("ghost", True) == _program("ghost", True, ghost_sum="bookkeeping")
    assert _program("ghost", True) != _program("ghost", True, ghost_sum="backward")


@pytest.mark.parametrize(
    "public,home,name",
    [
        (OLD_PRIVACY, noise, "NOISE_BLOCK_SIZE"),
        (noise, noise, "NOISE_BLOCK_SIZE"),
        (core_norms, _reduce, "PACK_MAX_SIZE"),
        (core_norms, _reduce, "SLICE_PACK_MAX_SIZE"),
        (hardened, _discrete_gaussian, "MAX_SIGMA"),
    ],
)
def test_other_forwarded_settings_assign_their_defining_module(public, home, name, monkeypatch):
    before = getattr(home, name)
    assert getattr(public, name) == before
    monkeypatch.setattr(public, name, before * 2)
    assert getattr(home, name) == before * 2
    monkeypatch.undo()
    assert getattr(home, name) == getattr(public, name) == before
