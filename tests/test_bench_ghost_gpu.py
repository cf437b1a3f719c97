"""The GPU DP-step benchmark (``benchmarks/bench_ghost_gpu.py``): skipping, selection and a tiny CPU run."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("flax")
import gradclip_jax as gcx
from benchmarks import bench_ghost_gpu as bg, models
from benchmarks.ghost_gpu import configs as ghost_configs, results, timing, variants
from benchmarks.steps import fresh_state
from gradclip_jax._core.backend import backend_setting
from tests.jaxprs import primitive_counts

ROOT = pathlib.Path(__file__).resolve().parents[1]
on_gpu = jax.default_backend() == "gpu"


@pytest.mark.skipif(on_gpu, reason="the skip path is for machines without a GPU")
def test_skips_cleanly_without_gpu(tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GHOST_GPU_")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "ghost-gpu", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "skipped, no GPU" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # neither its own files nor an empty RESULTS.md


def test_select_by_prefix_and_unknown_name() -> None:
    assert {c.name for c in ghost_configs.select("gpt2-qkv")} == {"gpt2-qkv-b8", "gpt2-qkv-b32"}
    assert [c.name for c in ghost_configs.select("wrn,gpt2-b8,wrn")] == ["wrn-b256", "gpt2-b8"]
    assert {c.name for c in ghost_configs.select("gpt2")} == {
        c.name for c in ghost_configs.CONFIGS if c.model.startswith("gpt2")
    }
    assert ghost_configs.select(None) == list(ghost_configs.CONFIGS)
    with pytest.raises(ValueError, match="models: unknown config 'gpt3'"):
        ghost_configs.select("gpt3")


def test_full_gpt2_is_gpt2_small() -> None:
    # shapes only (jax.eval_shape): 124.4M parameters with the output head tied to the embedding
    def n_params(fused: bool, scan: bool = False) -> int:
        box: dict = {}

        def make() -> object:
            _, params, _, label = models.gpt2(
                1, fused=fused, dtype=jax.numpy.float32, tiny=False, scan=scan
            )
            box["label"] = label
            return params

        shapes = jax.eval_shape(make)
        assert "tied embedding" in box["label"]
        return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))

    assert n_params(True) == n_params(False) == n_params(True, scan=True) == 124_439_808


def test_scanned_gpt2_keeps_its_blocks_in_one_loop_on_the_ghost_path() -> None:
    # what the gpt2-scan configs measure: every block leaf a site inside the scan, nothing falls back
    losses, params, data, label = models.gpt2(
        2, fused=True, dtype=jax.numpy.float32, tiny=True, scan=True
    )
    rep = gcx.ghost_report(losses, params, data)
    assert "lax.scan" in label and rep.fallback == []
    blocks = [kind for path, kind in rep.ghost if path.startswith("['h']")]
    assert len(blocks) == 12 and all(kind.startswith("scan:") for kind in blocks)


@pytest.mark.slow
@pytest.mark.heavy
def test_tiny_cpu_run_writes_and_merges_results(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GHOST_GPU_STEPS", "ghost")
    rows = bg.run(quick=True, out=tmp_path, models="gpt2-qkv-b8", force=True)
    assert [r["group"] for r in rows] == ["ghost-gpu"]
    assert rows[0]["ours_ms"] > 0 and rows[0]["baseline_ms"] > 0 and rows[0]["temp_mb"] > 0
    monkeypatch.setenv(
        "GHOST_GPU_COMPILE_SPLIT", "1"
    )  # the second run also compiles without autotuning
    bg.run(quick=True, out=tmp_path, models="wrn", force=True)
    doc = json.loads((tmp_path / results.RESULTS_JSON).read_text())
    assert doc["meta"]["sizes"] == "tiny (smoke)"
    configs = {c["config"]: c for c in doc["configs"]}
    assert list(configs) == ["gpt2-qkv-b8", "wrn-b256"]  # the second run merged into the first
    for c in configs.values():
        assert c["batch"] == ghost_configs.TINY_BATCH
        steps = c["steps"]
        assert steps["nonprivate"]["rounds"] == 5
        assert steps["ghost"]["time_x"] == pytest.approx(
            steps["ghost"]["ms"] / steps["nonprivate"]["ms"]
        )
        assert steps["ghost"]["temp_x"] > 0 and steps["ghost"]["compile_x"] > 0
        assert steps["vmap"]["skipped"].startswith("skipped: not selected")
        report = c["ghost_report"]
        assert report["ghost"] + report["fallback"] == report["leaves"] > 0
    compiled = [s for s in configs["wrn-b256"]["steps"].values() if "xla_compile_s" in s]
    assert len(compiled) == 2 and all(s["xla_noautotune_s"] > 0 for s in compiled)
    assert not any("xla_noautotune_s" in s for s in configs["gpt2-qkv-b8"]["steps"].values())
    md = (tmp_path / results.RESULTS_MD).read_text()
    assert "| gpt2-qkv-b8 |" in md and "| wrn-b256 |" in md and "ghost_report:" in md
    assert md.count("XLA without autotuning") == 2  # wrn's two steps


@pytest.mark.cpu_only(
    reason="counts in XLA:CPU's optimized program; a GPU compiler may unroll the 3-step loop"
)
def test_control_flow_counts_conditionals_and_loops():
    import jax.numpy as jnp

    def f(x):
        y = jax.lax.cond(x[0] > 0, lambda v: v * 2, lambda v: v - 1, x)
        return jax.lax.fori_loop(0, x.shape[0], lambda i, v: v + i, y)

    compiled = jax.jit(f).lower(jnp.arange(3.0)).compile()
    assert timing.control_flow(compiled) == {"conditionals": 1, "loops": 1}


def test_product_accuracy_measures_reduced_pass_products_and_restores_the_table():
    from gradclip_jax.per_example import PRODUCT_PRECISION
    from gradclip_jax.per_example._products import product_refusal
    from tests.per_example.models import mlp_setup

    before = dict(PRODUCT_PRECISION)
    loss, params, data = mlp_setup()
    acc = variants.product_accuracy(loss, params, data, ["bf16x6", "fp8"])
    assert dict(PRODUCT_PRECISION) == before
    if product_refusal("bf16x6") is not None:  # on GPUs: its error exceeds its margin
        assert "'bf16x6' is refused" in acc["bf16x6"]["error"]
    else:
        # on the CPU six bfloat16 passes give float32 products: the norms agree and the sum moves
        # by the clip-norm margin the reduced passes cost (8 units of float32 roundoff)
        assert acc["bf16x6"]["norm_rel_err"] < 1e-6
        assert 0 < acc["bf16x6"]["sum_rel_err"] < 2e-6
    assert "unknown strategy 'fp8'" in acc["fp8"]["error"]


def test_product_steps_trace_with_their_setting_and_tf32_needs_a_gpu():
    cfg = ghost_configs.Config("x", "gpt2", 2, ("nonprivate", "ghost_tf32x3", "ghost_bf16x6"))
    steps = variants.step_variants(cfg, lambda p, b: b, 2, ghost_configs.STEPS)
    if not on_gpu:
        assert (
            steps["ghost_tf32x3"] == "skipped: TF32 products need an NVIDIA GPU (Ampere or later)"
        )
    assert callable(steps["ghost_bf16x6"])
    assert {c.name for c in ghost_configs.CONFIGS if "ghost_tf32x3" in c.steps} == {
        "gpt2-b8",
        "gpt2-b32",
        "wrn-b256",
    }


def test_steps_are_parsed_from_the_variable_and_an_unknown_one_is_named():
    assert ghost_configs.parse_steps(None, "GHOST_GPU_STEPS") == ghost_configs.STEPS
    assert ghost_configs.parse_steps(" ghost,vmap", "GHOST_GPU_STEPS") == ("ghost", "vmap")
    with pytest.raises(ValueError, match="GHOST_GPU_STEPS: unknown steps \\['', 'ghots'\\]"):
        ghost_configs.parse_steps("ghots,,vmap", "GHOST_GPU_STEPS")


def test_runs_of_different_steps_merge_into_one_config(tmp_path: pathlib.Path) -> None:
    meta = {
        "jax": "0",
        "flax": "0",
        "optax": "0",
        "backend": "gpu",
        "device": "H100",
        "machine": "m",
        "sizes": "full",
        "date": "d",
    }

    def config(steps: dict, acc: dict | None = None) -> dict:
        c = {"config": "gpt2-b32", "label": "GPT-2", "batch": 32, "params": 1e8, "steps": steps}
        if acc:
            c["product_accuracy"] = acc
        return c

    first = config(
        {
            "nonprivate": {"ms": 50.0},
            "ghost": {"ms": 80.0, "time_x": 1.6},
            "vmap": {"skipped": "skipped: not selected (GHOST_GPU_STEPS)"},
        },
        {"tf32x3": {"norm_rel_err": 1e-6, "sum_rel_err": 1e-6}},
    )
    second = config(
        {
            "nonprivate": {"ms": 52.0},
            "ghost": {"skipped": "skipped: not selected (GHOST_GPU_STEPS)"},
            "vmap": {"ms": 70.0, "time_x": 1.35},
        }
    )
    results.write_results(tmp_path, meta, [first])
    merged = results.write_results(tmp_path, meta, [second])
    steps = merged[0]["steps"]
    assert steps["nonprivate"] == {"ms": 52.0}  # the latest run's baseline
    assert steps["vmap"] == {"ms": 70.0, "time_x": 1.35}
    assert steps["ghost"] == {"ms": 80.0, "time_x": 1.6, "earlier_run": True}  # kept, and marked
    assert merged[0]["product_accuracy"]["tf32x3"]["norm_rel_err"] == 1e-6
    assert "measured in an earlier run" in (tmp_path / results.RESULTS_MD).read_text()
    # the --merge path folds files the same way
    again = results.write_results(tmp_path / "m", meta, [first, second])
    assert again[0]["steps"] == steps
    # another device's run replaces the file: its steps are not kept beside this one's
    other = results.write_results(tmp_path, {**meta, "device": "H200"}, [second])
    assert "ghost" not in {k for k, r in other[0]["steps"].items() if "skipped" not in r}
    assert "earlier run" not in (tmp_path / results.RESULTS_MD).read_text()


def test_noise_shapes_step_draws_once_per_leaf_shape():
    losses, params, data, _ = models.gpt2(2, fused=True, dtype=jnp.float32, tiny=True, layers=2)
    cfg = ghost_configs.Config("x", "gpt2", 2, ("nonprivate", "ghost", "ghost_noise_shapes"))
    steps = variants.step_variants(cfg, losses, 2, ghost_configs.STEPS)
    state = fresh_state(params, 0)
    draws = str(jax.make_jaxpr(steps["ghost_noise_shapes"])(state, data)).count("random_bits[")
    shapes = {(x.shape, jnp.result_type(x, jnp.float32)) for x in jax.tree.leaves(params)}
    assert draws == len(shapes) < len(jax.tree.leaves(params))


def test_noise_steps_add_the_noise_to_the_unclipped_sum_or_draw_it_unstored():
    losses, params, data, _ = models.gpt2(2, fused=True, dtype=jnp.float32, tiny=True, layers=2)
    names = ("nonprivate", "ghost", "nonprivate_noise", "ghost_noise_unstored")
    steps = variants.step_variants(
        ghost_configs.Config("x", "gpt2", 2, names), losses, 2, ghost_configs.STEPS
    )
    with backend_setting(gcx.dp.noise.NOISE_STRATEGY, "leaves"):  # a draw per leaf, as on GPUs
        jaxprs = {n: jax.make_jaxpr(steps[n])(fresh_state(params, 0), data).jaxpr for n in names}
    leaves = len(jax.tree.leaves(params))
    count = {n: primitive_counts(j) for n, j in jaxprs.items()}
    # ours stores every noised leaf and the leaves' keys; optax's draw stores nothing (what the
    # unstored ghost step stores is the clipping's own: the per-leaf norms and the clip factor)
    clipping = count["ghost_noise_unstored"]["optimization_barrier"]
    assert count["nonprivate_noise"]["optimization_barrier"] == leaves + 1
    assert count["ghost"]["optimization_barrier"] == clipping + leaves + 1
    for n in ("ghost", "nonprivate_noise", "ghost_noise_unstored"):
        assert count[n]["random_bits"] == leaves, n
    assert count["nonprivate"]["random_bits"] == 0
