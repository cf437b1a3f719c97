"""User-level DP: UserPoissonSampler, user_loss, per-user clipping on vmap and ghost, accounting, make_private."""

from __future__ import annotations

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx
from gradclip_jax import ghost_report, make_private
from gradclip_jax.dp import BatchSampler, UserBatch, UserPoissonSampler, user_loss

C = 1.0


def _sampler(**kw):
    args = dict(
        expected_users=6, max_examples_per_user=3, steps=5, seed=1, process_index=0, process_count=1
    )
    return UserPoissonSampler(kw.pop("user_ids", np.repeat(np.arange(30), 5)), **{**args, **kw})


def _mlp_params(d=4, h=8):
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(d, h)), jnp.float32),
        "b1": jnp.zeros(h),
        "w2": jnp.asarray(rng.normal(size=(h,)), jnp.float32),
    }


def _example_loss(p, ex):
    """``[users, k, d] -> [users, k]``: the layout is kept, so a dense layer sees ``[users, k, d]``."""
    h = jnp.tanh(ex["x"] @ p["w1"] + p["b1"])
    return 0.5 * (h @ p["w2"] - ex["y"]) ** 2


def _user_batch(users=6, k=3, seed=0):
    rng = np.random.default_rng(seed)
    ex = {
        "x": jnp.asarray(rng.normal(size=(users, k, 4)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(users, k)), jnp.float32),
    }
    em = rng.random((users, k)) < 0.7
    em[:, 0] = True  # every user has an example
    return UserBatch(ex, jnp.asarray(em))


# --- the sampler ---


def test_protocol_and_layout():
    s = _sampler()
    assert isinstance(s, BatchSampler) and s.num_users == 30 and s.dataset_size == 150
    assert s.sample_rate == pytest.approx(0.2) and s.expected_batch_size == pytest.approx(6)
    user_ids = np.repeat(np.arange(30), 5)
    for b in s:
        m = s.max_batch_size
        assert b.indices.shape == b.example_mask.shape == (m, 3) and b.mask.shape == (m,)
        assert not b.example_mask[~b.mask].any()  # padding users have no examples
        for idx, em in zip(b.indices[b.mask], b.example_mask[b.mask]):
            assert em.all() and len(set(user_ids[idx])) == 1  # k=3 < 5: three examples of one user
        users = user_ids[b.indices[b.mask, 0]]
        assert len(set(users)) == len(users)  # a user at most once per step


def test_deterministic_and_processes():
    s = _sampler(steps=20)
    b1, b2 = s.batch(7), _sampler(steps=20).batch(7)
    assert np.array_equal(b1.indices, b2.indices) and np.array_equal(
        b1.example_mask, b2.example_mask
    )
    halves = [
        _sampler(steps=20, process_index=i, process_count=2, max_users=20).batch(7) for i in (0, 1)
    ]
    full = _sampler(steps=20, max_users=20).batch(7)
    assert np.array_equal(np.concatenate([h.indices for h in halves]), full.indices)
    assert np.array_equal(np.concatenate([h.example_mask for h in halves]), full.example_mask)


def test_poisson_rate_over_users():
    s = _sampler(steps=400)
    counts = np.array([int(s.batch(t).mask.sum()) for t in range(400)])
    assert counts.mean() == pytest.approx(6.0, abs=0.5)  # Binomial(30, 0.2): sd of the mean 0.1


def test_example_choice():
    ids = np.repeat(np.arange(4), [2, 6, 6, 1])
    first = _sampler(user_ids=ids, expected_users=4, steps=10, example_choice="first")
    rand = _sampler(user_ids=ids, expected_users=4, steps=10)
    assert np.array_equal(first.examples_of(1, 0), [2, 3, 4]) and np.array_equal(
        first.examples_of(1, 9), [2, 3, 4]
    )
    assert np.array_equal(rand.examples_of(0, 3), [0, 1]) and np.array_equal(
        rand.examples_of(3, 3), [14]
    )
    picks = {tuple(rand.examples_of(1, t)) for t in range(10)}
    assert len(picks) > 1 and all(set(p) <= set(range(2, 8)) and len(p) == 3 for p in picks)
    # a short user's row is padded and masked
    b = first.batch(0)  # rate 1: every user
    assert b.example_mask.sum(1).tolist()[:4] == [2, 3, 3, 1]


