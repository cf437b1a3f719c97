"""Tests for gradclip_jax.dp.accounting: accounting backed by dp-accounting."""

from __future__ import annotations

import builtins
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import PrivacyAccountant
from gradclip_jax.dp import accounting
from gradclip_jax.dp.accounting import pld_interval, sampled_gaussian_event
from gradclip_jax.dp.accounting._composition import _step_pld_uncached, loss_std
from gradclip_jax.dp.noise import add_gaussian_noise

dp_accounting = pytest.importorskip("dp_accounting")


def _grid(phases):
    """The PLD grid of a run of ``(z, q, steps)`` phases: pld_interval at its smallest z and its loss's spread."""
    events = [(sampled_gaussian_event(z, q), t) for z, q, t in phases]
    return pld_interval(min(z for z, _, _ in phases), loss_std(events))


def _direct_rdp(z, q, steps, delta):
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
    )
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(
    "z,q,steps,delta",
    [
        (1.1, 256 / 60000, 14062, 1e-5),
        (0.8, 0.01, 1000, 1e-6),
        (4.0, 1.0, 10, 1e-5),
        (1.0, 0.1, 1, 1e-3),
    ],
)
def test_epsilon_matches_rdp_accountant(z, q, steps, delta):
    eps = accounting.epsilon(z, q, steps, delta, accountant="rdp")
    assert isinstance(eps, float)
    assert eps == pytest.approx(_direct_rdp(z, q, steps, delta), rel=1e-12)


def test_epsilon_known_value_and_pld():
    # the JAX DP-SGD example: sigma 1.1, batch 256 of 60000, 60 epochs -> about 2.6-3 at 1e-5
    eps = accounting.epsilon(1.1, 256 / 60000, 60 * 60000 // 256, 1e-5, accountant="rdp")
    assert 2.0 < eps < 3.5
    pld = accounting.epsilon(1.1, 0.01, 200, 1e-5)  # PLD is the default
    assert pld == accounting.epsilon(1.1, 0.01, 200, 1e-5, accountant="pld")
    # dp-accounting's PLD accountant on the grid of pld_interval (coarser for a wider loss) ...
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=_grid([(1.1, 0.01, 200)]))
    acc.compose(accounting.dp_sgd_event(1.1, 0.01, 200))
    assert pld == pytest.approx(acc.get_epsilon(1e-5), rel=1e-8)  # up to the rounding of FFTs
    # ... an upper bound a little above the one on its default grid
    fine = dp_accounting.pld.PLDAccountant()
    fine.compose(accounting.dp_sgd_event(1.1, 0.01, 200))
    assert fine.get_epsilon(1e-5) <= pld <= fine.get_epsilon(1e-5) * (1 + 1e-4)
    assert (
        pld <= accounting.epsilon(1.1, 0.01, 200, 1e-5, accountant="rdp") * 1.01
    )  # PLD is at least as tight


def test_epsilon_is_monotone():
    steps = [1, 10, 100, 1000, 5000]
    # RDP for speed here (the property holds for both; PLD is covered below)
    eps = [accounting.epsilon(1.0, 0.01, t, 1e-5, accountant="rdp") for t in steps]
    assert all(a < b for a, b in itertools.pairwise(eps))
    zs = [0.6, 0.8, 1.0, 2.0, 5.0]
    eps_z = [accounting.epsilon(z, 0.01, 1000, 1e-5, accountant="rdp") for z in zs]
    assert all(a > b for a, b in itertools.pairwise(eps_z))
    assert accounting.epsilon(0.0, 0.01, 10, 1e-5) == math.inf
    assert accounting.epsilon(1.0, 0.01, 0, 1e-5) == 0.0


@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_calibrate_inverts_epsilon(target):
    q, steps, delta = 0.01, 2000, 1e-5
    # RDP for speed (calibration is ~15 accountant evaluations); the PLD default is tested below
    z = accounting.calibrate_noise_multiplier(target, q, steps, delta, accountant="rdp")
    eps = accounting.epsilon(z, q, steps, delta, accountant="rdp")
    assert eps <= target
    assert eps == pytest.approx(target, rel=1e-2)
    # and the other way round
    z2 = accounting.calibrate_noise_multiplier(
        accounting.epsilon(1.3, q, steps, delta, accountant="rdp"),
        q,
        steps,
        delta,
        accountant="rdp",
    )
    assert z2 == pytest.approx(1.3, abs=2e-3)


