"""The shared argument checks of gradclip_jax._core.validation."""

from __future__ import annotations

import warnings

import pytest

from gradclip_jax._core.validation import clip_norm_arg, either_spelling


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
    with pytest.raises(TypeError, match=r"^g: missing the required argument `l2_clip_norm`.*`l2_norm_clip`"):
        clip_norm_arg("g", None, None)
