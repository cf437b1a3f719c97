"""Importing a deprecated module on purpose: the warning is expected, every time."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

import gradclip_jax


def import_moved(name: str) -> types.ModuleType:
    """Imports the deprecation shim ``gradclip_jax.<name>`` afresh, expecting its warning."""
    sys.modules.pop(f"gradclip_jax.{name}", None)
    gradclip_jax.__dict__.pop(name, None)
    with pytest.warns(DeprecationWarning, match=rf"gradclip_jax\.{name} is deprecated"):
        return importlib.import_module(f"gradclip_jax.{name}")
