"""PRODUCT_PRECISION: the precision of the per-example path's products, and the margin it costs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gradclip_jax import clipped_grad, per_example_global_norm_clip
from gradclip_jax.per_example import PRODUCT_PRECISION, _products
from gradclip_jax.per_example._products import (
    PRODUCT_UNITS,
    exact_in_float32,
    product_einsum,
    product_margin,
    product_precision,
    tf32_passes,
    tf32_round,
    tf32_weighted,
    view_dtype,
)
from tests._backend import backend_default_precision, refuses_backward
from tests.jaxprs import equations
from tests.per_example.models import (
    assert_tree_close,
    cnn_setup,
    embed_setup,
    loop_reference,
    mlp_setup,
)

X6 = "BF16_BF16_F32_X6"  # the reduced-pass algorithm XLA's CPU backend accepts


BF16X6_REFUSED = _products.product_refusal("bf16x6") is not None  # on GPUs


@pytest.fixture
def x6(monkeypatch):
    """This backend's products at six bfloat16 passes (restored afterwards); refused on GPUs."""
    if BF16X6_REFUSED:
        pytest.skip("'bf16x6' products are refused on GPUs (test_bf16x6_is_refused_on_gpus)")
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "bf16x6")


def test_bf16x6_is_refused_on_gpus(monkeypatch):
    """On an H200 XLA's six-pass bfloat16 products were ~1e-3 relative off float32's: with the
    margin of 8 units of roundoff a clipped contribution could exceed the clip norm."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(PRODUCT_PRECISION, "gpu", "bf16x6")
    loss, params, data = mlp_setup()
    with pytest.raises(
        ValueError, match=r"PRODUCT_PRECISION: 'bf16x6' is refused on 'gpu': measured"
    ):
        clipped_grad(loss, 1.0, method="ghost")(params, data)
    with pytest.raises(ValueError, match="'bf16x6' is refused"):
        product_margin(np.float32)


def _precisions(fn, *args, primitive=lax.dot_general_p) -> list:
    """The ``precision`` of every ``primitive`` equation in ``fn``'s jaxpr (nested jaxprs included),
    traced at the backend's default precision: the model's own products are left at ``None``
    (under the suite's full precision on a GPU they would read ``HIGHEST`` too)."""
    with backend_default_precision():
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [eqn.params["precision"] for eqn in equations(jaxpr) if eqn.primitive is primitive]


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


def test_default_is_highest_on_the_cpu_and_tf32_on_gpus():
    assert PRODUCT_PRECISION.get("cpu", "highest") == "highest"
    assert _products.DEFAULT_PRODUCT_PRECISION == {"gpu": "tf32", "cuda": "tf32"}
    if jax.default_backend() != "cpu":
        return
    assert product_precision(np.float32, np.float32) is lax.Precision.HIGHEST
    assert product_margin(np.float32) == 1.0
    loss, params, data = mlp_setup()
    precs = _algorithms(clipped_grad(loss, 1.0, method="ghost"), params, data)
    assert sum("HIGHEST" in p for p in precs) >= 4
    assert not any(X6 in p for p in precs)


def test_reduced_passes_reach_every_per_example_product(x6):
    loss, params, data = mlp_setup()
    precs = _algorithms(
        clipped_grad(loss, 1.0, method="ghost", ghost_sum="bookkeeping"), params, data
    )
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
    if BF16X6_REFUSED:
        pytest.skip("'bf16x6' products are refused on GPUs (test_bf16x6_is_refused_on_gpus)")
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(3, 40)) * 10, jnp.float32)}
    hi, _ = per_example_global_norm_clip(g, 1.0)
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "bf16x6")
    assert product_margin(np.float32) == 1.0 - PRODUCT_UNITS["bf16x6"] * 2.0**-24
    lo, _ = per_example_global_norm_clip(g, 1.0)
    # every example is above the bound: the sum shrinks by the margin (8 units), to rounding
    ratio = np.linalg.norm(np.asarray(lo["w"], np.float64)) / np.linalg.norm(
        np.asarray(hi["w"], np.float64)
    )
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
    x = jnp.asarray(
        np.random.default_rng(0).normal(size=1000) * 10.0 ** np.arange(-5, 5).repeat(100),
        jnp.float32,
    )
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
    at_highest = (
        jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum="bookkeeping"))
        .trace(params, data)
        .lower()
        .as_text()
        .count("stablehlo.convolution")
    )
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


