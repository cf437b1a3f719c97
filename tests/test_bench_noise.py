"""The noise benchmark's parts (``benchmarks/bench_noise.py``): each part draws what it says and
is timed against optax's per-leaf normal draw in the same rounds."""

from __future__ import annotations

import math
import time

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_noise as bn


def _tree():
    return {"a": jnp.zeros((300, 7)), "b": {"c": jnp.zeros(11)}}


def test_every_part_but_gpu_flags_gives_a_row_with_positive_times():
    rows = bn.part_rows(_tree(), jax.random.key(0), "tiny tree", reps=2)
    on_gpu = jax.default_backend() == "gpu"
    expected = [n for n, (_, _, flags) in bn.PARTS.items() if on_gpu or not flags]
    assert len(rows) == 2 * len(expected)  # time, lower+compile
    for (t, c), name in zip(zip(rows[::2], rows[1::2], strict=True), expected, strict=True):
        assert (
            bn.PARTS[name][0] in t["name"] and t["name"].endswith("time") and t["group"] == "noise"
        )
        assert bn.PARTS[name][0] in c["name"] and "lower+compile" in c["name"]
        for r in (t, c):
            assert r["ours_ms"] > 0 and r["baseline_ms"] > 0 and math.isfinite(r["ratio"])


def test_parts_past_the_deadline_are_left_out_and_said(capsys):
    rows = bn.part_rows(
        _tree(), jax.random.key(0), "tiny tree", reps=2, deadline=time.perf_counter()
    )
    assert rows == []
    assert (
        "parts from 'floor' on left out: NOISE_BUDGET_S would be spent" in capsys.readouterr().out
    )


def test_run_under_a_spent_budget_keeps_the_draw_rows_and_prints_them(monkeypatch, capsys):
    monkeypatch.setenv(bn.BUDGET_ENV, "0")
    monkeypatch.setattr(bn, "gpt2_tree", lambda **kw: _tree())
    rows = bn.run(quick=True)
    assert len(rows) == 4 and all(
        "then adamw" not in r["name"] and "parts" not in r["name"] for r in rows
    )
    out = capsys.readouterr().out
    assert "adamw rows left out" in out and "parts from 'floor' on left out" in out
    assert all(f"[noise] {r['name']}: " in out for r in rows)


def test_per_shape_part_draws_once_per_shape_whatever_the_backends_strategy():
    tree = {
        "a": jnp.zeros((5, 3)),
        "b": jnp.zeros((5, 3)),
        "c": jnp.zeros(7),
        "d": {"e": jnp.zeros((5, 3))},
    }
    jaxpr = str(jax.make_jaxpr(bn.PARTS["per_shape"][1])(tree, jax.random.key(11)))
    assert jaxpr.count("random_bits[") == 2  # (5, 3) and (7,)


@pytest.mark.parametrize("name", ["box_muller", "one_draw", "per_shape", "pairs"])
def test_normal_parts_draw_standard_normals(name):
    tree = {"a": jnp.zeros((400, 50)), "b": jnp.zeros(1001)}
    out = jax.jit(bn.PARTS[name][1])(tree, jax.random.key(3))
    z = np.concatenate([np.ravel(x) for x in jax.tree.leaves(out)])
    assert z.shape == (21001,)
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1.0) < 0.03
    assert 0.02 < np.mean(z > 2.0) < 0.026  # P(Z > 2) = 0.0228


def test_floor_part_only_adds_one():
    out = jax.jit(bn.PARTS["floor"][1])(_tree(), jax.random.key(0))
    assert all(bool(jnp.all(x == 1.0)) for x in jax.tree.leaves(out))


def test_flags_are_restored():
    before = jax.config.jax_threefry_gpu_kernel_lowering
    with bn._flags({"jax_threefry_gpu_kernel_lowering": not before}):
        assert jax.config.jax_threefry_gpu_kernel_lowering is (not before)
    assert jax.config.jax_threefry_gpu_kernel_lowering is before


def test_adamw_rows_time_and_compile_both_draws_followed_by_adamw():
    rows = bn.adamw_rows(_tree(), jax.random.key(0), "tiny tree", reps=2)
    assert [r["name"].rsplit(": ", 1)[1] for r in rows] == ["time", "lower+compile (ms)"]
    for r in rows:
        assert "then adamw's update" in r["name"] and r["group"] == "noise"
        assert r["ours_ms"] > 0 and r["baseline_ms"] > 0 and math.isfinite(r["ratio"])


def test_then_adamw_updates_by_the_noised_tree():
    import optax

    tree = _tree()
    state = optax.adamw(1e-4).init(tree)
    new, _ = jax.jit(bn._then_adamw(lambda t, k: jax.tree.map(jnp.ones_like, t)))(
        tree, state, jax.random.key(0)
    )
    # adamw's first step moves every parameter by -lr * sign(gradient) (bias-corrected moments)
    for x in jax.tree.leaves(new):
        np.testing.assert_allclose(np.asarray(x), -1e-4, rtol=1e-3)


def test_pairs_part_hashes_half_the_counters_and_uses_both_words():
    x = jnp.zeros((7, 3))
    key = jax.random.key(4)
    z = bn._pairs_normal(key, x)
    # 11 hashes for 21 values: the first 11 from each hash's first word, the rest from the second
    words = jax.extend.random.threefry2x32_p.bind(
        *jax.random.key_data(key), jnp.zeros(11, jnp.uint32), jnp.arange(11, dtype=jnp.uint32)
    )
    expect = bn.normal_from_bits(jnp.concatenate(words)[:21]).reshape(7, 3)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(expect))
    assert len(set(np.ravel(np.asarray(z)).tolist())) == 21  # every value its own


def test_hardened_rows_time_both_hardened_noises_against_ours():
    rows = bn.hardened_rows(_tree(), jax.random.key(0), "tiny tree", reps=2)
    assert [
        ("sum of four normals" in r["name"], "discrete Gaussian" in r["name"]) for r in rows
    ] == [(True, False), (False, True)]
    assert all(r["group"] == "noise" and r["ours_ms"] > 0 and r["baseline_ms"] > 0 for r in rows)