def test_user_examples_form():
    s = UserPoissonSampler(
        user_examples=[[0, 5], [1], [2, 3, 4]],
        expected_users=3,
        max_examples_per_user=2,
        steps=2,
        process_index=0,
        process_count=1,
        dataset_size=8,
        example_choice="first",
    )
    assert s.num_users == 3 and s.dataset_size == 8
    b = s.batch(0)
    assert b.indices[:3].tolist() == [[0, 5], [1, 0], [2, 3]]  # rate 1: every user, the first k
    assert b.example_mask.sum(1).tolist() == [2, 1, 2]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(user_ids=np.array([0, -1])), "user_ids"),
        (dict(user_ids=np.array([0.5, 1.0])), "user_ids"),
        (dict(user_ids=None), "exactly one of `user_ids` and `user_examples`"),
        (dict(user_ids=None, user_examples=[[0], [0, 1]]), "under two users"),
        (dict(user_ids=None, user_examples=[[0], [9]], dataset_size=5), "outside"),
        (dict(user_ids=None, user_examples=[[0], []]), r"user_examples\[1\]"),
        (dict(max_examples_per_user=0), "max_examples_per_user"),
        (dict(expected_users=31), "expected_users"),
        (dict(expected_users=0), "expected_users"),
        (dict(max_users=3), "max_users"),
        (dict(example_choice="last"), "example_choice"),
        (dict(dataset_size=10), "dataset_size"),
    ],
)
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        _sampler(**kw)


def test_user_loss_reduce():
    b = _user_batch()
    p = _mlp_params()
    per = _example_loss(p, b.examples)
    m = np.asarray(b.example_mask)
    s = user_loss(_example_loss)(p, b)
    mean = user_loss(_example_loss, reduce="mean")(p, b)
    np.testing.assert_allclose(s, np.where(m, per, 0).sum(1), rtol=1e-6)
    np.testing.assert_allclose(mean, np.where(m, per, 0).sum(1) / m.sum(1), rtol=1e-6)
    with pytest.raises(ValueError, match="reduce"):
        user_loss(_example_loss, reduce="max")


# --- per-user clipping: the user is the unit on vmap and ghost ---


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_ghost_equals_vmap_per_user(reduce):
    loss, p, b = user_loss(_example_loss, reduce), _mlp_params(), _user_batch()
    rep = ghost_report(loss, p, b)
    assert rep.fallback == [] and {name for name, _ in rep.ghost} == {"['b1']", "['w1']", "['w2']"}
    user_mask = jnp.array([True] * 5 + [False])
    # jitted: called eagerly, each clipped sum dispatches (and compiles) its operations one by one
    gv, iv = jax.jit(gcx.clipped_grad(loss, C, method="vmap"))(p, b, mask=user_mask)
    gg, ig = jax.jit(gcx.clipped_grad(loss, C, method="ghost"))(p, b, mask=user_mask)
    for a, c in zip(jax.tree.leaves(gv), jax.tree.leaves(gg)):
        np.testing.assert_allclose(a, c, atol=1e-5)
    np.testing.assert_allclose(iv.norms, ig.norms, rtol=1e-5)
    # the user's norm is the norm of the sum (or mean) of its examples' gradients
    u0 = jax.tree.map(lambda x: x[:1], b)
    g0 = jax.jit(jax.grad(lambda q: loss(q, u0)[0]))(p)
    assert float(iv.norms[0]) == pytest.approx(float(gcx.norms.tree_norm(g0)), rel=1e-5)


def _aligned_users(users=5, k=4):
    """Users whose examples all pull one way: a user's sum of k gradients has norm ~k times one's."""
    x = np.ones((users, k, 3), np.float32) * np.linspace(1, 2, users)[:, None, None]
    return UserBatch({"x": jnp.asarray(x)}, jnp.ones((users, k), bool))


def _lin_loss(w, ex):
    return 10.0 * (ex["x"] @ w)  # gradient x * 10: norm well above C, every example clipped


def test_neighbour_removing_a_user():
    b = _aligned_users()
    w = jnp.zeros(3)
    per_user = gcx.clipped_grad(user_loss(_lin_loss), C, method="vmap")
    full, _ = per_user(w, b)
    for u in range(5):
        keep = jnp.arange(5) != u
        without, _ = per_user(w, b, mask=keep)
        assert float(jnp.linalg.norm(full - without)) <= C * (1 + 1e-6)
    # example-level clipping: removing the user's k examples one at a time moves the sum by k * C
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), b.examples)
    per_example = gcx.clipped_grad(lambda w, ex: 10.0 * (ex["x"] @ w), C, method="vmap")
    full_ex, _ = per_example(w, flat)
    keep = np.ones(20, bool)
    keep[:4] = False  # user 0's four examples
    without_ex, _ = per_example(w, flat, mask=jnp.asarray(keep))
    assert float(jnp.linalg.norm(full_ex - without_ex)) == pytest.approx(4 * C, rel=1e-5)


