"""The compile breakdown rows (``benchmarks/bench_compile.py``): trace, lower and compile timed
apart, instructions by source, and one row per DP step and phase against the non-private step."""

from __future__ import annotations

import jax
import optax
import pytest

from benchmarks import bench_compile as bc
from benchmarks.variants import make_steps
from tests.per_example.models import mlp_setup

# counts instructions by source, from the compiled programs' metadata
pytestmark = pytest.mark.reads_compiled_names


def test_breakdown_times_each_phase_and_counts_instructions_by_source():
    losses, params, data = mlp_setup()
    opt = optax.adamw(1e-3)
    state = (params, opt.init(params), jax.random.key(0))
    res = bc.breakdown(make_steps(losses, 7, ("ghost",))["ghost"], state, data)
    assert all(res[p] > 0 for p in bc.PHASES)
    assert abs(res["total"] - sum(res[p] for p in bc.PHASES)) < 1e-6
    by = res["by_source"]
    assert by["model"] > 0 and by["optimizer"] > 0 and by["noise"] > 0 and by["norms"] > 0
    assert 0 < res["kernels"] < sum(by.values())  # a kernel holds one or more instructions
    assert 0 < res["distinct"] < res["kernels"]  # equal kernels (equal layers, say) counted once


def test_rows_are_ratios_to_the_non_private_step_and_the_hand_written_one():
    def rec(s):
        return {
            "trace": s,
            "lower": 2 * s,
            "compile": 3 * s,
            "total": 6 * s,
            "by_source": {"model": 10},
        }

    res = {"nonprivate": rec(1.0), "hand": rec(2.0), "vmap": rec(3.0), "ghost": rec(1.5)}
    rows = bc.rows_of(res, "tiny")
    assert len(rows) == 3 * 4 + 1 and all(r["group"] == "compile" for r in rows)
    by_name = {r["name"]: r for r in rows}
    assert by_name["compile: DP step (ghost) vs non-private step (tiny)"]["ratio"] == 1.5
    assert by_name["total: DP step (vmap) vs non-private step (tiny)"]["ratio"] == 3.0
    last = rows[-1]
    assert (
        last["ratio"] == 1.5 and "hand-written" in last["name"] and "goal <= 1.2x" in last["note"]
    )
    assert (
        "ghost 10 (model 10)"
        in by_name["trace: DP step (ghost) vs non-private step (tiny)"]["note"]
    )
    # the clipped sums alone, when measured: vmap against the hand-written, ghost against grad
    sums = {
        "sum_grad": rec(1.0),
        "sum_hand": rec(1.0),
        "sum_vmap": rec(1.25),
        "sum_ghost": rec(2.0),
    }
    extra = bc.rows_of(res | sums, "tiny")[len(rows) :]
    assert [r["ratio"] for r in extra] == [1.25, 2.0]
    assert "vmap" in extra[0]["name"] and "goal <= 1.2x" in extra[0]["note"]
    assert "jax.grad" in extra[1]["name"]


@pytest.mark.slow  # compiles four DP steps of the stand-in model (about 8 s)
def test_larger_models_rows_give_each_dp_steps_total_and_phases(monkeypatch):
    """The larger models' rows (not in the quick run): measured on a stand-in model here."""
    losses, params, data = mlp_setup()
    monkeypatch.setitem(bc.LARGER, "stand-in", lambda: (losses, params, data, "mlp", 7))
    res, label = bc.measure_larger("stand-in")
    assert set(res) == set(bc.LARGER_STEPS) and label == "mlp"
    rows = bc.larger_rows(res, label)
    backend = jax.default_backend()
    assert [r["name"] for r in rows] == [
        f"total: DP step ({n}) vs non-private step (mlp, {backend})" for n in ("ghost", "vmap")
    ]
    for r, n in zip(rows, ("ghost", "vmap")):
        assert r["ratio"] == pytest.approx(res[n]["total"] / res["nonprivate"]["total"])
        assert f"compile {res[n]['compile'] / res['nonprivate']['compile']:.2f}x" in r["note"]
        assert "goal <= 1.5x" in r["note"]


def test_measured_takes_each_phase_median_over_rounds_after_tracing_each_step(monkeypatch):
    traced, calls = [], iter([1.0, 5.0, 3.0, 2.0, 2.0, 9.0])

    def fake(step, *args):  # rounds in turn: a, b, a, b, a, b
        s = next(calls)
        return {"trace": s, "lower": s, "compile": s, "total": 3 * s, "kernels": s}

    monkeypatch.setattr(bc, "breakdown", fake)
    steps = {"a": lambda x: traced.append("a") or x, "b": lambda x: traced.append("b") or x}
    res = bc.measured(steps, (1.0,), reps=3)
    assert traced == ["a", "b"]  # each traced once before the rounds
    # the medians of (1, 3, 2) and (5, 2, 9)
    assert res["a"]["compile"] == 2.0 and res["b"]["compile"] == 5.0
    assert res["a"]["total"] == 6.0 and res["a"]["kernels"] == 2.0  # counts: the last round's
