"""clip_norm_growth and clip_value_growth (torchzero's growth clippers).

Every published multi-step reference vector runs over all its steps in float64
and float32. Our contract drops two reference bugs (``add=mul=None`` crashes in
``ClipNormGrowth``; ``min_value`` also floors the divisor of every update); those
behaviours are checked against an independent NumPy statement of the rules
(``_norm_oracle`` / ``_value_oracle``), which reproduces every usable reference
vector when run with the reference's rules, and we check that the reference's
own rule really gives something else there.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax.transforms.ema import clip_value_by_ema
from gradclip_jax.transforms.growth import (
    ClipNormGrowthState,
    ClipValueGrowthState,
    clip_norm_growth,
    clip_value_growth,
)
from tests import oracle
from tests._backend import on_cpu
from tests.vectors import arrays, cases_for

CASES = cases_for("ClipNormGrowth", "ClipValueGrowth")
FACTORY = {"ClipNormGrowth": clip_norm_growth, "ClipValueGrowth": clip_value_growth}
# BUG: torchzero's helper returns a bare tensor for add=mul=None and unpacking it fails
# on step 2; our contract makes it the identity (with the usual state).
IDENTITY_HERE = {"ClipNormGrowth/add=None,mul=None"}


def _ids(cases):
    return [c["id"] for c in cases]


def _steps(case, dtype=np.float64):
    return [arrays(case, "inputs", s, dtype) for s in range(len(case["inputs"]))]


def _run(module: str, params: dict, steps, jit: bool = True):
    tx = FACTORY[module](**params)
    state = tx.init([jnp.asarray(x) for x in steps[0]])
    update = jax.jit(tx.update) if jit else tx.update
    outs = []
    for xs in steps:
        xs = [jnp.asarray(x) for x in xs]
        out, state = update(xs, state)
        for o, x in zip(out, xs, strict=True):
            assert o.dtype == x.dtype and o.shape == x.shape
        outs.append([np.asarray(o, np.float64) for o in out])
    return outs, state


def _close(got, want, rtol, atol=1e-15):
    for g_step, w_step in zip(got, want, strict=True):
        for g, w in zip(g_step, w_step, strict=True):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True)


# ----------------------------------------------------------------------------
# Independent NumPy statements of the rules (reference-semantics §2.11-2.12)
# ----------------------------------------------------------------------------


def _norm_oracle(
    steps,
    add=None,
    mul=1.5,
    min_value=1e-4,
    max_decay=2.0,
    ord=2,  # noqa: A002
    tensorwise=True,
    reference_bugs=False,
):
    """ClipNormGrowth; ``reference_bugs=True`` adds torchzero's divisor floor at min_value."""
    prev = None
    outs = []
    for xs in steps:
        groups = [[i] for i in range(len(xs))] if tensorwise else [list(range(len(xs)))]
        if prev is None:
            prev = [
                float(oracle.norm(np.concatenate([xs[i].ravel() for i in g]), ord).reshape(()))
                for g in groups
            ]
            outs.append([x.copy() for x in xs])
            continue
        out = list(xs)
        for k, g in enumerate(groups):
            n = float(oracle.norm(np.concatenate([xs[i].ravel() for i in g]), ord).reshape(()))
            p = prev[k]
            d = 1.0
            with np.errstate(divide="ignore", invalid="ignore"):
                if add is not None and n > p + add:
                    d = n / (p + add)
                if mul is not None and n > p * mul:
                    d = max(d, np.float64(n) / np.float64(p * mul))
                if reference_bugs and min_value is not None:
                    d = max(d, min_value)
                new = n / d
                if max_decay is not None and np.float64(n) / np.float64(p) < 1 / max_decay:
                    new = p / max_decay
            if min_value is not None:
                new = max(new, min_value)
            prev[k] = new
            for i in g:
                out[i] = xs[i] / d
        outs.append(out)
    return outs


