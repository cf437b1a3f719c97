"""The models and model-shaped trees every benchmark suite shares.

Each model builder returns ``(losses, params, data)`` (the GPU configs' builders add a
label): ``losses(params, batch)`` gives per-example losses of shape ``(B,)``, as
``gcx.clipped_grad`` wants them. The flax models import flax when built, so the
suites that do not use them run without it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

MLP_SIZES = (784, 512, 512, 10)


def mlp(seed: int, batch: int) -> tuple[Callable[..., Any], Any, Any]:
    """A 784-512-512-10 ReLU MLP with a cross-entropy loss per example."""
    r = np.random.default_rng(seed)
    params = [
        {
            "w": jnp.asarray(r.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b, jnp.float32),
        }
        for a, b in itertools.pairwise(MLP_SIZES)
    ]
    data = {
        "x": jnp.asarray(r.normal(size=(batch, MLP_SIZES[0])), jnp.float32),
        "y": jnp.asarray(r.integers(0, MLP_SIZES[-1], size=batch)),
    }

    def losses(p: Any, b: Any) -> jax.Array:
        h = b["x"]
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.take_along_axis(logp, b["y"][:, None], axis=1)[:, 0]

    return losses, params, data


def _layer_norm(p: Any, h: jax.Array) -> jax.Array:
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
    return (h - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def transformer(
    seed: int,
    batch: int,
    *,
    layers: int = 2,
    d: int = 128,
    heads: int = 4,
    seq: int = 64,
    vocab: int = 256,
) -> tuple[Callable[..., Any], Any, Any]:
    """A small pre-LN transformer LM in plain JAX; the loss is the mean token cross-entropy."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * layers + 8))

    def dense(n_in: int, n_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (n_in, n_out)) / jnp.sqrt(n_in)

    def ln() -> dict[str, jax.Array]:
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    params: dict[str, Any] = {
        "embed": 0.02 * jax.random.normal(next(keys), (vocab, d)),
        "pos": 0.02 * jax.random.normal(next(keys), (seq, d)),
        "ln_f": ln(),
        "head": dense(d, vocab),
        "layers": [
            {
                "ln1": ln(),
                "ln2": ln(),
                "q": dense(d, d),
                "k": dense(d, d),
                "v": dense(d, d),
                "o": dense(d, d),
                "up": dense(d, 4 * d),
                "up_b": jnp.zeros(4 * d),
                "down": dense(4 * d, d),
                "down_b": jnp.zeros(d),
            }
            for _ in range(layers)
        ],
    }
    tokens = jax.random.randint(next(keys), (batch, seq + 1), 0, vocab)
    data = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def losses(p: Any, b: Any) -> jax.Array:
        h = p["embed"][b["x"]] + p["pos"]
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        for lp in p["layers"]:
            a = _layer_norm(lp["ln1"], h)
            q, k, v = (jnp.reshape(a @ lp[n], (*a.shape[:-1], heads, d // heads)) for n in "qkv")
            att = jnp.einsum("bthe,bshe->bhts", q, k) / jnp.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            h = h + jnp.reshape(jnp.einsum("bhts,bshe->bthe", att, v), a.shape) @ lp["o"]
            m = _layer_norm(lp["ln2"], h)
            h = h + jax.nn.gelu(m @ lp["up"] + lp["up_b"]) @ lp["down"] + lp["down_b"]
        logits = _layer_norm(p["ln_f"], h) @ p["head"]
        ll = jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][..., None], axis=-1)[..., 0]
        return -jnp.mean(ll, axis=-1)

    return losses, params, data


def _gpt2_block(d: int, heads: int, fused: bool, dtype: Any) -> type:
    """The flax nnx class of one pre-LN GPT-2 block (q/k/v ``fused`` into one projection or not)."""
    from flax import nnx

    init = nnx.initializers.normal(0.02)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            dense = dict(dtype=dtype, param_dtype=dtype, kernel_init=init, rngs=rngs)
            self.ln_1 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)
            if fused:
                self.c_attn = nnx.Linear(d, 3 * d, **dense)
            else:
                self.q_proj = nnx.Linear(d, d, **dense)
                self.k_proj = nnx.Linear(d, d, **dense)
                self.v_proj = nnx.Linear(d, d, **dense)
            self.attn_proj = nnx.Linear(d, d, **dense)
            self.ln_2 = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)
            self.c_fc = nnx.Linear(d, 4 * d, **dense)
            self.mlp_proj = nnx.Linear(4 * d, d, **dense)

        def __call__(self, x: jax.Array) -> jax.Array:
            b, t, _ = x.shape
            h = self.ln_1(x)
            if fused:
                q, k, v = jnp.split(self.c_attn(h), 3, axis=-1)
            else:
                q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
            q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads).astype(dtype)
            causal = jnp.tril(jnp.ones((t, t), dtype=bool))
            att = jnp.where(causal, att, jnp.finfo(att.dtype).min)
            att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(dtype)
            y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
            x = x + self.attn_proj(y)
            return x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x))))

    return Block


