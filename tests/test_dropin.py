"""Drop-in behaviour shared by every transform: optax idioms, state checks, run-time hyperparameters."""

from __future__ import annotations

import functools
import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradclip_jax as gcx
from gradclip_jax._core.validation import renamed_kwarg

# name -> (factory called with these kwargs, its numeric hyperparameters with run-time bad values)
NEG_NAN = (-1.0, math.nan)
TRANSFORMS = {
    "clip_by_global_norm": (gcx.clip_by_global_norm, {"max_norm": 1.0}, {"max_norm": NEG_NAN}),
    "clip_by_norm": (
        gcx.clip_by_norm,
        {"max_norm": 1.0, "min_norm": 0.1},
        {"max_norm": NEG_NAN, "min_norm": NEG_NAN},
    ),
    "clip_by_value": (gcx.clip_by_value, {"max_value": 1.0}, {"max_value": NEG_NAN}),
    "clip": (gcx.clip, {"max_delta": 1.0}, {"max_delta": NEG_NAN}),
    "clip_by_block_rms": (gcx.clip_by_block_rms, {"threshold": 1.0}, {"threshold": NEG_NAN}),
    "normalize": (gcx.normalize, {"norm_value": 1.0}, {"norm_value": NEG_NAN}),
    "centralize": (gcx.centralize, {}, {}),
    "adaptive_grad_clip": (
        gcx.adaptive_grad_clip,
        {"clipping": 0.1},
        {"clipping": NEG_NAN, "eps": NEG_NAN},
    ),
    "clip_norm_by_ema": (
        gcx.clip_norm_by_ema,
        {},
        {
            "beta": (-0.5, 1.5, math.nan),
            "max_ema_growth": NEG_NAN,
            "init": (math.inf, math.nan),
            "min_norm": NEG_NAN,
        },
    ),
    "normalize_by_ema": (
        gcx.normalize_by_ema,
        {},
        {"beta": (1.0, math.nan), "max_ema_growth": NEG_NAN},
    ),
    "clip_value_by_ema": (gcx.clip_value_by_ema, {}, {"beta": (1.5, math.nan), "init": NEG_NAN}),
    "clip_norm_growth": (
        gcx.clip_norm_growth,
        {"add": 1.0},
        {"add": NEG_NAN, "mul": NEG_NAN, "min_value": NEG_NAN, "max_decay": (0.0, math.nan)},
    ),
    "clip_value_growth": (
        gcx.clip_value_growth,
        {"add": 1.0},
        {"add": NEG_NAN, "mul": NEG_NAN, "min_value": NEG_NAN, "max_decay": (-2.0, math.nan)},
    ),
    "autoclip": (
        gcx.autoclip,
        {},
        {"percentile": (-1.0, 101.0, math.nan), "min_norm": NEG_NAN},
    ),
    "zclip": (
        gcx.zclip,
        {"max_grad_norm": 10.0},
        {
            "alpha": (1.0, math.nan),
            "z_thresh": (0.0, math.inf, math.nan),
            "max_grad_norm": NEG_NAN,
            "clip_factor": (-1.0, math.nan),
            "eps": NEG_NAN,
            "rel_std_floor": NEG_NAN,
        },
    ),
    "adagc": (
        gcx.adagc,
        {},
        {
            "clip_ratio": (0.0, math.nan),
            "beta": (1.0, math.nan),
            "warmup_max_norm": NEG_NAN,
            "min_gamma": NEG_NAN,
        },
    ),
    "quantile_clip": (
        gcx.quantile_clip,
        {},
        {"target_quantile": (1.5, math.nan), "learning_rate": NEG_NAN},
    ),
}
STATELESS = [
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip",
    "clip_by_block_rms",
    "normalize",
    "centralize",
    "adaptive_grad_clip",
]


def _tree():
    return {"w": jnp.array([[3.0, -4.0], [1.0, 2.0]]), "b": jnp.array([0.5, -0.25])}


def _update(tx, g, state, params=None):
    return tx.update(g, state, g if params is None else params)