def _value_oracle(steps, add=None, mul=1.5, min_value=1e-4, max_decay=2.0):
    prev = None
    outs = []
    for xs in steps:
        if prev is None:
            prev = [x.copy() for x in xs]
            outs.append([x.copy() for x in xs])
            continue
        out = []
        for i, (x, r) in enumerate(zip(xs, prev, strict=True)):
            x = x.copy()
            with np.errstate(divide="ignore", invalid="ignore"):
                if add is not None:
                    g = np.maximum(np.abs(x) - np.abs(r), 0)
                    x = np.where(g > add, x - np.sign(x) * (g - add), x)
                m = np.abs(r) if min_value is None else np.maximum(np.abs(r), min_value)
                rho = np.maximum(np.abs(x) / m, 1e-8)
                if mul is not None:
                    x = np.where(rho > mul, x * mul / rho, x)
                prev[i] = (
                    np.where(rho < 1 / max_decay, r / max_decay, x) if max_decay is not None else x
                )
            out.append(x)
        outs.append(out)
    return outs


def _oracle_for(case, dtype=np.float64, **kw):
    steps = _steps(case, dtype)
    if case["module"] == "ClipNormGrowth":
        return _norm_oracle(steps, **{**case["params"], **kw})
    return _value_oracle(steps, **case["params"])


# ----------------------------------------------------------------------------
# Reference vectors
# ----------------------------------------------------------------------------

USABLE = [c for c in CASES if "expected_error" not in c]


def _expected(case):
    return [arrays(case, "expected", s) for s in range(len(case["expected"]))]


@pytest.mark.parametrize("case", USABLE, ids=_ids(USABLE))
def test_reference_float64(case):
    with jax.enable_x64(True):
        rtol = 1e-12 if case["dtype"] == "float64" else 2e-6
        _close(_run(case["module"], case["params"], _steps(case))[0], _expected(case), rtol)


@pytest.mark.parametrize("case", USABLE, ids=_ids(USABLE))
def test_reference_float32(case):
    _close(
        _run(case["module"], case["params"], _steps(case, np.float32))[0],
        _expected(case),
        rtol=2e-6,
        atol=1e-7,
    )


@pytest.mark.parametrize("case", USABLE, ids=_ids(USABLE))
def test_oracle_matches_reference(case):
    """The oracle, with the reference's bugs switched on, reproduces torchzero exactly."""
    dtype = np.float32 if case["dtype"] == "float32" else np.float64
    kw = {"reference_bugs": True} if case["module"] == "ClipNormGrowth" else {}
    _close(
        _oracle_for(case, dtype, **kw), _expected(case), rtol=2e-6 if dtype == np.float32 else 1e-12
    )


def test_every_case_is_covered():
    assert {c["id"] for c in CASES} == {c["id"] for c in USABLE} | IDENTITY_HERE
    assert len(USABLE) >= 16


@pytest.mark.parametrize("cid", sorted(IDENTITY_HERE))
def test_add_mul_none_is_identity_with_fixed_state(cid):
    case = next(c for c in CASES if c["id"] == cid)
    assert case["expected_error"].startswith("ValueError")  # the reference crashes
    with jax.enable_x64(True):
        steps = _steps(case)
        outs, state = _run(case["module"], case["params"], steps)
        _close(outs, steps, rtol=0, atol=0)
        tx = clip_norm_growth(add=None, mul=None)
        s0 = tx.init([jnp.asarray(x) for x in steps[0]])
        assert jax.tree_util.tree_structure(s0) == jax.tree_util.tree_structure(state)
        assert not any(bool(c) for c in state.clipped)


def test_value_growth_identity():
    case = next(c for c in CASES if c["id"] == "ClipValueGrowth/add=None,mul=None")
    outs, _ = _run("ClipValueGrowth", case["params"], _steps(case, np.float32))
    _close(outs, _steps(case, np.float32), rtol=0, atol=0)


# ----------------------------------------------------------------------------
# The reference's divisor floor is not copied
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("tensorwise", [True, False])
def test_min_value_above_one_floors_only_the_tracked_norm(tensorwise):
    base = next(c for c in USABLE if c["id"] == "ClipNormGrowth/add=0.5")
    steps = _steps(base)
    params = {"min_value": 2.0, "tensorwise": tensorwise}
    with jax.enable_x64(True):
        ours, state = _run("ClipNormGrowth", params, steps)
    _close(ours, _norm_oracle(steps, **params), rtol=1e-12)
    buggy = _norm_oracle(steps, **params, reference_bugs=True)
    differ = [
        not np.allclose(o, b)
        for os_, bs in zip(ours, buggy, strict=True)
        for o, b in zip(os_, bs, strict=True)
    ]
    assert any(differ)  # torchzero divides every update after the first by >= 2
    # the tracked norm is floored at 2 from step 2 on
    tracked = np.asarray(jax.tree_util.tree_leaves(state.prev_norm))
    assert np.all(tracked >= 2.0)


