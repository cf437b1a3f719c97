"""The profiler report (``benchmarks/profile_gpu.py``): kernel categories, the trace parser and a tiny CPU run."""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

pytest.importorskip("flax")
from benchmarks import profile_gpu as pg
from benchmarks.__main__ import EXTRA_SUITES, SUITES, module_name
from benchmarks.hlo_program import PHASES

# reads the compiled programs' source metadata (hlo_hints, hlo_phases)
pytestmark = pytest.mark.reads_compiled_names

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOPPER_TF32 = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off"
AMPERE_TF32 = "cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4"


@pytest.mark.parametrize(
    ("name", "args", "category"),
    [
        (HOPPER_TF32, {}, "matmul_tf32"),
        (AMPERE_TF32, {}, "matmul_tf32"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3", {}, "matmul_f32"),
        ("ampere_sgemm_128x64_nn", {}, "matmul_f32"),
        ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8", {}, "matmul_bf16"),
        ("ampere_h16816gemm_256x128_ldg8_stages_32x3_nn", {}, "matmul_fp16"),
        # a Triton gemm fusion's name says nothing of its arithmetic: the HLO dot's precision does
        (
            "triton_gemm_dot_3",
            {"hlo_op": "triton_gemm_dot.3", "hlo": "dot highest"},
            "matmul_highest",
        ),
        ("gemm_fusion_dot_1", {"hlo": "dot 3xtf32"}, "matmul_3xtf32"),
        ("gemm_fusion_dot_2", {}, "matmul_unknown"),
        (
            "sm80_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x16",
            {},
            "convolution",
        ),
        (
            "sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nhwc",
            {},
            "convolution",
        ),
        ("loop_reduce_fusion", {}, "reduction"),  # a kLoop fusion that reduces: not a while loop
        ("input_reduce_fusion_3", {}, "reduction"),
        ("transpose_copy", {}, "copy"),
        ("loop_transpose_fusion", {}, "copy"),
        ("Memcpy DtoD (Device -> Device)", {}, "copy"),
        ("Memcpy HtoD", {}, "transfer"),
        ("MemcpyDtoH", {}, "transfer"),
        ("Memcpy", {"thread": "Stream #14(MemcpyH2D)"}, "transfer"),
        (
            "loop_add_fusion_2",
            {"hlo_op": "loop_add_fusion.2", "long_name": "jit(step)/while/body/add"},
            "loop",
        ),
        ("loop_add_fusion_4", {"hlo": "elementwise in_while"}, "loop"),
        ("loop_convert_fusion", {}, "other"),  # "convert" is no convolution
        ("loop_multiply_fusion", {"long_name": "jit(step)/transpose(jvp(GPT2))/mul"}, "other"),
        # XLA:CPU op names, read through the compiled program's hints
        ("ynn_fusion.3", {"hlo_op": "ynn_fusion.3", "hlo": "dot default"}, "matmul_default"),
        ("dot.43", {"hlo_op": "dot.43", "hlo": "dot highest in_while"}, "matmul_highest"),
        ("while.5", {"hlo_op": "while.5", "hlo": "while"}, "loop"),
        ("wrapped_tanh", {"hlo_op": "wrapped_tanh", "in_while": True}, "loop"),
        ("convolution.2", {"hlo_op": "convolution.2"}, "convolution"),
        ("copy.5", {"hlo_op": "copy.5", "hlo": "copy"}, "copy"),
        ("cond.71", {"hlo_op": "cond.71", "hlo": "conditional"}, "other"),
    ],
)
def test_categorize_reads_kernel_names_and_hints(name: str, args: dict, category: str) -> None:
    assert pg.categorize(name, args) == category
    assert category in pg.CATEGORIES


def _meta(pid: int, name: str, tid: int | None = None) -> dict:
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid: int, tid: int, ts: float, dur: float, name: str, **args: str) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def _gpu_trace() -> dict:
    """Two steps of a GPU trace as xprof writes it: host process, device process with a compute and
    a memcpy stream, and a derived "XLA Ops" line that repeats the kernels (not to be counted)."""
    host, gpu, compute, h2d, ops = 1, 7, 13, 14, 100
    events = [
        _meta(host, "/host:CPU"),
        _meta(host, "python", 1),
        _meta(gpu, "/device:GPU:0 (NVIDIA H100)"),
        _meta(gpu, "Stream #13(Compute)", compute),
        _meta(gpu, "Stream #14(MemcpyH2D)", h2d),
        _meta(gpu, "XLA Ops", ops),
        {
            "ph": "M",
            "pid": gpu,
            "tid": compute,
            "name": "thread_sort_index",
            "args": {"sort_index": 1},
        },
    ]
    for step in range(2):
        t = 10_000.0 * step
        events += [
            _x(host, 1, t, 5000, "PjitFunction(step)"),  # host activity: not a kernel
            _x(host, 1, t + 1, 20, "fusion.1", hlo_op="fusion.1"),
            _x(gpu, h2d, t, 50, "Memcpy HtoD"),
            _x(gpu, compute, t + 100, 400, HOPPER_TF32, hlo_op="cublas-gemm.1"),
            _x(gpu, compute, t + 500, 300, AMPERE_TF32, hlo_op="cublas-gemm.2"),
            _x(gpu, compute, t + 800, 250, "triton_gemm_dot_3", hlo_op="triton_gemm_dot.3"),
            _x(gpu, compute, t + 1100, 200, "loop_reduce_fusion", hlo_op="loop_reduce_fusion"),
            _x(gpu, compute, t + 1300, 100, "transpose_copy", hlo_op="transpose_copy"),
            _x(
                gpu,
                compute,
                t + 1400,
                80,
                "loop_add_fusion_2",
                hlo_op="loop_add_fusion.2",
                long_name="jit(step)/while/body/add",
            ),
            _x(
                gpu,
                compute,
                t + 1500,
                70,
                AMPERE_TF32,
                hlo_op="cublas-gemm.3",
                long_name="jit(step)/while/body/dot",
            ),
            _x(gpu, compute, t + 1600, 10, "MemcpyDtoH"),
            _x(gpu, compute, t + 1700, 40, "loop_convert_fusion", hlo_op="loop_convert_fusion"),
            _x(gpu, ops, t + 100, 9000, "fusion.9", hlo_op="fusion.9"),  # the derived line
        ]
    return {"displayTimeUnit": "ns", "traceEvents": events}