@pytest.mark.parametrize("name", STATELESS)
def test_stateless_update_accepts_none_state(name):
    factory, kwargs, _ = TRANSFORMS[name]
    tx = factory(**kwargs)
    g = _tree()
    out_none, state_none = jax.jit(lambda u: _update(tx, u, None))(g)
    out, state = _update(tx, g, tx.init(g))
    jax.tree_util.tree_map(np.testing.assert_array_equal, out_none, out)
    # a proper state, the one a state from init would have become
    assert type(state_none) is type(state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, state_none, state)


def test_optax_update_none_matches_ours():
    g = _tree()
    for ours, ref in (
        (gcx.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)),
        (gcx.clip(1.0), optax.clip(1.0)),
        (gcx.clip_by_block_rms(1.0), optax.clip_by_block_rms(1.0)),
    ):
        a, _ = ours.update(g, None)
        b, _ = ref.update(g, None)
        jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), a, b)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_plain_optax_inject_hyperparams_with_default_structural_args(name):
    factory, kwargs, hps = TRANSFORMS[name]
    tx = optax.inject_hyperparams(factory)(**kwargs)
    g = _tree()
    state = tx.init(g)
    assert set(hps) <= set(state.hyperparams)
    assert not set(getattr(factory, "static_args", ())) & set(state.hyperparams)
    step = jax.jit(lambda u, s: _update(tx, u, s))
    out, state = step(g, state)
    out, state = step(g, state)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(out))


@pytest.mark.parametrize(
    "name,arg,value",
    [
        ("clip_by_global_norm", "ord", 1),
        ("zclip", "warmup_steps", 3),
        ("autoclip", "history_size", 10),
        ("centralize", "min_size", 1),
    ],
)
def test_passing_a_structural_arg_to_optax_inject_lists_all_of_them(name, arg, value):
    factory, kwargs, _ = TRANSFORMS[name]
    tx = optax.inject_hyperparams(factory)(**kwargs, **{arg: value})
    g = _tree()
    state = tx.init(g)
    with pytest.raises(TypeError, match="static_args") as err:
        jax.jit(lambda u, s: _update(tx, u, s))(g, state)
    assert name in str(err.value)
    for static in factory.static_args:
        assert repr(static) in str(err.value)
    # the fix the message names works
    tx = gcx.inject_hyperparams(factory)(**kwargs, **{arg: value})
    jax.jit(lambda u, s: _update(tx, u, s))(g, tx.init(g))


@pytest.mark.parametrize("name", sorted(n for n in TRANSFORMS if TRANSFORMS[n][2]))
def test_invalid_traced_hyperparameters_give_an_all_nan_update(name):
    factory, kwargs, hps = TRANSFORMS[name]
    tx = optax.inject_hyperparams(factory)(**kwargs)
    g = _tree()
    step = jax.jit(lambda u, s: _update(tx, u, s))
    for hp, bads in hps.items():
        for bad in bads:
            state = tx.init(g)
            _, state = step(g, state)  # one valid step first (stateful ones have history)
            state.hyperparams[hp] = jnp.asarray(bad, state.hyperparams[hp].dtype)
            out, _ = step(g, state)
            for leaf in jax.tree_util.tree_leaves(out):
                assert bool(jnp.all(jnp.isnan(leaf))), (hp, bad, leaf)


