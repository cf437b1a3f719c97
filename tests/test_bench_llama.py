"""The Llama-style nnx decoder of ``benchmarks/models.py``: it builds in each way it can be written,
padding does not count in an example's loss, and ghost clipping agrees with ``method='vmap'`` on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
import gradclip_jax as gcx
from benchmarks import cost_llama, models
from benchmarks.ghost_gpu import max_batch

TINY = dict(layers=2, d=32, heads=4, kv_heads=2, seq=8, vocab=64)
# the LoRA way is the quick run's; the scan + remat default is test_streamed's decoder, and the
# others compile as long
SLOW = pytest.mark.slow
WAYS = [
    pytest.param(dict(), marks=SLOW),
    dict(lora=4),
    pytest.param(dict(scan=False), marks=SLOW),
    pytest.param(dict(remat=False), marks=SLOW),
    pytest.param(dict(lora=4, scan=False, remat=False), marks=SLOW),
]


def _ids(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "scan+remat"


@pytest.mark.parametrize("kw", WAYS, ids=_ids)
def test_ghost_equals_vmap(kw: dict) -> None:
    cfg = models.LlamaConfig(**TINY, **kw)
    losses, params, data = models.llama(0, 4, cfg)
    assert losses(params, data).shape == (4,)
    report = gcx.ghost_report(losses, params, data)
    assert report.fallback == []  # every leaf measured: the ghost path is the one compared
    # compiled (op by op the decoder takes a minute): one vmap program for both clip norms
    vmap = jax.jit(lambda p, d, c: gcx.clipped_grad(losses, c, method="vmap")(p, d))
    clip = 0.5 * float(jnp.median(vmap(params, data, 1e9)[1].norms))
    g, gi = jax.jit(gcx.clipped_grad(losses, clip, method="ghost"))(params, data)
    v, vi = vmap(params, data, clip)
    np.testing.assert_allclose(gi.norms, vi.norms, rtol=1e-4)
    assert int(vi.num_clipped) >= 1  # the clip bites: scaling matters in the comparison
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(v), strict=True):
        # float32 sums in two orders: an element near 0 differs by rounding of the leaf's scale
        # (1.4e-6 at 0.0035 in a leaf up to 0.24, once in CI), not of its own value
        scale = float(np.max(np.abs(b)))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


def test_lora_trains_adapters_only() -> None:
    full = models.llama(0, 2, models.LlamaConfig(**TINY))[1]
    lora = models.llama(0, 2, models.LlamaConfig(**TINY, lora=4))[1]
    n_full, n_lora = (sum(x.size for x in jax.tree.leaves(p)) for p in (full, lora))
    # adapters on q, v, gate, up, down of each layer: rank x (in + out) each
    d, hid, kv = (
        TINY["d"],
        models.LlamaConfig(**TINY).hidden,
        TINY["d"] // TINY["heads"] * TINY["kv_heads"],
    )
    assert n_lora == TINY["layers"] * 4 * ((d + d) + (d + kv) + 2 * (d + hid) + (hid + d))
    assert n_lora < n_full / 5


def test_padding_does_not_count() -> None:
    cfg = models.LlamaConfig(**TINY, scan=False)
    losses, params, data = models.llama(0, 4, cfg)
    assert not bool(data["mask"][3, -1]) and bool(data["mask"][0].all())  # example 3 is padded
    changed = dict(
        data,
        x=data["x"].at[3, -1].set((data["x"][3, -1] + 1) % cfg.vocab),
        y=data["y"].at[3, -1].set((data["y"][3, -1] + 1) % cfg.vocab),
    )
    np.testing.assert_allclose(losses(params, changed), losses(params, data), rtol=1e-6)
    kept = dict(data, y=data["y"].at[0, -1].set((data["y"][0, -1] + 1) % cfg.vocab))
    assert float(losses(params, kept)[0]) != pytest.approx(float(losses(params, data)[0]), rel=1e-6)


@pytest.mark.slow
def test_bfloat16_builds() -> None:
    losses, params, data = models.llama(0, 2, models.LlamaConfig(**TINY, dtype=jnp.bfloat16))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert losses(params, data).dtype == jnp.float32


def test_compiled_costs_count_variadic_reductions() -> None:
    x = jnp.ones((4, 8))
    three = cost_llama.compiled_costs(
        lambda a: jax.lax.reduce(
            (a, a * a), (0.0, 0.0), lambda p, q: (p[0] + q[0], p[1] + q[1]), (1,)
        ),
        x,
    )
    plain = cost_llama.compiled_costs(lambda a: (jnp.sum(a, 1), jnp.sum(a * a, 1)), x)
    assert three["variadic_reduces"] == 1 and plain["variadic_reduces"] == 0
    assert plain["flops"] > 0 and plain["instructions"] > 0


def test_check_mlp_fails_on_a_variadic_reduction() -> None:
    good = {"ghost": {"variadic_reduces": 0}, "nonprivate": {"variadic_reduces": 0}}
    cost_llama.check_mlp(good)
    if jax.default_backend() == "cpu":
        with pytest.raises(AssertionError, match="2 variadic reductions"):
            cost_llama.check_mlp({**good, "ghost": {"variadic_reduces": 2}})


@pytest.mark.cpu_only(reason="the CPU's ROW_NORMS")
def test_mlp_ghost_grad_holds_no_variadic_reduction_on_the_cpu() -> None:
    res = cost_llama.mlp_costs(batch=16, reps=3)
    cost_llama.check_mlp(res)  # fails with ROW_NORMS 'branch-free' on the CPU
    rows = {r["measure"]: r for r in cost_llama.mlp_rows(res, batch=16)}
    assert set(rows) == {"ms", "flops", "bytes", "instructions", "variadic_reduces"}
    assert rows["ms"]["ours_ms"] > 0 and rows["ms"]["baseline_ms"] > 0
    assert rows["flops"]["ratio"] > 1 and rows["variadic_reduces"]["ours_ms"] == 0


@pytest.mark.slow
def test_llama_cost_rows_of_a_tiny_config() -> None:
    cfg = models.LlamaConfig(**{**TINY, "layers": 1})  # one layer: no unrolled compile
    rows = cost_llama.llama_rows(True, batch=2, configs=[("tiny", cfg)])
    assert len(rows) == 3 * len(cost_llama.MEASURES)
    by = {(r["step"], r["measure"]): r for r in rows}
    assert set(by) == {(s, m) for s in ("ghost", "vmap", "auto") for m, *_ in cost_llama.MEASURES}
    for r in rows:
        assert r["group"] == "cost" and np.isfinite(r["ratio"]) and r["baseline_ms"] > 0
    # a DP step does more work than the non-private one, and auto is one of the two paths
    assert by[("ghost", "flops")]["ratio"] > 1 and by[("vmap", "flops")]["ratio"] > 1
    assert by[("auto", "flops")]["ours_ms"] in (
        by[("ghost", "flops")]["ours_ms"],
        by[("vmap", "flops")]["ours_ms"],
    )


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 7, 8, 100, 5000])
def test_largest_batch_finds_the_edge(limit: int) -> None:
    calls: list[int] = []

    def fits(b: int) -> bool:
        calls.append(b)
        return b <= limit

    assert max_batch.largest_batch(fits, cap=4096) == (min(limit, 4096), True)
    assert len(calls) <= 2 * 13 + 2  # doubling, then bisection
    calls.clear()
    assert max_batch.largest_batch(fits, cap=4096, start=8) == (min(limit, 4096), True)
    assert len(calls) <= 2 * 13 + 2


def test_largest_batch_stops_with_a_lower_bound() -> None:
    tries: list[int] = []

    def fits(b: int) -> bool:
        tries.append(b)
        return b <= 100

    assert max_batch.largest_batch(fits, give_up=lambda: len(tries) >= 3) == (
        4,
        False,
    )  # 1, 2, 4 fit


def test_ghost_gpu_llama_configs() -> None:
    from benchmarks.ghost_gpu import configs as ghost_configs

    assert {c.name for c in ghost_configs.select("llama")} == {"llama-b8", "llama-lora-b8"}
    full = ghost_configs.select("llama-b8")[0]

    def n_params(cfg: object) -> int:
        shapes = jax.eval_shape(
            lambda: models.llama(0, 1, ghost_configs.llama_config(cfg, False))[1]
        )
        return sum(x.size for x in jax.tree.leaves(shapes))

    assert 350e6 <= n_params(full) <= 1e9  # the full config: a 0.35-1B model
    lora = ghost_configs.select("llama-lora-b8")[0]
    assert ghost_configs.llama_config(lora, False).lora and n_params(lora) < n_params(full) / 50
    losses, params, data, label, batch = ghost_configs.build(full, tiny=True)
    assert losses(params, data).shape == (batch,) and "bfloat16" in label


@pytest.mark.slow
def test_max_batch_rows_of_the_tiny_llama() -> None:
    from benchmarks import bench_ghost_gpu
    from benchmarks.ghost_gpu import configs as ghost_configs

    rows = bench_ghost_gpu.max_batch_rows(ghost_configs.select("llama-b8")[0], tiny=True)
    assert {r["step"] for r in rows} == {"ghost", "vmap"}
    for r in rows:
        assert (
            1 <= r["baseline_ms"] <= bench_ghost_gpu.TINY_CAP
            and 0 <= r["ours_ms"] <= r["baseline_ms"]
        )


def test_llama_cost_configs() -> None:
    quick, full = cost_llama.llama_configs(True), cost_llama.llama_configs(False)
    # quick: T=512 full and LoRA, scanned (the temporaries of the remat'd blocks as users write them)
    assert [(c.seq, c.lora, c.scan, c.remat) for _, c in quick] == [
        (512, 0, True, True),
        (512, 8, True, True),
    ]
    assert [(c.seq, c.lora, c.scan, c.remat) for _, c in full] == [
        (512, 0, True, True),
        (512, 8, True, True),
        (2048, 0, True, True),
        (2048, 8, True, True),
    ]
