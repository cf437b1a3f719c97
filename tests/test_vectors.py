"""Reference vectors of torchzero, declearn and PPOxFamily (stateless modules).

Every published case runs in float64 (x64 enabled) and in float32. Where the
reference library has a quirk, bug or edge behaviour that our contract does not
copy, the case is listed in DEVIATIONS with the reason; for those we assert our
contract (via the independent NumPy oracle in tests/oracle.py) and that the
reference output really differs, so the list cannot go stale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradclip_jax as gcx
from tests import oracle
from tests.vectors import arrays, cases_for, param

MODULES = (
    "ClipValue",
    "ClipNorm",
    "Normalize",
    "Centralize",
    "clip_grad_norm_",
    "normalize_grads_",
    "clip_grad_value_",
    "L2Clipping",
    "L2GlobalClipping",
    "grad_clip_norm_",
)
CASES = cases_for(*MODULES)

DEVIATIONS = {
    "ClipNorm/dim=-1,inverse": "QUIRK: torchzero never removes negative dims on inversion; "
    "we reduce over every axis except each leaf's last",
    "ClipNorm/global,ord=l0": "BUG: torchzero raises ZeroDivisionError; we count non-zeros",
    "ClipNorm/global,ord=0": "BUG: torchzero raises ZeroDivisionError; we count non-zeros",
    "ClipNorm/edge_zero_tiny": "torchzero's 1e-12 guard multiplies a tiny slice by max_norm; "
    "we leave a slice under the bound unchanged",
    "ClipNorm/std_single_element": "torchzero's std of one element is NaN; ours is 0, so the "
    "slice is left unchanged",
    "Normalize/default_vec_first": "QUIRK: torchzero freezes dim=None to the first tensor's axes",
    "Normalize/scalar_first": "QUIRK: torchzero freezes dim=None to the first tensor's axes",
    "Normalize/global_zero": "EDGE: torchzero gives NaN for a zero global norm; we leave it",
    "Normalize/edge_zero_tiny": "torchzero's 1e-12 guard; we normalize any positive norm exactly",
    "Centralize/vec_first": "QUIRK: torchzero freezes dim=None to the first tensor's axes",
    "Centralize/scalar_first": "QUIRK: a 0-d first tensor makes torchzero centralize nothing",
    "ppox/p=0": "QUIRK: PPOxFamily counts non-zero tensors; our global ord=0 counts non-zeros",
    "ppox/empty": "PPOxFamily raises IndexError on no grads; we return the empty tree, norm 0",
}
# dim=None with inverse_dims=True has no axis left to reduce: a ValueError at construction.
RAISES = {"Normalize/dim=None,inverse", "Normalize/dim=None,inverse,vec_first"}
PER_TENSOR_GROUPS = {"ClipValue", "Normalize", "ClipNorm"}


def _p(case, name, default=None):
    return param(case, name, default)


def _ours(case: dict, xs: list[np.ndarray]):
    """Runs our equivalent of ``case`` on ``xs``; returns (outputs, returned norm or None)."""
    m = case["module"]
    xs = [jnp.asarray(x) for x in xs]
    if case.get("param_groups"):
        assert m in PER_TENSOR_GROUPS and _p(case, "dim") != "global"
        outs = [None] * len(xs)
        for group in case["param_groups"]:
            sub = dict(
                case, params={**case["params"], **{k: v for k, v in group.items() if k != "idx"}}
            )
            sub.pop("param_groups")
            res, _ = _ours(sub, [xs[i] for i in group["idx"]])
            for i, r in zip(group["idx"], res):
                outs[i] = r
        return outs, None
    dim, inv = _p(case, "dim"), _p(case, "inverse_dims", False)
    ord_ = _p(case, "ord", 2)
    if m == "ClipValue":
        tx = gcx.clip_by_value(_p(case, "value"))
    elif m == "ClipNorm":
        tx = gcx.clip_by_norm(
            _p(case, "max_norm"),
            ord=ord_,
            dim=dim,
            inverse_dims=inv,
            min_size=_p(case, "min_size", 1),
        )
    elif m == "Normalize":
        tx = gcx.normalize(
            _p(case, "norm_value", 1.0),
            ord=ord_,
            dim=dim,
            inverse_dims=inv,
            min_size=_p(case, "min_size", 1),
        )
    elif m == "Centralize":
        tx = gcx.centralize(dim=dim, inverse_dims=inv, min_size=_p(case, "min_size", 2))
    elif m == "clip_grad_norm_":  # torchzero's function: default min_size=2, optional min_norm
        tx = gcx.clip_by_norm(
            _p(case, "max_norm"),
            ord=ord_,
            dim=dim,
            inverse_dims=inv,
            min_size=_p(case, "min_size", 2),
            min_norm=_p(case, "min_norm"),
        )
    elif m == "normalize_grads_":
        return gcx.normalize_grads(
            xs,
            _p(case, "norm_value"),
            ord=ord_,
            dim=dim,
            inverse_dims=inv,
            min_size=_p(case, "min_size", 1),
        ), None
    elif m == "clip_grad_value_":
        return gcx.clip_grad_value(xs, _p(case, "value")), None
    elif m == "L2Clipping":
        tx = gcx.clip_by_norm(_p(case, "max_norm", 1.0))
    elif m == "L2GlobalClipping":
        tx = gcx.clip_by_global_norm(_p(case, "max_norm", 1.0))
    elif m == "grad_clip_norm_":
        return gcx.clip_grad_norm(xs, _p(case, "max_norm"), ord=_p(case, "norm_type", 2.0))
    else:  # pragma: no cover
        raise AssertionError(m)
    out, _state = tx.update(xs, tx.init(xs))
    return out, None


def _oracle(case: dict, xs: list[np.ndarray]):
    """Our contract's answer for ``case``, from the NumPy oracle."""
    m = case["module"]
    if case.get("param_groups"):
        outs = [None] * len(xs)
        for group in case["param_groups"]:
            sub = dict(
                case, params={**case["params"], **{k: v for k, v in group.items() if k != "idx"}}
            )
            sub.pop("param_groups")
            for i, r in zip(group["idx"], _oracle(sub, [xs[i] for i in group["idx"]])[0]):
                outs[i] = r
        return outs, None
    dim, inv, ord_ = _p(case, "dim"), _p(case, "inverse_dims", False), _p(case, "ord", 2)
    if m in ("ClipValue", "clip_grad_value_"):
        v = _p(case, "value")
        return [np.clip(x, -v, v) for x in xs], None
    if m in ("ClipNorm", "clip_grad_norm_"):
        ms = _p(case, "min_size", 1 if m == "ClipNorm" else 2)
        return oracle.rescale(
            xs,
            ord=ord_,
            dim=dim,
            inverse=inv,
            min_size=ms,
            hi=_p(case, "max_norm"),
            lo=_p(case, "min_norm"),
        ), None
    if m in ("Normalize", "normalize_grads_"):
        return oracle.rescale(
            xs,
            ord=ord_,
            dim=dim,
            inverse=inv,
            min_size=_p(case, "min_size", 1),
            target=_p(case, "norm_value", 1.0),
        ), None
    if m == "Centralize":
        return oracle.centralize(xs, dim=dim, inverse=inv, min_size=_p(case, "min_size", 2)), None
    if m == "L2Clipping":
        return oracle.rescale(xs, hi=_p(case, "max_norm", 1.0)), None
    if m == "L2GlobalClipping":
        return oracle.rescale(xs, dim="global", hi=_p(case, "max_norm", 1.0)), None
    if m == "grad_clip_norm_":
        p = _p(case, "norm_type", 2.0)
        total = (
            float(oracle.norm(np.concatenate([x.ravel() for x in xs]), p).reshape(()))
            if xs
            else 0.0
        )
        coef = (
            min(_p(case, "max_norm") / (total + 1e-6), 1.0) if not math.isnan(total) else math.nan
        )
        return [x * coef for x in xs], total
    raise AssertionError(m)  # pragma: no cover


