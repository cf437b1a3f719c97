"""Ghost-clipping coverage on models built by real libraries.

``python -m tools.coverage_real --out DIR [--only NAMES]`` builds small but real
models with the libraries that are installed (flax linen and nnx, equinox, haiku,
keras 3 on the JAX backend and keras-hub), gives each a per-example loss, and
reports for each:

* how many parameter leaves there are, how many :func:`gradclip_jax.ghost_report`
  puts on the ghost path (and how many of those have their per-example gradients formed for
  that leaf alone, ``formed:`` kinds) and how many fall back to per-example gradients, and why;
* whether :func:`gradclip_jax.clipped_grad` crashes (the error's text), or
  gives the error the model is expected to give (BatchNorm statistics in training);
* the largest difference between ``method='ghost'`` and ``method='vmap'``, relative to the
  largest value, on the per-example norms and on the clipped sum (clip norm: the median
  per-example norm, so that some examples are clipped and some are not).

It writes ``coverage.md`` (a Markdown table, then the fallback reasons) and
``coverage.json`` under ``--out``. A model whose library is missing is listed as
skipped. ``--only`` takes comma-separated model names or library names (``haiku``,
``keras-hub``, ...). The builders are plain functions (``MODELS``), reused by the tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# keras 3 picks its backend when first imported: the JAX one here, unless the caller chose.
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

B, T, D, V, CLASSES = 4, 6, 8, 17, 3
TOLERANCE = 1e-5
"""The agreement asked of ghost and vmap (relative to the largest value), in float32."""

Setup = tuple[Callable[..., Any], Any, Any]
"""``(loss_fn, params, batch)``: ``loss_fn(params, batch)`` returns the losses, shape ``(B,)``."""


@dataclass(frozen=True)
class Model:
    """One model of the table: its name, library, builder, and the error it must give (if any)."""

    name: str
    library: str
    build: Callable[[], Setup]
    expect: str | None = (
        None  # a text the error must contain (a loss that cannot be clipped per example)
    )


def xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Cross-entropy of each example's (mean over positions of) logits."""
    while logits.ndim > 2:
        logits = jnp.mean(logits, axis=1)
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), axis=-1)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def seq_data(seed: int = 0, n: int = B, t: int = T, d: int = D) -> dict[str, jax.Array]:
    """Real-valued sequences ``x`` (n, t, d), of different scales per example, and labels ``y``."""
    r = _rng(seed)
    x = r.normal(size=(n, t, d)) * r.uniform(0.3, 3.0, size=(n, 1, 1))
    return {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(r.integers(0, CLASSES, size=n))}


