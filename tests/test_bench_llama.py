"""The Llama-style nnx decoder of ``benchmarks/models.py``: it builds in each way it can be written,
padding does not count in an example's loss, and ghost clipping agrees with ``method='vmap'`` on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
import gradclip_jax as gcx
from benchmarks import models

TINY = dict(layers=2, d=32, heads=4, kv_heads=2, seq=8, vocab=64)
SLOW = pytest.mark.slow  # the scan + remat ways users write are the quick run's; the others compile as long
WAYS = [dict(), dict(lora=4), pytest.param(dict(scan=False), marks=SLOW), pytest.param(dict(remat=False), marks=SLOW),
        pytest.param(dict(lora=4, scan=False, remat=False), marks=SLOW)]


def _ids(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "scan+remat"


@pytest.mark.parametrize("kw", WAYS, ids=_ids)
def test_ghost_equals_vmap(kw: dict) -> None:
    cfg = models.LlamaConfig(**TINY, **kw)
    losses, params, data = models.llama(0, 4, cfg)
    assert losses(params, data).shape == (4,)
    report = gcx.ghost_report(losses, params, data)
    assert report.fallback == []  # every leaf measured: the ghost path is the one compared
    clip = 0.5 * float(jnp.median(gcx.clipped_grad(losses, 1e9, method="vmap")(params, data)[1].norms))
    g, gi = gcx.clipped_grad(losses, clip, method="ghost")(params, data)
    v, vi = gcx.clipped_grad(losses, clip, method="vmap")(params, data)
    np.testing.assert_allclose(gi.norms, vi.norms, rtol=1e-4)
    assert int(vi.num_clipped) >= 1  # the clip bites: scaling matters in the comparison
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(v), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_lora_trains_adapters_only() -> None:
    full = models.llama(0, 2, models.LlamaConfig(**TINY))[1]
    lora = models.llama(0, 2, models.LlamaConfig(**TINY, lora=4))[1]
    n_full, n_lora = (sum(x.size for x in jax.tree.leaves(p)) for p in (full, lora))
    # adapters on q, v, gate, up, down of each layer: rank x (in + out) each
    d, hid, kv = TINY["d"], models.LlamaConfig(**TINY).hidden, TINY["d"] // TINY["heads"] * TINY["kv_heads"]
    assert n_lora == TINY["layers"] * 4 * ((d + d) + (d + kv) + 2 * (d + hid) + (hid + d))
    assert n_lora < n_full / 5


def test_padding_does_not_count() -> None:
    cfg = models.LlamaConfig(**TINY, scan=False)
    losses, params, data = models.llama(0, 4, cfg)
    assert not bool(data["mask"][3, -1]) and bool(data["mask"][0].all())  # example 3 is padded
    changed = dict(data, x=data["x"].at[3, -1].set((data["x"][3, -1] + 1) % cfg.vocab),
                   y=data["y"].at[3, -1].set((data["y"][3, -1] + 1) % cfg.vocab))
    np.testing.assert_allclose(losses(params, changed), losses(params, data), rtol=1e-6)
    kept = dict(data, y=data["y"].at[0, -1].set((data["y"][0, -1] + 1) % cfg.vocab))
    assert float(losses(params, kept)[0]) != pytest.approx(float(losses(params, data)[0]), rel=1e-6)


@pytest.mark.slow
def test_bfloat16_builds() -> None:
    losses, params, data = models.llama(0, 2, models.LlamaConfig(**TINY, dtype=jnp.bfloat16))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert losses(params, data).dtype == jnp.float32
