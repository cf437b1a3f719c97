"""The code of docs/guides/dp-sgd.md, run as written.

The guide's ``python`` blocks form one program: they run in order in one
namespace, section by section (``## `` headings). After each section the test
checks what that section computed: the epsilon spent is the accountant's and
meets the target, the model learned, the pieces agree with the one-call builder.
"""

from __future__ import annotations

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# runs the whole DP guide (about 2 minutes) once, in one worker (the fixture is module-scoped)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dp_guide")]

pytest.importorskip("dp_accounting")

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "dp-sgd.md"
SECTIONS = [
    "DP-SGD in five minutes",
    "1. The whole loop in one call: `make_private`",
    "2. The same loop, piece by piece",
    "3. Accounting: PLD or RDP",
    "4. The padded size and overflows",
    "5. Large logical batches",
    "6. Several devices and processes",
    "8. Flax NNX and Equinox, checkpoints and resuming",
    "9. Other samplers: the `BatchSampler` protocol",
    "10. Auditing epsilon",
    "11. User-level DP",
]


def guide_sections() -> dict[str, str]:
    """``{heading: the section's python code}`` for each ``## `` section that has code."""
    out = {}
    for part in re.split(r"^## ", GUIDE.read_text(), flags=re.M)[1:]:
        code = "\n".join(re.findall(r"^```python\n(.*?)^```", part, flags=re.S | re.M))
        if code.strip():
            out[part.splitlines()[0].strip()] = code
    return out


def train_accuracy(ns: dict) -> float:
    p, x, y = ns["params"], ns["x"], ns["data"]["y"]
    return float(jnp.mean(jnp.argmax(x @ p["w"] + p["b"], -1) == y))


def _jit_to_completion(jit):
    """``jax.jit`` whose functions return only once their results are computed."""

    def jit_blocking(fn, *args, **kwargs):
        compiled = jit(fn, *args, **kwargs)

        def call(*a, **k):
            return jax.block_until_ready(compiled(*a, **k))

        return call

    return jit_blocking