@pytest.fixture
def tf32(monkeypatch):
    """This backend's products at ``"tf32"`` (on a CPU, DEFAULT is float32: the same values as a GPU)."""
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), "tf32")


def _tf32_exact(x) -> bool:
    """Every value of ``x`` has at most 11 significant bits (a TF32 value)."""
    m, _ = np.frexp(np.asarray(x, np.float64))
    return bool(np.all(m * 2.0**11 == np.round(m * 2.0**11)))


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_16bit_products_are_exact_with_float32_accumulation(dt):
    """Operands of one 16-bit type are multiplied as they are, with a float32 result: the exact
    products summed in float32, as their float32 widening at full precision gives; beside a
    float32 operand they are widened first, as before."""
    r = np.random.default_rng(4)
    a = jnp.asarray(r.normal(size=(3, 7, 40)) * 10.0 ** r.integers(-2, 3, (3, 7, 1)), dt)
    assert exact_in_float32(dt, dt) and not exact_in_float32(dt, jnp.float32)
    assert not exact_in_float32(jnp.bfloat16, jnp.float16)
    assert view_dtype(dt, dt, jnp.float32) == dt  # a 16-bit site's views stay 16-bit
    assert view_dtype(dt, jnp.float32, jnp.float32) == jnp.float32
    got = product_einsum("btd,bsd->bts", a, a)
    assert got.dtype == jnp.float32
    a64 = np.asarray(a.astype(jnp.float32), np.float64)
    exact = np.einsum("btd,bsd->bts", a64, a64)
    size = np.einsum("btd,bsd->bts", np.abs(a64), np.abs(a64))
    assert np.all(
        np.abs(np.asarray(got, np.float64) - exact) <= 40 * 2.0**-24 * size
    )  # float32 sums only
    b = jnp.asarray(r.normal(size=(3, 7, 40)), jnp.float32)
    np.testing.assert_array_equal(
        product_einsum("btd,bsd->bts", a, b),
        product_einsum("btd,bsd->bts", a.astype(jnp.float32), b),
    )


def test_tf32_round_keeps_ten_mantissa_bits_and_makes_products_exact():
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=4000) * 10.0 ** r.integers(-15, 15, 4000), jnp.float32)
    y = tf32_round(x)
    assert y.dtype == jnp.float32 and _tf32_exact(y)
    rel = np.abs(np.asarray(y, np.float64) / np.asarray(x, np.float64) - 1.0)
    assert rel.max() <= 2.0**-11  # round to nearest
    a, b = np.asarray(y[:2000], np.float64), np.asarray(y[2000:], np.float64)
    assert np.array_equal(np.asarray(y[:2000] * y[2000:], np.float64), a * b)  # exact in float32
    assert tf32_weighted(x, x) is None  # only at "tf32"


def test_tf32_weighted_parts_sum_to_the_truncated_weight_times_the_rounded_cotangent(tf32):
    r = np.random.default_rng(1)
    g = jnp.asarray(r.normal(size=(6, 50)) * 10.0 ** r.integers(-5, 5, (6, 1)), jnp.float32)
    w = jnp.asarray(r.uniform(0, 1, size=(6, 1)), jnp.float32)
    head, tail = tf32_weighted(g, w)
    assert _tf32_exact(head) and _tf32_exact(tail)
    wt = np.asarray(w, np.float64)
    trunc = np.asarray(head + tail, np.float64) / np.asarray(tf32_round(g), np.float64)
    assert np.all(trunc <= wt) and np.all(trunc > wt * (1 - 2.0**-10))
    exact = np.asarray(head, np.float64) + np.asarray(tail, np.float64)
    np.testing.assert_array_equal(exact, trunc[:, :1] * np.asarray(tf32_round(g), np.float64))
    assert (
        tf32_weighted(g.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.bfloat16), w)
        is None
    )