@pytest.mark.parametrize(
    "name", ["clip_by_global_norm", "clip_by_value", "clip_norm_by_ema", "zclip"]
)
def test_invalid_schedule_value_is_caught_by_apply_if_finite(name):
    # apply_if_finite checks the updates it is given: it wraps the optimizer after the clipper
    factory, kwargs, hps = TRANSFORMS[name]
    hp = next(iter(hps))
    good = {**kwargs}.get(hp, 0.5 if hp in ("beta", "alpha") else 1.0)
    sched = lambda count: jnp.where(count >= 1, -1.0 if hp not in ("beta", "alpha") else 1.5, good)  # noqa: E731
    tx = optax.chain(factory(**{**kwargs, hp: sched}), optax.apply_if_finite(optax.sgd(0.1), 3))
    params = _tree()
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(p, s, p))
    upd, state = step(params, state)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(upd))
    upd, state = step(params, state)  # the schedule turned invalid: the step is skipped
    assert int(state[1].notfinite_count) == 1
    assert all(bool(jnp.all(x == 0)) for x in jax.tree_util.tree_leaves(upd))
    if hasattr(state[0], "exp_avg") or hasattr(state[0], "mean"):
        assert int(state[0].count) == 1  # a stateful clipper's statistics did not absorb the step


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_a_chain_state_gives_a_clear_error(name):
    factory, kwargs, _ = TRANSFORMS[name]
    tx = factory(**kwargs)
    chain = optax.chain(factory(**kwargs), optax.sgd(0.1))
    g = _tree()
    with pytest.raises(TypeError, match=f"{name}.*optax.chain"):
        _update(tx, g, chain.init(g))


def _distinct_buffers(state):
    """No two array leaves of ``state`` share a device buffer (jit rejects donating one twice)."""
    leaves = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
    pointers = [x.unsafe_buffer_pointer() for x in leaves]
    return len(set(pointers)) == len(pointers)


DONATED = {
    name: (lambda f=factory, kw=kwargs: f(**kw))
    for name, (factory, kwargs, _) in TRANSFORMS.items()
}
DONATED["skip_on_spike(zclip)"] = lambda: gcx.skip_on_spike(gcx.zclip())
DONATED["chain(clip_norm_by_ema, zclip, adamw)"] = lambda: optax.chain(
    gcx.clip_norm_by_ema(), gcx.zclip(), optax.adamw(1e-3)
)


@pytest.mark.parametrize("name", sorted(DONATED))
def test_state_can_be_donated_to_a_jitted_step(name):
    # Training loops donate the optimizer state (jax.jit(step, donate_argnums=...)); a state whose
    # leaves share one buffer fails there on the first step with "donate the same buffer twice".
    tx = DONATED[name]()
    g = _tree()
    state = tx.init(g)
    assert _distinct_buffers(state)
    plain = jax.jit(lambda u, s: _update(tx, u, s))
    donated = jax.jit(lambda u, s: _update(tx, u, s), donate_argnums=1)
    for step in (
        donated,
        plain,
        donated,
        donated,
    ):  # a plain step may forward inputs to its outputs
        _, state = step(g, state)
        assert _distinct_buffers(state)


PER_LEAF = [
    "clip_by_norm",
    "clip_by_block_rms",
    "adaptive_grad_clip",
    "clip_norm_by_ema",
    "normalize_by_ema",
    "clip_value_by_ema",
    "clip_norm_growth",
    "clip_value_growth",
    "adagc",
]
SHAPED = ["clip_norm_by_ema", "normalize_by_ema", "clip_value_by_ema", "clip_value_growth"]


@pytest.mark.parametrize("name", PER_LEAF)
def test_state_initialised_on_another_tree_names_the_leaf(name):
    factory, kwargs, _ = TRANSFORMS[name]
    tx = factory(**kwargs)
    state = tx.init({"w": jnp.ones((2, 2)), "c": jnp.ones(2)})
    g = _tree()
    with pytest.raises(ValueError, match=rf"{name}.*\['b'\]"):
        _update(tx, g, state)


