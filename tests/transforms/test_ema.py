"""clip_norm_by_ema, normalize_by_ema, clip_value_by_ema (torchzero's EMA clippers).

Every published multi-step reference vector runs over all its steps in float64
and in float32. The reference's ``inner=Mul(10)`` is our ``inner=optax.scale(10)``.
Where torchzero raises (a string ``ord`` with ``tensorwise=True``), our contract
supports the case; it is checked against an independent NumPy statement of the
same rules (``_oracle`` below), which is itself checked against every usable
reference vector so it cannot drift.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradclip_jax.transforms.ema import (
    ClipValueByEMAState,
    NormByEMAState,
    clip_norm_by_ema,
    clip_value_by_ema,
    normalize_by_ema,
)
from tests import oracle
from tests.vectors import arrays, cases_for

CASES = cases_for("ClipNormByEMA", "NormalizeByEMA", "ClipValueByEMA")
FACTORY = {
    "ClipNormByEMA": clip_norm_by_ema,
    "NormalizeByEMA": normalize_by_ema,
    "ClipValueByEMA": clip_value_by_ema,
}
# torchzero raises TypeError for a string ord with tensorwise=True (torch._foreach_norm
# takes numbers only); every ord works in our contract, checked against the oracle.
SUPPORTED_HERE = {"ClipNormByEMA/beta=0.5,ord=mad_tensorwise"}


def _ids(cases):
    return [c["id"] for c in cases]


def _kwargs(case: dict) -> dict:
    kw = dict(case["params"])
    extra = case.get("params_extra", {})
    if "inner" in extra:
        assert extra["inner"].startswith("Mul(10.0)")
        kw["inner"] = optax.scale(10.0)
    assert "exp_avg_tfm" not in extra  # none published; exp_avg_tfm is tested below
    return kw


def _run(case: dict, dtype) -> list[list[np.ndarray]]:
    tx = FACTORY[case["module"]](**_kwargs(case))
    state = tx.init([jnp.asarray(x) for x in arrays(case, "inputs", 0, dtype)])
    update = jax.jit(tx.update)
    outs = []
    for step in range(len(case["inputs"])):
        xs = [jnp.asarray(x) for x in arrays(case, "inputs", step, dtype)]
        out, state = update(xs, state)
        for o, x in zip(out, xs, strict=True):
            assert o.dtype == x.dtype and o.shape == x.shape
        outs.append([np.asarray(o, np.float64) for o in out])
    return outs


def _close(got, want, rtol, atol):
    for g_step, w_step in zip(got, want, strict=True):
        for g, w in zip(g_step, w_step, strict=True):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True)


def _expected(case):
    return [arrays(case, "expected", s) for s in range(len(case["expected"]))]


# ----------------------------------------------------------------------------
# An independent NumPy statement of the EMA rules (reference-semantics §2.8-2.10)
# ----------------------------------------------------------------------------


def _oracle(
    module: str,
    steps: list[list[np.ndarray]],
    params: dict,
    inner_mul: float = 1.0,
    dtype=np.float64,
) -> list[list[np.ndarray]]:
    p = {
        "beta": 0.99,
        "ord": 2,
        "tensorwise": True,
        "max_ema_growth": 1.5,
        "init": 0.0,
        "min_norm": 1e-6,
        **params,
    }
    beta = p["beta"]
    outs = []
    if module == "ClipValueByEMA":
        ema = None
        for xs in steps:
            if ema is None:
                ema = [p["init"] * np.abs(x) for x in xs]
            ema = [e + (1 - beta) * (np.abs(x) - e) for e, x in zip(ema, xs, strict=True)]
            outs.append(
                [np.minimum(np.maximum(x * inner_mul, -e), e) for x, e in zip(xs, ema, strict=True)]
            )
        return outs
    eps = 2 * np.finfo(dtype).tiny
    ema, prev = None, None

    def norm(ts):
        return float(oracle.norm(np.concatenate([t.ravel() for t in ts]), p["ord"]).reshape(()))

    for xs in steps:
        if ema is None:
            ema = [np.full_like(x, p["init"]) for x in xs]
        ema = [e + (1 - beta) * (x - e) for e, x in zip(ema, xs, strict=True)]
        groups = [[i] for i in range(len(xs))] if p["tensorwise"] else [list(range(len(xs)))]
        factors = [1.0] * len(xs)
        if prev is None:
            prev = [None] * len(groups)
        for k, idx in enumerate(groups):
            a = norm([xs[i] for i in idx])
            e = norm([ema[i] for i in idx])
            if p["max_ema_growth"] is not None:
                if prev[k] is None:
                    prev[k] = e
                allowed = max(p["max_ema_growth"] * prev[k], p["min_norm"])
                if e > allowed:
                    for i in idx:
                        ema[i] = ema[i] * (allowed / e)
                    e = allowed
                prev[k] = e
            target = max(e, eps)
            if not (math.isfinite(a) and a > 0):
                f = 1.0  # our contract: a zero / negative / non-finite norm is left alone
            elif module == "NormalizeByEMA":
                f = target / a
            else:
                f = min(1.0, target / a)
            for i in idx:
                factors[i] = f
        outs.append([x * inner_mul * f for x, f in zip(xs, factors, strict=True)])
    return outs


def _oracle_for(case, dtype=np.float64):
    steps = [arrays(case, "inputs", s, dtype) for s in range(len(case["inputs"]))]
    inner = 10.0 if "inner" in case.get("params_extra", {}) else 1.0
    return _oracle(case["module"], steps, case["params"], inner, dtype)


# ----------------------------------------------------------------------------
# Reference vectors
# ----------------------------------------------------------------------------

USABLE = [c for c in CASES if "expected_error" not in c]


@pytest.mark.parametrize("case", USABLE, ids=_ids(USABLE))
def test_reference_float64(case):
    with jax.enable_x64(True):
        rtol, atol = (1e-12, 1e-15) if case["dtype"] == "float64" else (2e-6, 1e-7)
        _close(_run(case, np.float64), _expected(case), rtol, atol)


@pytest.mark.parametrize("case", USABLE, ids=_ids(USABLE))
def test_reference_float32(case):
    _close(_run(case, np.float32), _expected(case), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("case", USABLE, ids=_ids(USABLE))
def test_oracle_matches_reference(case):
    """The NumPy oracle reproduces torchzero on every usable case (so it is trustworthy)."""
    dtype = np.float32 if case["dtype"] == "float32" else np.float64
    rtol = 2e-6 if dtype == np.float32 else 1e-12
    _close(_oracle_for(case, dtype), _expected(case), rtol=rtol, atol=1e-15)


def test_every_case_is_covered():
    ids = {c["id"] for c in CASES}
    assert ids == {c["id"] for c in USABLE} | SUPPORTED_HERE
    assert len(USABLE) >= 18


@pytest.mark.parametrize("cid", sorted(SUPPORTED_HERE))
def test_string_ord_tensorwise_is_supported(cid):
    """torchzero raises TypeError here; we compute it (checked against the oracle)."""
    case = next(c for c in CASES if c["id"] == cid)
    assert case["expected_error"].startswith("TypeError")
    with jax.enable_x64(True):
        _close(_run(case, np.float64), _oracle_for(case), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("ord_", ["mad", "std", 1.5, -1.0])
@pytest.mark.parametrize("tensorwise", [True, False])
@pytest.mark.parametrize("module", ["ClipNormByEMA", "NormalizeByEMA"])
def test_every_ord_matches_oracle(module, tensorwise, ord_):
    base = next(c for c in USABLE if c["id"] == "ClipNormByEMA/beta=0.5")
    case = dict(base, module=module, params={"beta": 0.5, "ord": ord_, "tensorwise": tensorwise})
    with jax.enable_x64(True):
        _close(_run(case, np.float64), _oracle_for(case), rtol=1e-11, atol=1e-15)


# ----------------------------------------------------------------------------
# Behaviour
# ----------------------------------------------------------------------------


def test_default_first_output_is_one_percent():
    g = {"w": jnp.array([[3.0, -4.0], [1.0, 2.0]]), "b": jnp.array([0.5])}
    for tx in (clip_norm_by_ema(), normalize_by_ema(), clip_value_by_ema()):
        out, _ = jax.jit(tx.update)(g, tx.init(g))
        for k in g:
            # rtol: the factor (0.01 from the EMA's bias correction) and the clip's rounding margin
            np.testing.assert_allclose(out[k], 0.01 * g[k], rtol=4e-6)


def test_zero_update_gives_zero_never_nan():
    z = [jnp.zeros(3), jnp.zeros((2, 2))]
    for tx in (
        clip_norm_by_ema(beta=0.5),
        normalize_by_ema(beta=0.5),
        clip_value_by_ema(beta=0.5),
        normalize_by_ema(beta=0.5, tensorwise=False, max_ema_growth=None, min_norm=0.0),
    ):
        state = tx.init(z)
        update = jax.jit(tx.update)
        for _ in range(3):
            out, state = update(z, state)
            for o in out:
                assert np.all(np.asarray(o) == 0)
            assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(state))


def test_normalize_negative_signed_sum_is_left_alone():
    """ord='sum' can be negative: torchzero divides by eps (huge values); we leave it."""
    tx = normalize_by_ema(beta=0.5, ord="sum", tensorwise=False)
    x = [jnp.array([-1.0, -2.0])]
    out, state = tx.update(x, tx.init(x))
    np.testing.assert_array_equal(out[0], x[0])
    assert float(state.norm) == -3.0 and not bool(state.clipped)


def test_state_records_norms_and_bound():
    tx = clip_norm_by_ema(beta=0.5, max_ema_growth=None)
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 1.0])}
    state = tx.init(g)
    out, state = tx.update(g, state)
    assert isinstance(state, NormByEMAState)
    np.testing.assert_allclose(optax.tree_utils.tree_get(state, "norm")["a"], 5.0)
    np.testing.assert_allclose(state.clip_norm["a"], 2.5)
    np.testing.assert_allclose(state.clip_norm["b"], 0.5)
    assert bool(state.clipped["a"]) and bool(state.clipped["b"])
    np.testing.assert_allclose(out["a"], [1.5, 2.0], rtol=1e-6)
    # second identical step: EMA = 0.75 g, so the norm 5 is clipped to 3.75
    out, state = tx.update(g, state)
    np.testing.assert_allclose(out["a"], 0.75 * g["a"], rtol=1e-6)
    assert int(state.count) == 2


def test_growth_limit_rescales_the_stored_ema():
    tx = clip_norm_by_ema(beta=0.0, max_ema_growth=2.0, tensorwise=False)
    x = jnp.array([1.0, 0.0])
    state = tx.init(x)
    _, state = tx.update(x, state)  # EMA = x, P = 1
    out, state = tx.update(10 * x, state)  # EMA would be 10x; limited to norm 2
    np.testing.assert_allclose(state.exp_avg, [2.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(state.prev_ema_norm, 2.0, rtol=1e-6)
    np.testing.assert_allclose(out, [2.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: clip_norm_by_ema(beta=0.5),
        lambda: normalize_by_ema(beta=0.5, tensorwise=False),
        lambda: clip_value_by_ema(beta=0.5),
    ],
    ids=["clip_norm", "normalize_global", "clip_value"],
)
def test_nonfinite_update_passes_and_leaves_state(make):
    tx = make()
    x1 = [jnp.array([1.0, -2.0, 0.5]), jnp.array([[0.3, 0.1], [-0.2, 0.4]])]
    bad = [jnp.array([jnp.nan, 1.0, 2.0]), jnp.array([[1.0, jnp.inf], [0.0, 1.0]])]
    x3 = [jnp.array([2.0, 1.0, -1.0]), jnp.array([[0.5, 0.5], [0.5, -0.5]])]
    s1 = tx.update(x1, tx.init(x1))[1]
    out, s2 = tx.update(bad, s1)
    for o, b in zip(out, bad, strict=True):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(b))
    assert int(s2.count) == int(s1.count) == 1
    for a, b in zip(
        jax.tree_util.tree_leaves(s2.exp_avg), jax.tree_util.tree_leaves(s1.exp_avg), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert not any(bool(c) for c in jax.tree_util.tree_leaves(s2.clipped))
    want = tx.update(x3, s1)[0]
    got = tx.update(x3, s2)[0]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_nonfinite_absorbed_when_not_skipping():
    tx = clip_value_by_ema(beta=0.5, skip_nonfinite=False)
    x = jnp.array([1.0, 2.0])
    s = tx.update(x, tx.init(x))[1]
    _, s = tx.update(jnp.array([jnp.nan, 2.0]), s)
    out, s = tx.update(x, s)  # torchzero: a NaN element stays NaN for good
    assert np.isnan(np.asarray(out)[0]) and np.isfinite(np.asarray(out)[1])
    assert int(s.count) == 3


def test_clip_value_init_one_leaves_first_update():
    tx = clip_value_by_ema(beta=0.9, init=1.0)
    x = {"w": jnp.array([1.0, -3.0, 0.0])}
    out, state = tx.update(x, tx.init(x))
    np.testing.assert_array_equal(out["w"], x["w"])
    assert isinstance(state, ClipValueByEMAState)


def test_clip_value_exp_avg_tfm_changes_bound_not_state():
    tx = clip_value_by_ema(beta=0.5, exp_avg_tfm=optax.scale(2.0))
    ref = clip_value_by_ema(beta=0.5)
    x = [jnp.array([1.0, -2.0]), jnp.array([4.0])]
    s, r = tx.init(x), ref.init(x)
    for scale in (1.0, 3.0, 0.5):
        xs = [scale * v for v in x]
        out, s = tx.update(xs, s)
        _, r = ref.update(xs, r)
        for o, v, e in zip(out, xs, r.exp_avg, strict=True):  # bound is 2 * EMA
            np.testing.assert_allclose(
                o, np.clip(v, -2 * np.asarray(e), 2 * np.asarray(e)), rtol=1e-6
            )
        for a, b in zip(s.exp_avg, r.exp_avg, strict=True):  # the stored EMA is untouched
            np.testing.assert_allclose(a, b, rtol=1e-7)


def test_clip_value_complex_keeps_phase():
    tx = clip_value_by_ema(beta=0.5)
    x = jnp.array([3.0 + 4.0j, 0.0 + 1.0j])
    out, _ = tx.update(x, tx.init(x))
    np.testing.assert_allclose(np.asarray(out), 0.5 * np.asarray(x), rtol=1e-6)
    assert out.dtype == jnp.complex64


def test_inner_statistics_come_from_the_input():
    tx = normalize_by_ema(beta=0.5, tensorwise=False, inner=optax.scale(10.0))
    plain = normalize_by_ema(beta=0.5, tensorwise=False)
    x = jnp.array([3.0, 4.0])
    (o1, s1), (o2, s2) = tx.update(x, tx.init(x)), plain.update(x, plain.init(x))
    np.testing.assert_allclose(o1, 10 * np.asarray(o2), rtol=1e-6)
    np.testing.assert_allclose(s1.exp_avg, s2.exp_avg)
    assert isinstance(s1.inner_state, optax.ScaleState) and isinstance(
        s2.inner_state, optax.EmptyState
    )


def test_bfloat16_leaves_keep_dtype_and_float32_state():
    x = {"w": jnp.array([3.0, 4.0], jnp.bfloat16)}
    for tx in (clip_norm_by_ema(beta=0.5), clip_value_by_ema(beta=0.5)):
        state = tx.init(x)
        assert state.exp_avg["w"].dtype == jnp.float32
        out, state = tx.update(x, state)
        assert out["w"].dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out["w"], np.float32), [1.5, 2.0], rtol=1e-2)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"beta": 1.0}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"beta": math.nan}, "beta"),
        ({"max_ema_growth": -1.0}, "max_ema_growth"),
        ({"min_norm": -1e-6}, "min_norm"),
        ({"init": math.inf}, "init"),
        ({"ord": "bogus"}, "ord"),
        ({"inner": 3}, "inner"),
    ],
)
def test_invalid_arguments_raise(kwargs, name):
    err = TypeError if name == "inner" else ValueError  # wrong type vs wrong value
    for make in (clip_norm_by_ema, normalize_by_ema):
        with pytest.raises(err, match=name):
            make(**kwargs)
    if name in ("beta", "inner"):
        with pytest.raises(err, match=name):
            clip_value_by_ema(**kwargs)
    with pytest.raises(TypeError, match="exp_avg_tfm"):
        clip_value_by_ema(exp_avg_tfm="no")


def test_schedule_beta():
    tx = clip_norm_by_ema(beta=lambda step: jnp.where(step == 0, 0.5, 0.0), max_ema_growth=None)
    x = jnp.array([3.0, 4.0])
    state = tx.init(x)
    out, state = tx.update(x, state)  # beta 0.5: EMA = x / 2
    np.testing.assert_allclose(out, x / 2, rtol=1e-6)
    out, state = tx.update(x / 10, state)  # beta 0: EMA = the update itself
    np.testing.assert_allclose(out, x / 10, rtol=1e-6)


def test_integer_leaf_raises_with_path():
    tx = clip_norm_by_ema()
    with pytest.raises(TypeError, match="steps"):
        tx.init({"w": jnp.zeros(2), "steps": jnp.zeros((), jnp.int32)})


@pytest.mark.parametrize("tensorwise", [True, False])
def test_growth_limit_under_vmap_and_jit_matches_one_by_one(tensorwise):
    # The rescaling pass runs in a lax.cond only when the limit engages or a step is
    # skipped; under vmap the predicate is batched and both branches run as a select.
    tx = clip_norm_by_ema(beta=0.5, max_ema_growth=1.5, tensorwise=tensorwise)
    rng = np.random.default_rng(0)
    scales = jnp.asarray([1.0, 50.0, np.nan, 0.2])  # limit off, limit on, skipped, shrink
    first = {
        "a": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4, 2, 2)), jnp.float32),
    }
    second = jax.tree_util.tree_map(lambda x: x * scales.reshape((4,) + (1,) * (x.ndim - 1)), first)

    def two_steps(g1, g2):
        s = tx.update(g1, tx.init(g1))[1]
        return tx.update(g2, s)

    batched = jax.jit(jax.vmap(two_steps))(first, second)
    # one example at a time: an unbatched predicate, a real lax.cond (jitted: eagerly each of its
    # operations would be dispatched, and compiled, on its own)
    one_by_one = jax.jit(two_steps)
    for i in range(4):
        one = one_by_one(*jax.tree_util.tree_map(lambda x, i=i: x[i], (first, second)))
        for got, want in zip(
            jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(one), strict=True
        ):
            np.testing.assert_allclose(np.asarray(got)[i], np.asarray(want), rtol=1e-6)
    assert int(batched[1].count[2]) == 1  # the NaN step was skipped
    # example 1: the EMA's norm grew 50x and was limited to 1.5x its previous norm
    first_ema = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[1].prev_ema_norm))(first)
    prev = np.asarray(first_ema["a"] if tensorwise else first_ema)
    np.testing.assert_allclose(
        np.asarray(batched[1].prev_ema_norm["a"] if tensorwise else batched[1].prev_ema_norm)[1],
        1.5 * prev[1],
        rtol=1e-5,
    )


def test_clip_value_flags_match_elementwise_comparison():
    tx = clip_value_by_ema(beta=0.5, init=1.0)
    x1 = {"r": jnp.array([1.0, -2.0, 0.5]), "c": jnp.array([1 + 1j, 2.0], jnp.complex64)}
    s = tx.update(x1, tx.init(x1))[1]
    for x2, want in [
        (
            {"r": jnp.array([1.0, -2.0, 0.5]), "c": jnp.array([1 + 1j, 2.0], jnp.complex64)},
            (False, False),
        ),
        (
            {"r": jnp.array([1.0, -2.5, 0.5]), "c": jnp.array([1 + 1j, 2.0], jnp.complex64)},
            (True, False),
        ),
        (
            {"r": jnp.array([1.0, 2.0, -0.5]), "c": jnp.array([1 + 3j, 0.0], jnp.complex64)},
            (False, True),
        ),
    ]:
        out, s2 = jax.jit(tx.update)(x2, s)
        assert (bool(s2.clipped["r"]), bool(s2.clipped["c"])) == want
        for k in x2:
            assert bool(jnp.any(out[k] != x2[k])) == bool(s2.clipped[k])


@pytest.mark.cpu_only(
    reason="reads XLA:CPU's buffer assignment and optimized program (copies, temporaries)"
)
@pytest.mark.parametrize(
    "make",
    [
        clip_norm_by_ema,
        normalize_by_ema,
        clip_value_by_ema,
        lambda: clip_norm_by_ema(tensorwise=False),
    ],
)
def test_a_donated_state_is_updated_in_place(make):
    # A training step donates the optimizer state: the stored EMA is read by the one pass
    # that writes the new EMA, so XLA overwrites it in place instead of copying it first.
    tx = make()
    g = {"w": jnp.ones((256, 128)), "b": jnp.ones((128,))}
    state = tx.init(g)
    compiled = jax.jit(tx.update, donate_argnums=1).lower(g, state).compile()
    leaf_bytes = 256 * 128 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < leaf_bytes
    hlo = compiled.as_text()
    assert "f32[256,128]{1,0} copy(" not in hlo
    out, new = compiled(g, state)
    assert bool(jnp.all(jnp.isfinite(out["w"])))
    assert int(new.count) == 1