def test_summarize_gpu_trace_counts_stream_kernels_per_step() -> None:
    s = pg.summarize(_gpu_trace(), steps=2, hints={"triton_gemm_dot.3": "dot highest"})
    assert s["classifier"] == "device"
    assert (
        "/device:GPU:0" in s["source"]
        and "Stream #13(Compute)" in s["source"]
        and "XLA Ops" not in s["source"]
    )
    assert s["events"] == 2 * 10
    assert s["ms_per_step"] == pytest.approx(1.5)  # 1500 us of kernels and copies per step
    assert s["categories"] == pytest.approx(
        {
            "matmul_tf32": 0.77,
            "matmul_highest": 0.25,
            "reduction": 0.2,
            "copy": 0.1,
            "loop": 0.08,
            "transfer": 0.06,
            "other": 0.04,
        }
    )
    assert next(iter(s["categories"])) == "matmul_tf32"  # largest first
    assert sum(s["shares"].values()) == pytest.approx(1.0)
    assert s["in_while_ms"] == pytest.approx(0.15)  # the while body's add and its gemm
    top = s["top"]
    assert [k["name"] for k in top[:3]] == [HOPPER_TF32, AMPERE_TF32, "triton_gemm_dot_3"]
    assert (
        top[1]["ms"] == pytest.approx(0.37) and top[1]["calls"] == 2
    )  # 300 + 70 us, twice per step
    assert top[0]["category"] == "matmul_tf32" and top[0]["share"] == pytest.approx(0.4 / 1.5)
    kernels = {
        e["name"] for e in _gpu_trace()["traceEvents"] if e["ph"] == "X" and e["tid"] in (13, 14)
    }
    assert len(top) == len(kernels) == 9


def test_summarize_cpu_trace_counts_nested_ops_by_their_own_time() -> None:
    host = 1
    events = [
        _meta(host, "/host:CPU"),
        _meta(host, "tf_XLAPjRtCpuClient/123", 5),
        _meta(host, "python", 6),
        _x(host, 6, 0, 2000, "train"),  # no hlo_op: not an op
        _x(host, 5, 0, 100, "while.5", hlo_op="while.5"),
        _x(host, 5, 5, 30, "ynn_fusion", hlo_op="ynn_fusion"),
        _x(host, 5, 35.5, 0.1, "end: ynn_fusion"),
        _x(host, 5, 40, 50, "wrapped_tanh", hlo_op="wrapped_tanh"),
        _x(host, 5, 100, 20, "copy.5", hlo_op="copy.5"),
    ]
    s = pg.summarize({"traceEvents": events}, steps=1, hints={"ynn_fusion": "dot default in_while"})
    assert s["classifier"] == "host" and "tf_XLAPjRtCpuClient" in s["source"]
    # a device process without kernels (CUPTI missing, say) falls back to the host ops, and says so
    gpu = [_meta(9, "/device:GPU:0"), _meta(9, "Stream #13(Compute)", 13)]
    fallback = pg.summarize({"traceEvents": gpu + events}, steps=1)
    assert fallback["classifier"] == "host" and fallback["source"].startswith("no device kernels")
    assert fallback["ms_per_step"] == pytest.approx(0.12)
    assert s["ms_per_step"] == pytest.approx(0.12)  # the loop and the copy after it
    assert s["categories"] == pytest.approx({"loop": 0.07, "matmul_default": 0.03, "copy": 0.02})
    assert s["in_while_ms"] == pytest.approx(0.1)  # the loop's own 20 us and its body's 80
    assert {k["name"]: k["ms"] for k in s["top"]}["while.5"] == pytest.approx(0.02)


