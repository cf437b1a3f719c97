"""PRODUCT_PRECISION: the precision of the per-example path's products, and the margin it costs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax.per_example import (
    PRODUCT_PRECISION,
    _products,
    clipped_grad,
    per_example_global_norm_clip,
)
from gradclip_jax.per_example._products import (
    PRODUCT_UNITS,
    product_einsum,
    product_margin,
    product_precision,
    tf32_passes,
)
from gradclip_jax.per_example.ghost._jaxpr import sub_jaxprs
from tests._backend import backend_default_precision, refuses_backward
from tests.per_example.models import assert_tree_close, cnn_setup, loop_reference, mlp_setup

X6 = "BF16_BF16_F32_X6"  # the reduced-pass algorithm XLA's CPU backend accepts


@pytest.fixture
def x6(monkeypatch):
    """This backend's products at six bfloat16 passes (restored afterwards)."""
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "bf16x6")


def _precisions(fn, *args, primitive=lax.dot_general_p) -> list:
    """The ``precision`` of every ``primitive`` equation in ``fn``'s jaxpr (nested jaxprs included),
    traced at the backend's default precision: the model's own products are left at ``None``
    (under the suite's full precision on a GPU they would read ``HIGHEST`` too)."""
    found: list = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive is primitive:
                found.append(eqn.params["precision"])
            for sub in sub_jaxprs(eqn):
                walk(sub)

    with backend_default_precision():
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _algorithms(fn, *args) -> list[str]:
    """The precision of every dot_general in ``fn``'s jaxpr, as text."""
    return [str(p) for p in _precisions(fn, *args)]


def _assert_matches_loop(fn, loss, params, data, clip):
    """``fn`` (a clipped_grad at ``clip``) gives the float64 per-example loop's sum, norms and count."""
    want, norms, clipped = loop_reference(loss, params, data, clip)
    got, info = jax.jit(fn)(params, data)
    assert_tree_close(got, want)
    np.testing.assert_allclose(info.norms, norms, rtol=2e-5)
    assert int(info.num_clipped) == clipped


def test_default_is_highest_everywhere():
    assert product_precision(np.float32, np.float32) is lax.Precision.HIGHEST
    assert product_margin(np.float32) == 1.0
    loss, params, data = mlp_setup()
    precs = _algorithms(clipped_grad(loss, 1.0, method="ghost"), params, data)
    assert sum("HIGHEST" in p for p in precs) >= 4
    assert not any(X6 in p for p in precs)


def test_reduced_passes_reach_every_per_example_product(x6):
    loss, params, data = mlp_setup()
    precs = _algorithms(clipped_grad(loss, 1.0, method="ghost", ghost_sum="bookkeeping"), params, data)
    # the Gram/formed norms and the book-kept sums all take the algorithm
    assert sum(X6 in p for p in precs) >= 4
    precs = _algorithms(clipped_grad(loss, 1.0, method="vmap"), params, data)
    assert any(X6 in p for p in precs)  # the weighted sum over formed rows


def test_only_float32_products_take_the_algorithm(x6):
    assert product_precision(np.float32, np.float32) == lax.DotAlgorithmPreset.BF16_BF16_F32_X6
    assert product_precision(np.float64, np.float64) is lax.Precision.HIGHEST
    assert product_precision(np.float32, np.complex64) is lax.Precision.HIGHEST
    assert product_margin(np.float64) == 1.0
    a = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    out = product_einsum("ij,kj->ik", a, a)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(a).T, rtol=1e-6)


def test_margin_lowers_the_clip_norm_by_the_product_error(monkeypatch):
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(3, 40)) * 10, jnp.float32)}
    hi, _ = per_example_global_norm_clip(g, 1.0)
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "bf16x6")
    assert product_margin(np.float32) == 1.0 - PRODUCT_UNITS["bf16x6"] * 2.0**-24
    lo, _ = per_example_global_norm_clip(g, 1.0)
    # every example is above the bound: the sum shrinks by the margin (8 units), to rounding
    ratio = np.linalg.norm(np.asarray(lo["w"], np.float64)) / np.linalg.norm(np.asarray(hi["w"], np.float64))
    assert 1.0 - 12 * 2.0**-24 < ratio < 1.0 - 4 * 2.0**-24