def test_min_value_two_by_hand():
    """Step 1 tracks 1; step 2 (norm 1.2 <= 1.5) passes *undivided* and tracks max(1.2, 2) = 2;
    step 3 allows 1.5 * 2 = 3, so a norm of 10 is clipped to 3."""
    tx = clip_norm_growth(mul=1.5, min_value=2.0)
    state = tx.init(jnp.zeros(1))
    outs = []
    for v in (1.0, 1.2, 10.0):
        out, state = tx.update(jnp.array([v]), state)
        outs.append(float(out[0]))
    np.testing.assert_allclose(outs, [1.0, 1.2, 3.0], rtol=1e-6)
    np.testing.assert_allclose(float(state.prev_norm), 3.0, rtol=1e-6)


@pytest.mark.parametrize("ord_", ["mad", "rms", "linf", 1.5])
@pytest.mark.parametrize("tensorwise", [True, False])
def test_string_and_other_ords(ord_, tensorwise):
    """torchzero takes numeric ords only (TypeError for strings); every ord works here."""
    base = next(c for c in USABLE if c["id"] == "ClipNormGrowth/add=1.0,mul=2.0,max_decay=1.5")
    params = {**base["params"], "ord": ord_, "tensorwise": tensorwise}
    steps = _steps(base)
    with jax.enable_x64(True):
        ours, _ = _run("ClipNormGrowth", params, steps)
    _close(ours, _norm_oracle(steps, **params), rtol=1e-12)


# ----------------------------------------------------------------------------
# Behaviour
# ----------------------------------------------------------------------------


def test_norm_growth_state_fields():
    tx = clip_norm_growth(mul=2.0, tensorwise=False)
    x = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0])}
    state = tx.init(x)
    assert isinstance(state, ClipNormGrowthState)
    _, state = tx.update(x, state)
    assert float(state.clip_norm) == math.inf and not bool(state.clipped)
    out, state = tx.update({"a": 10 * x["a"], "b": x["b"]}, state)
    np.testing.assert_allclose(float(state.norm), 50.0)
    np.testing.assert_allclose(float(state.clip_norm), 10.0)
    assert bool(state.clipped) and int(state.count) == 2
    np.testing.assert_allclose(out["a"], [6.0, 8.0], rtol=1e-6)


def test_max_decay_limits_the_tracked_norm():
    tx = clip_norm_growth(mul=1.5, max_decay=2.0, min_value=None)
    state = tx.init(jnp.zeros(1))
    for v, want_prev in ((8.0, 8.0), (1.0, 4.0), (1.0, 2.0), (1.0, 1.0), (1.0, 1.0)):
        _, state = tx.update(jnp.array([v]), state)
        np.testing.assert_allclose(float(state.prev_norm), want_prev)


def test_norm_growth_nonfinite_skip():
    tx = clip_norm_growth()
    x = [jnp.array([1.0, 2.0])]
    _, s1 = tx.update(x, tx.init(x))
    bad = [jnp.array([jnp.inf, 1.0])]
    out, s2 = tx.update(bad, s1)
    np.testing.assert_array_equal(out[0], bad[0])  # passes through; inf is not zeroed
    assert int(s2.count) == 1 and float(s2.prev_norm[0]) == float(s1.prev_norm[0])
    # without skipping, the NaN norm is not clipped and the tracked norm recovers next step
    tx = clip_norm_growth(skip_nonfinite=False)
    _, s = tx.update(x, tx.init(x))
    out, s = tx.update([jnp.array([jnp.nan, 1.0])], s)
    assert np.isnan(float(s.prev_norm[0]))
    out, s = tx.update(x, s)
    np.testing.assert_allclose(out[0], x[0])
    assert np.isfinite(float(s.prev_norm[0]))


def test_value_growth_by_hand_and_state():
    tx = clip_value_growth(add=None, mul=2.0, min_value=None, max_decay=None)
    state = tx.init({"w": jnp.zeros(3)})
    assert isinstance(state, ClipValueGrowthState)
    _, state = tx.update({"w": jnp.array([1.0, -1.0, 0.5])}, state)
    out, state = tx.update({"w": jnp.array([5.0, 1.5, -0.1])}, state)
    np.testing.assert_allclose(out["w"], [2.0, 1.5, -0.1])
    np.testing.assert_allclose(state.prev["w"], [2.0, 1.5, -0.1])
    assert bool(state.clipped["w"])


