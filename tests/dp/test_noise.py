"""add_gaussian_noise: the documented draw under both strategies, its statistics, and
what the blocked draw saves on the CPU (one loop, temporaries the size of the noise)."""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from gradclip_jax._core.jaxcompat import gpu_threefry_on_cpu, is_literal
from gradclip_jax.dp import noise as noise_mod
from gradclip_jax.dp.noise import add_gaussian_noise
from gradclip_jax.dp.philox import philox_normal
from tests._backend import assert_equal_on_cpu
from tests.jaxprs import primitive_counts

BACKEND = jax.default_backend()


def _jitted():
    # a fresh function per call: the strategy is read when tracing, and jax.jit caches traces
    return jax.jit(lambda tree, std, key: add_gaussian_noise(tree, std, key))


@pytest.fixture(params=["leaves", "blocks", "shapes", "philox"])
def strategy(request, monkeypatch):
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, request.param)
    return request.param


def _tree():
    return {
        "a": jnp.zeros((300, 70)),
        "b": jnp.zeros(5),
        "c": jnp.zeros((), jnp.float32),
        "d": jnp.zeros((64, 33), jnp.bfloat16),
        "e": jnp.zeros(1000),
    }


def test_leaves_draw_is_documented(monkeypatch):
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "leaves")
    tree = {"a": jnp.ones((4, 3)), "b": jnp.ones(5)}
    key = jax.random.key(3)
    out = add_gaussian_noise(tree, 2.0, key)
    _, ka, kb = jax.random.split(key, 3)
    assert_equal_on_cpu(out["a"], 1.0 + 2.0 * jax.random.normal(ka, (4, 3)))
    assert_equal_on_cpu(out["b"], 1.0 + 2.0 * jax.random.normal(kb, (5,)))


def test_shapes_draw_is_the_leaves_draw(monkeypatch):
    """Drawn once per distinct shape and dtype, the values are the per-leaf draws' (same keys, same
    random bits; XLA may round the transform to normals differently by an ulp)."""
    tree = {
        "a": jnp.ones((4, 3)),
        "b": jnp.ones(5),
        "c": jnp.ones((4, 3)),
        "d": jnp.ones((4, 3), jnp.bfloat16),
        "e": jnp.ones(5),
        "f": jnp.ones((4, 3), jnp.complex64),
        "g": jnp.ones(()),
        "h": jnp.ones(7),
    }
    key = jax.random.key(5)
    outs = {}
    for name in ("leaves", "shapes"):
        monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, name)
        outs[name] = _jitted()(tree, 1.5, key)
    for path in tree:
        # bfloat16 leaves are noised in float32; the complex leaf is drawn per leaf as before
        np.testing.assert_allclose(
            np.asarray(outs["shapes"][path]),
            np.asarray(outs["leaves"][path]),
            rtol=1e-6,
            atol=1e-6,
            err_msg=path,
        )
        assert outs["shapes"][path].dtype == outs["leaves"][path].dtype
    # leaves of one shape get different draws
    assert not np.allclose(outs["shapes"]["a"], outs["shapes"]["c"])


def test_shapes_draw_is_one_draw_per_shape(monkeypatch):
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "shapes")
    tree = {f"w{i}": jnp.zeros((8, 4)) for i in range(6)} | {
        f"b{i}": jnp.zeros(4) for i in range(6)
    }
    jaxpr = str(jax.make_jaxpr(lambda t, k: add_gaussian_noise(t, 1.0, k))(tree, jax.random.key(0)))
    assert jaxpr.count("random_bits") == 2  # one per shape, not one per leaf


def test_gpu_default_draws_once_per_leaf_shape():
    """On GPUs the per-leaf draws (the same bits) are made once per distinct shape: half the
    program of one draw per leaf, read as a GPU compiles it (``NOISE_STRATEGY``'s comment)."""
    tree = {f"w{i}": jnp.zeros((8, 4)) for i in range(3)} | {"b": jnp.zeros(4), "c": jnp.zeros(4)}
    with mock.patch.object(jax, "default_backend", lambda: "gpu"):
        jaxpr = jax.make_jaxpr(lambda t, k: add_gaussian_noise(t, 1.0, k))(tree, jax.random.key(0))
    assert primitive_counts(jaxpr.jaxpr)["random_bits"] == 2