@pytest.mark.parametrize("setup", [mlp_setup, cnn_setup], ids=["mlp", "cnn"])
def test_ghost_at_reduced_passes_matches_the_loop(x6, setup):
    loss, params, data = setup()
    _assert_matches_loop(clipped_grad(loss, 0.5, method="ghost"), loss, params, data, 0.5)


def test_unknown_setting_names_the_table(monkeypatch):
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "fp8")
    loss, params, data = mlp_setup()
    with pytest.raises(ValueError, match="PRODUCT_PRECISION: unknown strategy 'fp8'"):
        clipped_grad(loss, 1.0, method="ghost")(params, data)


@pytest.fixture
def tf32x3_on_cpu(monkeypatch):
    """``"tf32x3"`` on this backend, its dots at HIGHEST (XLA's CPU backend rejects the TF32
    algorithm): what stays specific to the setting is how convolutions are written out."""
    monkeypatch.setitem(_products._ALGORITHMS, "tf32x3", lax.Precision.HIGHEST)
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "tf32x3")


def test_tf32_split_is_exact_and_its_head_has_ten_mantissa_bits():
    x = jnp.asarray(np.random.default_rng(0).normal(size=1000) * 10.0 ** np.arange(-5, 5).repeat(100), jnp.float32)
    head, tail = _products._tf32_split(x)
    np.testing.assert_array_equal(np.asarray(head + tail), np.asarray(x))
    assert not np.any(np.asarray(head).view(np.uint32) & 0x1FFF)  # low 13 of 23 mantissa bits clear
    assert np.all(np.abs(np.asarray(tail)) < 2.0**-10 * np.abs(np.asarray(x)))
    assert tf32_passes(x, x) is None  # only at "tf32x3"


def test_tf32x3_writes_convolution_sums_out_as_three_passes(tf32x3_on_cpu, monkeypatch):
    loss, params, data = cnn_setup()
    f = clipped_grad(loss, 0.5, method="ghost", ghost_sum="bookkeeping")
    convs = _precisions(f, params, data, primitive=lax.conv_general_dilated_p)
    assert convs and not any(p == (lax.Precision.HIGHEST,) * 2 for p in convs)
    # each of the CNN's two kernels' sums is one convolution at "highest" and three at "tf32x3"
    lowered = jax.jit(f).trace(params, data).lower().as_text().count("stablehlo.convolution")
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "highest")
    at_highest = jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum="bookkeeping")).trace(
        params, data).lower().as_text().count("stablehlo.convolution")
    assert lowered == at_highest + 2 * 2
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "tf32x3")
    # and the result is the clipped sum: on a CPU each pass is a float32 product, so only the
    # dropped tail x tail term (< 2**-20 relative) and the margin (2**-17) move it
    _assert_matches_loop(f, loss, params, data, 0.5)


def test_tf32x3_lowers_for_cuda_with_no_product_at_highest(monkeypatch):
    # The GPU setting cannot run on a CPU, but it lowers for CUDA on any machine: every product of
    # a book-kept CNN step then takes TF32 passes (dots by the algorithm, convolutions written out).
    # At the backend's default precision, as a user's step: the model's own products stay at
    # DEFAULT (and on a GPU an explicit 'backward' is refused there).
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "tf32x3")
    loss, params, data = cnn_setup()
    with backend_default_precision():
        for ghost_sum in ("backward", "bookkeeping"):
            f = jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum=ghost_sum))
            if refuses_backward(ghost_sum, lambda f=f: f.trace(params, data)):
                continue
            text = f.trace(params, data).lower(lowering_platforms=("cuda",)).as_text()
            assert "HIGHEST" not in text
            assert "lhs_precision_type = tf32" in text
