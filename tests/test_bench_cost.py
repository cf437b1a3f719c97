"""The CPU cost report (``benchmarks/bench_cost.py``): StableHLO counts and the quick report's rows."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("flax")
from benchmarks import bench_cost as bc
from benchmarks.__main__ import SUITES

# the cost rows count instructions by source, from the compiled programs' metadata
pytestmark = pytest.mark.reads_compiled_names

MODULE = """\
module @jit_step attributes {mhlo.num_partitions = 1 : i32} {
  func.func public @main(%arg0: tensor<4x4xf32>, %arg1: tensor<i32>) -> (tensor<4x4xf32>) {
    %0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : \
(tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = call @norms(%0) : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = func.call @norms(%1) : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %3 = "stablehlo.case"(%arg1) ({
      stablehlo.return %2 : tensor<4x4xf32>
    }, {
      stablehlo.return %0 : tensor<4x4xf32>
    }) : (tensor<i32>) -> tensor<4x4xf32>
    return %3 : tensor<4x4xf32>
  }
  func.func private @norms(%arg0: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = stablehlo.dot_general %arg0, %arg0, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : \
(tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = stablehlo.convolution(%0, %0) dim_numbers = [b, 0, f]x[0, i, o]->[b, 0, f], window = {stride = [1]} \
{batch_group_count = 1 : i64, feature_group_count = 1 : i64, precision_config = [#stablehlo<precision HIGHEST>, \
#stablehlo<precision HIGHEST>]} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    %2:2 = stablehlo.while(%iterArg = %1, %iterArg_0 = %0) : tensor<4x4xf32>, tensor<4x4xf32>
    cond {
      %c = stablehlo.constant dense<true> : tensor<i1>
      stablehlo.return %c : tensor<i1>
    } do {
      %3 = stablehlo.dot_general %iterArg, %iterArg_0, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT], \
algorithm = <lhs_precision_type = tf32, rhs_precision_type = tf32, accumulation_type = f32, lhs_component_count = 1, \
rhs_component_count = 1, num_primitive_operations = 3, allow_imprecise_accumulation = false> : \
(tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
      stablehlo.return %3, %iterArg_0 : tensor<4x4xf32>, tensor<4x4xf32>
    }
    return %2#0 : tensor<4x4xf32>
  }
}
"""


def test_stablehlo_counts_weigh_private_functions_by_their_calls() -> None:
    counts = bc.stablehlo_counts(MODULE)
    assert counts == {
        "dot_general DEFAULT": 1,
        "dot_general HIGHEST": 2,
        "convolution HIGHEST": 2,
        "dot_general algorithm tf32 x3": 2,
        "while": 2,
        "case": 1,
    }
    summary = bc.lowered_summary(MODULE)
    assert (
        summary["products_highest"],
        summary["products_default"],
        summary["while"],
        summary["case"],
    ) == (4, 1, 2, 1)


@pytest.mark.parametrize(
    ("line", "precision"),
    [
        ("stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2xf32>)", "DEFAULT"),
        ("stablehlo.dot_general %a, %b, precision = [HIGH, HIGH] : (tensor<2xf32>)", "HIGH"),
        (
            "stablehlo.dot_general %a, %b, precision = [HIGHEST, DEFAULT] : (tensor<2xf32>)",
            "HIGHEST/DEFAULT",
        ),
        (
            "algorithm = <lhs_precision_type = bf16, rhs_precision_type = bf16, num_primitive_operations = 6>",
            "algorithm bf16 x6",
        ),
    ],
)
def test_product_precision(line: str, precision: str) -> None:
    assert bc.product_precision(line) == precision


@pytest.mark.slow
@pytest.mark.cpu_only(
    reason="the cost report compiles the steps for the CPU backend (on a GPU run the suite "
    "has JAX_PLATFORMS=cuda); its CUDA lowering is read on the CPU"
)
def test_quick_cost_report_of_tiny_gpt2_reports_flops_and_precisions() -> None:
    assert "cost" in SUITES
    res = bc.measure_model("gpt2-2l", quick=True)
    rows = bc.rows_of(res)
    expected = {
        f"gpt2-2l {step} DP step vs non-private step, B=4: {title} ({unit}, in the ms columns)"
        for step in ("ghost", "vmap")
        for _, title, unit, _ in bc.MEASURES
    }
    assert {r["name"] for r in rows} == expected and len(rows) == len(expected)
    assert all(r["group"] == "cost" for r in rows)
    by = {(r["step"], r["measure"]): r for r in rows}
    for step in ("ghost", "vmap"):
        flops = by[(step, "flops")]
        assert flops["unit"] == "GFLOP" and flops["ours_ms"] > 0 and flops["baseline_ms"] > 0
        assert flops["ratio"] == pytest.approx(flops["ours_ms"] / flops["baseline_ms"])
        assert by[(step, "bytes")]["ours_ms"] > 0 and by[(step, "instructions")]["ours_ms"] > 0
        temps = by[(step, "temporaries")]
        assert temps["unit"] == "MiB" and temps["ours_ms"] > 0 and temps["baseline_ms"] > 0
    # the ghost path forms its per-example products at HIGHEST; the model's own matmuls stay at DEFAULT
    highest, default = by[("ghost", "products_highest")], by[("ghost", "products_default")]
    assert highest["ours_ms"] >= 1 and highest["baseline_ms"] == 0 and math.isnan(highest["ratio"])
    assert default["baseline_ms"] >= 1 and default["ours_ms"] >= 1
    steps = res["steps"]
    assert steps["nonprivate"]["lowered_ops"].get("dot_general DEFAULT", 0) >= 1
    assert "dot_general HIGHEST" not in steps["nonprivate"]["lowered_ops"]
    assert steps["ghost"]["lowered_ops"]["dot_general HIGHEST"] == highest["ours_ms"]
    assert "dot_general HIGHEST" in highest["note"]
    # the instructions by source: the ghost step's noise and clipping, none of them in the non-private step
    mine, theirs = steps["ghost"]["by_source"], steps["nonprivate"]["by_source"]
    assert sum(mine.values()) == steps["ghost"]["instructions"]
    assert mine["noise"] > 0 and mine["norms"] > 0 and mine["clipped sum"] > 0 and mine["model"] > 0
    assert mine["noise"] > theirs.get("noise", 0)
    # none of the non-private step's is the clipping's, but for a few ops of jitted helpers that JAX
    # traced first inside gradclip_jax (jnp.where's, say): their cached trace keeps that source
    assert (
        theirs.get("norms", 0) + theirs.get("clipped sum", 0)
        <= 0.01 * steps["nonprivate"]["instructions"]
    )
    assert "by source: model" in by[("ghost", "instructions")]["note"]


@pytest.mark.slow
@pytest.mark.heavy
def test_quick_cost_report_of_tiny_wrn_counts_convolutions_by_precision() -> None:
    rows = bc.rows_of(bc.measure_model("wrn", quick=True))
    assert {r["model"] for r in rows} == {"wrn"} and len(rows) == 2 * len(bc.MEASURES)
    wrn = {(r["step"], r["measure"]): r for r in rows}
    assert wrn[("ghost", "flops")]["ours_ms"] > 0 and wrn[("ghost", "flops")]["baseline_ms"] > 0
    # traced as on a GPU, the per-example convolution products take TF32-rounded operands at
    # DEFAULT (PRODUCT_PRECISION 'tf32'); the weighted sums of formed rows stay at HIGHEST
    default = wrn[("ghost", "products_default")]
    assert default["ours_ms"] > default["baseline_ms"] >= 1
    note = wrn[("ghost", "products_highest")]["note"]
    assert "convolution DEFAULT" in note and "convolution HIGHEST" not in note
    assert wrn[("ghost", "products_highest")]["ours_ms"] >= 1  # the formed rows' weighted sums


def test_compiled_loops_leave_out_the_random_number_generators_rolled_loops():
    import jax
    import jax.numpy as jnp

    def step(x, key):
        noise = jax.random.normal(key, x.shape)  # the CPU rolls threefry's rounds into a loop
        return jax.lax.fori_loop(0, x.shape[0], lambda i, c: c * 0.5 + x[i], noise)

    x = jnp.ones((3, 4))
    compiled = jax.jit(step).lower(x, jax.random.key(0)).compile()
    text = compiled.as_text()
    if jax.default_backend() == "cpu":
        assert bc.rng_loops(text) >= 1
    assert text.count(" while(") - bc.rng_loops(text) == 1  # the fori_loop only
    assert bc.compiled_summary(compiled)["loops"] == 1