def test_value_growth_nonfinite_skip():
    tx = clip_value_growth()
    x = jnp.array([1.0, -1.0])
    _, s1 = tx.update(x, tx.init(x))
    out, s2 = tx.update(jnp.array([jnp.nan, 9.0]), s1)
    np.testing.assert_array_equal(np.asarray(out), [np.nan, 9.0])
    np.testing.assert_array_equal(s2.prev, s1.prev)
    assert int(s2.count) == 1


def test_value_growth_complex_keeps_phase():
    tx = clip_value_growth(mul=2.0, min_value=None)
    s = tx.update(jnp.array([1.0 + 0.0j]), tx.init(jnp.zeros(1, jnp.complex64)))[1]
    out, _ = tx.update(jnp.array([3.0 + 4.0j]), s)  # |x| = 5 > 2 * 1: magnitude 2
    np.testing.assert_allclose(np.asarray(out), [1.2 + 1.6j], rtol=1e-6)


def test_bfloat16():
    x = {"w": jnp.array([1.0, -2.0], jnp.bfloat16)}
    for tx in (clip_norm_growth(), clip_value_growth()):
        state = tx.init(x)
        _, state = tx.update(x, state)
        out, state = tx.update({"w": 10 * x["w"]}, state)
        assert out["w"].dtype == jnp.bfloat16
        assert all(leaf.dtype != jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(state))
        np.testing.assert_allclose(
            np.asarray(out["w"], np.float32), 1.5 * np.asarray(x["w"], np.float32), rtol=1e-2
        )


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"add": -1.0}, "add"),
        ({"mul": math.nan}, "mul"),
        ({"min_value": -1.0}, "min_value"),
        ({"max_decay": 0.0}, "max_decay"),
    ],
)
def test_invalid_arguments_raise(kwargs, name):
    for make in (clip_norm_growth, clip_value_growth):
        with pytest.raises(ValueError, match=name):
            make(**kwargs)
    with pytest.raises(ValueError, match="ord"):
        clip_norm_growth(ord="nope")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_value_growth_flag_is_any_element_changed(dtype):
    tx = clip_value_growth(mul=2.0, max_decay=None)
    s = tx.update(jnp.array([1.0, -1.0, 0.0], dtype), tx.init(jnp.zeros(3, dtype)))[1]
    for x, want in [([1.5, -2.0, 1e-4], False), ([2.5, -1.0, 0.0], True), ([1.0, -3.0, 0.0], True)]:
        x = jnp.array(x, dtype)
        out, s2 = jax.jit(tx.update)(x, s)
        assert bool(s2.clipped) == want
        assert bool(jnp.any(out != x)) == want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clip_value_growth_writes_a_donated_state_in_place(dtype):
    # A training step donates the optimizer state and its buffers go to the new state. The
    # new tracked values are read from the output, so XLA computes the output first and then
    # overwrites the stored values in place (without that ordering it copies them first).
    tx = clip_value_growth()
    g = {"w": jnp.ones((256, 128), dtype)}
    state = tx.init(g)
    step = jax.jit(lambda u, s: tx.update(u, s)[::-1], donate_argnums=1)  # (state, updates)
    compiled = step.lower(g, state).compile()
    hlo = compiled.as_text()
    if (
        dtype == jnp.float32 and on_cpu()
    ):  # bf16 leaves keep float32 state: the output cannot hold it
        assert "f32[256,128]{1,0} copy(" not in hlo  # (XLA:CPU's program; other compilers' differ)
    # and the result is the same as without donation
    x1 = {"w": jnp.full((256, 128), 2.0, dtype)}
    x2 = {"w": jnp.linspace(-8.0, 8.0, 256 * 128).reshape(256, 128).astype(dtype)}
    s1 = tx.update(x1, tx.init(x1))[1]
    want_out, want_state = jax.jit(tx.update)(x2, s1)
    got_state, got_out = step(x2, jax.tree.map(jnp.copy, s1))
    np.testing.assert_array_equal(
        np.asarray(got_out["w"], np.float32), np.asarray(want_out["w"], np.float32)
    )
    np.testing.assert_array_equal(got_state.prev["w"], want_state.prev["w"])
    assert bool(got_state.clipped["w"])