@pytest.mark.parametrize("name", SHAPED)
def test_state_of_other_shapes_names_the_leaf(name):
    factory, kwargs, _ = TRANSFORMS[name]
    tx = factory(**kwargs)
    g = _tree()
    state = tx.init({"w": jnp.ones((2, 3)), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match=rf"{name}.*\['w'\].*\(2, 2\).*\(2, 3\)"):
        _update(tx, g, state)


SLICED = {
    "clip_by_norm(dim=0, inverse_dims=True)": lambda: gcx.clip_by_norm(
        1.0, dim=0, inverse_dims=True
    ),
    "normalize(dim=1)": lambda: gcx.normalize(dim=1),
    "clip_by_norm(dim=-1, min_norm)": lambda: gcx.clip_by_norm(1.0, dim=-1, min_norm=0.1),
    "adaptive_grad_clip": lambda: gcx.adaptive_grad_clip(0.1),
}


@pytest.mark.parametrize("name", sorted(SLICED))
def test_state_of_other_slice_shapes_names_the_leaf(name):
    # per-slice norms: updates of another shape used to give a state of another shape (breaks lax.scan)
    tx = SLICED[name]()
    fn = name.split("(")[0]
    state = tx.init({"w": jnp.ones((2, 3))})
    # one norm per row (4 rows instead of 2), or for AGC per output unit (5 columns instead of 3)
    other = {"w": jnp.ones((2, 5))} if name.startswith("adaptive") else {"w": jnp.ones((4, 3))}
    with pytest.raises(
        ValueError,
        match=rf"^{fn}: leaf \['w'\] has shape {re.escape(str(other['w'].shape))}.*"
        r"initialised with shape \((2|3),\)",
    ):
        _update(tx, other, state, other)
    # the same shapes: fine, and the state keeps its shapes
    g = {"w": jnp.full((2, 3), 2.0)}
    _, new = _update(tx, g, state, g)
    assert jax.tree.map(jnp.shape, new) == jax.tree.map(jnp.shape, state)


NONE_MEANS_OFF = {
    ("clip_by_norm", "max_norm"),
    ("clip_by_norm", "min_norm"),
    ("zclip", "max_grad_norm"),
    ("clip_norm_by_ema", "max_ema_growth"),
    ("normalize_by_ema", "max_ema_growth"),
    ("adagc", "warmup_max_norm"),
} | {
    (g, hp)
    for g in ("clip_norm_growth", "clip_value_growth")
    for hp in ("add", "mul", "min_value", "max_decay")
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_wrong_types_are_type_errors_and_wrong_values_value_errors(name):
    factory, kwargs, hps = TRANSFORMS[name]
    for hp in hps:
        none_ok = (name, hp) in NONE_MEANS_OFF
        bad_types = ("1.0", object()) if none_ok else (None, "1.0", object())
        for bad in bad_types:
            with pytest.raises(TypeError, match=rf"{name}.*{hp}"):
                factory(**{**kwargs, hp: bad})
        with pytest.raises(ValueError, match=rf"{name}.*{hp}"):
            factory(**{**kwargs, hp: math.nan})


@pytest.mark.parametrize("name", sorted(n for n in TRANSFORMS if TRANSFORMS[n][2]))
def test_complex_and_sequence_hyperparameters_are_type_errors_naming_the_argument(name):
    # complex used to raise a bare "float() argument must be ..." and [1.0] was accepted
    factory, kwargs, hps = TRANSFORMS[name]
    for hp in hps:
        for bad in (1 + 2j, np.complex64(1.0), jnp.asarray(1 + 0j), [1.0], (1.0,)):
            with pytest.raises(TypeError, match=rf"^{name}: `{hp}` must be a"):
                factory(**{**kwargs, hp: bad})


@pytest.mark.parametrize(
    "factory,hp",
    [
        (gcx.dp_aggregate, "l2_norm_clip"),
        (gcx.dp_noise, "stddev"),
        (gcx.per_example_global_norm_clip, "l2_norm_clip"),
    ],
)
def test_complex_and_list_hyperparameters_outside_the_transform_table(factory, hp):
    kwargs = (
        {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "seed": 0}
        if factory is gcx.dp_aggregate
        else (
            {"stddev": 1.0, "seed": 0} if factory is gcx.dp_noise else {"grads": [jnp.ones((2, 3))]}
        )
    )
    for bad in (1 + 2j, [1.0]):
        with pytest.raises(TypeError, match=rf"`{hp}` must be a"):
            factory(**{**kwargs, hp: bad})


@pytest.mark.parametrize(
    "make",
    [
        lambda d: gcx.clip_by_norm(1.0, dim=d),
        lambda d: gcx.normalize(dim=d),
        lambda d: gcx.centralize(dim=d),
    ],
)
def test_dim_that_no_leaf_has_raises(make):
    g = _tree()
    tx = make(5)
    with pytest.raises(ValueError, match=r"dim=\(5,\)"):
        tx.update(g, tx.init(g))
    tx = make((1, 5))  # some leaves have axis 1: fine, the vector is left alone
    out, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(out["b"], g["b"])


@pytest.mark.parametrize(
    "make",
    [
        lambda d, i: gcx.clip_by_norm(0.1, dim=d, inverse_dims=i),
        lambda d, i: gcx.normalize(3.0, dim=d, inverse_dims=i),
        lambda d, i: gcx.centralize(dim=d, inverse_dims=i),
    ],
)
def test_leaves_lacking_the_dim_axes_are_unchanged(make):
    # as the docstrings say: a leaf without any of the axes (or, with inverse_dims, with no axis left)
    # is left unchanged; the others are transformed; dim=5 (no leaf has it) raises, inverse or not
    g = _tree()
    for dim, inv in ((1, False), ((1, 7), False), (0, True)):
        tx = make(dim, inv)
        out, _ = tx.update(g, tx.init(g))
        np.testing.assert_array_equal(out["b"], g["b"])
        assert not np.array_equal(out["w"], g["w"])
    with pytest.raises(ValueError, match=r"no leaf has any of the axes dim=\(5,\)"):
        tx = make(5, True)
        tx.update(g, tx.init(g))


def test_leaf_norms_dim_that_no_leaf_has_raises():
    with pytest.raises(ValueError, match="dim"):
        gcx.leaf_norms(_tree(), dim=-3)


def test_centralize_leaves_0d_leaves_unchanged_with_min_size_1():
    tx = gcx.centralize(min_size=1)
    g = {"s": jnp.asarray(2.5), "v": jnp.array([1.0, 3.0])}
    out, _ = tx.update(g, tx.init(g))
    assert float(out["s"]) == 2.5
    np.testing.assert_allclose(out["v"], [-1.0, 1.0])


@pytest.mark.parametrize(
    "clipper",
    [
        gcx.clip_by_global_norm(1.0),
        gcx.clip_by_norm(1.0),
        gcx.clip_by_block_rms(0.5),
        gcx.adaptive_grad_clip(0.1),
    ],
)
def test_skip_on_spike_with_stateless_clippers(clipper):
    tx = gcx.skip_on_spike(clipper, field="clipped")
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    small = {"w": jnp.full((2, 2), 1e-3)}
    out, state = tx.update(small, state, params)
    np.testing.assert_array_equal(out["w"], small["w"])
    out, state = tx.update({"w": jnp.full((2, 2), 10.0)}, state, params)
    assert bool(state.skipped) and int(state.num_skipped) == 1
    np.testing.assert_array_equal(out["w"], 0.0)


def test_skip_on_spike_rejects_flagless_transforms():
    with pytest.raises(ValueError, match="clipped"):
        gcx.skip_on_spike(gcx.clip_by_value(1.0), field="clipped").init(_tree())


def test_norms_from_state_with_two_clippers_and_multi_transform():
    tx = optax.chain(gcx.clip_by_global_norm(1.0), gcx.clip_by_norm(10.0), optax.adam(1e-3))
    params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
    state = tx.init(params)
    with pytest.raises(KeyError):
        optax.tree_utils.tree_get(state, "norm")  # why norms_from_state exists
    _, state = jax.jit(tx.update)(
        {"w": jnp.array([3.0, 4.0]), "b": jnp.array([12.0])}, state, params
    )
    norms = gcx.norms_from_state(state)
    assert set(norms) == {"0/norm", "1/norm/w", "1/norm/b"}
    np.testing.assert_allclose(norms["0/norm"], 13.0)
    np.testing.assert_allclose(norms["1/norm/w"], 5.0 / 13.0, rtol=1e-6)
    assert set(gcx.norms_from_state(state, "clipped")) == {
        "0/clipped",
        "1/clipped/w",
        "1/clipped/b",
    }

    mt = optax.multi_transform(
        {"a": gcx.clip_by_global_norm(1.0), "z": gcx.zclip()}, {"w": "a", "b": "z"}
    )
    state = mt.init(params)
    _, state = mt.update({"w": jnp.array([3.0, 4.0]), "b": jnp.array([2.0])}, state, params)
    norms = gcx.norms_from_state(state)
    assert {k.split("/")[1] for k in norms} == {"a", "z"}
    assert sorted(float(v) for v in norms.values()) == [2.0, 5.0]


def test_norms_from_state_under_flax_nnx():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(
        model, optax.chain(gcx.clip_by_global_norm(1.0), optax.sgd(0.1)), wrt=nnx.Param
    )

    def loss(m):
        return jnp.sum(m(jnp.ones((1, 2))) ** 2)

    grads = nnx.grad(loss)(model)
    opt.update(model, grads)
    norms = gcx.norms_from_state(opt.opt_state)
    assert list(norms) == ["0/norm"]
    assert isinstance(norms["0/norm"], jax.Array)
    expected = gcx.tree_norm(jax.tree_util.tree_leaves(nnx.state(grads)))
    np.testing.assert_allclose(norms["0/norm"], expected, rtol=1e-6)


def test_norms_from_state_finds_norms_in_nnx_state_objects():
    # nnx.State turns each NamedTuple into a mapping of its fields: norms_from_state returned {} there
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 3, rngs=rngs)
            self.norm = nnx.LayerNorm(
                3, rngs=rngs
            )  # adam's mu has a key 'norm' too: not a clipper's state

        def __call__(self, x):
            return self.norm(self.lin(x))

    model = Model(nnx.Rngs(0))
    tx = optax.chain(
        gcx.clip_by_global_norm(1.0),
        gcx.skip_on_spike(gcx.zclip()),
        gcx.inject_hyperparams(gcx.clip_by_norm)(10.0),
        optax.adam(1e-3),
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2))) ** 2))(model)
    opt.update(model, grads)
    want = gcx.norms_from_state(opt.opt_state)
    assert want["0/norm"].shape == () and "2/inner_state/norm/lin/kernel" in want and len(want) == 6
    for field in ("norm", "clipped"):
        want = gcx.norms_from_state(opt.opt_state, field)
        for state in (nnx.state(opt), nnx.split(opt)[1], nnx.state(opt, nnx.OptState)):
            got = gcx.norms_from_state(state, field)
            assert list(got) == [f"opt_state/{k}" for k in want]
            for k, v in want.items():
                assert isinstance(got[f"opt_state/{k}"], jax.Array)
                np.testing.assert_array_equal(got[f"opt_state/{k}"], v)