def test_shapes_draw_waits_for_its_leaves(monkeypatch):
    """A group's draw depends on its keys alone; it is tied to the group's leaves, so that XLA
    makes it just before the addition instead of early, holding every group's draw at once."""
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "shapes")
    tree = {"a": jnp.ones((6, 5)), "c": jnp.ones((6, 5))}
    jaxpr = jax.make_jaxpr(lambda t, k: add_gaussian_noise(t, 1.0, k))(
        tree, jax.random.key(0)
    ).jaxpr
    deps = {v: {i} for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        got = set().union(*(deps.get(v, set()) for v in eqn.invars if not is_literal(v)))
        deps.update({v: got for v in eqn.outvars})
    draws = [v for e in jaxpr.eqns for v in e.outvars if v.aval.shape == (2, 6, 5)]
    assert draws and all(deps[v] == {0, 1, 2} for v in draws)  # both leaves (0, 1) and the key (2)


def test_philox_draw_is_documented(monkeypatch):
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "philox")
    tree = {"a": jnp.ones((4, 3)), "b": jnp.ones(5), "h": jnp.ones(6, jnp.float16)}
    key = jax.random.key(3)
    out = add_gaussian_noise(tree, 2.0, key)
    _, ka, kb, kh = jax.random.split(key, 4)
    np.testing.assert_array_equal(out["a"], 1.0 + 2.0 * philox_normal(ka, (4, 3)))
    np.testing.assert_array_equal(out["b"], 1.0 + 2.0 * philox_normal(kb, (5,)))
    np.testing.assert_array_equal(
        out["h"], 1.0 + 2.0 * philox_normal(kh, (6,))
    )  # float32 after the cast
    assert not np.allclose(out["a"], 1.0 + 2.0 * jax.random.normal(ka, (4, 3)))  # not threefry's


@pytest.mark.parametrize("partitionable", [True, False])
def test_blocks_draw_is_documented(monkeypatch, partitionable):
    """The leaves laid end to end get ``jax.random.normal(key, (n,))`` (under JAX's default
    partitionable threefry; the draw is the same under the older flag), in blocks of any size."""
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    monkeypatch.setattr(noise_mod, "NOISE_BLOCK_SIZE", 8)
    tree = {"a": jnp.ones((4, 3)), "b": jnp.ones(5), "h": jnp.ones(6, jnp.bfloat16)}
    key = jax.random.key(3)
    with jax.threefry_partitionable(partitionable):
        out = add_gaussian_noise(tree, 2.0, key)
    flat = jax.random.normal(key, (23,))  # all three leaves accumulate in float32: one line
    assert_equal_on_cpu(out["a"], 1.0 + 2.0 * flat[:12].reshape(4, 3))
    assert_equal_on_cpu(out["b"], 1.0 + 2.0 * flat[12:17])
    assert_equal_on_cpu(out["h"], 1.0 + 2.0 * flat[17:23])
    assert out["h"].dtype == jnp.float32
    raw = add_gaussian_noise(tree, 2.0, jax.random.key_data(key))  # a raw key: the same draw
    np.testing.assert_array_equal(raw["a"], out["a"])


def test_blocks_with_a_leaf_drawn_alone_hash_under_the_first_split_key(monkeypatch):
    """A leaf drawn on its own (an explicitly sharded one) takes ``split(key, n + 1)[i + 1]``; the
    blocks then hash their counters under ``split(key, n + 1)[0]``, never under ``key``, whose
    counters the split hashed."""
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    monkeypatch.setattr(noise_mod, "explicit_spec", lambda x: "alone" if x.shape == (5,) else None)
    tree = {"a": jnp.ones((4, 3)), "b": jnp.ones(5), "c": jnp.ones(2)}
    key = jax.random.key(3)
    out = add_gaussian_noise(tree, 2.0, key)
    k0, _, kb, _ = jax.random.split(key, 4)
    flat = jax.random.normal(k0, (14,))
    np.testing.assert_array_equal(out["a"], 1.0 + 2.0 * flat[:12].reshape(4, 3))
    np.testing.assert_array_equal(out["b"], 1.0 + 2.0 * jax.random.normal(kb, (5,)))
    np.testing.assert_array_equal(out["c"], 1.0 + 2.0 * flat[12:])


