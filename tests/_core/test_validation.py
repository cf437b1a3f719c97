"""The shared argument checks of gradclip_jax._core.validation."""

from __future__ import annotations

import ast
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax._core import validation
from gradclip_jax._core.validation import (
    StaticDefault,
    check_bool,
    check_choice,
    check_int,
    check_mask,
    check_number,
    check_transform,
    clip_norm_arg,
    either_spelling,
    renamed_kwarg,
)


def test_either_spelling_returns_the_one_given_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert either_spelling("f", "a", "b", 1, None) == 1
        assert either_spelling("f", "a", "b", None, 2) == 2
        assert either_spelling("f", "a", "b", None, None) is None
        assert clip_norm_arg("f", None, 0.5) == clip_norm_arg("f", 0.5, None) == 0.5


def test_either_spelling_rejects_both_and_names_them():
    with pytest.raises(TypeError, match=r"^f: got both `a` and `b`"):
        either_spelling("f", "a", "b", 1, 1)
    with pytest.raises(
        TypeError, match=r"^g: missing the required argument `l2_clip_norm`.*`l2_norm_clip`"
    ):
        clip_norm_arg("g", None, None)


def test_check_int_one_behaviour():
    assert check_int("f", "n", 3) == 3 and check_int("f", "n", np.int64(3), 1) == 3
    assert check_int("f", "n", 4.0) == 4  # optax.inject_hyperparams hands numbers over as floats
    assert check_int("f", "n", jnp.asarray(5)) == 5
    for bad in (True, np.bool_(False), 2.5, "3", None, [1]):
        with pytest.raises(TypeError, match=r"^f: `n` must be an int"):
            check_int("f", "n", bad)
    with pytest.raises(ValueError, match=r"^f: `n` must be >= 1, got 0"):
        check_int("f", "n", 0, 1)


def test_check_mask_never_casts():
    assert check_mask("f", None, 3) is None
    np.testing.assert_array_equal(check_mask("f", np.array([True, False]), 2), [True, False])
    for bad in (np.array([1.0, 0.0]), np.array([1, 0]), jnp.array([0.5, 0.0])):
        with pytest.raises(TypeError, match=r"^f: `mask` must be a bool array"):
            check_mask("f", bad, 2)
    with pytest.raises(ValueError, match=r"^f: `mask` must have shape \(B,\) = \(3,\)"):
        check_mask("f", np.ones(2, bool), 3)


def test_check_number_is_host_side():
    assert check_number("f", "x", 1) == 1.0
    for bad in (None, lambda t: 1.0, True, "1"):
        with pytest.raises(TypeError, match=r"^f: `x` must be a"):
            check_number("f", "x", bad)
    with pytest.raises(ValueError, match=r"^f: `x` must be < 1"):
        check_number("f", "x", 1.0, high=1.0, high_inclusive=False)
    with pytest.raises(ValueError, match=r"^f: `x` must be finite"):
        check_number("f", "x", float("inf"), allow_inf=False)

    @jax.jit
    def traced(x):
        return check_number("f", "x", x)

    with pytest.raises(TypeError, match="must be a number"):
        traced(1.0)


def test_renamed_kwarg_treats_a_static_default_as_not_given():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert renamed_kwarg("f", "old", "new", StaticDefault(None), 4) == 4
    with pytest.warns(DeprecationWarning, match="`old` is deprecated"):
        assert renamed_kwarg("f", "old", "new", 3, StaticDefault(None)) == 3


def test_check_bool_choice_transform():
    assert check_bool("f", "b", np.bool_(True)) is True
    with pytest.raises(TypeError, match=r"^f: `b` must be a bool"):
        check_bool("f", "b", 1)
    assert check_choice("f", "c", "A", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"^f: `c` must be one of"):
        check_choice("f", "c", "z", ("a", "b"))
    check_transform("f", "t", None)
    with pytest.raises(TypeError, match=r"^f: `t` must be an optax"):
        check_transform("f", "t", object())


def test_one_definition_of_each_check():
    """Every check of the package is defined once, in _core.validation (the duplicates of issue 30)."""
    root = pathlib.Path(validation.__file__).parents[1]
    names = (
        "check_int",
        "check_mask",
        "check_bool",
        "check_choice",
        "check_transform",
        "check_scalar",
        "check_number",
        "renamed_kwarg",
        "static_value",
    )
    defs = {n: [] for n in names}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in defs:
                defs[node.name.lstrip("_")].append(path.relative_to(root).as_posix())
    assert defs == {n: ["_core/validation.py"] for n in names}