def _gpt2_model(
    block: type, sizes: tuple[int, int, int], layers: int, dtype: Any, scan: bool
) -> type:
    """The flax nnx class of GPT-2 with ``layers`` blocks and a tied output head;
    ``sizes`` = ``(vocab, positions, width)``."""
    from flax import nnx

    vocab, n_pos, d = sizes
    init = nnx.initializers.normal(0.02)
    lists = getattr(nnx, "List", list)  # flax >= 0.12 wants module lists wrapped

    class GPT2(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.wte = nnx.Embed(
                vocab, d, dtype=dtype, param_dtype=dtype, embedding_init=init, rngs=rngs
            )
            self.wpe = nnx.Embed(
                n_pos, d, dtype=dtype, param_dtype=dtype, embedding_init=init, rngs=rngs
            )
            if scan:

                @nnx.split_rngs(splits=layers)
                @nnx.vmap(in_axes=0, out_axes=0)
                def stacked(r: nnx.Rngs) -> Any:
                    return block(r)

                self.h = stacked(rngs)
            else:
                self.h = lists([block(rngs) for _ in range(layers)])
            self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
            if scan:
                blocks, stack = nnx.split(self.h)
                x, _ = jax.lax.scan(lambda x, s: (nnx.merge(blocks, s)(x), None), x, stack)
            else:
                for blk in self.h:
                    x = blk(x)
            return self.wte.attend(self.ln_f(x))  # tied output head

    return GPT2


def gpt2(
    batch: int,
    *,
    fused: bool,
    dtype: Any,
    tiny: bool,
    seed: int = 0,
    scan: bool = False,
    layers: int | None = None,
) -> tuple[Callable, Any, Any, str]:
    """GPT-2 small (or the tiny smoke size) in flax nnx; returns ``(losses, params, data, label)``.

    Args:
      batch: examples in ``data``.
      fused: q/k/v in one ``Linear(d, 3d)`` split with ``jnp.split`` (else three projections).
      dtype: parameters' and activations' dtype (the loss is taken in float32).
      tiny: 2 blocks of width 64, 4 heads, vocabulary 512, T=16 (else 12x768, 12 heads, 50257, T=256).
      seed: parameters' and tokens' seed.
      scan: the blocks stacked on axis 0 (``nnx.vmap``) and run by ``lax.scan``.
      layers: that many blocks instead of the size's own.
    """
    from flax import nnx

    vocab, n_pos, d, depth, heads, seq = (
        (512, 16, 64, 2, 4, 16) if tiny else (50257, 1024, 768, 12, 12, 256)
    )
    layers = depth if layers is None else layers
    model = _gpt2_model(_gpt2_block(d, heads, fused, dtype), (vocab, n_pos, d), layers, dtype, scan)
    graphdef, params = nnx.split(model(nnx.Rngs(seed)))
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(batch, seq + 1))
    data = {"x": jnp.asarray(tokens[:, :-1], jnp.int32), "y": jnp.asarray(tokens[:, 1:], jnp.int32)}

    def losses(p: Any, b: Any) -> jax.Array:
        logits = nnx.merge(graphdef, p)(b["x"]).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), axis=-1)

    qkv = "fused qkv + jnp.split" if fused else "separate q/k/v"
    size = f"{layers}x{d}, {heads} heads, vocab {vocab}, T={seq}"
    kind = " (tiny)" if tiny else " small" if layers == depth else f" ({layers} blocks of small)"
    label = (
        f"GPT-2{kind} nnx, {size}, tied embedding, {qkv}, "
        f"{'blocks stacked, lax.scan, ' if scan else ''}{jnp.dtype(dtype).name}"
    )
    return losses, params, data, label


