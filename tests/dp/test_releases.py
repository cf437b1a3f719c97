"""make_private's epsilon covers every noisy update that ran (gradclip_jax.dp.private_step._releases)."""

from __future__ import annotations

import json
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gradclip_jax import PrivacyBudgetError, PrivacyBudgetWarning, make_private

pytest.importorskip("dp_accounting")

N, B, STEPS = 200, 20, 6


def _loss(w, batch):
    return 0.5 * (batch["x"] @ w - batch["y"]) ** 2


def _data():
    x = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -1.0, 2.0], np.float32)}


def _priv(**kw):
    args = dict(
        dataset_size=N,
        expected_batch_size=B,
        steps=STEPS,
        target_epsilon=4.0,
        delta=1e-4,
        l2_clip_norm=1.0,
        seed=0,
        process_index=0,
        process_count=1,
    )
    return make_private(_loss, optax.sgd(0.1), **{**args, **kw})


def test_the_documented_loop_is_covered_and_its_epsilon_given():
    priv = _priv()
    step = jax.jit(priv.step)
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    for batch, mask, key in priv.batches(_data(), noise_key=jax.random.key(1)):
        w, opt, _ = step(w, opt, batch, mask, key)
    assert priv.releases is not None and priv.releases.counts() == (STEPS, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of batches without an update
        assert priv.epsilon() == pytest.approx(priv.planned_epsilon, rel=1e-9)
    assert priv.state_dict()["sampler"]["steps_taken"] == STEPS


def test_a_step_called_directly_runs_a_program_without_callback_and_counts_each_call():
    """``priv.step`` called outside a transformation is jitted by itself without the release
    log's host callback (which keeps a program out of JAX's persistent cache) and counts each
    call on the host: the same bits as the traced step, the same refusals, AOT included."""
    priv, data = _priv(), _data()
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    items = list(priv.batches(data, noise_key=jax.random.key(1)))
    args = (w, opt, *items[0])
    assert "callback" not in priv.step.lower(*args).as_text()
    assert "callback" in jax.jit(priv.step).lower(*args).as_text()
    direct, traced = priv.step(*args), jax.jit(priv.step)(*args)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(traced)):
        np.testing.assert_array_equal(a, b)
    assert priv.releases.counts() == (1, 1)  # the same key in both: a reuse
    priv = _priv()
    items = list(priv.batches(data, noise_key=jax.random.key(1)))
    compiled = priv.step.lower(*args).compile()
    for batch, mask, key in items[:3]:
        w, opt, _ = compiled(w, opt, batch, mask, key)
    for batch, mask, key in items[3:]:
        w, opt, _ = priv.step(w, opt, batch, mask, key=key)
    assert priv.releases.counts() == (STEPS, 0)
    assert priv.epsilon() == pytest.approx(priv.planned_epsilon, rel=1e-9)
    priv.step(w, opt, *items[0][:2], jax.random.key(99))  # a batch used again
    with pytest.raises(PrivacyBudgetError, match=rf"{STEPS + 1} noisy updates"):
        priv.epsilon()


def test_a_direct_call_counts_the_key_its_program_received():
    """The log reads a direct call's key bits from an output of the program, not from the
    caller's key: a key deleted (or donated) after the call, or a numpy buffer refilled with the
    next step's bits, is still counted as it was used; a uint64 key is the uint32 key JAX
    makes of it, as in the traced program."""
    priv, data = _priv(), _data()
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    items = list(priv.batches(data, noise_key=jax.random.key(1)))
    buffer = np.zeros(2, np.uint32)
    for i, (batch, mask, key) in enumerate(items):
        if i < 3:
            priv.step(w, opt, batch, mask, key)
            key.delete()
        else:
            buffer[:] = [0, i]  # raw keys (0, 3), (0, 4), (0, 5): distinct
            priv.step(w, opt, batch, mask, buffer)
    buffer[:] = 7
    assert priv.releases.counts() == (STEPS, 0)
    jax.jit(priv.noisy_update)(w, opt, jnp.ones(3), np.array([0, 3], np.uint32))
    assert priv.releases.counts() == (STEPS, 1)  # the traced program saw the same key
    if not jax.config.jax_enable_x64:
        priv.noisy_update(w, opt, jnp.ones(3), np.array([0, 4], np.uint64))
        assert priv.releases.counts() == (STEPS, 2)


def test_a_direct_call_under_disable_jit_is_counted_at_once():
    """Under ``jax.disable_jit`` the program's outputs can be the caller's own key: the update
    reports as it runs, so deleting the key afterwards leaves the run's checks working."""
    priv, data = _priv(), _data()
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    batch, mask, key = next(iter(priv.batches(data, noise_key=jax.random.key(1))))
    with jax.disable_jit():
        priv.step(w, opt, batch, mask, key)
    key.delete()
    assert priv.releases.counts() == (1, 0)
    assert len(priv.state_dict()["noise_keys"]) == 1