def token_data(seed: int = 0, n: int = B, t: int = T, vocab: int = V) -> dict[str, jax.Array]:
    """Token ids (n, t), a padding mask with the last tokens of some examples masked, labels."""
    r = _rng(seed)
    mask = np.ones((n, t), np.int32)
    mask[1, -2:] = 0
    return {
        "ids": jnp.asarray(r.integers(0, vocab, size=(n, t)), jnp.int32),
        "mask": jnp.asarray(mask),
        "segments": jnp.asarray((np.arange(t)[None] >= t // 2).repeat(n, 0), jnp.int32),
        "y": jnp.asarray(r.integers(0, CLASSES, size=n)),
    }


def image_data(seed: int = 0, n: int = B, size: int = 8, channels: int = 3) -> dict[str, jax.Array]:
    """Images (n, size, size, channels), NHWC, of different scales per example, and labels."""
    r = _rng(seed)
    x = r.normal(size=(n, size, size, channels)) * r.uniform(0.3, 3.0, size=(n, 1, 1, 1))
    return {"img": jnp.asarray(x, jnp.float32), "y": jnp.asarray(r.integers(0, CLASSES, size=n))}


# ----------------------------------------------------------------------------
# flax linen
# ----------------------------------------------------------------------------


def linen_transformer() -> Setup:
    """Token and learned position embeddings, a pre-norm attention block, an MLP, a head."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, ids: jax.Array) -> jax.Array:
            h = nn.Embed(V, D)(ids)
            h = h + self.param("pos", nn.initializers.normal(0.5), (T, D))
            h = h + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(h))
            h = h + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(h))))
            return nn.Dense(CLASSES)(nn.LayerNorm()(h))

    data = token_data(0)
    model = Block()
    params = model.init(jax.random.key(0), data["ids"])["params"]
    return (lambda p, b: xent(model.apply({"params": p}, b["ids"]), b["y"])), params, data


def linen_cnn() -> Setup:
    """Convolutions with GroupNorm, average pooling, a dense head."""
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.GroupNorm(num_groups=2)(nn.Conv(4, (3, 3))(x)))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(6, (3, 3), strides=2)(x))
            return nn.Dense(CLASSES)(x.reshape(x.shape[0], -1))

    data = image_data(1)
    model = CNN()
    params = model.init(jax.random.key(1), data["img"])["params"]
    return (lambda p, b: xent(model.apply({"params": p}, b["img"]), b["y"])), params, data


def linen_lstm() -> Setup:
    """``nn.RNN(nn.OptimizedLSTMCell)`` (an ``nn.scan`` over time) and a dense head."""
    import flax.linen as nn

    class LSTM(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.RNN(nn.OptimizedLSTMCell(D))(x)
            return nn.Dense(CLASSES)(h[:, -1])

    data = seq_data(2)
    model = LSTM()
    params = model.init(jax.random.key(2), data["x"])["params"]
    return (lambda p, b: xent(model.apply({"params": p}, b["x"]), b["y"])), params, data


def linen_batchnorm() -> Setup:
    """BatchNorm in training mode (batch statistics): must be refused with the BatchNorm error."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Conv(4, (3, 3))(x)))
            return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))

    data = image_data(3)
    model = Net()
    variables = model.init(jax.random.key(3), data["img"])

    def loss(p: Any, b: Any) -> jax.Array:
        out, _ = model.apply(
            {"params": p, "batch_stats": variables["batch_stats"]},
            b["img"],
            mutable=["batch_stats"],
        )
        return xent(out, b["y"])

    return loss, variables["params"], data


# ----------------------------------------------------------------------------
# flax nnx
# ----------------------------------------------------------------------------


def _nnx_loss(model: Any, call: Callable[[Any, Any], jax.Array]) -> tuple[Callable[..., Any], Any]:
    """A loss over the model's parameters (``nnx.split``), its other state fixed."""
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p: Any, b: Any) -> jax.Array:
        return call(nnx.merge(graphdef, p, rest), b)

    return loss, params