def test_renamed_kwarg_warns_and_rejects_both():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert renamed_kwarg("f", "old", "new", 3, None) == 3
    assert issubclass(w[0].category, DeprecationWarning) and "`old`" in str(w[0].message)
    assert renamed_kwarg("f", "old", "new", None, 4) == 4
    with pytest.raises(TypeError, match="both"):
        renamed_kwarg("f", "old", "new", 3, 4)


EAGER = dict(DONATED)
EAGER["clip_by_global_norm(ord=1)"] = lambda: gcx.clip_by_global_norm(1.0, ord=1)
EAGER["dp_noise"] = lambda: gcx.dp_noise(1.0, 0)


class _Compiles:
    """Counts XLA compilations (JAX's backend-compile event) while active, and programs read back
    from a persistent compilation cache instead (CI shares one between its stages): either is a
    program that was not in memory."""

    EVENTS = (
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",
    )

    def __init__(self):
        self.count = 0

    def _listen(self, event, duration, **kwargs):
        if event in self.EVENTS:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def _eager_tree(seed, scale):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w": scale * jax.random.normal(k1, (6, 5)), "b": scale * jax.random.normal(k2, (5,))}


def test_compile_counter_sees_a_compilation():
    # the eager tests below assert a count of zero: this one makes sure the counter counts
    with _Compiles() as fresh:
        jax.jit(lambda x: x * 3 + 1)(jnp.ones(7)).block_until_ready()
    assert fresh.count >= 1


