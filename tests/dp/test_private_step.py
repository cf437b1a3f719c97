"""Tests for gradclip_jax.dp.private_step (make_private) and the MultiSteps guard of dp_noise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gradclip_jax as gcx
from gradclip_jax import make_private
from gradclip_jax.demo import accuracy, init_mlp, load_digits_split, per_example_loss
from gradclip_jax.dp import accounting
from gradclip_jax.dp.noise import add_gaussian_noise
from tests._backend import assert_equal_on_cpu
from tests.dp import setup_two_process as dp_setup

pytest.importorskip("dp_accounting")


def _lin_loss(w, batch):
    return 0.5 * (batch["x"] @ w - batch["y"]) ** 2


def _lin_data(n=400, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)}


def _priv(**kw):
    args = dict(
        dataset_size=400,
        expected_batch_size=40,
        steps=30,
        target_epsilon=3.0,
        delta=1e-4,
        l2_clip_norm=1.0,
        seed=0,
        process_index=0,
        process_count=1,
        accountant="rdp",
    )
    args.update(kw)
    return make_private(_lin_loss, optax.sgd(0.1), **args)


def test_reaches_target_epsilon_and_accounts_the_run():
    priv = make_private(
        _lin_loss,
        optax.sgd(0.1),
        dataset_size=400,
        expected_batch_size=40,
        epochs=3,
        target_epsilon=2.0,
        delta=1e-4,
        l2_clip_norm=1.0,
        process_index=0,
        process_count=1,
    )
    assert priv.steps == 30 and priv.sample_rate == 0.1 and priv.expected_batch_size == 40
    assert priv.planned_epsilon <= 2.0 and priv.planned_epsilon == pytest.approx(2.0, rel=0.01)
    assert priv.planned_epsilon == pytest.approx(
        accounting.epsilon(priv.noise_multiplier, 0.1, 30, 1e-4), rel=1e-9
    )
    assert priv.epsilon() == 0.0
    for i, _ in enumerate(priv.batches()):
        assert priv.accountant.steps == i + 1  # recorded before the batch is used
    assert priv.epsilon() == pytest.approx(priv.planned_epsilon, rel=1e-9)


def test_step_is_dp_sgd_with_expected_batch_divisor():
    priv = _priv()
    d = _lin_data()
    batch, mask = next(priv.batches(d))
    w = jnp.array([0.3, -0.1, 0.2, 0.0])
    key = jax.random.key(3)
    new_w, _, metrics = jax.jit(priv.step)(w, priv.init(w), batch, mask, key)
    # by hand: clip each real example, sum, add z*C*N(0,1) drawn by add_gaussian_noise, / (q n), sgd
    g = jax.vmap(
        jax.grad(lambda w, x, y: _lin_loss(w, {"x": x[None], "y": y[None]})[0]),
        in_axes=(None, 0, 0),
    )(w, batch["x"], batch["y"])
    norms = jnp.linalg.norm(g, axis=1)
    clipped = g * jnp.minimum(1.0, 1.0 / norms)[:, None]
    summed = jnp.sum(jnp.where(jnp.asarray(mask)[:, None], clipped, 0.0), 0)
    noised = add_gaussian_noise(summed, priv.noise_multiplier * 1.0, key)
    np.testing.assert_allclose(
        np.asarray(new_w), np.asarray(w - 0.1 * noised / 40.0), rtol=1e-5, atol=1e-6
    )
    assert int(metrics.num_clipped) == int(jnp.sum((norms > 1.0) & jnp.asarray(mask)))


def test_padded_rows_contribute_nothing_and_neighbours_differ_by_sensitivity():
    priv = _priv()
    d = _lin_data()
    params = jnp.array([0.5, 0.5, -0.5, 0.0])
    fn = jax.jit(priv.clipped_sum)
    for batch, mask in list(priv.batches(d))[:5]:
        s, _ = fn(params, batch, mask)
        # garbage (huge, NaN) in the padding rows changes nothing
        bad = {
            k: np.where(mask.reshape(-1, *[1] * (v.ndim - 1)), v, np.float32(1e30))
            for k, v in batch.items()
        }
        bad["y"] = np.where(mask, bad["y"], np.nan).astype(np.float32)
        s_bad, _ = fn(params, bad, mask)
        # bit for bit on a CPU; to float32 rounding on a GPU, whose reductions need not add in
        # one order from run to run (H200, jax 0.11.2: 2.6e-7 relative)
        assert_equal_on_cpu(
            np.asarray(s), np.asarray(s_bad), rtol=1e-6, atol=1e-6 * float(jnp.abs(s).max())
        )
        # the neighbour without one example of the batch (its row turned into padding)
        for i in np.flatnonzero(mask)[:3]:
            m2 = mask.copy()
            m2[i] = False
            s2, _ = fn(params, batch, m2)
            rounding = (
                4e-7 * float(jnp.linalg.norm(s)) * len(mask) ** 0.5
            )  # float32 sums of ~40 rows
            assert float(jnp.linalg.norm(s - s2)) <= priv.grad_fn.sensitivity() + rounding


def test_one_compilation_for_the_whole_run():
    traces = []

    def loss(w, batch):
        traces.append(1)
        return _lin_loss(w, batch)

    priv = make_private(
        loss,
        optax.adam(0.05),
        dataset_size=400,
        expected_batch_size=40,
        steps=40,
        target_epsilon=3.0,
        delta=1e-4,
        l2_clip_norm=1.0,
        process_index=0,
        process_count=1,
        accountant="rdp",
    )
    step = jax.jit(priv.step)
    w = jnp.zeros(4)
    state = priv.init(w)
    key = jax.random.key(0)
    sizes = set()
    for i, (batch, mask) in enumerate(priv.batches(_lin_data())):
        sizes.add(int(mask.sum()))
        key, sub = jax.random.split(key)
        w, state, _ = step(w, state, batch, mask, sub)
        if i == 0:
            after_first = len(traces)
    assert len(sizes) > 5  # the batch size did vary ...
    assert len(traces) == after_first > 0  # ... and nothing was traced again
    assert step._cache_size() == 1


def test_physical_batches_and_host_accumulation_noise_once():
    d = _lin_data()
    full, chunked = _priv(), _priv(physical_batch_size=7)
    w = jnp.array([0.3, -0.1, 0.2, 0.0])
    batch, mask = next(full.batches(d))
    key = jax.random.key(5)
    a = jax.jit(full.step)(w, full.init(w), batch, mask, key)[0]
    b = jax.jit(chunked.step)(w, chunked.init(w), batch, mask, key)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # host-side accumulation: clipped sums of 3 pieces, noise once
    cuts = np.array_split(np.arange(len(mask)), 3)
    total = sum(full.clipped_sum(w, {k: v[c] for k, v in batch.items()}, mask[c])[0] for c in cuts)
    c = full.noisy_update(w, full.init(w), total, key)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)


def test_dp_noise_refuses_multisteps():
    params = {"w": jnp.zeros(3)}
    tx = optax.MultiSteps(optax.chain(gcx.dp_noise(1.0, 0, normalize_by=32), optax.sgd(0.1)), 4)
    state = tx.init(params)
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError, match=r"MultiSteps.*noise once per logical step"):
            update(params, state, params)
    # outside MultiSteps it works, eagerly and under jit
    ok = optax.chain(gcx.dp_noise(1.0, 0, normalize_by=32), optax.sgd(0.1))
    jax.jit(ok.update)(params, ok.init(params), params)


def test_noise_std_is_z_c_over_expected_batch():
    priv = _priv(l2_clip_norm=2.0)
    w = jnp.zeros(20000)
    new_w, _, _ = priv.noisy_update(w, priv.init(w), jnp.zeros(20000), jax.random.key(1))
    std = float(jnp.std(new_w)) / 0.1  # sgd(0.1)
    assert std == pytest.approx(priv.noise_multiplier * 2.0 / 40, rel=0.03)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="sample_rate"):
        _priv(expected_batch_size=None, sample_rate=1.5)
    with pytest.raises(ValueError, match="expected_batch_size"):
        _priv(expected_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        _priv(max_batch_size=30)
    with pytest.raises(ValueError, match=r"target_epsilon.*unreachable"):
        _priv(target_epsilon=1e-4)
    with pytest.raises(ValueError, match=r"steps.*epochs"):
        _priv(epochs=2)
    with pytest.raises(ValueError, match="l2_clip_norm"):
        _priv(l2_clip_norm=0.0)
    with pytest.raises(ValueError, match=r"truncate.*accountant"):
        _priv(on_overflow="truncate", accountant="rdp")
    with pytest.warns(UserWarning, match="delta"):
        _priv(delta=1 / 300)
    priv = _priv()
    batch, mask = next(priv.batches(_lin_data()))
    w = jnp.zeros(4)
    with pytest.raises(ValueError, match=r"mask.*shape"):
        priv.step(w, priv.init(w), batch, mask[:-1], jax.random.key(0))
    with pytest.raises(TypeError, match=r"mask.*bool"):
        priv.step(w, priv.init(w), batch, mask.astype(np.float32), jax.random.key(0))


def test_both_spellings_of_the_clip_norm_are_accepted_without_a_warning():
    # optax's spelling as well as the canonical one (jax-privacy's): no warning, the same run
    args = dict(
        dataset_size=400,
        expected_batch_size=40,
        steps=30,
        target_epsilon=3.0,
        delta=1e-4,
        seed=0,
        process_index=0,
        process_count=1,
        accountant="rdp",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        priv = make_private(_lin_loss, optax.sgd(0.1), l2_norm_clip=1.0, **args)
    ref = _priv()
    assert priv.noise_multiplier == ref.noise_multiplier and priv.l2_clip_norm == 1.0
    batch, mask = next(ref.batches(_lin_data()))
    w = jnp.array([0.3, -0.1, 0.2, 0.0])
    got = priv.step(w, priv.init(w), batch, mask, jax.random.key(1))[0]
    want = ref.step(w, ref.init(w), batch, mask, jax.random.key(1))[0]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(
        TypeError, match=r"make_private: got both `l2_clip_norm` and `l2_norm_clip`"
    ):
        make_private(_lin_loss, optax.sgd(0.1), l2_norm_clip=1.0, l2_clip_norm=1.0, **args)
    with pytest.raises(TypeError, match=r"make_private: missing.*l2_clip_norm"):
        make_private(_lin_loss, optax.sgd(0.1), **args)


def test_digits_mlp_reaches_90_percent_at_epsilon_3():
    x_tr, y_tr, x_te, y_te = load_digits_split(0)
    priv = make_private(
        per_example_loss,
        optax.adam(1e-2),
        dataset_size=len(x_tr),
        expected_batch_size=128,
        steps=300,
        target_epsilon=3.0,
        delta=1e-5,
        l2_clip_norm=1.0,
        seed=0,
        process_index=0,
        process_count=1,
    )
    assert priv.planned_epsilon == pytest.approx(3.0, rel=0.01)
    params = init_mlp(jax.random.key(0))
    state = priv.init(params)
    step = jax.jit(priv.step)
    key = jax.random.key(1)
    for batch, mask in priv.batches({"x": x_tr, "y": y_tr}):
        key, sub = jax.random.split(key)
        params, state, _ = step(params, state, batch, mask, sub)
    assert priv.epsilon() == pytest.approx(priv.planned_epsilon, rel=1e-9) and priv.epsilon() <= 3.0
    assert accuracy(params, x_te, y_te) >= 0.90


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_eight_devices_equal_one_device():
    priv = dp_setup.build()
    d = dp_setup.data()
    ref = dp_setup.run_steps(priv, d, lambda b, m: (b, m), dp_setup.STEPS)
    mesh = jax.make_mesh((8,), ("x",))
    rows, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    priv8 = dp_setup.build()
    with jax.set_mesh(mesh):
        out = dp_setup.run_steps(
            priv8,
            d,
            lambda b, m: (jax.device_put(b, rows), jax.device_put(m, rows)),
            dp_setup.STEPS,
            rep,
        )
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert a.sharding.is_fully_replicated
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        for s in shards[1:]:  # the same noise on every device
            np.testing.assert_array_equal(s, shards[0])
        np.testing.assert_allclose(shards[0], np.asarray(b), rtol=1e-5, atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    worker = Path(__file__).with_name("two_process_worker.py")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    outs = [tmp_path / f"p{i}.npz" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), "2", str(port), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    ref = dp_setup.run_steps(dp_setup.build(), dp_setup.data(), lambda b, m: (b, m), dp_setup.STEPS)
    got = [np.load(o) for o in outs]
    for i, layer in enumerate(ref):
        for k, v in layer.items():
            np.testing.assert_array_equal(
                got[0][f"{i}_{k}"], got[1][f"{i}_{k}"]
            )  # same noise everywhere
            np.testing.assert_allclose(got[0][f"{i}_{k}"], np.asarray(v), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(ref[0]["w"]), np.asarray(init_mlp(jax.random.key(0))[0]["w"]))


def test_the_plan_is_a_limit():
    """Iterating the batches again continues the run and ends with the plan; a step recorded
    beyond it is an error, or, opted in, a warning stating the epsilon spent."""
    priv = _priv(steps=5)
    d = _lin_data()
    first = [m.copy() for _, m in priv.batches(d)]
    assert len(first) == 5 and priv.accountant.steps == 5
    assert list(priv.batches(d)) == []  # the plan is spent: nothing more, nothing recorded
    assert priv.accountant.steps == 5 and priv.epsilon() <= priv.target_epsilon
    with pytest.raises(
        gcx.PrivacyBudgetError, match=r"beyond the planned 5 steps.*allow_beyond_plan=True"
    ):
        priv.record_step()
    assert priv.accountant.steps == 5
    over = _priv(steps=5, allow_beyond_plan=True)
    for _ in over.batches():
        pass
    with pytest.warns(
        gcx.PrivacyBudgetWarning, match=r"6 steps recorded, beyond the planned 5: epsilon spent"
    ):
        over.record_step()
    assert over.epsilon() > over.planned_epsilon and over.accountant.steps == 6


def test_batches_resume_where_the_accountant_stands():
    """Two iterations stopped early and resumed give the batches of one uninterrupted iteration."""
    whole = [(b["x"].copy(), m.copy()) for b, m in _priv(steps=6).batches(_lin_data())]
    priv = _priv(steps=6)
    parts = []
    for i, (b, m) in enumerate(priv.batches(_lin_data())):
        parts.append((b["x"].copy(), m.copy()))
        if i == 1:
            break
    parts += [(b["x"].copy(), m.copy()) for b, m in priv.batches(_lin_data())]
    assert len(parts) == len(whole) == 6
    for (xa, ma), (xb, mb) in zip(parts, whole):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ma, mb)


@pytest.mark.parametrize("rows", [300, 600])
def test_data_rows_must_match_dataset_size(rows):
    priv = _priv()
    data = {"x": np.zeros((rows, 4), np.float32), "y": np.zeros(400, np.float32)}
    with pytest.raises(
        ValueError, match=rf"`dataset_size`=400, but leaf \['x'\] of `data` has {rows} rows"
    ):
        next(priv.batches(data))
    assert priv.accountant.steps == 0  # nothing recorded


def test_method_is_checked_before_calibration():
    with pytest.raises(
        ValueError, match=r"`method` must be one of \('vmap', 'ghost', 'auto'\), got 'foo'"
    ):
        _priv(method="foo")


def _train(priv, params, opt_state, data, key, stop_after=None):
    """The loop of a run, with the noise key of step t fixed: fold_in(key, t)."""
    step = jax.jit(priv.step)
    for batch, mask in priv.batches(data):
        t = priv.accountant.steps - 1
        params, opt_state, _ = step(params, opt_state, batch, mask, jax.random.fold_in(key, t))
        if stop_after is not None and priv.accountant.steps == stop_after:
            break
    return params, opt_state


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_stopped_and_resumed_run_equals_the_uninterrupted_run(tmp_path, accountant):
    """A run stopped after 3 of 7 steps, checkpointed with orbax (params, opt_state and
    priv.state_dict()), restored into a fresh make_private(resume_from=...) and finished, has the
    batches, the epsilon and (on the CPU) the parameters of the run that never stopped, bit for bit."""
    ocp = pytest.importorskip("orbax.checkpoint")
    kw = dict(steps=7, accountant=accountant)
    d, key, w0 = _lin_data(), jax.random.key(3), jnp.zeros(4)
    whole = _priv(**kw)
    w_whole, _ = _train(whole, w0, whole.init(w0), d, key)

    first = _priv(**kw)
    w, s = _train(first, w0, first.init(w0), d, key, stop_after=3)
    assert first.accountant.steps == 3
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": w, "opt_state": s}),
                priv=ocp.args.JsonSave(first.state_dict()),
            ),
        )
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        like = {"params": w0, "opt_state": first.init(w0)}
        back = mngr.restore(
            mngr.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(like), priv=ocp.args.JsonRestore()
            ),
        )
    assert back.priv == first.state_dict()  # JSON round-trips the floats exactly

    resumed = _priv(**kw, resume_from=back.priv)
    assert resumed.accountant.steps == 3 and resumed.accountant.phases == first.accountant.phases
    steps = [b.step for b in _priv(**kw, resume_from=back.priv).batches()]
    assert steps == [3, 4, 5, 6]
    w_res, _ = _train(resumed, back.state["params"], back.state["opt_state"], d, key)
    np.testing.assert_array_equal(np.asarray(w_res), np.asarray(w_whole))
    assert resumed.epsilon() == whole.epsilon() and resumed.accountant.steps == 7


def test_state_dict_is_plain_and_pickles():
    import json
    import pickle

    priv = _priv(steps=4)
    for _ in priv.batches():
        break
    state = priv.state_dict()
    assert pickle.loads(pickle.dumps(state)) == state
    assert json.loads(json.dumps(state)) == state
    assert state["sampler"] == {"seed": 0, "steps_taken": 1}
    assert state["plan"]["noise_multiplier"] == priv.noise_multiplier
    assert state["plan"]["steps"] == 4 and state["plan"]["accountant"] == "rdp"
    assert state["accountant"]["phases"] == [[priv.noise_multiplier, 0.1, 1, None, None]]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(steps=5), "steps"),
        (dict(target_epsilon=4.0), "target_epsilon"),
        (dict(seed=1), "seed"),
        (dict(l2_clip_norm=2.0), "l2_clip_norm"),
        (dict(expected_batch_size=20), "sample_rate"),
        (dict(accountant="pld"), "accountant"),
        (dict(delta=1e-5), "delta"),
    ],
)
def test_resume_from_another_plan_names_the_field(change, field):
    state = _priv(steps=4).state_dict()
    with pytest.raises(ValueError, match=rf"`resume_from` was saved by another plan: {field}="):
        _priv(**{"steps": 4, **change}, resume_from=state)


def test_resume_compares_64_bit_seeds_exactly():
    """Compared as floats, seeds 2**60 and 2**60 + 1 were the same plan: the resumed run drew
    other batches than the interrupted one would have."""
    state = _priv(steps=4, seed=2**60).state_dict()
    with pytest.raises(ValueError, match="another plan: seed="):
        _priv(steps=4, seed=2**60 + 1, resume_from=state)
    _priv(steps=4, seed=2**60, resume_from=state)


def test_resume_from_a_changed_calibration_or_a_bad_state_is_an_error():
    state = _priv(steps=4).state_dict()
    state["plan"]["noise_multiplier"] *= (
        0.9  # less noise than calibrated: spends more than the target
    )
    with pytest.warns(
        UserWarning, match=r"`resume_from`'s noise_multiplier=.* above `target_epsilon`=3"
    ):
        resumed = _priv(steps=4, resume_from=state)
    assert (
        resumed.noise_multiplier == state["plan"]["noise_multiplier"]
        and resumed.planned_epsilon > 3.0
    )
    state["plan"]["noise_multiplier"] = -1.0
    with pytest.raises(ValueError, match=r"no positive plan field 'noise_multiplier'"):
        _priv(steps=4, resume_from=state)
    with pytest.raises(
        ValueError, match=r"`resume_from` must be a dict from PrivateTraining.state_dict"
    ):
        _priv(steps=4, resume_from={"plan": {}})
    good = _priv(steps=4).state_dict()
    good["sampler"]["steps_taken"] = 2
    with pytest.raises(ValueError, match=r"`resume_from` is inconsistent"):
        _priv(steps=4, resume_from=good)


def test_progress_bar_shows_the_live_epsilon(capsys):
    pytest.importorskip("tqdm")
    priv = _priv(steps=4)
    for _ in priv.batches(progress=True):
        pass
    err = capsys.readouterr().err
    assert "4/4" in err and f"epsilon {priv.epsilon():.3g} of 3" in err
    resumed = _priv(steps=4)
    for _ in resumed.batches():
        break
    for _ in resumed.batches(progress=True):  # starts where the accountant stands
        pass
    assert "1/4" in capsys.readouterr().err


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_resume_reuses_the_calibration(monkeypatch, accountant):
    """make_private(resume_from=...) takes the saved noise multiplier: no search runs, and the run,
    its planned epsilon and the epsilon spent are those of the calibrated run."""
    import gradclip_jax.dp.private_step._make_private as mp

    priv = _priv(steps=40, accountant=accountant)
    for _ in priv.batches():
        if priv.accountant.steps == 25:
            break
    state = priv.state_dict()

    def no_search(*args, **kwargs):
        raise AssertionError("calibration ran on resume")

    monkeypatch.setattr(mp, "calibrate", no_search)
    resumed = _priv(steps=40, accountant=accountant, resume_from=state)
    assert resumed.noise_multiplier == priv.noise_multiplier
    assert resumed.planned_epsilon == priv.planned_epsilon
    # the same 25 steps composed by another route (dp-accounting's FFTs) may differ in the last
    # bits (one failure at rel=1e-12 in many runs); another calibration would differ by far more
    assert resumed.epsilon() == pytest.approx(priv.epsilon(), rel=1e-9)
    with pytest.raises(AssertionError, match="calibration ran"):
        _priv(steps=40, accountant=accountant)  # a fresh run does search


def test_progress_bar_is_at_most_one_percent_of_the_plan_behind(monkeypatch):
    """The bar's epsilon is refreshed every 1% of the planned steps (the issue's bar showed
    step 177 of 200 with the epsilon of a much earlier step)."""
    pytest.importorskip("tqdm")
    priv = _priv(steps=300)
    epsilon, asked_at = priv.accountant.epsilon, []

    def spy(delta):
        asked_at.append(priv.accountant.steps)
        return epsilon(delta)

    monkeypatch.setattr(priv.accountant, "epsilon", spy)
    for _ in priv.batches(progress=True):
        # the bar's last epsilon is of a step at most 3 (1% of 300) before this one
        assert priv.accountant.steps - asked_at[-1] <= 3
    assert asked_at[0] == 0 and asked_at[-1] == 300
    assert len(asked_at) <= 102  # about once every 1%: not at every step


def test_progress_without_tqdm_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tqdm(name, *args, **kwargs):
        if name == "tqdm" or name.startswith("tqdm."):
            raise ImportError("No module named 'tqdm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tqdm)
    priv = _priv(steps=4)
    with pytest.raises(ImportError, match=r"`progress=True` needs tqdm: pip install tqdm"):
        next(priv.batches(progress=True))


def test_metrics_count_the_dropped_nonfinite_examples():
    """A NaN example is dropped from the clipped sum (parameters stay finite) and counted."""
    priv = _priv()
    batch, mask = next(priv.batches(_lin_data()))
    real = np.flatnonzero(mask)
    bad = {k: v.copy() for k, v in batch.items()}
    bad["x"][real[0]] = np.nan  # a NaN example
    bad["y"][real[1]] = np.inf  # an inf example
    bad["x"][np.flatnonzero(~mask)[:1]] = np.nan  # padding: neither used nor counted
    w = jnp.array([0.3, -0.1, 0.2, 0.0])
    step = jax.jit(priv.step)
    new_w, _, metrics = step(w, priv.init(w), bad, mask, jax.random.key(0))
    assert int(metrics.num_nonfinite) == 2
    assert np.isnan(float(metrics.loss))  # the loss shows it; the update does not
    assert np.all(np.isfinite(np.asarray(new_w)))
    # the update is the one without the two examples
    m2 = mask.copy()
    m2[real[:2]] = False
    ref_w, _, ref_metrics = step(w, priv.init(w), batch, m2, jax.random.key(0))
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(ref_w), rtol=1e-6, atol=1e-7)
    assert int(ref_metrics.num_nonfinite) == 0


def test_batches_give_each_step_its_noise_key_and_a_resume_draws_the_same():
    d, key = _lin_data(), jax.random.key(7)

    def run(priv, w, state, stop_after=None):
        step, keys = jax.jit(priv.step), []
        for batch, mask, k in priv.batches(d, noise_key=key):
            keys.append(jax.random.key_data(k))
            w, state, _ = step(w, state, batch, mask, k)
            if priv.accountant.steps == stop_after:
                break
        return w, state, keys

    w0 = jnp.array([0.3, -0.1, 0.2, 0.0])
    whole = _priv(steps=8)
    w_all, _, keys_all = run(whole, w0, whole.init(w0))
    # the old idiom's keys, fold_in(noise_key, accountant.steps - 1) inside the loop, are the same
    old = _priv(steps=8)
    old_keys = [
        jax.random.key_data(jax.random.fold_in(key, old.accountant.steps - 1))
        for _ in old.batches()
    ]
    for a, b in zip(old_keys, keys_all, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    first = _priv(steps=8)
    w_half, s_half, keys_a = run(first, w0, first.init(w0), stop_after=3)
    resumed = _priv(steps=8, resume_from=first.state_dict())
    w_end, _, keys_b = run(resumed, w_half, s_half)
    for a, b in zip(keys_a + keys_b, keys_all, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_equal_on_cpu(np.asarray(w_end), np.asarray(w_all), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(resumed.step_key(key))), np.asarray(keys_all[-1])
    )  # the last recorded step's
    with pytest.raises(ValueError, match="no step recorded"):
        _priv(steps=8).step_key(key)
    # without data: (sampled batch, key)
    b, k = next(_priv(steps=8).batches(noise_key=key))
    assert b.step == 0
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(k)), np.asarray(keys_all[0]))