def test_tf32_products_are_default_precision_on_rounded_operands(tf32):
    assert (
        product_precision(np.float32, np.float32) is lax.Precision.HIGHEST
    )  # weighted sums of rows
    assert product_margin(np.float32) == 1.0 and PRODUCT_UNITS["tf32"] == 0
    loss, params, data = mlp_setup()
    f = clipped_grad(loss, 1.0, method="ghost", ghost_sum="bookkeeping")
    precs = _algorithms(f, params, data)
    assert sum("DEFAULT" in p for p in precs) >= 4  # the Gram norms and the two passes of each sum
    text = jax.jit(f).trace(params, data).lower(lowering_platforms=("cuda",)).as_text()
    assert "reduce_precision" in text


@pytest.mark.parametrize("setup", [mlp_setup, cnn_setup, embed_setup], ids=["mlp", "cnn", "embed"])
@pytest.mark.parametrize("ghost_sum", ["bookkeeping", "auto"])
def test_ghost_at_tf32_matches_the_loop_to_tf32_rounding(tf32, setup, ghost_sum):
    loss, params, data = setup()
    want, norms, _ = loop_reference(loss, params, data, 0.5)
    got, info = jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum=ghost_sum))(params, data)
    assert_tree_close(got, want, rtol=4e-3, atol=4e-4)
    np.testing.assert_allclose(info.norms, norms, rtol=2e-3)


@pytest.mark.parametrize("setup", [mlp_setup, cnn_setup, embed_setup], ids=["mlp", "cnn", "embed"])
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2))])
@pytest.mark.parametrize(("setting", "slack"), [("tf32", 1e-2), ("tf32x2", 2.0**-9)])
def test_tf32_contribution_stays_within_the_clip_norm(setup, seed, setting, slack, monkeypatch):
    """One example far above the bound: what is added (float64 norm) is at most C, with no margin,
    and not far below: by the weight's truncation (at most 2**-10) at "tf32x2"; at "tf32" also by
    the one-pass sums' widened norm (the spread over the norm: 0.22% on the CNN, under 1% here)."""
    monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), setting)
    loss, params, data = setup(seed=seed, batch=1)
    # the clip norm as an argument: one compiled program per ghost_sum serves every bound (and
    # measures the example's norm, which an eager call compiled op by op)
    steps = {
        ghost_sum: jax.jit(
            lambda p, d, c, s=ghost_sum: clipped_grad(loss, c, method="ghost", ghost_sum=s)(p, d)
        )
        for ghost_sum in ("bookkeeping", "auto")
    }
    _, info = steps["bookkeeping"](params, data, jnp.float32(1.0))
    checked = 0
    for clip in float(info.norms[0]) * np.array([1e-4, 0.37, 0.9, 2.0]):
        for step in steps.values():
            got, info = step(params, data, jnp.float32(clip))
            if float(info.norms[0]) <= clip:  # not clipped: nothing to bound
                continue
            norm = np.sqrt(
                sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(got))
            )
            assert norm <= clip
            assert norm > clip * (1 - slack)
            checked += 1
    assert checked >= 2


def test_tf32_refuses_a_second_backward_pass_and_auto_books_keeps(tf32):
    """The norms measure the gradients of rounded operands, which only book-keeping adds."""
    loss, params, data = cnn_setup()
    with pytest.raises(
        ValueError, match=r"ghost_sum='backward' cannot be used here: .*PRODUCT_PRECISION is 'tf32'"
    ):
        clipped_grad(loss, 0.5, method="ghost", ghost_sum="backward")(params, data)
    got, _ = jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum="auto"))(params, data)
    want, _ = jax.jit(clipped_grad(loss, 0.5, method="ghost", ghost_sum="bookkeeping"))(
        params, data
    )
    assert_tree_close(got, want, rtol=0, atol=0)


def _cancelling_dense(seed: int, tokens: int = 64, width: int = 32):
    """A dense layer over ``tokens`` positions whose per-token gradients nearly cancel: a large
    component shared by every position's input and cotangents of alternating sign make
    ``sum_t ||a_t|| ||g_t||`` about 1e3 times the per-example gradient's norm, where rounding the
    weighted inputs moves the gradient most against its norm."""
    r = np.random.default_rng(seed)
    common = r.normal(size=(1, 1, width)) * 50.0
    x = common + r.normal(size=(1, tokens, width)) * 0.05
    sign = np.where(np.arange(tokens) % 2 == 0, 1.0, -1.0)[None, :, None]
    target = sign * (1.0 + r.normal(size=(1, tokens, width)) * 1e-3)
    params = {"w": jnp.asarray(r.normal(size=(width, width)), jnp.float32)}
    data = {"x": jnp.asarray(x, jnp.float32), "t": jnp.asarray(target, jnp.float32)}

    def loss(p, b):
        return jnp.sum(
            (b["x"] @ p["w"]) * b["t"], axis=(1, 2)
        )  # the cotangent of the dense output is t

    return loss, params, data