def test_blocks_of_each_dtype_take_the_next_counters():
    """Float32 and float64 leaves: one line of counters, each dtype's span drawn as
    ``jax.random.normal`` of that dtype draws it; a block's counters carry into the high word."""
    key = jax.random.key(5)
    with jax.enable_x64(True):
        tree = {"a": jnp.zeros(5, jnp.float32), "d": jnp.zeros(11, jnp.float64)}
        out = noise_mod._blocked_noise([tree["d"]], key, 1.0, np.dtype(np.float64), 5)
        np.testing.assert_array_equal(out[0], jax.random.normal(key, (16,), jnp.float64)[5:])
        words = noise_mod._key_words(key)
        lo = np.uint32(2**32 - 3)
        across = noise_mod._counter_normals(words, jnp.uint32(0), lo, 6, np.dtype(np.float32))
        after = noise_mod._counter_normals(
            words, jnp.uint32(1), jnp.uint32(0), 3, np.dtype(np.float32)
        )
        np.testing.assert_array_equal(across[3:], after)
        assert not np.array_equal(across[:3], after)
    other = add_gaussian_noise({"a": jnp.zeros(6)}, 1.0, jax.random.key(5, impl="rbg"))
    assert np.isfinite(other["a"]).all() and np.unique(other["a"]).size == 6  # its own bits


def test_statistics_and_dtypes(strategy, monkeypatch):
    monkeypatch.setattr(noise_mod, "NOISE_BLOCK_SIZE", 4096)  # many blocks, leaves straddling them
    tree = _tree()
    out = _jitted()(tree, 3.0, jax.random.key(0))
    assert {k: v.dtype for k, v in out.items()} == {k: jnp.float32 for k in tree}
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in tree.items()}
    z = np.concatenate([np.asarray(v).ravel() for v in out.values()]) / 3.0
    n = z.size
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert z.var() == pytest.approx(1.0, abs=6 * np.sqrt(2 / n))
    assert np.mean(z**4) == pytest.approx(3.0, abs=0.15)  # Gaussian kurtosis
    # no two leaves or blocks share a draw: a reused key would repeat thousands of values;
    # float32 normals take about 2**23 values, so ~n**2 / 2**24 (here ~35) repeat by chance
    assert n - np.unique(z).size < 4 * n * n / 2**24 + 20
    # neighbours (across leaf and block boundaries) are uncorrelated
    assert abs(np.corrcoef(z[:-1], z[1:])[0, 1]) < 5 / np.sqrt(n)


def test_same_key_same_noise_other_key_other_noise(strategy):
    tree = _tree()
    a = add_gaussian_noise(tree, 1.0, jax.random.key(1))
    b = _jitted()(tree, 1.0, jax.random.key(1))
    c = add_gaussian_noise(tree, 1.0, jax.random.key(2))
    for k in tree:
        np.testing.assert_array_equal(a[k], b[k])
        if tree[k].size > 1:
            assert not np.allclose(a[k], c[k])


def test_traced_stddev_and_zero_stddev(strategy):
    tree = _tree()
    out = _jitted()(tree, jnp.asarray(0.0), jax.random.key(0))
    for k in tree:
        np.testing.assert_array_equal(out[k], np.zeros(tree[k].shape, np.float32))


def test_complex_leaf_gets_full_variance_in_both_parts(strategy):
    tree = {"r": jnp.zeros(7), "z": jnp.zeros((100, 200), jnp.complex64) + 1j}
    out = add_gaussian_noise(tree, 2.0, jax.random.key(0))["z"]
    assert out.dtype == jnp.complex64  # the imaginary part is kept
    re, im = np.real(np.asarray(out)).ravel(), np.imag(np.asarray(out)).ravel() - 1.0
    assert float(np.var(re)) == pytest.approx(4.0, rel=0.05)
    assert float(np.var(im)) == pytest.approx(4.0, rel=0.05)
    assert abs(np.corrcoef(re, im)[0, 1]) < 0.03


def test_dp_aggregate_complex_gradients_get_full_variance():
    from gradclip_jax import dp_aggregate

    grads = {"z": jnp.zeros((4, 100, 100), jnp.complex64)}
    tx = dp_aggregate(1.0, 2.0, 0, batch_size=1)
    out, _ = tx.update(grads, tx.init(grads))
    z = np.asarray(out["z"])
    assert z.dtype == np.complex64
    assert float(np.var(np.real(z))) == pytest.approx(4.0, rel=0.05)
    assert float(np.var(np.imag(z))) == pytest.approx(4.0, rel=0.05)