@pytest.fixture(scope="module")
def run_guide(tmp_path_factory):
    """Runs the sections in order; returns ``{heading: snapshot of the namespace after it}``.

    The quick start turns on JAX's persistent compilation cache: without a
    ``JAX_COMPILATION_CACHE_DIR`` (CI sets one) its folder is a temporary one, not the
    user's home, and the cache settings are restored afterwards.

    On XLA:CPU the tests' 8 simulated devices share one thread pool: a multi-device step
    dispatched while the previous one still runs can hold the threads the previous one's
    all-reduce waits for (XLA aborts the process after 40 s: "Termination timeout for all
    reduce"), so the sections' jitted steps run to completion before the loop goes on.
    """
    ns: dict = {"__name__": "dp_guide"}
    after = {}
    cache = {
        k: getattr(jax.config, k)
        for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    if cache["jax_compilation_cache_dir"] is None:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(jax, "jit", _jit_to_completion(jax.jit))
            for heading, code in guide_sections().items():
                exec(compile(code, f"{GUIDE.name}: {heading}", "exec"), ns)
                after[heading] = dict(ns)
    finally:
        for k, v in cache.items():
            jax.config.update(k, v)
    return after


def test_every_code_block_is_in_a_checked_section():
    assert list(guide_sections()) == SECTIONS
    text = GUIDE.read_text()
    assert "shuffled batches treated as Poisson" not in text
    # no python block before the first section (it would not run)
    assert "```python" not in text.split("\n## ")[0]


def test_five_minutes(run_guide):
    """The quick start trained, checkpointed at step 50, resumed and spent the target."""
    ns = run_guide["DP-SGD in five minutes"]
    priv = ns["priv"]
    assert priv.accountant.steps == 100 == priv.steps
    assert 2.9 < priv.epsilon() <= 3.0 + 1e-9
    assert ns["saved"]["run"]["sampler"]["steps_taken"] == 50
    assert train_accuracy(ns) >= 0.9


def test_make_private_loop(run_guide):
    ns = run_guide[SECTIONS[1]]
    priv = ns["priv"]
    assert priv.accountant.steps == 200 == priv.steps
    assert priv.epsilon() == priv.accountant.epsilon(1e-5)
    assert 2.9 < priv.epsilon() <= 3.0 + 1e-9
    assert train_accuracy(ns) >= 0.9


def test_piece_by_piece_loop(run_guide):
    ns = run_guide[SECTIONS[2]]
    acc, priv, sampler = ns["accountant"], ns["priv"], ns["sampler"]
    assert acc.steps == 200 and len(acc.phases) == 1
    assert acc.phases[0].sample_rate == sampler.sample_rate == pytest.approx(0.05)
    # the same calibration as the builder's, hence (up to its tolerance) the same epsilon
    assert ns["z"] == pytest.approx(priv.noise_multiplier, abs=2e-3)
    assert acc.epsilon(1e-5) == pytest.approx(priv.epsilon(), rel=2e-3)
    assert train_accuracy(ns) >= 0.9


def test_accounting_section(run_guide):
    ns = run_guide[SECTIONS[3]]
    from gradclip_jax.dp import accounting

    z, q, steps, delta = ns["z"], ns["q"], ns["steps"], ns["delta"]
    pld = accounting.epsilon(z, q, steps, delta)
    rdp = accounting.epsilon(z, q, steps, delta, accountant="rdp")
    assert pld < rdp  # PLD is the tighter of the two
    two = ns["two_phase"]
    assert two.steps == 150 and len(two.phases) == 2
    assert two.epsilon(delta) > accounting.epsilon(z, q, 100, delta)


def test_overflow_section(run_guide):
    ns = run_guide[SECTIONS[4]]
    sampler, small = ns["sampler"], ns["small"]
    assert sampler.overflow_probability <= 1e-9
    assert sampler.max_batch_size > sampler.expected_batch_size
    assert small.truncated_batch_size == 80
    phase = ns["truncated"].phases[0]
    assert phase.truncated_batch_size == 80 and phase.steps == 200
    # truncation is accounted: it costs (a little) epsilon at the same noise
    eps = ns["truncated"].epsilon(1e-5)
    assert math.isfinite(eps) and ns["priv"].epsilon() < eps < 1.05 * ns["priv"].epsilon()


def test_large_logical_batches(run_guide):
    ns = run_guide[SECTIONS[5]]
    big = ns["big"]
    assert big.sampler.max_batch_size % 100 == 0
    assert big.accountant.steps == 20
    assert big.epsilon() <= 3.0 + 1e-9
    assert train_accuracy(ns) >= 0.9


def test_host_accumulation_equals_one_step(run_guide):
    # summing the pieces' clipped sums and noising once is the builder's own step
    ns = run_guide[SECTIONS[5]]
    big, data, piece = ns["big"], ns["data"], ns["piece"]
    params = {"w": jnp.ones((8, 2)) * 0.1, "b": jnp.zeros(2)}
    b = big.sampler.batch(0)
    batch = jax.tree.map(lambda a: a[b.indices], data)
    key = jax.random.key(5)
    whole, _, _ = big.step(params, big.init(params), batch, b.mask, key)
    total = None
    for s in range(0, len(b.mask), piece):
        g, _ = big.clipped_sum(
            params, jax.tree.map(lambda a: a[s : s + piece], batch), b.mask[s : s + piece]
        )
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    pieces, _, _ = big.noisy_update(params, big.init(params), total, key)
    for a, c in zip(jax.tree.leaves(whole), jax.tree.leaves(pieces)):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


def test_sharded_section(run_guide):
    ns = run_guide[SECTIONS[6]]
    dist = ns["dist"]
    assert dist.sampler.max_batch_size % jax.device_count() == 0
    assert dist.accountant.steps == 50
    assert dist.epsilon() <= 3.0 + 1e-9
    assert train_accuracy(ns) >= 0.9


def test_nnx_equinox_and_resumed_run(run_guide):
    """The NNX and Equinox runs each stopped after 10 steps, checkpointed with orbax and resumed
    are the uninterrupted runs: their batches, epsilon and parameters, bit for bit."""
    ns = run_guide[SECTIONS[7]]
    from flax import nnx

    gcx, eqx, optax = ns["gcx"], ns["eqx"], ns["optax"]
    x, y = ns["x"], ns["data"]["y"]
    assert ns["priv_nnx"].accountant.steps == 10 and ns["resumed_nnx"].accountant.steps == 20
    assert ns["resumed_nnx"].epsilon() <= 3.0 + 1e-9
    # 20 noisy steps of a two-class problem: well above chance (0.5); the value moves with the
    # noise's draw (0.79 with this one, above 0.8 with the one before), the resumed run's
    # equality below does not
    assert float(jnp.mean(jnp.argmax(ns["model"](x), -1) == y)) >= 0.75
    assert isinstance(ns["nnx_params"], nnx.State)
    whole_nnx = gcx.make_private(ns["nnx_loss"], optax.adam(1e-2), **ns["plan"])
    _, state = nnx.split(ns["MLP"](nnx.Rngs(0)))
    state, _ = ns["train"](whole_nnx, state, whole_nnx.init(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ns["nnx_params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    resumed = ns["resumed"]
    assert resumed.accountant.steps == 20 and ns["priv_eqx"].accountant.steps == 10
    plan = ns["plan"]
    whole = gcx.make_private(ns["eqx_loss"], optax.adam(1e-2), **plan)
    params, _ = eqx.partition(eqx.nn.MLP(8, 2, 16, 1, key=jax.random.key(2)), eqx.is_inexact_array)
    params, _ = ns["train"](whole, params, whole.init(params))
    assert whole.epsilon() == resumed.epsilon()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ns["eqx_params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.mean(jnp.argmax(jax.vmap(ns["eqx_model"])(x), -1) == y)) >= 0.8


def test_custom_sampler_section(run_guide):
    """The fixed-size sampler of the guide plugs into make_private: the accountant's epsilon is
    dp-accounting's for its own event (sampling without replacement, replace-one), at the target."""
    import dp_accounting

    ns = run_guide[SECTIONS[8]]
    fixed = ns["fixed"]
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    one = dp_accounting.SampledWithoutReplacementDpEvent(
        1000, 50, dp_accounting.GaussianDpEvent(fixed.noise_multiplier)
    )
    acc.compose(dp_accounting.SelfComposedDpEvent(one, 200))
    assert fixed.accountant.steps == 200 and fixed.epsilon() == acc.get_epsilon(1e-5) <= 3.0 + 1e-9
    assert train_accuracy(ns) >= 0.8


def test_audit_section_passes_the_honest_run_and_catches_the_missing_noise(run_guide):
    """The audit of the honest make_private run stays below its epsilon; the loop that forgot the
    noise gets a lower bound above the same claim (tests/dp/test_audit.py has the full table)."""
    pytest.importorskip("jax_privacy.auditing")
    ns = run_guide[SECTIONS[9]]
    audit = ns["audit"]
    assert audit.claimed_epsilon <= 4.0 + 1e-9 and not audit.falsified
    assert audit.epsilon_lower_bound < 2.0
    assert ns["priv_audit"].accountant.steps == 100
    assert ns["broken_bound"] > ns["priv_audit"].epsilon() >= 3.99


def test_audit_section_catches_shuffled_batches_reported_as_poisson(run_guide):
    """The audit of the sampling: the guide's shuffling sampler accounted as Poisson gets a lower
    bound above its claimed epsilon (tests/dp/test_audit.py runs it with as many runs, and the
    honest Poisson sampler at the same settings)."""
    pytest.importorskip("jax_privacy.auditing")
    res = run_guide[SECTIONS[9]]["shuffle_audit"]
    assert res.runs == 5000 and res.claimed_epsilon == pytest.approx(1.0, rel=1e-3)
    assert res.noise_multiplier < 1.0 and res.falsified


def test_user_level_section(run_guide):
    """The user-level run: its epsilon is dp-accounting's Poisson-sampled Gaussian over users, at the
    target; every user has at most k examples in a step; the model learned; ghost keeps every leaf."""
    import dp_accounting

    ns = run_guide[SECTIONS[10]]
    priv, users = ns["user_priv"], ns["users"]
    q = 25 / users.num_users
    assert users.sample_rate == pytest.approx(q) and priv.expected_batch_size == pytest.approx(25)
    from gradclip_jax.dp.accounting import pld_interval
    from gradclip_jax.dp.accounting._composition import loss_std

    event = dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(priv.noise_multiplier)
    )
    grid = pld_interval(
        priv.noise_multiplier, loss_std([(event, 200)])
    )  # the accountant's PLD grid
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=grid)
    acc.compose(event, 200)
    assert priv.accountant.steps == 200 and priv.epsilon() == pytest.approx(
        acc.get_epsilon(1e-5), rel=1e-6
    )
    assert priv.epsilon() <= 3.0 + 1e-9
    batch, mask = ns["batch"], ns["mask"]
    assert (
        batch.example_mask.shape[1] == 4
        and not np.asarray(batch.example_mask)[~np.asarray(mask)].any()
    )
    assert ns["user_acc"] >= 0.9
    rep = ns["ghost_report"](ns["per_user_loss"], ns["params"], batch)
    assert rep.fallback == []