def _value_growth_reference(xs, add, mul, min_value, max_decay):
    """clip_value_growth's docstring math, step by step in float64 numpy."""
    r, outs = None, []
    for x in xs:
        x = np.asarray(x, np.float64)
        if r is None:
            r = x.copy()
            outs.append(x)
            continue
        ar = np.abs(r)
        y = x.copy()
        if add is not None:
            cap = ar + add
            y = np.where(np.abs(y) > cap, np.sign(y) * cap, y)
        after_add = np.abs(y)
        m = ar if min_value is None else np.maximum(ar, min_value)
        if mul is not None:
            cap = mul * m
            y = np.where(np.abs(y) > cap, np.sign(y) * cap, y)
        if max_decay is None:
            r = y
        else:
            rho = np.maximum(after_add / np.where(m > 0, m, 1.0), 1e-8)
            rho = np.where(m > 0, rho, np.inf)
            r = np.where(rho < 1 / max_decay, r / max_decay, y)
        outs.append(y)
    return outs, r


@pytest.mark.parametrize(
    "cfg",
    [
        dict(
            add=None, mul=1.5, min_value=1e-4, max_decay=2.0
        ),  # the defaults: decay read off the output
        dict(add=0.5, mul=1.5, min_value=None, max_decay=2.0),
        dict(add=0.5, mul=None, min_value=1e-4, max_decay=3.0),
        dict(
            add=None, mul=0.3, min_value=1e-4, max_decay=2.0
        ),  # mul * max_decay < 1: decay read off the input
        dict(add=0.2, mul=0.4, min_value=1e-4, max_decay=1.5),
    ],
)
def test_clip_value_growth_decay_test_from_output_or_input_agree(cfg):
    # With fixed numbers where mul * max_decay >= 1 the decay test reads |output|; with the
    # same values injected as arrays (or mul * max_decay < 1) it reads the input. Both must
    # give the documented math, bit for bit the same as each other.
    rng = np.random.default_rng(0)
    scales = [1.0, 4.0, 0.05, 1.0, 0.3, 10.0, 0.01, 1.0]
    xs = [(rng.standard_normal(512) * s).astype(np.float32) for s in scales]
    xs[3][:8] = 0.0  # zero tracked values
    fixed = clip_value_growth(**cfg)
    injected = clip_value_growth(
        **{k: (None if v is None else jnp.asarray(v)) for k, v in cfg.items()}
    )
    sf, si = fixed.init(jnp.zeros(512)), injected.init(jnp.zeros(512))
    got = []
    for x in xs:
        of, sf = jax.jit(fixed.update)(jnp.asarray(x), sf)
        oi, si = jax.jit(injected.update)(jnp.asarray(x), si)
        np.testing.assert_array_equal(np.asarray(of), np.asarray(oi))
        np.testing.assert_array_equal(np.asarray(sf.prev), np.asarray(si.prev))
        assert bool(sf.clipped) == bool(si.clipped) == bool(jnp.any(of != x))
        got.append(np.asarray(of))
    want, want_r = _value_growth_reference(xs, **cfg)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(np.asarray(sf.prev), want_r, rtol=1e-6, atol=1e-30)


def _entry_reads(compiled, name: str) -> int:
    """How many top-level instructions of the compiled step read the parameter ``name``."""
    entry = compiled.as_text().split("ENTRY", 1)[1]
    param = re.search(rf"(%\S*{name}\S*) = \S+ parameter", entry).group(1)
    return sum(1 for line in entry.splitlines()[1:] if f"{param})" in line or f"{param}," in line)


@pytest.mark.cpu_only(
    reason="counts reads in XLA:CPU's optimized program and reads its buffer assignment"
)
@pytest.mark.reads_compiled_names  # finds the update's parameter by its name
@pytest.mark.parametrize("make, reads", [(clip_value_growth, 2), (clip_value_by_ema, 3)])
def test_elementwise_clippers_read_the_update_once_per_pass(make, reads):
    # One read-only pass finds both whether the update is finite and whether it clips (no
    # separate finiteness pass); clip_value_growth's new state reads the output, not the
    # update. A regression here costs a parameter-sized pass per step.
    tx = make()
    g = {"w": jnp.ones((256, 128))}
    step = jax.jit(lambda upd, s: tx.update(upd, s)[::-1], donate_argnums=1)
    compiled = step.lower(g, tx.init(g)).compile()
    assert _entry_reads(compiled, "upd") == reads
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * 128 * 4