@pytest.mark.parametrize("name", sorted(EAGER))
def test_eager_steps_compile_nothing_after_the_first(name):
    # Notebook users call tx.update eagerly, as optax allows. A lax.cond (or a reducer
    # closure) made per call was traced and compiled again on every eager step: a 0.2 s
    # clip_by_global_norm step against optax's 3 ms. After one step on a tree of normal
    # values and one on a tree whose sum of squares overflows float32 (the norm's
    # fallback), further steps on new values of the same shapes compile nothing.
    tx = EAGER[name]()
    params = _eager_tree(0, 1.0)
    state = tx.init(params)
    for seed, scale in ((1, 1.0), (2, 1e25)):
        _, state = _update(tx, _eager_tree(seed, scale), state, params)
    with _Compiles() as later:
        for seed, scale in ((3, 1.0), (4, 1e25), (5, 2.0)):
            out, state = _update(tx, _eager_tree(seed, scale), state, params)
            jax.block_until_ready((out, state))
    assert later.count == 0


@functools.cache
def _fallback_clippers():
    """The clippers with a norm fallback, each with its jitted step: one program for every scale
    (under jit the fallback is a lax.cond, chosen at run time)."""
    txs = (gcx.clip_by_global_norm(1.0), gcx.clip_by_norm(0.5), gcx.adaptive_grad_clip(0.05))
    return [(tx, jax.jit(lambda u, t=tx: _update(t, u, t.init(u)))) for tx in txs]