def test_a_compiled_update_cannot_leave_the_count():
    """A compiled direct update shows JAX's text and analyses, not its executable, and cannot be
    pickled: serialized and loaded again it would run updates the log never counts."""
    priv = _priv()
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    compiled = priv.noisy_update.lower(w, opt, jnp.ones(3), jax.random.key(0)).compile()
    assert compiled.memory_analysis() is not None and "HloModule" in compiled.as_text()
    with pytest.raises(AttributeError, match="not '_executable'"):
        assert compiled._executable is None  # (raises)
    with pytest.raises(TypeError, match="cannot be serialized"):
        pickle.dumps(compiled)
    pytest.importorskip("jax.experimental.serialize_executable")
    from jax.experimental import serialize_executable

    with pytest.raises(AttributeError):
        serialize_executable.serialize(compiled)


def test_an_update_on_constants_inside_a_jit_counts_each_run_of_the_program():
    """Inside the user's ``jax.jit`` with every argument a constant (no traced value among
    them), the call still runs as often as the program does: it reports from the program."""
    priv = _priv()
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    summed, key = jnp.ones(3), jax.random.key(3)
    program = jax.jit(lambda: priv.noisy_update(w, opt, summed, key)[0])
    program()
    program()
    assert priv.releases.counts() == (1, 1)


def test_batches_trained_over_twice_leave_no_epsilon():
    """A cached list of the run's batches used for two epochs releases each batch twice: the
    accountant's epsilon (one release each) is not the guarantee of what ran."""
    priv = _priv()
    step = jax.jit(priv.step)
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    cached = list(priv.batches(_data()))
    key = jax.random.key(0)
    for _ in range(2):
        for batch, mask in cached:
            key, sub = jax.random.split(key)
            w, opt, _ = step(w, opt, batch, mask, sub)
    match = rf"{2 * STEPS} noisy updates \(step or noisy_update\) ran, but the accountant recorded {STEPS} steps"
    with pytest.raises(PrivacyBudgetError, match=match):
        priv.epsilon()
    with pytest.raises(PrivacyBudgetError, match=match):
        priv.state_dict()