def nnx_transformer() -> Setup:
    """Token embedding, a learned position table, attention, LayerNorm, an MLP, a head."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.pos = nnx.Param(jax.random.normal(rngs.params(), (T, D)) * 0.5)
            self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
            self.att = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
            self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)
            self.head = nnx.Linear(D, CLASSES, rngs=rngs)

        def __call__(self, ids: jax.Array) -> jax.Array:
            h = self.embed(ids) + self.pos[...]
            h = h + self.att(self.ln1(h))
            h = h + self.down(nnx.gelu(self.up(self.ln2(h))))
            return self.head(h)

    loss, params = _nnx_loss(Block(nnx.Rngs(4)), lambda m, b: xent(m(b["ids"]), b["y"]))
    return loss, params, token_data(4)


def nnx_cnn() -> Setup:
    """Convolutions, GroupNorm, max pooling, a linear head."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.c1 = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
            self.c2 = nnx.Conv(4, 6, (3, 3), strides=2, rngs=rngs)
            self.head = nnx.Linear(6, CLASSES, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = nnx.max_pool(nnx.relu(self.gn(self.c1(x))), (2, 2), (2, 2))
            return self.head(jnp.mean(nnx.relu(self.c2(x)), axis=(1, 2)))

    loss, params = _nnx_loss(CNN(nnx.Rngs(5)), lambda m, b: xent(m(b["img"]), b["y"]))
    return loss, params, image_data(5)


def nnx_batchnorm() -> Setup:
    """nnx.BatchNorm in training mode: must be refused with the BatchNorm error."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.head = nnx.Linear(4, CLASSES, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(jnp.mean(nnx.relu(self.bn(self.conv(x))), axis=(1, 2)))

    loss, params = _nnx_loss(Net(nnx.Rngs(6)), lambda m, b: xent(m(b["img"]), b["y"]))
    return loss, params, image_data(6)


# ----------------------------------------------------------------------------
# equinox (modules act on one example; the loss vmaps them over the batch)
# ----------------------------------------------------------------------------


def _eqx_loss(model: Any, call: Callable[[Any, Any], jax.Array]) -> tuple[Callable[..., Any], Any]:
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p: Any, b: Any) -> jax.Array:
        return call(eqx.combine(p, static), b)

    return loss, params


def eqx_mlp() -> Setup:
    import equinox as eqx

    model = eqx.nn.MLP(D, CLASSES, width_size=16, depth=2, key=jax.random.key(7))
    loss, params = _eqx_loss(
        model, lambda m, b: xent(jax.vmap(m)(jnp.mean(b["x"], axis=1)), b["y"])
    )
    return loss, params, seq_data(7)


def eqx_cnn() -> Setup:
    import equinox as eqx

    k = jax.random.split(jax.random.key(8), 3)
    model = [
        eqx.nn.Conv2d(3, 4, 3, padding=1, key=k[0]),
        eqx.nn.MaxPool2d(2, 2),
        eqx.nn.Conv2d(4, 6, 3, stride=2, key=k[1]),
        eqx.nn.Linear(6, CLASSES, key=k[2]),
    ]

    def one(m: Any, img: jax.Array) -> jax.Array:  # img: (H, W, C) -> equinox's (C, H, W)
        x = jnp.transpose(img, (2, 0, 1))
        x = m[1](jax.nn.relu(m[0](x)))
        return m[3](jnp.mean(jax.nn.relu(m[2](x)), axis=(1, 2)))

    loss, params = _eqx_loss(
        model, lambda m, b: xent(jax.vmap(lambda x: one(m, x))(b["img"]), b["y"])
    )
    return loss, params, image_data(8)


def eqx_transformer() -> Setup:
    """Embedding, a learned position table, ``eqx.nn.MultiheadAttention``, LayerNorm, an MLP."""
    import equinox as eqx

    k = jax.random.split(jax.random.key(9), 6)
    model = {
        "embed": eqx.nn.Embedding(V, D, key=k[0]),
        "pos": jax.random.normal(k[1], (T, D)) * 0.5,
        "ln1": eqx.nn.LayerNorm(D),
        "ln2": eqx.nn.LayerNorm(D),
        "att": eqx.nn.MultiheadAttention(2, D, key=k[2]),
        "up": eqx.nn.Linear(D, 2 * D, key=k[3]),
        "down": eqx.nn.Linear(2 * D, D, key=k[4]),
        "head": eqx.nn.Linear(D, CLASSES, key=k[5]),
    }

    def one(m: Any, ids: jax.Array) -> jax.Array:
        h = jax.vmap(m["embed"])(ids) + m["pos"]
        a = jax.vmap(m["ln1"])(h)
        h = h + m["att"](a, a, a)
        h = h + jax.vmap(lambda x: m["down"](jax.nn.gelu(m["up"](m["ln2"](x)))))(h)
        return m["head"](jnp.mean(h, axis=0))

    loss, params = _eqx_loss(
        model, lambda m, b: xent(jax.vmap(lambda i: one(m, i))(b["ids"]), b["y"])
    )
    return loss, params, token_data(9)


def eqx_gru_scan() -> Setup:
    """``eqx.nn.GRUCell`` run over time by ``lax.scan`` inside the per-example function (vmapped)."""
    import equinox as eqx

    k = jax.random.split(jax.random.key(10), 2)
    model = {"cell": eqx.nn.GRUCell(D, D, key=k[0]), "head": eqx.nn.Linear(D, CLASSES, key=k[1])}

    def one(m: Any, xs: jax.Array) -> jax.Array:
        h, _ = lax.scan(lambda h, x: (m["cell"](x, h), None), jnp.zeros(D), xs)
        return m["head"](h)

    loss, params = _eqx_loss(
        model, lambda m, b: xent(jax.vmap(lambda x: one(m, x))(b["x"]), b["y"])
    )
    return loss, params, seq_data(10)


def eqx_lstm_scan() -> Setup:
    """``eqx.nn.LSTMCell`` vmapped over the batch inside a ``lax.scan`` over time."""
    import equinox as eqx

    k = jax.random.split(jax.random.key(11), 2)
    model = {"cell": eqx.nn.LSTMCell(D, D, key=k[0]), "head": eqx.nn.Linear(D, CLASSES, key=k[1])}

    def run(m: Any, b: Any) -> jax.Array:
        n = b["x"].shape[0]
        zeros = jnp.zeros((n, D))
        (h, _), _ = lax.scan(
            lambda hc, x: (jax.vmap(m["cell"])(x, hc), None),
            (zeros, zeros),
            jnp.swapaxes(b["x"], 0, 1),
        )
        return xent(jax.vmap(m["head"])(h), b["y"])

    loss, params = _eqx_loss(model, run)
    return loss, params, seq_data(11)


# ----------------------------------------------------------------------------
# haiku
# ----------------------------------------------------------------------------


def haiku_mlp() -> Setup:
    import haiku as hk

    f = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([16, 16, CLASSES])(x)))
    data = seq_data(12)
    x0 = jnp.mean(data["x"], axis=1)
    params = f.init(jax.random.key(12), x0)
    return (lambda p, b: xent(f.apply(p, jnp.mean(b["x"], axis=1)), b["y"])), params, data


def haiku_transformer() -> Setup:
    """``hk.Embed``, a learned position table, ``hk.MultiHeadAttention``, ``hk.LayerNorm``, an MLP."""
    import haiku as hk

    def fwd(ids: jax.Array) -> jax.Array:
        h = hk.Embed(V, D)(ids) + hk.get_parameter(
            "pos", (T, D), init=hk.initializers.RandomNormal(0.5)
        )
        a = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
        h = h + hk.MultiHeadAttention(
            num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling()
        )(a, a, a)
        a = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
        h = h + hk.nets.MLP([2 * D, D], activation=jax.nn.gelu)(a)
        return hk.Linear(CLASSES)(h)

    f = hk.without_apply_rng(hk.transform(fwd))
    data = token_data(13)
    params = f.init(jax.random.key(13), data["ids"])
    return (lambda p, b: xent(f.apply(p, b["ids"]), b["y"])), params, data


def haiku_lstm() -> Setup:
    """``hk.dynamic_unroll`` of ``hk.LSTM`` (a ``lax.scan`` over time) and a linear head."""
    import haiku as hk

    def fwd(x: jax.Array) -> jax.Array:
        core = hk.LSTM(D)
        out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1), core.initial_state(x.shape[0]))
        return hk.Linear(CLASSES)(out[-1])

    f = hk.without_apply_rng(hk.transform(fwd))
    data = seq_data(14)
    params = f.init(jax.random.key(14), data["x"])
    return (lambda p, b: xent(f.apply(p, b["x"]), b["y"])), params, data


def _haiku_resnet(is_training: bool, seed: int) -> Setup:
    import haiku as hk

    def fwd(x: jax.Array, training: bool) -> jax.Array:
        net = hk.nets.ResNet(
            blocks_per_group=(1, 1, 1, 1),
            num_classes=CLASSES,
            bottleneck=False,
            channels_per_group=(4, 4, 8, 8),
            initial_conv_config={"output_channels": 4},
        )
        return net(x, is_training=training)

    f = hk.transform_with_state(fwd)
    data = image_data(seed, size=16)
    params, state = f.init(
        jax.random.key(seed), data["img"], True
    )  # the moving averages exist after a step

    def loss(p: Any, b: Any) -> jax.Array:
        out, _ = f.apply(p, state, None, b["img"], is_training)
        return xent(out, b["y"])

    return loss, params, data


def haiku_resnet_train() -> Setup:
    """``hk.nets.ResNet`` with BatchNorm in training mode: must be refused with the BatchNorm error."""
    return _haiku_resnet(True, 15)


def haiku_resnet_eval() -> Setup:
    """``hk.nets.ResNet`` with frozen BatchNorm statistics (``is_training=False``)."""
    return _haiku_resnet(False, 16)


# ----------------------------------------------------------------------------
# keras 3 (JAX backend) and keras-hub
# ----------------------------------------------------------------------------


def _keras() -> Any:
    import keras

    if keras.backend.backend() != "jax":
        raise ImportError(
            f"keras runs on the {keras.backend.backend()!r} backend, not 'jax' (set KERAS_BACKEND=jax)"
        )
    keras.utils.set_random_seed(0)
    return keras


def _keras_loss(
    model: Any, inputs: Callable[[Any], Any], data: Any, training: bool = False
) -> tuple[Callable[..., Any], Any]:
    """A loss over ``model``'s trainable variables (by path) and a dense head on its output (a
    keras-hub backbone's sequence output, averaged over positions), its other variables fixed."""
    out = model(inputs(data))
    if isinstance(out, dict):
        out = out["sequence_output"]
    out_dim = out.shape[-1]
    names = [v.path for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]
    params = {"model": {n: v.value for n, v in zip(names, model.trainable_variables, strict=True)}}
    params["head"] = jnp.asarray(
        _rng(99).normal(size=(out_dim, CLASSES)) / math.sqrt(out_dim), jnp.float32
    )

    def loss(p: Any, b: Any) -> jax.Array:
        out, _ = model.stateless_call(
            [p["model"][n] for n in names], fixed, inputs(b), training=training
        )
        if isinstance(out, dict):
            out = out["sequence_output"]
        return xent(out @ p["head"], b["y"])

    return loss, params


def _text_inputs(segments: bool = False) -> Callable[[Any], Any]:
    def inputs(b: Any) -> dict[str, jax.Array]:
        x = {"token_ids": b["ids"], "padding_mask": b["mask"]}
        if segments:
            x["segment_ids"] = b["segments"]
        return x

    return inputs


def keras_hub_gpt2() -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.GPT2Backbone(
        vocabulary_size=V,
        num_layers=2,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=2 * D,
        max_sequence_length=T,
    )
    data = token_data(20)
    loss, params = _keras_loss(m, _text_inputs(), data)
    return loss, params, data


def keras_hub_bert() -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.BertBackbone(
        vocabulary_size=V,
        num_layers=2,
        num_heads=2,
        hidden_dim=D,
        intermediate_dim=2 * D,
        max_sequence_length=T,
        num_segments=2,
    )
    data = token_data(21)
    loss, params = _keras_loss(m, _text_inputs(segments=True), data)
    return loss, params, data


def keras_hub_vit() -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=D, mlp_dim=2 * D
    )
    data = image_data(22)
    loss, params = _keras_loss(m, lambda b: b["img"], data)
    return loss, params, data