def test_validation():
    with pytest.raises(ValueError, match="sample_rate"):
        accounting.epsilon(1.0, 0.0, 10, 1e-5)
    with pytest.raises(ValueError, match="sample_rate"):
        accounting.epsilon(1.0, 1.5, 10, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        accounting.epsilon(1.0, 0.1, 10, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        accounting.epsilon(-1.0, 0.1, 10, 1e-5)
    # an infinite one crashed inside dp_accounting's PLD ("cannot convert float NaN to integer")
    for kind in ("pld", "rdp"):
        with pytest.raises(ValueError, match="`noise_multiplier` must be finite"):
            accounting.epsilon(float("inf"), 0.1, 10, 1e-5, accountant=kind)
    with pytest.raises(ValueError, match="`noise_multiplier` must be finite"):
        PrivacyAccountant().step(float("inf"), 0.1, 10)
    with pytest.raises(TypeError, match="`steps` must be an int"):
        accounting.epsilon(1.0, 0.1, 2.5, 1e-5)
    with pytest.raises(ValueError, match="accountant"):
        accounting.epsilon(1.0, 0.1, 10, 1e-5, accountant="moments")
    with pytest.raises(ValueError, match="target_epsilon"):
        accounting.calibrate_noise_multiplier(0.0, 0.1, 10, 1e-5)
    with pytest.raises(ValueError, match="steps"):
        accounting.calibrate_noise_multiplier(1.0, 0.1, 0, 1e-5)


def test_missing_dp_accounting_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "dp_accounting" or name.startswith("dp_accounting."):
            raise ImportError("No module named 'dp_accounting'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r'pip install "gradclip_jax\[dp\]"'):
        accounting.epsilon(1.0, 0.1, 10, 1e-5)
    with pytest.raises(ImportError, match="dp-accounting"):
        accounting.calibrate_noise_multiplier(1.0, 0.1, 10, 1e-5)


def test_add_gaussian_noise():
    tree = {"a": jnp.zeros(50000, jnp.bfloat16), "b": jnp.zeros((100, 100), jnp.float32)}
    out = add_gaussian_noise(tree, 3.0, jax.random.key(0))
    assert out["a"].dtype == jnp.float32  # noise added in float32 for 16-bit leaves
    assert float(np.std(np.asarray(out["a"]))) == pytest.approx(3.0, rel=0.03)
    assert float(np.std(np.asarray(out["b"]))) == pytest.approx(3.0, rel=0.05)


# ---------------------------------------------------------------------------
# PLD default, the accountant object, quiet dp-accounting
# ---------------------------------------------------------------------------


def test_calibrate_defaults_to_pld():
    q, steps, delta = 0.05, 200, 1e-5
    z = accounting.calibrate_noise_multiplier(2.0, q, steps, delta)
    assert z == accounting.calibrate_noise_multiplier(2.0, q, steps, delta, accountant="pld")
    eps = accounting.epsilon(z, q, steps, delta, accountant="pld")
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-2)
    # PLD is tighter, so it needs less noise than RDP for the same target
    assert z < accounting.calibrate_noise_multiplier(2.0, q, steps, delta, accountant="rdp")


def test_calibrate_unreachable_target_names_it():
    with pytest.raises(ValueError, match=r"target_epsilon.*unreachable"):
        accounting.calibrate_noise_multiplier(1e-4, 0.5, 1000, 1e-5)


def _direct_accountant(kind, phases):
    """dp-accounting's accountant, from scratch (PLD: on the grid of the smallest z and all the steps)."""
    acc = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=_grid(phases))
        if kind == "pld"
        else dp_accounting.rdp.RdpAccountant()
    )
    for z, q, t in phases:
        acc.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t
            )
        )
    return acc