def _wrn_model(k: int, groups: int, classes: int, blocks: int) -> Any:
    """A flax linen pre-activation wide ResNet: widths 16k, 32k, 64k, ``blocks`` blocks each."""
    from flax import linen as nn

    class WideBasic(nn.Module):
        width: int
        stride: int

        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            o = nn.relu(nn.GroupNorm(num_groups=groups)(x))
            y = nn.Conv(self.width, (3, 3), strides=self.stride, padding=1, use_bias=False)(o)
            y = nn.relu(nn.GroupNorm(num_groups=groups)(y))
            y = nn.Conv(self.width, (3, 3), padding=1, use_bias=False)(y)
            if self.stride != 1 or x.shape[-1] != self.width:
                x = nn.Conv(self.width, (1, 1), strides=self.stride, use_bias=False)(o)
            return x + y

    class WideResNet(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.Conv(16, (3, 3), padding=1, use_bias=False)(x)
            for i, width in enumerate((16 * k, 32 * k, 64 * k)):
                for j in range(blocks):
                    x = WideBasic(width, 2 if (i > 0 and j == 0) else 1)(x)
            x = nn.relu(nn.GroupNorm(num_groups=groups)(x))
            return nn.Dense(classes)(jnp.mean(x, axis=(1, 2)))

    return WideResNet()


def wrn(batch: int, *, tiny: bool, seed: int = 0) -> tuple[Callable, Any, Any, str]:
    """WRN-16-4 with GroupNorm on 32x32x3 (WRN-16-1 on 8x8 when ``tiny``) in flax linen;
    returns ``(losses, params, data, label)``."""
    depth, k, hw, classes, groups = (16, 1, 8, 10, 16) if tiny else (16, 4, 32, 10, 16)
    model = _wrn_model(k, groups, classes, (depth - 4) // 6)
    r = np.random.default_rng(seed)
    data = {
        "x": jnp.asarray(r.standard_normal((batch, hw, hw, 3)), jnp.float32),
        "y": jnp.asarray(r.integers(0, classes, size=batch), jnp.int32),
    }
    params = model.init(jax.random.key(seed), data["x"][:1])["params"]

    def losses(p: Any, b: Any) -> jax.Array:
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])

    label = f"WRN-{depth}-{k} GroupNorm({groups}) linen, {hw}x{hw}x3, {classes} classes, float32"
    return losses, params, data, label