def keras_hub_gemma() -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.GemmaBackbone(
        vocabulary_size=V,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=D,
        intermediate_dim=2 * D,
        head_dim=4,
    )
    data = token_data(23)
    loss, params = _keras_loss(m, _text_inputs(), data)
    return loss, params, data


def keras_hub_llama() -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.LlamaBackbone(
        vocabulary_size=V,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=D,
        intermediate_dim=2 * D,
    )
    data = token_data(24)
    loss, params = _keras_loss(m, _text_inputs(), data)
    return loss, params, data


def keras_hub_mixtral() -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.MixtralBackbone(
        vocabulary_size=V,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=D,
        intermediate_dim=2 * D,
        num_experts=4,
        top_k=2,
    )
    data = token_data(25)
    loss, params = _keras_loss(m, _text_inputs(), data)
    return loss, params, data


def _keras_hub_resnet(training: bool, seed: int) -> Setup:
    _keras()
    import keras_hub

    m = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(8, 8, 3),
    )
    data = image_data(seed)
    loss, params = _keras_loss(m, lambda b: b["img"], data, training=training)
    return loss, params, data


def keras_hub_resnet_train() -> Setup:
    """keras-hub's ResNet with BatchNorm in training mode: must be refused with the BatchNorm error."""
    return _keras_hub_resnet(True, 26)