def _ids(cases):
    return [c["id"] for c in cases]


def _close(ours, expected, rtol, atol):
    assert len(ours) == len(expected)
    for o, e in zip(ours, expected):
        o = np.asarray(o, np.float64)
        assert o.shape == np.shape(e)
        np.testing.assert_allclose(o, e, rtol=rtol, atol=atol, equal_nan=True)


AGREE = [
    c
    for c in CASES
    if c["id"] not in DEVIATIONS and c["id"] not in RAISES and "expected_error" not in c
]


@pytest.mark.parametrize("case", AGREE, ids=_ids(AGREE))
def test_matches_reference_float64(case):
    with jax.enable_x64(True):
        xs = arrays(case, "inputs", 0)
        out, ret = _ours(case, xs)
        # cases the reference computed in float32 carry float32 rounding
        rtol, atol = (1e-12, 1e-15) if case["dtype"] == "float64" else (2e-6, 1e-7)
        _close(out, arrays(case, "expected", 0), rtol=rtol, atol=atol)
        for o, x in zip(out, xs):
            assert o.dtype == jnp.float64 and o.shape == x.shape
        if "expected_return" in case:
            np.testing.assert_allclose(
                float(ret), float(case["expected_return"]), rtol=rtol, equal_nan=True
            )


@pytest.mark.parametrize("case", AGREE, ids=_ids(AGREE))
def test_matches_reference_float32(case):
    xs = arrays(case, "inputs", 0, np.float32)
    out, ret = _ours(case, xs)
    for o in out:
        assert o.dtype == jnp.float32
    _close(out, arrays(case, "expected", 0), rtol=2e-5, atol=2e-6)
    if "expected_return" in case:
        np.testing.assert_allclose(
            float(ret), float(case["expected_return"]), rtol=2e-5, equal_nan=True
        )