def _direct_pld(event, steps, z):
    """dp-accounting's PLD accountant composed with ``steps`` of ``event``, on the accountant's grid."""
    from gradclip_jax.dp.accounting import pld_interval
    from gradclip_jax.dp.accounting._composition import loss_std

    acc = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=pld_interval(z, loss_std([(event, steps)]))
    )
    acc.compose(event, steps)
    return acc


def test_accounting_is_poisson_over_users():
    s = _sampler(steps=50)
    z, delta = 1.1, 1e-5
    direct = _direct_pld(
        dp_accounting.PoissonSampledDpEvent(6 / 30, dp_accounting.GaussianDpEvent(z)), 50, z
    )
    acc = gcx.PrivacyAccountant("pld")
    acc.step(z, sampler=s, steps=50)
    assert acc.epsilon(delta) == pytest.approx(direct.get_epsilon(delta), rel=1e-8)
    assert acc.phases[0].sample_rate == pytest.approx(0.2)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(z)), 50)
    acc_rdp = gcx.PrivacyAccountant("rdp")
    acc_rdp.step(z, sampler=s, steps=50)
    assert acc_rdp.epsilon(delta) == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)


def test_saved_steps_do_not_reload_at_another_rate():
    """The sampler's plan does not hold its rate (expected users): loading a saved record with
    a sampler of another rate would account the saved steps at that rate (epsilon 18.3 read
    back as 1.58 for q 0.1 -> 0.01)."""
    acc = gcx.PrivacyAccountant("pld")
    run = _sampler(steps=50, max_users=20)
    acc.step(1.1, sampler=run, steps=50)
    state = acc.state_dict()
    other = _sampler(steps=50, max_users=20, expected_users=3)
    assert other.plan() == run.plan()
    with pytest.raises(ValueError, match=r"sampling rate 0\.2.*rate 0\.1"):
        gcx.PrivacyAccountant.from_state_dict(state, sampler=other)
    same = gcx.PrivacyAccountant.from_state_dict(state, sampler=_sampler(steps=50, max_users=20))
    assert same.epsilon(1e-5) == acc.epsilon(1e-5)


# --- make_private end to end ---


def _data(n_users=40, per_user=6, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(n_users), rng.integers(1, per_user + 1, n_users))
    x = rng.normal(size=(len(ids), 3)).astype(np.float32)
    return ids, {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5], np.float32))}


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_make_private_end_to_end(method):
    ids, data = _data()
    sampler = UserPoissonSampler(
        ids,
        expected_users=8,
        max_examples_per_user=4,
        steps=12,
        seed=0,
        process_index=0,
        process_count=1,
    )

    def example_loss(w, ex):
        return 0.5 * (ex["x"] @ w - ex["y"]) ** 2

    priv = make_private(
        user_loss(example_loss, "mean"),
        optax.sgd(0.5),
        target_epsilon=4.0,
        delta=1e-3,
        l2_clip_norm=1.0,
        sampler=sampler,
        method=method,
    )
    step = jax.jit(priv.step)
    w, state, key = jnp.zeros(3), priv.init(jnp.zeros(3)), jax.random.key(0)
    for batch, mask in priv.batches(data):
        assert isinstance(batch, UserBatch) and batch.examples["x"].shape[:2] == (
            sampler.max_batch_size,
            4,
        )
        key, sub = jax.random.split(key)
        w, state, metrics = step(w, state, batch, mask, sub)
        assert int(metrics.num_clipped) <= int(mask.sum())  # users clipped, of the real users
    assert np.isfinite(np.asarray(w)).all() and priv.accountant.steps == 12
    z = priv.noise_multiplier
    direct = _direct_pld(
        dp_accounting.PoissonSampledDpEvent(8 / 40, dp_accounting.GaussianDpEvent(z)), 12, z
    )
    # the same event, on the accountant's grid, up to FFT rounding
    assert priv.epsilon() == pytest.approx(direct.get_epsilon(1e-3), rel=1e-6)
    assert priv.epsilon() <= 4.0 + 1e-9 and priv.sample_rate == pytest.approx(0.2)
    assert priv.plan()["sampler"] == "UserPoissonSampler"


def test_make_private_warns_delta_over_users():
    ids, _ = _data()
    sampler = UserPoissonSampler(
        ids, expected_users=8, max_examples_per_user=4, steps=3, process_index=0, process_count=1
    )
    with pytest.warns(UserWarning, match="num_users"):
        make_private(
            user_loss(lambda w, ex: (ex["x"] @ w) ** 2),
            optax.sgd(0.1),
            target_epsilon=8.0,
            delta=0.03,
            l2_clip_norm=1.0,
            sampler=sampler,
        )