def test_empty_tree_and_none_leaves(strategy):
    assert add_gaussian_noise({}, 1.0, jax.random.key(0)) == {}
    out = add_gaussian_noise({"a": None, "b": jnp.zeros(3)}, 1.0, jax.random.key(0))
    assert out["a"] is None and out["b"].shape == (3,)


def test_vmap_over_keys(strategy):
    keys = jax.random.split(jax.random.key(0), 3)
    # jitted: eagerly, vmap dispatches (and compiles) every batched operation on its own
    out = jax.jit(jax.vmap(lambda k: add_gaussian_noise({"a": jnp.zeros(50)}, 1.0, k)))(keys)
    one = add_gaussian_noise({"a": jnp.zeros(50)}, 1.0, keys[1])
    np.testing.assert_allclose(out["a"][1], one["a"], rtol=1e-6)


def _noise_program(n_leaves: int):
    tree = {f"w{i}": jnp.zeros((128, 96 + i)) for i in range(n_leaves)}
    compiled = _jitted().lower(tree, 1.0, jax.random.key(0)).compile()
    nbytes = sum(x.size * 4 for x in tree.values())
    return compiled, nbytes


@pytest.mark.skipif(
    BACKEND != "cpu", reason="the CPU lowering of threefry is what the blocked draw avoids"
)
def test_blocked_draw_compiles_one_loop_and_holds_only_the_noise(monkeypatch):
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    monkeypatch.setattr(noise_mod, "NOISE_BLOCK_SIZE", 1 << 12)
    loops = []
    for n in (4, 24):
        compiled, nbytes = _noise_program(n)
        loops.append(len(re.findall(r" while\(", compiled.as_text())))
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp <= 1.25 * nbytes + (
            1 << 20
        )  # the flat draw plus one block, not uint32 copies per leaf
    assert loops[0] == loops[1]  # the loop count does not grow with the leaves


@pytest.mark.skipif(BACKEND != "cpu", reason="the CPU's fusion of a one-block draw")
def test_one_block_draw_is_not_copied_into_each_leaf(monkeypatch):
    """A tree that fits one block: its draw (uniform bits to normals) is compiled once, not into
    each leaf's addition (about 90 instructions a leaf when the one-trip loop is inlined); the
    values are the documented ones (``jax.random.normal(key, (17,))``)."""
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    monkeypatch.setattr(noise_mod, "NOISE_BLOCK_SIZE", 1 << 18)
    sizes = []
    for n in (4, 24):
        tree = {f"w{i}": jnp.zeros((17 + i, 9)) for i in range(n)}
        text = _jitted().lower(tree, 1.0, jax.random.key(0)).compile().as_text()
        sizes.append(len(re.findall(r"^\s*(?:ROOT )?%[\w.-]+ = ", text, re.M)))
    # a leaf, in each of the two branches of _spans_added: its offset, slice, scale and addition
    assert sizes[1] - sizes[0] <= 20 * 40, sizes
    tree = {"a": jnp.ones((4, 3)), "b": jnp.ones(5)}
    key = jax.random.key(3)
    out = _jitted()(tree, 2.0, key)
    flat = jax.random.normal(key, (17,))
    np.testing.assert_array_equal(out["a"], 1.0 + 2.0 * flat[:12].reshape(4, 3))
    np.testing.assert_array_equal(out["b"], 1.0 + 2.0 * flat[12:])