def _added_norm(tree) -> float:
    return float(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    )


@pytest.mark.parametrize("seed", range(4))
def test_one_pass_dense_sum_stays_within_the_clip_norm_where_tokens_cancel(tf32, seed, monkeypatch):
    """At "tf32" a dense layer's book-kept sum rounds its weighted operand once: the clip factor
    comes from the norm widened by that rounding's bound, and what is added stays within C. With
    the widening taken out (ONCE_ROUNDING = 0), the same sums exceed C: the bound is needed."""
    loss, params, data = _cancelling_dense(seed)

    def step():  # the clip norm as an argument: one program serves every bound
        return jax.jit(
            lambda p, d, c: clipped_grad(loss, c, method="ghost", ghost_sum="bookkeeping")(p, d)
        )

    widened = step()
    _, info = widened(params, data, jnp.float32(1.0))
    norm = float(info.norms[0])
    clips = [float(np.float32(norm * scale)) for scale in (1e-3, 0.3, 0.9)]
    for clip in clips:
        got, _ = widened(params, data, jnp.float32(clip))
        assert _added_norm(got) <= clip
    monkeypatch.setattr(_products, "ONCE_ROUNDING", 0.0)
    import gradclip_jax.per_example.ghost._measure as measure_mod

    monkeypatch.setattr(measure_mod, "ONCE_ROUNDING", 0.0)
    unwidened = step()  # traced anew: reads ONCE_ROUNDING = 0
    excess = [_added_norm(unwidened(params, data, jnp.float32(clip))[0]) / clip for clip in clips]
    assert max(excess) > 1.0 + 1e-3  # unwidened, one pass overshoots the clip norm


def test_one_pass_is_one_product_per_dense_sum_and_tf32x2_keeps_two(monkeypatch):
    """ "tf32" runs each dense book-kept sum as one DEFAULT-precision product; "tf32x2" as two
    exact passes. Unclipped examples (weight 1) add exactly what "tf32x2" adds."""
    loss, params, data = mlp_setup()
    counts, sums = {}, {}
    for name in ("tf32", "tf32x2"):
        monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), name)
        f = clipped_grad(loss, 1e6, method="ghost", ghost_sum="bookkeeping")
        counts[name] = sum("DEFAULT" in p for p in _algorithms(f, params, data))
        sums[name] = jax.jit(f)(params, data)[0]
    assert counts["tf32x2"] - counts["tf32"] >= 2  # at least the two dense kernels' second passes
    # bit for bit on the CPU; a GPU's two programs may accumulate in another order (1e-7 seen)
    exact = jax.default_backend() == "cpu"
    assert_tree_close(
        sums["tf32"], sums["tf32x2"], rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6
    )


@pytest.mark.parametrize("setup", [mlp_setup, cnn_setup, embed_setup], ids=["mlp", "cnn", "embed"])
def test_one_pass_clips_at_most_a_spread_below_two_passes(setup, monkeypatch):
    """The widened norm clips one-pass sums a little harder than two exact passes, by at most
    ``2**-11`` times the spread over the norm (here well under 1%)."""
    loss, params, data = setup()
    out = {}
    for name in ("tf32", "tf32x2"):
        monkeypatch.setitem(PRODUCT_PRECISION, jax.default_backend(), name)
        out[name] = jax.jit(clipped_grad(loss, 0.3, method="ghost", ghost_sum="bookkeeping"))(
            params, data
        )
    np.testing.assert_array_equal(
        out["tf32"][1].norms, out["tf32x2"][1].norms
    )  # norms are reported unwidened
    assert_tree_close(out["tf32"][0], out["tf32x2"][0], rtol=1e-2, atol=1e-4)