def test_find_trace_takes_the_newest_perfetto_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no perfetto_trace\.json\.gz"):
        pg.find_trace(tmp_path)
    for i, stamp in enumerate(("2026_01_01_00_00_00", "2026_01_01_00_00_09")):
        path = tmp_path / "plugins" / "profile" / stamp / "perfetto_trace.json.gz"
        path.parent.mkdir(parents=True)
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": [{"ph": "M", "name": str(i)}]}, f)
        os.utime(path, (1000 + i, 1000 + i))
    assert pg.load_trace(pg.find_trace(tmp_path))["traceEvents"][0]["name"] == "1"


def test_wired_into_the_suite_runner_and_skips_without_gpu(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "profile-gpu" in EXTRA_SUITES and "profile-gpu" not in SUITES
    assert module_name("profile-gpu") == "benchmarks.profile_gpu"
    assert module_name("ghost-gpu") == "benchmarks.bench_ghost_gpu"
    if jax.default_backend() == "gpu":
        pytest.skip("the skip path is for machines without a GPU")
    assert pg.run(quick=True, out=tmp_path) == []
    assert "profile-gpu: skipped, no GPU" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_steps_are_chosen_with_the_nonprivate_step_first() -> None:
    assert pg.chosen_steps(None) == pg.STEPS
    assert pg.chosen_steps("ghost_noise_unstored, ghost,nonprivate,ghost") == (
        "nonprivate",
        "ghost_noise_unstored",
        "ghost",
    )
    with pytest.raises(ValueError, match="PROFILE_GPU_STEPS: unknown steps \\['ghots'\\]"):
        pg.chosen_steps("ghost,ghots")


@pytest.mark.slow
def test_tiny_cpu_run_writes_both_files(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.profile_gpu",
            "--tiny",
            "--quick",
            "--models",
            "gpt2-b8",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / pg.RESULTS_JSON).read_text())
    assert doc["meta"]["sizes"] == "tiny (smoke)" and doc["meta"]["classifier"] == "host"
    (config,) = doc["configs"]
    assert config["config"] == "gpt2-b8" and list(config["steps"]) == list(pg.STEPS)
    for name, rec in config["steps"].items():
        assert rec["classifier"] == "host", name
        assert rec["ms_per_step"] > 0 and rec["wall_ms"] > 0 and rec["events"] > 0, name
        assert sum(rec["categories"].values()) == pytest.approx(rec["ms_per_step"])
        assert 0 < len(rec["top"]) <= pg.TOP_KERNELS_JSON
        assert any(c.startswith("matmul_") for c in rec["categories"]), name
    assert config["steps"]["ghost"]["time_x"] > 0
    phases = {name: rec["phases"] for name, rec in config["steps"].items()}
    for name, rec in config["steps"].items():  # every op's time in one part of the step
        assert sum(phases[name].values()) == pytest.approx(rec["ms_per_step"]), name
        assert set(phases[name]) <= set(PHASES) and phases[name].get("model", 0) > 0, name
    assert "norms" not in phases["nonprivate"] and "clipped sum" not in phases["nonprivate"]
    assert phases["ghost"]["noise"] > phases["nonprivate"].get(
        "noise", 0.0
    )  # the latter: its key split
    assert (
        phases["ghost"]["noise"] > 0
        and phases["ghost"]["clipped sum"] > 0
        and phases["ghost"]["norms"] > 0
    )
    md = (tmp_path / pg.RESULTS_MD).read_text()
    assert "## gpt2-b8:" in md and "| ghost |" in md and "### gpt2-b8 vmap: top" in md
    assert "### gpt2-b8: time by source" in md