def _direct(kind, phases, delta):
    return _direct_accountant(kind, phases).get_epsilon(delta)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_accountant_equals_dp_accounting(kind):
    phases = [(1.1, 0.02, 160), (0.9, 0.05, 60), (1.1, 0.02, 40)]
    acc = PrivacyAccountant(kind)
    for z, q, t in phases:
        for _ in range(t // 20):
            acc.step(z, q, steps=20)  # recorded in pieces: merged into phases
    assert acc.steps == 260 and len(acc.phases) == 3
    for delta in (1e-5, 1e-3):
        assert acc.epsilon(delta) == pytest.approx(_direct(kind, phases, delta), rel=1e-6)
    # any time: after the first phase it equals the one-phase formula
    first = PrivacyAccountant(kind)
    first.step(1.1, 0.02, 160)
    assert first.epsilon(1e-5) == pytest.approx(
        accounting.epsilon(1.1, 0.02, 160, 1e-5, accountant=kind), rel=1e-9
    )
    assert first.epsilon(1e-5) < acc.epsilon(1e-5)
    # delta(epsilon) is the inverse
    assert first.delta(first.epsilon(1e-5)) == pytest.approx(1e-5, rel=0.05)


def test_accountant_pld_is_the_default_and_tighter():
    pld, rdp = PrivacyAccountant(), PrivacyAccountant("rdp")
    for acc in (pld, rdp):
        acc.step(1.1, 256 / 60000, 14062)
    assert pld.accountant == "pld"
    assert pld.epsilon(1e-5) == pytest.approx(2.38, abs=0.01)  # the MNIST numbers
    assert rdp.epsilon(1e-5) == pytest.approx(2.60, abs=0.01)


def test_pld_takes_the_rdp_bound_where_its_long_run_grid_is_looser():
    """2e6 steps: the PLD grid, coarsened to stay bounded, rounds every step up (dp-accounting's
    PLD on that grid gives 5.17 against RDP's 4.81; at 1e7 steps and z=2, 14.96 against 9.54).
    Both bound the same run, so the 'pld' accountant reports the smaller, for epsilon and delta."""
    z, q, steps, delta = 1.0, 0.0005, 2_000_000, 1e-6
    pld, rdp = PrivacyAccountant(), PrivacyAccountant("rdp")
    for acc in (pld, rdp):
        acc.step(z, q, steps)
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=_grid([(z, q, steps)]))
    direct.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps
        )
    )
    eps = rdp.epsilon(delta)
    assert direct.get_epsilon(delta) > eps * 1.01
    assert pld.epsilon(delta) == eps
    assert pld.delta(eps) == rdp.delta(eps) < direct.get_delta(eps)
    # where the PLD is tighter (a short run) it stands
    short = PrivacyAccountant()
    short.step(z, q, 10_000)
    assert short.epsilon(delta) < accounting.epsilon(z, q, 10_000, delta, accountant="rdp")


def test_long_runs_compose_as_dp_accounting_without_its_size_power(monkeypatch):
    """dp-accounting's sparse PMF decides whether T compositions go dense by computing
    size ** T exactly: a Python integer of millions of digits (an epsilon at 10 million steps
    took 28-45 s, at 1 million 1.3-1.8 s; 0.02-0.04 s now). The accountant converts first,
    so the PMF it composes is the one dp-accounting would have built."""
    z, q, delta = 2.0, 0.001, 1e-6
    sparse = dp_accounting.pld.pld_pmf.SparsePLDPmf
    composed, original = [], sparse.self_compose

    def spy(self, num_times, *args, **kwargs):
        composed.append((self.size, num_times))
        return original(self, num_times, *args, **kwargs)

    monkeypatch.setattr(sparse, "self_compose", spy)
    for steps in (200_000, 10_000_000):
        acc = PrivacyAccountant()
        acc.step(z, q, steps)
        eps = acc.epsilon(delta)
        assert math.isfinite(eps)
    assert all(size < 2 or times <= 10 for size, times in composed), composed
    # to the bit dp-accounting's own self_compose of the same step (PLD < RDP here)
    monkeypatch.undo()
    step = _step_pld_uncached(
        sampled_gaussian_event(z, q), "add_or_remove", _grid([(z, q, 200_000)])
    )
    acc = PrivacyAccountant()
    acc.step(z, q, 200_000)
    assert acc.epsilon(delta) == step.self_compose(200_000).get_epsilon_for_delta(delta)


