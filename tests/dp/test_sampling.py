"""Tests for gradclip_jax.dp.sampling: Poisson batches padded to fixed shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

import gradclip_jax as gcx
from gradclip_jax import BatchOverflowError, PoissonSampler
from gradclip_jax.dp.sampling import max_batch_size_for, overflow_probability
from tests.moved import import_moved


def _sampler(**kw):
    args = dict(steps=10, expected_batch_size=20, seed=0, process_index=0, process_count=1)
    args.update(kw)
    return PoissonSampler(kw.pop("n", 200), **{k: v for k, v in args.items() if k != "n"})


def test_inclusion_frequency_matches_rate():
    n, q, steps = 200, 0.1, 2000
    s = PoissonSampler(n, steps=steps, sample_rate=q, seed=1, process_index=0, process_count=1)
    counts = np.zeros(n)
    sizes = []
    pair = 0
    for b in s:
        real = b.indices[b.mask]
        assert len(np.unique(real)) == len(real)  # no example twice in a batch
        counts[real] += 1
        sizes.append(len(real))
        pair += (0 in real) and (1 in real)
    # each example: Binomial(steps, q); |z| < 4.5 for all 200 (fails with prob ~1e-3 under H0)
    z = (counts - steps * q) / math.sqrt(steps * q * (1 - q))
    assert np.max(np.abs(z)) < 4.5, np.max(np.abs(z))
    # counts are not more concentrated than binomial either (a fixed-size sampler would be)
    assert 0.7 < np.var(counts) / (steps * q * (1 - q)) < 1.3
    # batch sizes: Binomial(n, q)
    assert np.mean(sizes) == pytest.approx(n * q, rel=0.02)
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.15)
    # independence of two examples: P(both) = q^2
    assert pair / steps == pytest.approx(q * q, abs=4 * math.sqrt(q * q / steps))


def test_padding_mask_and_shapes():
    s = _sampler(steps=50)
    for b in s:
        assert b.indices.shape == b.mask.shape == (s.max_batch_size,)
        assert b.indices.dtype == np.int32 and b.mask.dtype == bool
        k = int(b.mask.sum())
        assert b.mask[:k].all() and not b.mask[k:].any()  # real rows first
        assert np.all(np.diff(b.indices[:k]) > 0)
        assert np.all(b.indices[k:] == 0)  # padding indexes a valid row
    # gathered, the padding rows are zeros, not copies of example 0 (a loop that forgets the mask
    # would count example 0 once per padding row)
    data = {"x": np.arange(1, 1 + 3 * s.dataset_size, dtype=np.float32).reshape(-1, 3)}
    rows, mask = s.gather(data, b)
    np.testing.assert_array_equal(rows["x"][mask], data["x"][b.indices[mask]])
    assert not mask.all() and np.all(rows["x"][~mask] == 0)


def test_deterministic_from_seed_and_random_access():
    a, b, c = _sampler(seed=5), _sampler(seed=5), _sampler(seed=6)
    la = list(a)
    for x, y in zip(la, b, strict=True):
        np.testing.assert_array_equal(x.indices, y.indices)
    assert any(not np.array_equal(x.indices, y.indices) for x, y in zip(la, c, strict=True))
    np.testing.assert_array_equal(a.batch(7).indices, la[7].indices)
    assert [x.step for x in la] == list(range(10)) and len(a) == 10


def test_process_pieces_concatenate_to_global_batch():
    full = _sampler(max_batch_size=60)
    pieces = [_sampler(max_batch_size=60, process_index=i, process_count=3) for i in range(3)]
    assert pieces[0].local_batch_size == 20
    for t in range(10):
        g = full.batch(t)
        got = [p.batch(t) for p in pieces]
        np.testing.assert_array_equal(np.concatenate([x.indices for x in got]), g.indices)
        np.testing.assert_array_equal(np.concatenate([x.mask for x in got]), g.mask)


def test_default_max_batch_size_bounds_overflow():
    n, q, steps = 5000, 0.02, 3000
    m = max_batch_size_for(n, q, steps)
    assert overflow_probability(n, q, m, steps) <= 1e-9 < overflow_probability(n, q, m - 1, steps)
    # the exact tail, composed over independent steps
    p = binom.sf(m, n, q)
    assert overflow_probability(n, q, m, steps) == pytest.approx(1 - (1 - p) ** steps, rel=1e-6)
    s = PoissonSampler(n, steps=steps, sample_rate=q, process_index=0, process_count=4)
    assert s.max_batch_size % 4 == 0 and s.max_batch_size >= m
    assert s.overflow_probability <= 1e-9
    assert "overflow_probability" in repr(s)


def test_overflow_raises_or_truncates_and_is_accounted():
    s = _sampler(steps=200, max_batch_size=20)  # = expected: about half the draws overflow
    assert s.overflow_probability > 0.99
    with pytest.raises(BatchOverflowError, match="max_batch_size=20"):
        list(s)
    t = _sampler(steps=200, max_batch_size=20, on_overflow="truncate")
    sizes = [int(b.mask.sum()) for b in t]
    assert max(sizes) == 20 and min(sizes) < 20
    assert t.accounting() == {"sample_rate": 0.1, "truncated_batch_size": 20, "dataset_size": 200}
    assert s.accounting()["truncated_batch_size"] is None


def test_buckets():
    s = _sampler(steps=100, max_batch_size=40, bucket_sizes=[24, 30])
    assert s.bucket_sizes == (24, 30, 40)
    shapes = {len(b.indices) for b in s}
    assert shapes <= {24, 30, 40} and len(shapes) >= 2
    assert s.padded_size(24) == 24 and s.padded_size(25) == 30
    with pytest.raises(ValueError, match="bucket_sizes"):
        _sampler(max_batch_size=40, bucket_sizes=[50])


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="sample_rate"):
        _sampler(expected_batch_size=None, sample_rate=0.0)
    with pytest.raises(ValueError, match="sample_rate"):
        _sampler(expected_batch_size=None, sample_rate=1.5)
    with pytest.raises(ValueError, match="expected_batch_size"):
        _sampler(expected_batch_size=300)
    with pytest.raises(ValueError, match="exactly one"):
        _sampler(sample_rate=0.1)
    with pytest.raises(ValueError, match="max_batch_size"):
        _sampler(max_batch_size=19)
    with pytest.raises(ValueError, match=r"max_batch_size.*multiple of process_count"):
        _sampler(max_batch_size=25, process_count=2)
    with pytest.raises(ValueError, match="on_overflow"):
        _sampler(on_overflow="drop")
    with pytest.raises(ValueError, match="process_index"):
        _sampler(process_index=2, process_count=2)
    with pytest.raises(TypeError, match="dataset_size"):
        PoissonSampler(10.5, steps=1, sample_rate=0.1)


def test_public_names():
    assert gcx.PoissonSampler is PoissonSampler and gcx.PoissonSampler is PoissonSampler
    assert "PoissonSampler" in gcx.__all__ and "make_private" in gcx.__all__
    privacy = import_moved("privacy")  # the deprecated path serves the same class, with a warning
    with pytest.warns(DeprecationWarning, match=r"gradclip_jax\.PrivacyAccountant instead"):
        assert privacy.PrivacyAccountant is gcx.PrivacyAccountant
