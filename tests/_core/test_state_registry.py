"""The explicit registry of state classes that norms_from_state reads (no package import at run time)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import gradclip_jax as gcx
from gradclip_jax import monitor
from gradclip_jax._core.state_registry import STATE_CLASSES, register_state


def test_every_public_state_class_is_registered_once():
    public = {getattr(gcx, n) for n in gcx.__all__ if n.endswith("State")}
    assert set(STATE_CLASSES) == public
    assert len(STATE_CLASSES) == len(set(STATE_CLASSES))


def test_monitor_imports_nothing_at_run_time():
    tree = ast.parse(pathlib.Path(monitor.__file__).read_text())
    inner = [
        n
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        for n in ast.walk(f)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    assert inner == []


def test_register_state_refuses_a_non_namedtuple():
    with pytest.raises(TypeError, match=r"register_state: .* is not a NamedTuple state class"):
        register_state(dict)