CONTRACT = [c for c in CASES if c["id"] not in RAISES]


@pytest.mark.parametrize("case", CONTRACT, ids=_ids(CONTRACT))
def test_matches_contract_oracle(case):
    """Every case (deviations included) against the independent NumPy oracle."""
    with jax.enable_x64(True):
        xs = arrays(case, "inputs", 0)
        out, ret = _ours(case, xs)
        want, want_ret = _oracle(case, xs)
        _close(out, want, rtol=1e-12, atol=1e-15)
        if want_ret is not None:
            np.testing.assert_allclose(float(ret), want_ret, rtol=1e-12, equal_nan=True)


DEVIATING = [c for c in CASES if c["id"] in DEVIATIONS]


@pytest.mark.parametrize("case", DEVIATING, ids=_ids(DEVIATING))
def test_deviations_are_real(case):
    """The reference really does something else here (so the list stays honest)."""
    with jax.enable_x64(True):
        xs = arrays(case, "inputs", 0)
        out, ret = _ours(case, xs)
        if "expected_error" in case:
            for o in out:  # the reference raised; we return a finite, defined result
                assert np.all(np.isfinite(np.asarray(o)))
            return
        exp = arrays(case, "expected", 0)
        same_out = all(
            np.allclose(np.asarray(o), e, rtol=1e-9, atol=0, equal_nan=True)
            for o, e in zip(out, exp)
        )
        same_ret = "expected_return" not in case or np.isclose(
            float(ret), float(case["expected_return"])
        )
        assert not (same_out and same_ret), DEVIATIONS[case["id"]]


@pytest.mark.parametrize("cid", sorted(RAISES))
def test_inverse_dims_without_dim_is_rejected(cid):
    case = next(c for c in CASES if c["id"] == cid)
    with pytest.raises(ValueError, match="inverse_dims"):
        _ours(case, arrays(case, "inputs", 0))


def test_every_stateless_case_is_covered():
    covered = {c["id"] for c in AGREE} | set(DEVIATIONS) | RAISES
    assert {c["id"] for c in CASES} <= covered
    assert len(CASES) >= 70
