"""Ghost clipping on the code that real libraries' models run (and on plain-JAX reductions of
it): each case is checked against ``method='vmap'`` (per-example gradients formed), to 1e-5
relative in float32. The library models are ``tools.coverage_real``'s builders; each test
skips when its library is not installed."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradclip_jax import clipped_grad, ghost_report
from tests.per_example.ghost.test_scan import D, _data, _w
from tests.per_example.models import vmap_reference, xent
from tools import coverage_real as cr


def ghost_equals_vmap(loss, params, data, **kw):
    """Ghost and vmap at the median per-example norm: norms and clipped sums to 1e-5 relative."""

    # the clip norm an argument: one compilation per method (vmap's shared by the sum modes)
    _, everyone = vmap_reference(loss, params, data, jnp.float32(1e30), **kw)
    clip = jnp.float32(np.median(np.asarray(everyone.norms)))
    want, want_info = vmap_reference(loss, params, data, clip, **kw)
    ghost = jax.jit(lambda p, b, c: clipped_grad(loss, c, method="ghost", **kw)(p, b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback warning: the report below says which
        got, got_info = ghost(params, data, clip)
    nv = np.asarray(want_info.norms, np.float64)
    np.testing.assert_allclose(np.asarray(got_info.norms), nv, rtol=1e-5, atol=1e-5 * nv.max())
    scale = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * scale)


def _model(name):
    model = next(m for m in cr.MODELS if m.name == name)
    try:
        return model.build()
    except ImportError as err:
        pytest.skip(f"{name}: {err}")


# ----------------------------------------------------------------------------
# A leaf used several times with the batch on axis 1 of its products (jax.vmap of W @ x)
# ----------------------------------------------------------------------------


@functools.cache  # one loss function: the sum modes share its vmap program
def _vmapped_tied_setup():
    """``jax.vmap`` of ``W @ tanh(W @ x)`` (equinox's ``Linear``, the weight used twice), a head."""
    r = np.random.default_rng(0)
    params = {"w": _w(r, D, D), "head": _w(r, D, 4)}

    def loss(p, b):
        h = jax.vmap(lambda x: p["w"] @ jnp.tanh(p["w"] @ x))(jnp.mean(b["x"], axis=1))
        return xent(h @ p["head"], b["y"])

    return loss, params, _data(0)


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_tied_leaf_whose_products_carry_the_batch_on_axis_1(ghost_sum):
    """``jax.vmap`` of ``W @ x`` (equinox's ``Linear``) puts the batch on axis 1 of the product; a
    leaf used twice so has its per-example gradients formed from those uses, mapped over axis 1
    (they were mapped over axis 0: "vmap got inconsistent sizes")."""
    loss, params, data = _vmapped_tied_setup()
    assert dict(ghost_report(loss, params, data).ghost)["['w']"] == "tied:dense+dense"
    ghost_equals_vmap(loss, params, data, ghost_sum=ghost_sum)


# ----------------------------------------------------------------------------
# Flattened tokens whose rows move to another axis (keras-hub Mixtral's experts and routing)
# ----------------------------------------------------------------------------

E = 3  # experts


@functools.cache  # one loss function: the sum modes share its vmap program
def _moe_setup(seed=1, mix=False):
    """keras-hub Mixtral's sparse block written out: tokens flattened to ``(B * T, D)``, routing
    weights transposed to ``(E, B * T)``, every expert at once by ``einsum('th,ehm->etm')`` (the
    rows on axis 1) and ``einsum('etm,emh->eth')`` (a product over the experts), weighted and summed over the experts, reshaped back to ``(B, T, D)``. With
    ``mix``, the routing weights are also averaged over all rows (over the batch)."""
    r = np.random.default_rng(seed)
    params = {
        "gate": _w(r, D, E),
        "up": _w(r, E, D, 2 * D),
        "down": _w(r, E, 2 * D, D),
        "head": _w(r, D, 4),
    }

    def loss(p, b):
        n, t, _ = b["x"].shape
        x = b["x"].reshape(-1, D)
        routing = jnp.transpose(jax.nn.softmax(x @ p["gate"], axis=-1), (1, 0))  # (E, B*T)
        if mix:
            routing = routing - jnp.mean(routing, axis=1, keepdims=True)
        h = jax.nn.gelu(jnp.einsum("th,ehm->etm", x, p["up"]))
        out = jnp.sum(jnp.einsum("etm,emh->eth", h, p["down"]) * routing[:, :, None], axis=0)
        return xent(jnp.mean(out.reshape(n, t, D), axis=1) @ p["head"], b["y"])

    return loss, params, _data(seed)


def test_mixture_of_experts_on_flattened_tokens_keeps_the_ghost_path():
    loss, params, data = _moe_setup()
    report = ghost_report(loss, params, data)
    assert report.fallback == [] and dict(report.ghost)["['up']"] == "dense"
    assert (
        dict(report.ghost)["['down']"] == "formed:dense"
    )  # a product with a batch dimension (the experts)
    ghost_equals_vmap(loss, params, data)


def test_a_reduction_over_the_moved_rows_combines_examples():
    loss, params, data = _moe_setup(mix=True)
    with pytest.raises(ValueError, match="combines examples at 'reduce_sum'"):
        clipped_grad(loss, 1.0, method="ghost")(params, data)


@pytest.mark.slow  # keras-hub: about a minute to trace and compile on 2 cores
def test_keras_hub_mixtral():
    loss, params, data = _model("keras-hub-mixtral")
    report = ghost_report(loss, params, data)
    assert report.fallback == []
    ghost_equals_vmap(loss, params, data)


# ----------------------------------------------------------------------------
# BatchNorm statistics: the clear error, naming BatchNorm and the remedies
# ----------------------------------------------------------------------------

_REMEDIES = r"BatchNorm.*GroupNorm or LayerNorm.*use_running_average=True"


@pytest.mark.parametrize("scope", ["conv1_bn", "stack0_block0_1_bn", "batch_normalization"])
def test_batch_statistics_in_a_keras_named_layer_are_named_batchnorm(scope):
    """Keras names a BatchNormalization layer ``batch_normalization`` and keras-hub's ResNet
    ``conv1_bn``: a batch mean inside such a name scope gets the BatchNorm error."""
    r = np.random.default_rng(2)
    params = {"w": _w(r, D, 4)}

    def loss(p, b):
        h = b["x"] @ p["w"]
        with jax.named_scope(scope):
            h = h - jnp.mean(h, axis=0)
        return xent(jnp.mean(h, axis=1), b["y"])

    with pytest.raises(ValueError, match=f"BatchNorm layer '{scope}'.*GroupNorm or LayerNorm"):
        clipped_grad(loss, 1.0, method="ghost")(params, _data(2))


def test_a_scope_merely_containing_bn_is_not_named_batchnorm():
    r = np.random.default_rng(2)
    params = {"w": _w(r, D, 4)}

    def loss(p, b):
        with jax.named_scope("cbnet_embedding"):
            h = b["x"] @ p["w"]
        return xent(jnp.mean(h - jnp.mean(h, axis=0), axis=1), b["y"])

    with pytest.raises(ValueError, match="combines examples at 'reduce_sum'"):
        clipped_grad(loss, 1.0, method="ghost")(params, _data(2))


@pytest.mark.parametrize(
    "name",
    [
        "nnx-batchnorm",
        "linen-batchnorm",
        "haiku-resnet-train",
        pytest.param("keras-hub-resnet-train", marks=pytest.mark.slow),
    ],
)  # 27 s
def test_batchnorm_in_training_mode_gets_the_clear_error(name):
    """From clipped_grad (both methods) and from ghost_report (nnx's BatchStat update failed
    there with flax's TraceContextError)."""
    loss, params, data = _model(name)
    for method in ("ghost", "vmap"):
        with pytest.raises(ValueError, match=_REMEDIES):
            clipped_grad(loss, 1.0, method=method)(params, data)
    if name == "nnx-batchnorm":
        with pytest.raises(ValueError, match=_REMEDIES):
            ghost_report(loss, params, data)


# ----------------------------------------------------------------------------
# Parameters broadcast over the batch, computed with constants, or summed, before their use
# ----------------------------------------------------------------------------


@functools.cache  # one loss function: the sum modes share its vmap program
def _bias_setup(seed=3, how="broadcast_to"):
    r = np.random.default_rng(seed)
    params = {
        "w": _w(r, D, D),
        "b": 0.1 * _w(r, D),
        "pos": 0.5 * _w(r, 8, D),
        "scale": 0.1 * _w(r, D),
        "head": _w(r, D, 4),
    }
    # frozen BatchNorm statistics, closed over: constants of the traced loss
    mean, var = (
        jnp.asarray(r.normal(size=D), jnp.float32),
        jnp.asarray(r.uniform(0.5, 2.0, size=D), jnp.float32),
    )

    def loss(p, b):
        n, t, _ = b["x"].shape
        if how == "broadcast_to":  # haiku's Linear, keras' PositionEmbedding
            h = b["x"] @ p["w"] + jnp.broadcast_to(p["b"], (n, t, D))
            h = h + jnp.broadcast_to(p["pos"][:t], (n, t, D))
        else:  # the batch on axis 1 of the sum: (T, B, D) + b
            h = jnp.einsum("btd,de->tbe", b["x"], p["w"]) + p["b"]
            h = jnp.transpose(h, (1, 0, 2)) + p["pos"][:t]
        h = jnp.tanh(h) * (1.0 + p["scale"])  # Gemma's RMSNorm scale
        h = (h - mean) * (
            p["scale"] * jax.lax.rsqrt(var + 1e-5)
        )  # a BatchNorm with frozen statistics
        return xent(jnp.mean(h, axis=1) @ p["head"], b["y"])

    return loss, params, _data(seed)


@pytest.mark.parametrize("how", ["broadcast_to", "batch_on_axis_1"])
@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_broadcast_and_computed_parameters_keep_the_ghost_path(how, ghost_sum):
    """A bias or position table broadcast over the batch (``jnp.broadcast_to(b, out.shape)``), a
    bias added with the batch on axis 1, ``1 + scale`` and ``scale * rsqrt(var + eps)`` with
    constant statistics: each an elementwise site, the leaf's gradient pulled back through its
    chain (they fell back: "used by 'add'", "used by 'mul'")."""
    loss, params, data = _bias_setup(how=how)
    report = ghost_report(loss, params, data)
    assert report.fallback == []
    assert (
        dict(report.ghost)["['b']"] == "elementwise"
        and dict(report.ghost)["['scale']"] == "tied:elementwise+elementwise"
    )
    ghost_equals_vmap(loss, params, data, ghost_sum=ghost_sum)


def test_a_dense_weight_computed_with_a_constant_has_its_gradients_formed():
    """``x @ (2 * w)``: the dense rule would measure the gradient with respect to ``2 * w``, twice
    the leaf's, so that leaf's per-example gradients are formed (pulled back through ``2 * w``)."""
    r = np.random.default_rng(4)
    params = {"w": _w(r, D, 4)}

    def loss(p, b):
        return xent(jnp.mean(b["x"], axis=1) @ (2.0 * p["w"]), b["y"])

    data = _data(4)
    assert dict(ghost_report(loss, params, data).ghost)["['w']"] == "formed:dense"
    ghost_equals_vmap(loss, params, data)


def test_a_bias_broadcast_over_as_many_positions_as_examples_keeps_the_ghost_path():
    """A bias broadcast along the positions when there are as many positions as examples: only
    the batch axis's broadcast is made for one example, so the use is measured at axis 0 alone."""
    r = np.random.default_rng(5)
    params = {"w": _w(r, D, D), "b": 0.1 * _w(r, D), "head": _w(r, D, 4)}
    data = _data(5)
    n = data["x"].shape[0]
    data = {**data, "x": jnp.tile(data["x"], (1, 2, 1))[:, :n]}  # T == B

    def loss(p, b):
        m, t, _ = b["x"].shape  # (B, B, D) on the whole batch
        h = b["x"] @ p["w"] + jnp.broadcast_to(p["b"], (m, t, D))  # both leading axes of length B
        return xent(jnp.mean(jnp.tanh(h), axis=1) @ p["head"], b["y"])

    assert ghost_report(loss, params, data).fallback == []
    ghost_equals_vmap(loss, params, data)


@functools.cache  # one loss function: the sum modes share its vmap program
def _summed_leaves_setup(seed=6):
    """keras' BatchNormalization with frozen statistics (``x * inv + (offset - mean * inv)``, the
    offset added to a value of the scale), and flax's ``OptimizedLSTMCell`` (the gates' kernels and
    biases joined by ``concatenate`` before one product)."""
    r = np.random.default_rng(seed)
    params = {
        "gamma": 1.0 + 0.1 * _w(r, D),
        "beta": 0.1 * _w(r, D),
        "k": [_w(r, D, D) for _ in range(3)],
        "b": [0.1 * _w(r, D) for _ in range(3)],
        "head": _w(r, 3 * D, 4),
    }
    mean, var = (
        jnp.asarray(r.normal(size=D), jnp.float32),
        jnp.asarray(r.uniform(0.5, 2.0, size=D), jnp.float32),
    )

    def loss(p, b):
        inv = jax.lax.rsqrt(var + 1e-3) * p["gamma"]
        h = b["x"] * inv + (-mean * inv + p["beta"])
        y = h @ jnp.concatenate(p["k"], axis=-1) + jnp.concatenate(p["b"], axis=-1)
        return xent(jnp.mean(jnp.tanh(y), axis=1) @ p["head"], b["y"])

    return loss, params, _data(seed)


@pytest.mark.parametrize("ghost_sum", ["backward", "bookkeeping"])
def test_leaves_summed_or_joined_before_their_use_keep_the_ghost_path(ghost_sum):
    """Each leaf of a sum or concatenation of leaves' values is measured through it, the others'
    values zeroed (every later step is linear in it); they fell back ("used by 'add'",
    "used by 'concatenate'")."""
    loss, params, data = _summed_leaves_setup()
    report = ghost_report(loss, params, data)
    assert report.fallback == []
    kinds = dict(report.ghost)
    assert kinds["['k'][0]"] == "formed:dense" and kinds["['b'][1]"] == "elementwise"
    assert (
        kinds["['gamma']"] == "tied:elementwise+elementwise" and kinds["['beta']"] == "elementwise"
    )
    ghost_equals_vmap(loss, params, data, ghost_sum=ghost_sum)


def test_a_nonlinear_step_after_a_sum_of_leaves_falls_back():
    """``exp(a + b)``: the gradient with respect to ``a`` depends on ``b``'s value, which the
    replay of ``a``'s chain does not have."""
    r = np.random.default_rng(7)
    params = {"a": 0.1 * _w(r, D), "b": 0.1 * _w(r, D), "head": _w(r, D, 4)}

    def loss(p, b):
        return xent(jnp.mean(b["x"] * jnp.exp(p["a"] + p["b"]), axis=1) @ p["head"], b["y"])

    data = _data(7)
    assert {path for path, _ in ghost_report(loss, params, data).fallback} == {"['a']", "['b']"}
    ghost_equals_vmap(loss, params, data)


# ----------------------------------------------------------------------------
# Recurrent weights on a constant initial state (B copies of zeros)
# ----------------------------------------------------------------------------


def _rnn_setup(seed=8, batched_cell=True):
    """An RNN whose carry starts as zeros: ``jnp.zeros((B, D))`` with a cell on the batch (keras' and
    flax's LSTMs), or ``jnp.zeros(D)`` in a per-example cell under ``jax.vmap`` (equinox's GRU), so at
    the first step the recurrent weight and bias meet a constant ``(B, ...)`` value, not the batch."""
    r = np.random.default_rng(seed)
    params = {
        "wx": _w(r, D, 2 * D),
        "wh": [0.5 * _w(r, D, D) for _ in range(2)],
        "bh": [0.1 * _w(r, D) for _ in range(2)],
        "head": _w(r, D, 4),
    }

    def cell(p, h, x):
        z = x @ p["wx"] + (
            h @ jnp.concatenate(p["wh"], axis=-1) + jnp.concatenate(p["bh"], axis=-1)
        )
        a, g = jnp.split(z, 2, axis=-1)
        return jax.nn.sigmoid(a) * jnp.tanh(g) + 0.5 * h

    def loss(p, b):
        xs = jnp.swapaxes(b["x"], 0, 1)
        if batched_cell:
            h, _ = jax.lax.scan(lambda h, x: (cell(p, h, x), None), jnp.zeros((xs.shape[1], D)), xs)
        else:
            h = jax.vmap(
                lambda seq: jax.lax.scan(lambda h, x: (cell(p, h, x), None), jnp.zeros(D), seq)[0]
            )(b["x"])
        return xent(h @ p["head"], b["y"])

    return loss, params, _data(seed)


@pytest.mark.parametrize("batched_cell", [True, False])
def test_recurrent_weights_on_a_zero_initial_state_keep_the_ghost_path(batched_cell):
    """The first step's ``h0 @ Wh + bh`` is a value of the leaves alone, B copies of one value along
    the batch axis (a product with B copies of zeros): one example's replay slices one copy. The
    recurrent leaves fell back ("used by 'add'")."""
    loss, params, data = _rnn_setup(batched_cell=batched_cell)
    report = ghost_report(loss, params, data)
    assert report.fallback == []
    ghost_equals_vmap(loss, params, data)


@pytest.mark.slow  # 20-35 s each on 2 busy cores
@pytest.mark.parametrize(
    "name", ["eqx-gru-scan", "eqx-lstm-scan", "linen-lstm", "keras-lstm", "haiku-lstm"]
)
def test_library_recurrent_models_keep_the_ghost_path(name):
    """equinox's GRU under scan crashed ("vmap got inconsistent sizes"); equinox's and keras'
    LSTMs, flax's OptimizedLSTMCell and haiku's LSTM had leaves on the fallback."""
    loss, params, data = _model(name)
    assert ghost_report(loss, params, data).fallback == []
    ghost_equals_vmap(loss, params, data)


_SLOW = pytest.mark.slow  # a real library's model: 20 s to minutes to trace and compile on 2 cores


@pytest.mark.parametrize(
    "name",
    [
        "haiku-mlp",  # biases broadcast by jnp.broadcast_to (fell back: "used by 'add'")
        pytest.param("haiku-transformer", marks=_SLOW),  # the same, and a learned position table
        pytest.param(
            "haiku-resnet-eval", marks=_SLOW
        ),  # BatchNorm with frozen statistics ("used by 'mul'")
        pytest.param("keras-hub-gpt2", marks=_SLOW),  # position embeddings broadcast over the batch
        pytest.param("keras-hub-bert", marks=_SLOW),  # the same
        pytest.param("keras-hub-gemma", marks=_SLOW),  # RMSNorm's x * (1 + scale)
        pytest.param(
            "keras-hub-resnet-eval", marks=_SLOW
        ),  # keras' BatchNormalization, frozen statistics
    ],
)
def test_library_model_keeps_every_leaf_on_the_ghost_path(name):
    loss, params, data = _model(name)
    assert ghost_report(loss, params, data).fallback == []
    ghost_equals_vmap(loss, params, data)