def keras_hub_resnet_eval() -> Setup:
    """keras-hub's ResNet in inference mode (frozen BatchNorm statistics)."""
    return _keras_hub_resnet(False, 27)


def keras_lstm() -> Setup:
    keras = _keras()
    m = keras.Sequential([keras.Input((T, D)), keras.layers.LSTM(D), keras.layers.Dense(CLASSES)])
    data = seq_data(28)
    loss, params = _keras_loss(m, lambda b: b["x"], data)
    return loss, params, data


_BN = "BatchNorm"
MODELS: tuple[Model, ...] = (
    Model("linen-transformer", "flax", linen_transformer),
    Model("linen-cnn", "flax", linen_cnn),
    Model("linen-lstm", "flax", linen_lstm),
    Model("linen-batchnorm", "flax", linen_batchnorm, expect=_BN),
    Model("nnx-transformer", "flax", nnx_transformer),
    Model("nnx-cnn", "flax", nnx_cnn),
    Model("nnx-batchnorm", "flax", nnx_batchnorm, expect=_BN),
    Model("eqx-mlp", "equinox", eqx_mlp),
    Model("eqx-cnn", "equinox", eqx_cnn),
    Model("eqx-transformer", "equinox", eqx_transformer),
    Model("eqx-gru-scan", "equinox", eqx_gru_scan),
    Model("eqx-lstm-scan", "equinox", eqx_lstm_scan),
    Model("haiku-mlp", "haiku", haiku_mlp),
    Model("haiku-transformer", "haiku", haiku_transformer),
    Model("haiku-lstm", "haiku", haiku_lstm),
    Model("haiku-resnet-train", "haiku", haiku_resnet_train, expect=_BN),
    Model("haiku-resnet-eval", "haiku", haiku_resnet_eval),
    Model("keras-hub-gpt2", "keras-hub", keras_hub_gpt2),
    Model("keras-hub-bert", "keras-hub", keras_hub_bert),
    Model("keras-hub-vit", "keras-hub", keras_hub_vit),
    Model("keras-hub-gemma", "keras-hub", keras_hub_gemma),
    Model("keras-hub-llama", "keras-hub", keras_hub_llama),
    Model("keras-hub-mixtral", "keras-hub", keras_hub_mixtral),
    Model("keras-hub-resnet-train", "keras-hub", keras_hub_resnet_train, expect=_BN),
    Model("keras-hub-resnet-eval", "keras-hub", keras_hub_resnet_eval),
    Model("keras-lstm", "keras", keras_lstm),
)