@pytest.mark.skipif(BACKEND != "cpu", reason="counts XLA:CPU's kernels")
@pytest.mark.reads_compiled_names  # hlo_program's reader of the compiled program's text
def test_equal_shaped_leaves_share_their_kernels_in_an_optimizer_step(monkeypatch):
    """The noise reads each leaf's span of the flat draw at an offset XLA cannot see, and the
    noised leaves are buffers of their own: adamw's kernels, one per shape without noise, stay
    one per shape (read at constant offsets, every leaf's addition and the adamw kernels it fuses
    into would be kernels of their own: about 10 ms of XLA:CPU's compile time each)."""
    import optax

    from benchmarks.hlo_program import distinct_kernel_count

    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    opt = optax.adamw(1e-3)

    def distinct(n: int, noised: bool) -> int:
        params = {f"w{i}": jnp.zeros((24, 16)) for i in range(n)} | {"b": jnp.zeros(16)}

        def step(params, state, key):
            grads = add_gaussian_noise(params, 1.0, key) if noised else params
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        args = (params, opt.init(params), jax.random.key(0))
        return distinct_kernel_count(jax.jit(step).lower(*args).compile().as_text())

    assert distinct(12, True) == distinct(3, True)
    assert distinct(12, False) == distinct(3, False)
    # and the noise adds a fixed number of kernels: the draw's loop and one addition per shape
    assert distinct(12, True) - distinct(12, False) <= 40


@pytest.mark.skipif(BACKEND != "cpu", reason="the CPU's default blocked draw")
def test_a_draw_too_large_for_int32_offsets_reads_its_spans_at_constant_offsets(monkeypatch):
    """Past int32 offsets the spans are read at constant offsets: the same noise (complex
    leaves, bfloat16 leaves in float32 and an empty leaf included), no conditional."""
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    tree = {
        "a": jnp.ones((4, 3)),
        "c": jnp.ones(3, jnp.complex64),
        "e": jnp.zeros((0, 2)),
        "h": jnp.ones(5, jnp.bfloat16),
    }
    key = jax.random.key(7)

    def noised():
        f = jax.jit(lambda t, k: add_gaussian_noise(t, 0.5, k))
        return f(tree, key), f.lower(tree, key).as_text()

    hidden, hidden_text = noised()
    monkeypatch.setattr(noise_mod, "_OFFSET_MAX", 4)
    constant, constant_text = noised()
    assert "stablehlo.case" in hidden_text and "stablehlo.case" not in constant_text
    for k in tree:
        np.testing.assert_array_equal(hidden[k], constant[k])
        assert hidden[k].dtype == constant[k].dtype


def _fusions_drawing(text: str) -> list[int]:
    """The xor count of each fused computation of an optimized HLO text that draws floats: it runs
    a counter-based generator's rounds (threefry2x32: 20 of add, rotate, xor, about 22 xors;
    philox: 10 of two multiplies and xors) and returns floats (a key's derivation returns integers)."""
    bodies = re.split(r"\n(?=\S.*\{\n)", text)
    return [
        b.count(" xor(")
        for b in bodies
        if b.startswith("%fused")
        and b.count(" xor(") >= 20
        and re.search(r"-> \(?f32", b.split("\n")[0])
    ]


