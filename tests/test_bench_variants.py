"""The one table of step variants (``benchmarks/variants.py``) every suite builds its steps from."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks import variants
from benchmarks.steps import fresh_state
from tests.per_example.models import mlp_setup


def test_every_variant_builds_a_step_or_says_why_not():
    losses, _, _ = mlp_setup()
    steps = variants.make_steps(losses, 7, tuple(variants.VARIANTS))
    assert list(steps) == list(variants.VARIANTS)  # in the order asked for
    for name, step in steps.items():
        assert callable(step) or step.startswith("skipped: "), name


def test_an_unknown_step_is_named():
    with pytest.raises(ValueError, match=r"unknown \['ghots'\]"):
        variants.make_steps(lambda p, b: b, 2, ("ghost", "ghots"))


@pytest.mark.slow  # four DP steps compiled; the smoke run compiles the suites' own
def test_the_dp_steps_agree_where_they_compute_the_same_sum():
    """'auto' takes a path of its own choosing; 'hand' clips as optax does: every DP step
    lands on the same parameters (same noise key, same clipped sum)."""
    losses, params, data = mlp_setup()
    steps = variants.make_steps(losses, 7, ("ghost", "vmap", "auto", "hand"))
    out = {n: jax.jit(s)(fresh_state(params, 0), data)[0] for n, s in steps.items()}
    for n in ("vmap", "auto", "hand"):
        for a, b in zip(jax.tree.leaves(out[n]), jax.tree.leaves(out["ghost"]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.slow  # ten GPT-2 steps traced
def test_the_ghost_suites_compile_rows_build_every_step(monkeypatch):
    """The ghost suite's compile rows (``bench_ghost.compile_rows``) build their steps from the
    table and trace each (traced, not compiled: the timing is the suite's)."""
    from benchmarks import bench_ghost

    traced = []

    def trace_only(step, *args):
        traced.append(jax.eval_shape(step, *args))
        return 1.0

    monkeypatch.setattr(bench_ghost, "_compile_s", trace_only)
    rows = bench_ghost.compile_rows("cpu", batch=2, tiny=True)
    assert len(traced) == 10 and rows and all(r["ratio"] == 1.0 for r in rows)