# ----------------------------------------------------------------------------
# Measuring one model
# ----------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def relative_errors(loss: Callable[..., Any], params: Any, data: Any) -> dict[str, float]:
    """Ghost against vmap at the median per-example norm as clip norm: the largest difference
    of the per-example norms and of the clipped sums, each relative to the largest value."""
    from gradclip_jax import clipped_grad

    def run(method: str) -> Callable[..., Any]:
        return jax.jit(lambda p, b, c: clipped_grad(loss, c, method=method)(p, b))

    vmap, ghost = run("vmap"), run("ghost")
    _, info = vmap(params, data, jnp.float32(1e30))
    clip = jnp.float32(np.median(np.asarray(info.norms)))
    want, want_info = vmap(params, data, clip)
    got, got_info = ghost(params, data, clip)
    nv, ng = np.asarray(want_info.norms, np.float64), np.asarray(got_info.norms, np.float64)
    sv = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(want)])
    sg = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(got)])
    return {
        "norms": float(np.max(np.abs(ng - nv)) / max(np.max(np.abs(nv)), 1e-30)),
        "sum": float(np.max(np.abs(sg - sv)) / max(np.max(np.abs(sv)), 1e-30)),
        "clip": float(clip),
    }


def measure(model: Model) -> dict[str, Any]:
    """One row of the table (see the module's docstring)."""
    from gradclip_jax import ghost_report

    row: dict[str, Any] = {"name": model.name, "library": model.library, "expect": model.expect}
    start = time.perf_counter()
    try:
        loss, params, data = model.build()
    except ImportError as err:
        return {**row, "status": "skipped", "error": _first_line(err)}
    except Exception as err:
        return {
            **row,
            "status": "build failed",
            "error": _first_line(err),
            "trace": traceback.format_exc(),
        }
    row["leaves"] = len(jax.tree.leaves(params))
    row["parameters"] = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    stage = "ghost_report"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = ghost_report(loss, params, data)
            row["ghost"], row["fallback"] = len(report.ghost), len(report.fallback)
            row["kinds"] = dict(report.ghost)
            # on the ghost path with their per-example gradients formed for that leaf alone (a leaf
            # computed with before its use; see ghost_report's 'formed:' kinds)
            row["formed"] = sum("formed:" in kind for kind in row["kinds"].values())
            row["reasons"] = dict(report.fallback)
            stage = "clipped_grad"
            row["error_rel"] = relative_errors(loss, params, data)
    except Exception as err:
        text = _first_line(err)
        if model.expect is not None and model.expect in str(err):
            row["status"] = "expected error"
        else:
            row["status"] = "crash"
            row["trace"] = traceback.format_exc()
        row["error"] = f"{stage}: {text}"
    else:
        if model.expect is not None:
            row["status"] = "no error"  # a loss that must be refused ran
        elif row["fallback"] == row["leaves"]:
            row["status"] = "wholly fallback"
        else:
            err = row["error_rel"]
            row["status"] = "ok" if max(err["norms"], err["sum"]) <= TOLERANCE else "mismatch"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