def _adamw_step(noise_fn):
    import optax

    opt = optax.adamw(1e-3)

    def step(params, state, grads, key):
        updates, state = opt.update(noise_fn(grads, key), state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    return step, (params, opt.init(params), params, jax.random.key(0))


def _draw_fusions(noise_fn) -> list[int]:
    """The generator's fusions in an adamw step on noised gradients, compiled for the CPU as a GPU
    compiles it: rounds unrolled, optimization barriers kept through fusion."""
    step, args = _adamw_step(noise_fn)
    with gpu_threefry_on_cpu() as swapped:
        if not swapped:
            pytest.skip(
                "this JAX keeps threefry's CPU lowering where gpu_threefry_on_cpu cannot swap it"
            )
        compiled = (
            jax.jit(step)
            .lower(*args)
            .compile(compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"})
        )
    return _fusions_drawing(compiled.as_text())


@pytest.mark.skipif(BACKEND != "cpu", reason="reads the CPU's fusions of a GPU-style draw")
@pytest.mark.parametrize("strategy_name", ["leaves", "shapes", "philox", "blocks"])
def test_each_leaf_is_drawn_once_however_many_times_the_optimizer_reads_it(
    strategy_name, monkeypatch
):
    """adamw reads its gradient in several fusions; without the barrier XLA fuses the whole draw
    into each of them (checked first, on optax's way of drawing), with it each leaf's draw runs once."""

    def unstored(grads, key):  # optax's per-leaf draw, nothing stored
        keys = jax.random.split(key, 2)
        return {
            k: g + jax.random.normal(kk, g.shape) for (k, g), kk in zip(sorted(grads.items()), keys)
        }

    if len(_draw_fusions(unstored)) <= 2:
        pytest.skip("this XLA does not fuse a draw into each of its readers")
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, strategy_name)
    monkeypatch.setattr(
        noise_mod, "NOISE_BLOCK_SIZE", 1 << 10
    )  # a loop of 4 blocks, not one inlined
    draws = _draw_fusions(lambda grads, key: add_gaussian_noise(grads, 1.0, key))
    assert len(draws) == (
        1 if strategy_name == "blocks" else 2
    )  # per leaf; "blocks": one, in its loop
    if strategy_name in ("leaves", "shapes"):
        # the split of the leaves' keys is stored too: a draw reads its key, it does not hash it again
        assert max(draws) < 30, draws


def test_noised_leaves_are_stored_on_every_path(strategy):
    """Each noised leaf leaves add_gaussian_noise (and dp_aggregate's draw) behind an optimization
    barrier, whatever the strategy, under jit, vmap and grad alike."""
    tree = {"a": jnp.ones((6, 5)), "b": jnp.ones(5), "c": jnp.ones((6, 5))}
    jaxpr = jax.make_jaxpr(lambda t, k: add_gaussian_noise(t, 1.0, k))(tree, jax.random.key(0))
    # the leaves and their keys' split ("shapes": and the draw of the two (6, 5) leaves, and its
    # keys held until those leaves exist)
    # ("blocks": the offsets of the leaves' spans of the flat draw, and no split: no leaf is
    # drawn on its own)
    barriers = 3 + (strategy != "blocks") + 2 * (strategy == "shapes") + (strategy == "blocks")
    assert str(jaxpr).count("optimization_barrier") == barriers
    # jitted: eagerly, grad and vmap dispatch (and compile) every operation on its own
    grads = jax.jit(
        jax.grad(
            lambda t: sum(
                jnp.sum(v) for v in add_gaussian_noise(t, 1.0, jax.random.key(0)).values()
            )
        )
    )
    assert all(np.all(np.asarray(g) == 1.0) for g in grads(tree).values())
    batched = jax.jit(jax.vmap(lambda k: add_gaussian_noise(tree, 0.0, k)))(
        jax.random.split(jax.random.key(1), 2)
    )
    np.testing.assert_array_equal(batched["a"], np.ones((2, 6, 5)))


def test_explicitly_sharded_leaf_is_drawn_on_its_own(monkeypatch):
    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices")
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "blocks")
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    key = jax.random.key(5)
    with jax.set_mesh(mesh):
        tree = {
            "s": jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, P("x", None))),
            "r": jax.device_put(jnp.zeros(10), NamedSharding(mesh, P())),
        }
        out = _jitted()(tree, 1.0, key)
        assert out["s"].sharding.spec == P("x", None)
        _, _, ks = jax.random.split(key, 3)  # leaves in key order: 'r', 's'
        expect = jax.random.normal(ks, (16, 4))
    np.testing.assert_allclose(np.asarray(out["s"]), np.asarray(expect), rtol=1e-6)
    assert not np.allclose(np.asarray(out["r"]), np.asarray(expect).ravel()[:10])


def _shard_mapped(f, n):
    mesh = jax.make_mesh((n,), ("x",))
    g = jax.device_put(jnp.zeros(4 * n), NamedSharding(mesh, P("x")))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))), g


