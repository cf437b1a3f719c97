"""The sampler protocol: a new batch-selection scheme is one class, and make_private and the
accountant take it as they take the Poisson sampler."""

from __future__ import annotations

import pickle
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx
from gradclip_jax import PoissonSampler, PrivacyAccountant, make_private
from gradclip_jax.dp import BatchSampler, IndexSampler, SampledBatch

N, B, T = 200, 20, 12


class FixedSizeSampler(IndexSampler):
    """Fixed-size batches drawn uniformly without replacement, accounted honestly as such:
    ``SampledWithoutReplacementDpEvent`` under replace-one neighbours (Wang et al. 2019)."""

    neighboring = "replace"

    def __init__(self, dataset_size: int, batch_size: int, *, steps: int, seed: int = 0):
        super().__init__(
            dataset_size,
            steps=steps,
            max_batch_size=batch_size,
            seed=seed,
            process_index=0,
            process_count=1,
        )
        self.batch_size = batch_size
        self.expected_batch_size = float(batch_size)  # exact: every batch has this size

    def draw(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        return np.sort(rng.choice(self.dataset_size, self.batch_size, replace=False))

    def dp_event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
        return dp_accounting.SampledWithoutReplacementDpEvent(
            self.dataset_size, self.batch_size, dp_accounting.GaussianDpEvent(noise_multiplier)
        )

    def plan(self) -> dict:
        return {"sampler": "fixed_size", "batch_size": self.batch_size, "seed": self.seed}


def _loss(w, batch):
    return 0.5 * (batch["x"] @ w - batch["y"]) ** 2


def _data():
    x = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}


def _private(sampler, **kw):
    args = dict(target_epsilon=4.0, delta=1e-4, l2_clip_norm=1.0, accountant="rdp", sampler=sampler)
    return make_private(_loss, optax.sgd(0.1), **{**args, **kw})


def _direct_epsilon(z: float, steps: int, delta: float) -> float:
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    event = dp_accounting.SampledWithoutReplacementDpEvent(N, B, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(acc.get_epsilon(delta))


def test_both_samplers_follow_the_protocol():
    poisson = PoissonSampler(N, steps=T, expected_batch_size=B, process_index=0, process_count=1)
    assert isinstance(poisson, BatchSampler) and isinstance(
        FixedSizeSampler(N, B, steps=T), BatchSampler
    )
    assert gcx.PoissonBatch is SampledBatch and isinstance(poisson.batch(0), SampledBatch)
    assert poisson.neighboring == "add_or_remove"
    want = dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(1.3))
    assert poisson.dp_event(1.3) == want
    trunc = PoissonSampler(
        N,
        steps=T,
        expected_batch_size=B,
        on_overflow="truncate",
        max_batch_size=30,
        process_index=0,
        process_count=1,
    )
    assert trunc.dp_event(1.3) == dp_accounting.TruncatedSubsampledGaussianDpEvent(
        N, B / N, 30, 1.3
    )


def test_a_custom_sampler_plugs_into_make_private_with_its_own_accounting():
    sampler = FixedSizeSampler(N, B, steps=T, seed=3)
    priv = _private(sampler)
    assert priv.sampler is sampler and priv.steps == T and priv.expected_batch_size == B
    eps = _direct_epsilon(priv.noise_multiplier, T, 1e-4)
    assert priv.planned_epsilon == pytest.approx(eps, rel=1e-12) and eps <= 4.0
    # calibrated: a little less noise would spend more than the target
    assert _direct_epsilon(priv.noise_multiplier - 1e-3, T, 1e-4) > 4.0
    w, state, key = jnp.zeros(3), priv.init(jnp.zeros(3)), jax.random.key(0)
    data = _data()
    for batch, mask in priv.batches(data):
        assert mask.shape == (B,) and mask.all() and len(np.unique(batch["x"][:, 0])) == B
        key, sub = jax.random.split(key)
        w, state, _ = priv.step(w, state, batch, mask, sub)
    assert priv.accountant.steps == T and priv.accountant.neighboring == "replace"
    assert priv.epsilon() == pytest.approx(eps, rel=1e-12)


def test_the_noise_scales_with_the_replace_one_sensitivity():
    # replace-one neighbours: the clipped sum's sensitivity is 2C, so the noise std is z * 2C
    priv = _private(FixedSizeSampler(N, B, steps=T))
    p = jnp.zeros(20000)
    new, _, _ = priv.noisy_update(p, priv.init(p), jnp.zeros(20000), jax.random.key(1))
    std = float(jnp.std(new)) / 0.1 * B  # sgd(0.1); the sum is divided by the batch size
    assert std == pytest.approx(priv.noise_multiplier * 2.0, rel=0.03)


def test_a_custom_sampler_run_resumes_from_its_state_dict():
    sampler = FixedSizeSampler(N, B, steps=T, seed=1)
    priv = _private(sampler)
    for _ in priv.batches():
        if priv.accountant.steps == 5:
            break
    state = pickle.loads(pickle.dumps(priv.state_dict()))
    assert state["accountant"]["phases"][0][5] == sampler.plan()
    assert state["accountant"]["neighboring"] == "replace"
    resumed = _private(FixedSizeSampler(N, B, steps=T, seed=1), resume_from=state)
    assert [b.step for b in resumed.batches()] == list(range(5, T))
    assert resumed.epsilon() == pytest.approx(priv.planned_epsilon, rel=1e-12)
    with pytest.raises(ValueError, match="seed"):
        _private(FixedSizeSampler(N, B, steps=T, seed=2), resume_from=state)


def test_accountant_records_a_sampler_and_checks_its_relation():
    sampler = FixedSizeSampler(N, B, steps=T)
    acc = PrivacyAccountant("rdp", neighboring="replace")
    acc.step(1.5, sampler=sampler, steps=3)
    acc.step(1.5, sampler=sampler, steps=2)
    assert len(acc.phases) == 1 and acc.steps == 5
    assert acc.epsilon(1e-5) == pytest.approx(_direct_epsilon(1.5, 5, 1e-5), rel=1e-12)
    back = PrivacyAccountant.from_state_dict(acc.state_dict(), sampler=sampler)
    assert back.epsilon(1e-5) == acc.epsilon(1e-5)
    with pytest.raises(ValueError, match="pass that sampler"):
        PrivacyAccountant.from_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match=r"'replace' neighbours.*'add_or_remove'"):
        PrivacyAccountant("rdp").step(1.5, sampler=sampler)
    with pytest.raises(ValueError, match="not both"):
        acc.step(1.5, 0.1, sampler=sampler)
    with pytest.raises(TypeError, match=r"BatchSampler protocol.*lacks"):
        acc.step(1.5, sampler=object())
    with pytest.raises(ValueError, match="`neighboring` must be one of"):
        PrivacyAccountant(neighboring="zero_out")


def test_make_private_sampler_errors_name_the_argument():
    sampler = FixedSizeSampler(N, B, steps=T)
    with pytest.raises(ValueError, match="with `sampler`, leave `expected_batch_size`"):
        _private(sampler, expected_batch_size=20)
    with pytest.raises(ValueError, match=r"`dataset_size`=100, but the sampler's is 200"):
        _private(sampler, dataset_size=100)
    with pytest.raises(TypeError, match="`sampler` must follow"):
        _private(object())
    # the PLD accountant has no bound for sampling without replacement: said, not a crash
    with pytest.raises(ValueError, match="'pld' accountant cannot account for this sampling"):
        _private(sampler, accountant="pld")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _private(sampler, dataset_size=N, steps=T)  # the sampler's own values are fine