# ----------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table (one row per model), then the fallback reasons and errors, model by model."""
    head = (
        "model",
        "library",
        "leaves",
        "ghost",
        "of which formed",
        "fallback",
        "status",
        "norms rel. err",
        "sum rel. err",
        "s",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = [0, 0]
    for r in rows:
        err = r.get("error_rel", {})
        cells = [
            r["name"],
            r["library"],
            r.get("leaves", ""),
            r.get("ghost", ""),
            r.get("formed", ""),
            r.get("fallback", ""),
            r["status"],
            f"{err['norms']:.1e}" if err else "",
            f"{err['sum']:.1e}" if err else "",
            r.get("seconds", ""),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        if "fallback" in r and r["status"] not in ("expected error", "skipped"):
            totals[0] += r["leaves"]
            totals[1] += r["fallback"]
    lines.append("")
    share = f" ({100 * totals[1] / totals[0]:.1f}%)" if totals[0] else ""
    lines.append(
        f"Leaves on the fallback: {totals[1]} of {totals[0]}{share}, over the models that ran."
    )
    for r in rows:
        notes = [f"- {r['error']}"] if "error" in r else []
        by_reason: dict[str, list[str]] = {}
        for path, why in r.get("reasons", {}).items():
            by_reason.setdefault(why, []).append(path)
        notes += [
            f"- {len(paths)} leaves: {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''}: {why}"
            for why, paths in by_reason.items()
        ]
        if notes:
            lines += ["", f"**{r['name']}**", *notes]
    return "\n".join(lines) + "\n"


def selected(only: str | None) -> list[Model]:
    """The models named (or of the libraries named) in the comma-separated ``only``; all for ``None``."""
    if not only:
        return list(MODELS)
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = names - {m.name for m in MODELS} - {m.library for m in MODELS}
    if unknown:
        raise SystemExit(
            f"coverage_real: unknown model or library {sorted(unknown)}; "
            f"models: {', '.join(m.name for m in MODELS)}"
        )
    return [m for m in MODELS if m.name in names or m.library in names]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.coverage_real", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, help="folder for coverage.md and coverage.json")
    parser.add_argument("--only", default=None, help="comma-separated model or library names")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in selected(args.only):
        row = measure(model)
        rows.append(row)
        print(
            f"{model.name}: {row['status']} leaves={row.get('leaves')} fallback={row.get('fallback')} "
            f"err={row.get('error_rel')} {row.get('error', '')}",
            flush=True,
        )
    (out / "coverage.json").write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))
    (out / "coverage.md").write_text(markdown(rows))
    print(f"wrote {out / 'coverage.md'} and {out / 'coverage.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