@pytest.mark.parametrize("strategy_name", ["leaves", "blocks", "shapes"])
def test_shards_inside_shard_map_need_their_own_keys(strategy_name, monkeypatch):
    """The same key on every device would give every shard the same noise (their differences
    noise-free): a ValueError naming the leaf and the axis, until the key varies too."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, strategy_name)
    key = jax.random.key(0)

    same, g = _shard_mapped(lambda x, k: add_gaussian_noise({"g": x}, 1.0, k)["g"], 4)
    with pytest.raises(
        ValueError,
        match=r"add_gaussian_noise: leaf \['g'\] differs across the manual mesh axes "
        r"\('x',\).*fold_in\(key, jax.lax.axis_index\('x'\)\)",
    ):
        same(g, key)

    def own_key(x, k):
        return add_gaussian_noise({"g": x}, 1.0, jax.random.fold_in(k, jax.lax.axis_index("x")))[
            "g"
        ]

    fixed, g = _shard_mapped(own_key, 4)
    shards = np.asarray(fixed(g, key)).reshape(4, 4)
    assert len({tuple(r) for r in shards.tolist()}) == 4  # every shard its own draw

    def summed(x, k):  # a psum'd (replicated) sum with the replicated key is fine
        total = jax.lax.psum(jnp.sum(x), "x")
        return x + add_gaussian_noise({"t": total}, 1.0, k)["t"]

    ok, g = _shard_mapped(summed, 4)
    assert np.all(np.isfinite(np.asarray(ok(g, key))))


@pytest.mark.parametrize("strategy_name", ["leaves", "blocks", "shapes"])
def test_a_per_device_key_on_a_replicated_sum_is_not_passed_off_as_replicated(
    strategy_name, monkeypatch
):
    """A per-device key (``fold_in(key, axis_index)``) noising a ``psum``'d total draws other
    noise on each device: the result must be typed as varying, so ``out_specs=P()`` is refused,
    not accepted with replicas that silently differ (each one a release of its own). The CPU's
    blocked draw hashes counters with JAX's threefry primitive, which typed its bits as the same
    on every device."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, strategy_name)
    mesh = jax.make_mesh((4,), ("x",))

    def noised_total(x, k):
        total = jax.lax.psum(x, "x")
        return add_gaussian_noise(
            {"t": total}, 1.0, jax.random.fold_in(k, jax.lax.axis_index("x"))
        )["t"]

    g = jax.device_put(jnp.zeros((4, 3)), NamedSharding(mesh, P("x")))
    replicated = jax.jit(
        jax.shard_map(noised_total, mesh=mesh, in_specs=(P("x"), P()), out_specs=P())
    )
    with pytest.raises(ValueError, match="out_specs"):
        replicated(g, jax.random.key(0))
    per_device = jax.jit(
        jax.shard_map(noised_total, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    )
    draws = np.asarray(per_device(g, jax.random.key(0)))
    assert len({tuple(r) for r in draws.tolist()}) == 4  # what each device drew: all different


def test_dp_aggregate_inside_shard_map_on_shards_is_an_error():
    if jax.device_count() < 4:
        pytest.skip("needs 4 (simulated) devices")
    from gradclip_jax import dp_aggregate

    tx = dp_aggregate(1.0, 1.0, 0)
    state = tx.init(None)
    mesh = jax.make_mesh((4,), ("x",))
    grads = jax.device_put(jnp.ones((2, 8)), NamedSharding(mesh, P(None, "x")))

    def f(x):
        return tx.update({"w": x}, state)[0]["w"]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "x"), out_specs=P("x")))
    with pytest.raises(
        ValueError, match=r"dp_aggregate: leaf 0 differs across the manual mesh axes \('x',\)"
    ):
        fn(grads)


def test_unknown_strategy_is_a_value_error_naming_the_setting(monkeypatch):
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "fast")
    with pytest.raises(ValueError, match=r"NOISE_STRATEGY: unknown strategy 'fast'"):
        add_gaussian_noise({"a": jnp.zeros(3)}, 1.0, jax.random.key(0))


def test_shapes_draw_is_chunked_and_each_chunk_is_the_leaves_draw(monkeypatch):
    """A group larger than the stored-draw limit is drawn in chunks: the same values as the
    per-leaf draw, in ceil(members / per-chunk) draws."""
    tree = {f"w{i}": jnp.ones((6, 5)) for i in range(5)}
    key = jax.random.key(9)
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "leaves")
    leaves = _jitted()(tree, 0.5, key)
    monkeypatch.setitem(noise_mod.NOISE_STRATEGY, BACKEND, "shapes")
    monkeypatch.setattr(noise_mod, "_SHAPES_DRAW_MAX", 2 * 30)  # two leaves per stored draw
    counts = primitive_counts(
        jax.make_jaxpr(lambda t, k: add_gaussian_noise(t, 0.5, k))(tree, key).jaxpr
    )
    assert counts["random_bits"] == 3  # chunks of 2, 2 and 1 leaves
    # the leaves, their keys, the chunks' draws and their keys held until their leaves exist
    assert counts["optimization_barrier"] == 5 + 1 + 3 + 3
    shapes = _jitted()(tree, 0.5, key)
    for name in tree:
        np.testing.assert_allclose(
            np.asarray(shapes[name]), np.asarray(leaves[name]), rtol=1e-6, atol=1e-6
        )
