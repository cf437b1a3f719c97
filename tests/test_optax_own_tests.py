"""optax's own clipping tests (``optax/transforms/_clipping_test.py``, shipped in the
installed optax wheel) run against our optax-named functions: they may fail no test
that optax's own functions pass.

The file is executed from the wheel (never copied here) with an ``__import__`` that
answers its ``from optax.transforms import _clipping`` with a shim module whose
clipping functions are ours; every other import (``optax.tree``, optax's test
utilities) is optax's. ``unitwise_norm`` is a measuring helper the tests use to
check AGC's results, so the shim keeps optax's.
"""

from __future__ import annotations

import builtins
import importlib.util
import pathlib
import types
import unittest
from typing import Any

import optax
import optax.transforms
import pytest

import gradclip_jax as gcx

OURS = (
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "adaptive_grad_clip",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
)


def _test_file() -> pathlib.Path | None:
    spec = importlib.util.find_spec("optax")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = (
        pathlib.Path(next(iter(spec.submodule_search_locations)))
        / "transforms"
        / "_clipping_test.py"
    )
    return path if path.is_file() else None


def _failures(path: pathlib.Path, clipping: Any = None) -> set[str]:
    """The test ids that fail when ``path`` imports ``clipping`` as ``optax.transforms._clipping``
    (``None``: optax's own, imported by the file itself)."""
    package = types.SimpleNamespace(_clipping=clipping)

    def importer(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if (
            clipping is not None
            and name == "optax.transforms"
            and fromlist
            and "_clipping" in fromlist
        ):
            return package
        return builtins.__import__(name, globals, locals, fromlist, level)

    namespace = {
        "__name__": "optax_clipping_test",
        "__builtins__": {**vars(builtins), "__import__": importer},
    }
    exec(
        compile(path.read_text(), str(path), "exec"), namespace
    )  # optax's own test file, from its wheel
    suite = unittest.TestSuite()
    for value in namespace.values():
        if isinstance(value, type) and issubclass(value, unittest.TestCase):
            suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(value))
    result = unittest.TestResult()
    suite.run(result)
    assert result.testsRun > 0
    return {test.id().split(".")[-1] for test, _ in result.failures + result.errors}


def _shim() -> types.ModuleType:
    """A module that looks like ``optax.transforms._clipping`` with our clipping functions."""
    shim = types.ModuleType("gradclip_jax_as_optax_clipping")
    for name in OURS:
        setattr(shim, name, getattr(gcx, name))
    shim.unitwise_norm = (
        optax.transforms.unitwise_norm
    )  # a measuring helper of the tests, not a clipper
    return shim


@pytest.mark.slow
def test_optax_clipping_tests_fail_no_more_on_ours():
    path = _test_file()
    if path is None:
        pytest.skip("the installed optax wheel ships no transforms/_clipping_test.py")
    theirs = _failures(path)
    ours = _failures(path, _shim())
    assert ours <= theirs, (
        f"fail on ours only: {sorted(ours - theirs)} (optax fails {sorted(theirs)})"
    )