def test_batches_merged_into_one_update_are_warned_about():
    """Two logical batches' clipped sums added before one noisy_update: another mechanism (an
    example in both moves it by 2C) than the accounted one (an audit measured epsilon 4.71 where
    3.00 was reported). The log cannot tell merged batches from skipped ones (safe): a warning,
    once; the documented loop (one update per batch) gives none."""
    priv = _priv()
    update = jax.jit(priv.noisy_update)
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    drawn = iter(priv.batches(_data(), noise_key=jax.random.key(2)))
    for _ in range(STEPS // 2):
        (b1, m1, key), (b2, m2, _) = next(drawn), next(drawn)
        s1, _ = priv.clipped_sum(w, b1, m1)
        s2, _ = priv.clipped_sum(w, b2, m2)
        w, opt, _ = update(w, opt, jax.tree.map(jnp.add, s1, s2), key)
    with pytest.warns(PrivacyBudgetWarning, match=r"3 batches drawn .* have had no noisy update"):
        priv.epsilon()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        priv.epsilon()  # once


def test_a_key_used_before_a_resume_is_refused_after_it():
    """The log of used keys was not in state_dict(): a resumed loop whose key counter started
    again at 0 reused three keys and its epsilon() said nothing. The documented loop, whose
    keys come from batches(noise_key=...), resumes without a word."""
    data, base = _data(), jax.random.key(11)
    w = jnp.zeros(3)

    def run(priv, keys, stop=None):
        step, opt = jax.jit(priv.step), priv.init(w)
        for i, item in enumerate(priv.batches(data, **keys)):
            batch, mask, key = item if keys else (*item, jax.random.fold_in(base, i))
            step(w, opt, batch, mask, key)
            if priv.accountant.steps == stop:
                break
        return json.loads(json.dumps(priv.state_dict()))

    state = run(_priv(), {}, stop=3)
    assert len(state["noise_keys"]) == 3
    with pytest.raises(PrivacyBudgetError, match="noise key was used by more than one"):
        run(_priv(resume_from=state), {})
    documented = {"noise_key": jax.random.key(5)}
    state = run(_priv(), documented, stop=3)
    resumed = _priv(resume_from=state)
    assert len(run(resumed, documented)["noise_keys"]) == STEPS


def test_steps_run_without_drawing_batches_leave_no_epsilon():
    """``step`` on batches the run did not draw (nothing recorded): epsilon would read 0."""
    priv = _priv()
    data = _data()
    batch, mask = {k: v[:B] for k, v in data.items()}, np.ones(B, bool)
    update = jax.jit(priv.noisy_update)
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    summed, _ = priv.clipped_sum(w, batch, mask)
    update(w, opt, summed, jax.random.key(3))
    with pytest.raises(PrivacyBudgetError, match=r"1 noisy updates .* recorded 0 steps"):
        priv.epsilon()
    with pytest.raises(
        PrivacyBudgetError, match="recorded 0 steps"
    ):  # and the loop refuses to go on
        next(iter(priv.batches(data)))


def test_a_noise_key_used_twice_leaves_no_epsilon():
    """The same key on two steps adds the same noise to two sums: their difference is exact."""
    priv = _priv()
    step = jax.jit(priv.step)
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    key = jax.random.key(7)
    for batch, mask in priv.batches(_data()):
        w, opt, _ = step(w, opt, batch, mask, key)
        if priv.accountant.steps == 2:
            break
    with pytest.raises(
        PrivacyBudgetError, match="noise key was used by more than one noisy update"
    ):
        priv.epsilon()


def test_updates_in_a_scan_and_on_sharded_batches_count_once_each():
    """Several steps in one jitted ``lax.scan`` count one each; a batch sharded over devices
    (one program for the mesh) and a replicated key inside ``shard_map`` (one draw, the same on
    every device) count one update, not one per device; a per-device key counts one per device,
    as the replicas then differ."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    priv = _priv(max_batch_size=40)
    data = _data()
    w, opt = jnp.zeros(3), priv.init(jnp.zeros(3))
    items = list(priv.batches(data, noise_key=jax.random.key(2)))[:4]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *items[:2])

    def two(carry, item):
        batch, mask, key = item
        return priv.step(*carry, batch, mask, key)[:2], None

    w, opt = jax.jit(lambda c, xs: jax.lax.scan(two, c, xs)[0])((w, opt), stacked)
    assert priv.releases.counts() == (2, 0)

    mesh = jax.make_mesh((4,), ("b",))
    rows = NamedSharding(mesh, P("b"))
    batch, mask, key = items[2]
    w, opt, _ = jax.jit(priv.step)(
        w, opt, jax.device_put(batch, rows), jax.device_put(mask, rows), key
    )
    assert priv.releases.counts() == (3, 0)

    def local(w, opt, batch, mask, key, per_device):
        summed = jax.lax.psum(priv.clipped_sum(w, batch, mask)[0], "b")
        if per_device:
            key = jax.random.fold_in(key, jax.lax.axis_index("b"))
        return priv.noisy_update(w, opt, summed, key)[:2]

    def run(per_device, out):
        f = jax.shard_map(
            lambda *a: local(*a, per_device),
            mesh=mesh,
            in_specs=(P(), P(), P("b"), P("b"), P()),
            out_specs=out,
        )
        return jax.jit(f)(w, opt, jax.device_put(batch, rows), jax.device_put(mask, rows), key)

    batch, mask, key = items[3]
    run(False, (P(), P()))
    assert priv.releases.counts() == (4, 0)
    with pytest.warns(PrivacyBudgetWarning, match="2 batches drawn"):  # two drawn, not used
        assert priv.epsilon() > 0.0
    run(True, (P("b"), P("b")))
    assert priv.releases.counts() == (8, 0)
    with pytest.raises(PrivacyBudgetError, match="8 noisy updates"):
        priv.epsilon()


def test_runs_under_vmap_report_their_keys_in_one_callback():
    """Many runs at once (``vmap``, as an audit simulates them) send every run's key to the host
    in one callback, not one unrolled callback per run; runs sharing one key on different sums
    are a reuse."""
    priv = _priv()
    runs = 6
    w = jnp.zeros((runs, 3))
    opt = jax.vmap(priv.init)(w)
    summed = jnp.arange(runs * 3.0).reshape(runs, 3)
    keys = jax.random.split(jax.random.key(5), runs)
    update = jax.jit(jax.vmap(priv.noisy_update))
    program = update.lower(w, opt, summed, keys).as_text()
    assert program.count("callback") <= 2, program.count("callback")  # (a call and its target)
    update(w, opt, summed, keys)
    assert priv.releases.counts() == (runs, 0)
    one_key = jax.jit(jax.vmap(priv.noisy_update, in_axes=(0, 0, 0, None)))
    one_key(w, opt, summed, jax.random.key(6))
    assert priv.releases.counts() == (runs + 1, runs - 1)