def test_accountant_edge_cases_and_checkpoint():
    acc = PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0 and acc.steps == 0
    acc.step(1.0, 0.1, 0)
    assert acc.phases == ()
    acc.step(1.0, 0.1, 5)
    acc.step(0.0, 0.1)
    assert acc.epsilon(1e-5) == math.inf
    back = PrivacyAccountant.from_state_dict(acc.state_dict())
    assert back.phases == acc.phases and back.accountant == acc.accountant
    with pytest.raises(ValueError, match="accountant"):
        PrivacyAccountant("moments")
    with pytest.raises(ValueError, match="sample_rate"):
        acc.step(1.0, 0.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.step(-1.0, 0.1)
    with pytest.raises(ValueError, match="delta"):
        acc.epsilon(0.0)
    with pytest.raises(ValueError, match=r"truncated_batch_size.*pld"):
        PrivacyAccountant("rdp").step(1.0, 0.1, truncated_batch_size=20, dataset_size=100)


def test_accountant_truncated_poisson_equals_dp_accounting():
    acc = PrivacyAccountant()
    acc.step(1.0, 0.1, 10, truncated_batch_size=15, dataset_size=100)
    direct = dp_accounting.pld.PLDAccountant()
    direct.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.TruncatedSubsampledGaussianDpEvent(100, 0.1, 15, 1.0), 10
        )
    )
    assert acc.epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-6)
    plain = PrivacyAccountant()
    plain.step(1.0, 0.1, 10)
    assert acc.epsilon(1e-5) != plain.epsilon(1e-5)


def test_dp_accounting_convergence_warnings_do_not_reach_the_user(capfd, caplog):
    # dp-accounting itself prints them for this setting ...
    _direct("rdp", [(0.5, 0.5, 100)], 1e-5)
    out, err = capfd.readouterr()
    assert "failed to converge" in out + err + caplog.text
    caplog.clear()
    # ... ours do not, through any entry point
    acc = PrivacyAccountant("rdp")
    acc.step(0.5, 0.5, 100)
    acc.epsilon(1e-5)
    accounting.epsilon(0.5, 0.5, 100, 1e-5, accountant="rdp")
    accounting.calibrate_noise_multiplier(50.0, 0.5, 100, 1e-5, accountant="rdp")
    out, err = capfd.readouterr()
    assert "failed to converge" not in out + err + caplog.text
    # and the filter is removed afterwards (dp-accounting's own calls are untouched)
    _direct("rdp", [(0.5, 0.5, 100)], 1e-5)
    out, err = capfd.readouterr()
    assert "failed to converge" in out + err + caplog.text


def test_load_state_dict_restores_in_place_and_checks_the_kind():
    acc = PrivacyAccountant()
    acc.step(1.0, 0.1, 5)
    acc.step(2.0, 0.1, 3, truncated_batch_size=20, dataset_size=100)
    other = PrivacyAccountant()
    other.step(5.0, 0.5, 1)
    other.load_state_dict(acc.state_dict())
    assert other.phases == acc.phases and other.epsilon(1e-5) == acc.epsilon(1e-5)
    with pytest.raises(
        ValueError, match=r"`state` was saved by a 'pld' accountant, this one is 'rdp'"
    ):
        PrivacyAccountant("rdp").load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match=r"`state` must be a dict"):
        other.load_state_dict([1, 2])


@pytest.mark.parametrize("target", [0.1, 10.0, 1e3, 1e6])
def test_calibration_at_any_target_meets_it_and_the_accountant_agrees(target):
    """make_private's setting of issue 31 (n=1500, batch 64, 100 steps), where a target of 1e6 ran
    out of memory and 1e3 took minutes: the PLD noise multiplier meets the target, the accountant
    of the run reports that same epsilon, and RDP's answer is of the same order of magnitude."""
    q, steps, delta = 64 / 1500, 100, 1e-5
    z = accounting.calibrate_noise_multiplier(target, q, steps, delta)
    planned = accounting.epsilon(z, q, steps, delta)
    assert planned <= target and planned >= 0.9 * target
    acc = PrivacyAccountant()
    for _ in range(steps):
        acc.step(z, q)
    assert acc.epsilon(delta) == planned  # the same grid rule: a consistent epsilon
    z_rdp = accounting.calibrate_noise_multiplier(target, q, steps, delta, accountant="rdp")
    assert accounting.epsilon(z_rdp, q, steps, delta, accountant="rdp") <= target
    assert z <= z_rdp < 10 * z


def test_pld_grid_follows_the_smallest_noise():
    assert pld_interval(5.0) == pld_interval(1.0) == 1e-4
    assert pld_interval(0.01) == pytest.approx(1.0)
    acc = PrivacyAccountant()
    acc.step(2.0, 0.01, 10)
    acc.step(0.5, 0.01, 10)  # the grid of z=0.5 for the whole record
    direct = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=_grid([(2.0, 0.01, 10), (0.5, 0.01, 10)])
    )
    direct.compose(acc.dp_event())
    assert acc.epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-8)