def transformer_tree(
    vocab: int = 8192, d: int = 512, layers: int = 8, seed: int = 0, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Gradient-like leaves shaped like a transformer's parameters.

    The defaults give ~29.6M parameters: an 8192 x 512 embedding and 8 layers of
    four d x d attention matrices, a d x 4d and a 4d x d MLP matrix, two biases and
    four layer-norm vectors.
    """
    rng = np.random.default_rng(seed)

    def leaf(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 1e-2, dtype)

    tree: dict[str, Any] = {"embed": leaf(vocab, d), "final_norm": leaf(d)}
    for i in range(layers):
        tree[f"layer{i}"] = {
            "q": leaf(d, d),
            "k": leaf(d, d),
            "v": leaf(d, d),
            "o": leaf(d, d),
            "mlp_in": leaf(d, 4 * d),
            "mlp_in_bias": leaf(4 * d),
            "mlp_out": leaf(4 * d, d),
            "mlp_out_bias": leaf(d),
            "ln1_scale": leaf(d),
            "ln1_bias": leaf(d),
            "ln2_scale": leaf(d),
            "ln2_bias": leaf(d),
        }
    return tree


def gpt2_grad_tree(
    layers: int = 48,
    d: int = 1600,
    vocab: int = 50257,
    ctx: int = 1024,
    dtype: Any = jnp.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """Gradient-like leaves with GPT-2's parameter shapes (XL by default: 580 leaves, 1.56B)."""
    key = jax.random.PRNGKey(seed)

    def leaf(*shape: int) -> jax.Array:
        nonlocal key
        key, sub = jax.random.split(key)
        return (jax.random.normal(sub, shape, jnp.float32) * 1e-3).astype(dtype)

    tree: dict[str, Any] = {
        "wte": leaf(vocab, d),
        "wpe": leaf(ctx, d),
        "ln_f": {"g": leaf(d), "b": leaf(d)},
    }
    for i in range(layers):
        tree[f"h{i}"] = {
            "ln_1": {"g": leaf(d), "b": leaf(d)},
            "attn": {
                "c_attn": {"w": leaf(d, 3 * d), "b": leaf(3 * d)},
                "c_proj": {"w": leaf(d, d), "b": leaf(d)},
            },
            "ln_2": {"g": leaf(d), "b": leaf(d)},
            "mlp": {
                "c_fc": {"w": leaf(d, 4 * d), "b": leaf(4 * d)},
                "c_proj": {"w": leaf(4 * d, d), "b": leaf(d)},
            },
        }
    return tree


class LlamaConfig(NamedTuple):
    """A Llama-style decoder's size and how it is written (defaults: the small CPU size).

    ``kv_heads`` < ``heads`` is grouped-query attention; ``ffn`` is the SwiGLU hidden width
    (0: the usual 8/3 d rounded up to a multiple of 32); ``lora`` > 0 makes low-rank adapters
    of that rank on q, v and the MLP the only trainable leaves. ``activations``, if given, is
    applied to the residual stream ``(B, T, d)`` after the embedding and after each block: an
    activation sharding annotation such as ``gcx.with_sharding_constraint``.
    """

    layers: int = 2
    d: int = 128
    heads: int = 4
    kv_heads: int = 2
    seq: int = 64
    vocab: int = 256
    ffn: int = 0
    dtype: Any = jnp.float32
    remat: bool = True
    scan: bool = True
    lora: int = 0
    activations: Callable[[jax.Array], jax.Array] | None = None

    @property
    def hidden(self) -> int:
        """The SwiGLU hidden width."""
        return self.ffn or 32 * -(-8 * self.d // (3 * 32))


def _rope(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary embeddings (rotate-half form) of ``x`` ``(B, T, H, hd)`` at ``positions`` ``(T,)``."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq  # (T, half)
    cos, sin = (f(angle)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _llama_block(cfg: LlamaConfig) -> type:
    """The flax nnx class of one pre-RMSNorm Llama block (GQA attention, SwiGLU MLP)."""
    from flax import nnx

    d, h, kvh, dt = cfg.d, cfg.heads, cfg.kv_heads, cfg.dtype
    hd = d // h

    def linear(n_in: int, n_out: int, adapted: bool, rngs: nnx.Rngs) -> Any:
        kw = dict(use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
        if adapted and cfg.lora:
            # B starts small, not zero, so that both factors get gradients from the first step
            return nnx.LoRALinear(
                n_in,
                n_out,
                lora_rank=cfg.lora,
                lora_param_dtype=dt,
                b_initializer=nnx.initializers.normal(0.02),
                **kw,
            )
        return nnx.Linear(n_in, n_out, **kw)

    class LlamaBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            norm = dict(epsilon=1e-5, dtype=dt, param_dtype=dt, rngs=rngs)
            self.attn_norm, self.mlp_norm = nnx.RMSNorm(d, **norm), nnx.RMSNorm(d, **norm)
            self.q = linear(d, h * hd, True, rngs)
            self.k = linear(d, kvh * hd, False, rngs)
            self.v = linear(d, kvh * hd, True, rngs)
            self.o = linear(h * hd, d, False, rngs)
            self.gate = linear(d, cfg.hidden, True, rngs)
            self.up = linear(d, cfg.hidden, True, rngs)
            self.down = linear(cfg.hidden, d, True, rngs)

        def __call__(self, x: jax.Array, allowed: jax.Array) -> jax.Array:
            b, t, _ = x.shape
            a, pos = self.attn_norm(x), jnp.arange(t)
            q = _rope(self.q(a).reshape(b, t, h, hd), pos)
            k = _rope(self.k(a).reshape(b, t, kvh, hd), pos)
            v = self.v(a).reshape(b, t, kvh, hd)
            k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)  # GQA
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
            att = jax.nn.softmax(
                jnp.where(allowed, att, jnp.finfo(jnp.float32).min), axis=-1
            ).astype(dt)
            x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, h * hd))
            m = self.mlp_norm(x)
            return x + self.down(jax.nn.silu(self.gate(m)) * self.up(m))

    return LlamaBlock


def _llama_layers(cfg: LlamaConfig, block: type, rngs: Any) -> Any:
    """The blocks: stacked on axis 0 by ``nnx.vmap`` (for ``nnx.scan``) or a list."""
    from flax import nnx

    if not cfg.scan:
        return getattr(nnx, "List", list)([block(rngs) for _ in range(cfg.layers)])

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def stacked(r: nnx.Rngs) -> Any:
        return block(r)

    return stacked(rngs)


def _run_blocks(cfg: LlamaConfig, layers: Any, x: jax.Array, allowed: jax.Array) -> jax.Array:
    """``x`` through the blocks as users write it: ``nnx.scan`` over the stack, each under ``nnx.remat``."""
    from flax import nnx

    def step(blk: Any, h: jax.Array) -> jax.Array:
        out = blk(h, allowed)
        return out if cfg.activations is None else cfg.activations(out)

    step = nnx.remat(step) if cfg.remat else step
    if not cfg.scan:
        for blk in layers:
            x = step(blk, x)
        return x

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def scanned(blk: Any, h: jax.Array) -> jax.Array:
        return step(blk, h)

    return scanned(layers, x)


def _llama_model(cfg: LlamaConfig) -> type:
    """The flax nnx class of the decoder: embedding, blocks, final RMSNorm, untied LM head."""
    from flax import nnx

    block, dt = _llama_block(cfg), cfg.dtype

    class Llama(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(
                cfg.vocab,
                cfg.d,
                dtype=dt,
                param_dtype=dt,
                embedding_init=nnx.initializers.normal(0.02),
                rngs=rngs,
            )
            self.layers = _llama_layers(cfg, block, rngs)
            self.norm = nnx.RMSNorm(cfg.d, epsilon=1e-5, dtype=dt, param_dtype=dt, rngs=rngs)
            self.lm_head = nnx.Linear(
                cfg.d, cfg.vocab, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs
            )

        def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
            t = tokens.shape[1]
            # causal, and no attending to padding keys
            allowed = jnp.tril(jnp.ones((t, t), bool))[None, None] & mask[:, None, None, :]
            x = self.embed(tokens)
            x = x if cfg.activations is None else cfg.activations(x)
            x = _run_blocks(cfg, self.layers, x, allowed)
            return self.lm_head(self.norm(x))

    return Llama


def llama_data(cfg: LlamaConfig, batch: int, seed: int = 0) -> dict[str, jax.Array]:
    """Random tokens, next-token labels and a right-padding mask (example i has i tokens of padding, up to T/2)."""
    r = np.random.default_rng(seed)
    tokens = r.integers(0, cfg.vocab, size=(batch, cfg.seq + 1))
    pad = np.minimum(np.arange(batch), cfg.seq // 2)
    mask = np.arange(cfg.seq)[None, :] < (cfg.seq - pad)[:, None]
    return {
        "x": jnp.asarray(tokens[:, :-1], jnp.int32),
        "y": jnp.asarray(tokens[:, 1:], jnp.int32),
        "mask": jnp.asarray(mask),
    }


def llama(
    seed: int, batch: int, cfg: LlamaConfig | None = None
) -> tuple[Callable[..., Any], Any, Any]:
    """A Llama-style decoder in flax nnx (see ``LlamaConfig``); the loss of an example is its mean
    token cross-entropy over the tokens its ``mask`` keeps (padding does not count).

    With ``cfg.lora`` the parameters are the adapters alone; the frozen base is closed over and
    merged with ``copy=True`` (nnx's merge otherwise reuses the closed-over variables, and a
    second trace would see the first trace's values in them).
    """
    from flax import nnx

    cfg = LlamaConfig() if cfg is None else cfg
    model = _llama_model(cfg)(nnx.Rngs(seed))
    if cfg.lora:
        graphdef, params, frozen = nnx.split(model, nnx.LoRAParam, ...)
    else:
        graphdef, params = nnx.split(model)
        frozen = None

    def losses(p: Any, b: Any) -> jax.Array:
        net = (
            nnx.merge(graphdef, p, frozen, copy=True)
            if frozen is not None
            else nnx.merge(graphdef, p)
        )
        logits = net(b["x"], b["mask"]).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])
        keep = b["mask"].astype(jnp.float32)
        return jnp.sum(ce * keep, axis=-1) / jnp.maximum(jnp.sum(keep, axis=-1), 1.0)

    return losses, params, llama_data(cfg, batch, seed)