@pytest.mark.parametrize("scale", [1.0, 1e25, 1e-30])
def test_eager_norm_fallback_equals_jit(scale):
    # Eagerly the norm's overflow/underflow fallback is chosen in Python; under jit by lax.cond.
    g = {"w": scale * jnp.arange(-4.0, 8.0).reshape(3, 4), "b": jnp.full((3,), 3.0 * scale)}
    for tx, step in _fallback_clippers():
        eager, _ = _update(tx, g, tx.init(g))
        jitted, _ = step(g)
        for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
            assert np.all(np.isfinite(a))


def _per_example(seed, scale):  # 4 examples, one of them all zeros
    return jax.tree_util.tree_map(
        lambda x: jnp.stack([x, 2 * x, 0 * x, x + 1]), _eager_tree(seed, scale)
    )


def _aggregate(tx):
    state = [tx.init(_eager_tree(0, 1.0))]

    def step(g):
        out, state[0] = tx.update(g, state[0])
        return out, state[0]

    return step


EAGER_FUNCTIONS = {
    "clip_grad_norm": (lambda: lambda g: gcx.clip_grad_norm(g, 1.0), _eager_tree),
    "normalize_grads": (lambda: lambda g: gcx.normalize_grads(g, 1.0), _eager_tree),
    "leaf_norms": (lambda: gcx.leaf_norms, _eager_tree),
    "tree_norm(ord=4)": (lambda: lambda g: gcx.tree_norm(g, 4), _eager_tree),
    "per_example_global_norm_clip": (
        lambda: lambda g: gcx.per_example_global_norm_clip(g, 1.0),
        _per_example,
    ),
    "per_example_layer_norm_clip": (
        lambda: lambda g: gcx.per_example_layer_norm_clip(g, 1.0),
        _per_example,
    ),
    "dp_aggregate": (lambda: _aggregate(gcx.dp_aggregate(1.0, 1.0, 0, batch_size=4)), _per_example),
    "dp_quantile_aggregate": (
        lambda: _aggregate(
            gcx.dp_quantile_aggregate(1.0, 0, expected_batch_size=4, count_noise_std=5.0)
        ),
        _per_example,
    ),
}


@pytest.mark.parametrize("name", sorted(EAGER_FUNCTIONS))
def test_eager_functions_compile_nothing_after_the_first(name):
    make, data = EAGER_FUNCTIONS[name]
    fn = make()
    for seed, scale in ((1, 1.0), (2, 1e25)):
        jax.block_until_ready(fn(data(seed, scale)))
    with _Compiles() as later:
        for seed, scale in ((3, 1.0), (4, 1e25), (5, 2.0)):
            jax.block_until_ready(fn(data(seed, scale)))
    assert later.count == 0