@pytest.mark.parametrize("kind", ["pld", "rdp"])
def test_accountant_epsilon_reuses_its_composition_and_equals_a_fresh_one(kind, monkeypatch):
    """epsilon() after new steps extends the kept composition (the step's PLD built once), and
    answers what dp-accounting computes from scratch, at every step count and after a resume."""
    from dp_accounting.pld import privacy_loss_distribution

    from gradclip_jax.dp.accounting import _composition

    _composition._step_pld_cached.cache_clear()
    _composition._step_rdp_cached.cache_clear()
    built = []  # each step's PLD, or RDP vector, that is built
    module, name = (
        (privacy_loss_distribution, "from_gaussian_mechanism")
        if kind == "pld"
        else (dp_accounting.rdp.rdp_privacy_accountant, "_compute_rdp_poisson_subsampled_gaussian")
    )
    make = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: built.append(1) or make(*a, **k))
    z, q, delta = 2.0, 0.05, 1e-5
    acc = PrivacyAccountant(kind)
    done, counts = (
        0,
        (1, 2, 3, 10, 17, 40, 41, 120),
    )  # extensions by 1, 7, ...; 120 is on a coarser grid
    answers = []
    for t in counts:
        acc.step(z, q, steps=t - done)
        done = t
        answers.append(acc.epsilon(delta))
    grids = {_grid([(z, q, t)]) for t in counts} if kind == "pld" else {None}
    assert len(built) == len(grids) < 4  # a step's PLD per grid (RDP: one), not one per call
    for t, eps in zip(counts, answers, strict=True):
        fresh = (
            _direct(kind, [(z, q, t)], delta)
            if t == 41
            else accounting.epsilon(z, q, t, delta, kind)
        )
        assert eps == pytest.approx(fresh, rel=1e-8)
    resumed = PrivacyAccountant.from_state_dict(acc.state_dict())
    assert resumed.epsilon(delta) == pytest.approx(acc.epsilon(delta), rel=1e-8)
    resumed.step(z, q, steps=5)
    assert resumed.epsilon(delta) == pytest.approx(_direct(kind, [(z, q, 125)], delta), rel=1e-8)
    assert resumed.delta(2.0) == pytest.approx(_direct_delta(kind, [(z, q, 125)], 2.0), rel=1e-6)


def _direct_delta(kind, phases, epsilon):
    return _direct_accountant(kind, phases).get_delta(epsilon)


@pytest.mark.parametrize(
    ("kind", "target"), [("rdp", 0.1), ("rdp", 8.0), ("rdp", 1e6), ("pld", 1.0)]
)
def test_calibration_takes_few_evaluations_and_lands_near_the_target(kind, target, monkeypatch):
    """A bracket from secant steps on log z, then Brent's method: a handful of accountant
    evaluations at any target, and the epsilon planned within the tolerance below the target."""
    from gradclip_jax.dp.accounting import _composition

    calls = []
    epsilon = _composition.Composition.epsilon
    monkeypatch.setattr(
        _composition.Composition, "epsilon", lambda self, *a: calls.append(1) or epsilon(self, *a)
    )
    q, steps, delta = 64 / 1500, 100, 1e-5
    z = accounting.calibrate_noise_multiplier(target, q, steps, delta, accountant=kind)
    assert len(calls) <= 10
    planned = accounting.epsilon(z, q, steps, delta, accountant=kind)
    assert (1 - 1e-3) * target <= planned <= target


@pytest.mark.parametrize(
    "target,q,steps,delta,acc",
    [(1.0, 1.0, 1, 0.5, "pld"), (3.0, 0.9, 50, 0.9, "pld"), (3.0, 0.9, 50, 0.9, "rdp")],
)
def test_calibration_at_a_large_delta_meets_the_target(target, q, steps, delta, acc):
    """At a large delta some noise multipliers spend epsilon 0: the search reads that as far
    below the target (it took log(0): a math domain error)."""
    z = accounting.calibrate_noise_multiplier(target, q, steps, delta, acc)
    assert z > 0.0 and accounting.epsilon(z, q, steps, delta, accountant=acc) <= target
