"""The sharded Llama benchmark (``benchmarks/bench_sharded.py``): FSDP specs, rows, and a tiny mesh run."""

from __future__ import annotations

import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
from benchmarks import bench_sharded as bs
from benchmarks.models import LlamaConfig


def test_fsdp_spec_shards_the_largest_divisible_axis() -> None:
    assert bs.fsdp_spec((128, 256), 4) == P(None, "fsdp")
    assert bs.fsdp_spec((256, 6), 4) == P("fsdp", None)
    assert bs.fsdp_spec((6, 10), 4) == P()  # no axis divisible: replicated
    assert bs.fsdp_spec((128, 256), 1) == P() and bs.fsdp_spec((), 8) == P()


def test_rows_of_compare_each_dp_step_with_the_non_private_one() -> None:
    res = {
        "2x4": {
            "nonprivate": {"temporaries": 10.0, "all_gathers": 4, "all_reduces": 1},
            "ghost": {"temporaries": 25.0, "all_gathers": 6, "all_reduces": 2},
            "vmap": {"temporaries": 12.0, "all_gathers": 4, "all_reduces": 3},
        }
    }
    rows = {(r["step"], r["measure"]): r for r in bs.rows_of(res, 64)}
    assert set(rows) == {(s, m) for s in ("ghost", "vmap") for m in ("temporaries", "all_gathers")}
    assert (
        rows[("ghost", "temporaries")]["ratio"] == 2.5
        and rows[("ghost", "all_gathers")]["ratio"] == 1.5
    )
    assert all(r["group"] == "sharded" and r["mesh"] == "2x4" for r in rows.values())


@pytest.mark.slow
@pytest.mark.skipif(
    jax.device_count() < 8 or jax.default_backend() != "cpu", reason="8 simulated CPU devices"
)
def test_tiny_llama_on_a_2x4_mesh() -> None:
    cfg = LlamaConfig(layers=1, d=32, heads=4, kv_heads=2, seq=8, vocab=64)
    res = bs.measure_mesh((2, 4), 8, cfg)
    assert set(res) == set(bs.STEPS)
    for rec in res.values():
        assert rec["temporaries"] > 0 and math.isfinite(rec["temporaries"])
    # FSDP: the sharded parameters are gathered for the forward pass
    assert res["nonprivate"]["all_gathers"] > 0
