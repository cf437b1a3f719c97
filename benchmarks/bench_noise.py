"""Benchmark: drawing the DP-SGD noise of a whole model, ours against optax's way.

``gcx.dp.noise.add_gaussian_noise`` (the noise of ``make_private`` and of the DP
steps in ``bench_ghost_gpu``) against the per-leaf draw that
``optax.contrib.differentially_private_aggregate`` makes (one
``jax.random.normal`` per leaf from ``jax.random.split(key, num_leaves)``), on
the tree of GPT-2 small (148 leaves, 124.4M parameters; ``--quick``: the same
148 leaves at width 128 and vocabulary 4096). Three rows, each a ratio of
ours to optax's way in this process: the time of one jitted call (median of
interleaved runs), the time to lower and compile it, and its compiled
temporaries. On the CPU ours draws in blocks (``gcx.dp.noise.NOISE_STRATEGY``).
A fourth row times ours drawing by ``"philox"`` (Philox4x32-10 bits instead of
threefry's) against the same per-leaf threefry draw. Two more time and compile
each draw followed by adamw's update, as a DP step reads its noise
(:func:`adamw_rows`: XLA's GPU fusion recomputes an unstored draw in each
fusion that reads it; ours stores each noised leaf).

Then the parts of a draw (:data:`PARTS`), each added to every leaf of the same
tree and timed against optax's per-leaf normal draw in the same rounds, to say
where a draw's time goes on a backend: a pass that only reads and writes the
tree (the memory floor), threefry bits, uniforms, normals by Box-Muller instead
of ``erf_inv``, one draw for the whole tree cut into leaves, normals from both
words of each threefry hash (JAX's draw keeps one word per hash), ours made once per
distinct leaf shape (``NOISE_STRATEGY`` ``"shapes"``; GPT-2 small's 148 leaves
have 9 shapes) and (on GPUs) JAX's threefry kernel
(``jax_threefry_gpu_kernel_lowering``) instead of threefry written in XLA ops;
each also by the time it takes to lower and compile (one fusion per leaf draw
is much code for a GPU compiler). Two rows time the hardened noise of
``gcx.dp.hardened`` against ours (:func:`hardened_rows`). On an H100 the per-leaf draw of GPT-2 small's
124M values took 4.6 ms where writing them takes about 0.3 ms.

Run: ``python -m benchmarks --only noise`` (``NOISE_BUDGET_S=SECONDS`` leaves out what
would run past it; each row is printed as it is measured).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.random import threefry2x32_p

import gradclip_jax as gcx
from benchmarks.common import interleaved_ms, memory_mb, row
from benchmarks.steps import optax_noise
from gradclip_jax._core.backend import backend_setting
from gradclip_jax.dp.philox import normal_from_bits

BUDGET_ENV = "NOISE_BUDGET_S"


def gpt2_tree(
    width: int = 768, vocab: int = 50257, layers: int = 12, positions: int = 1024
) -> dict[str, Any]:
    """Zeros shaped like GPT-2's parameters (tied head: no separate output matrix)."""
    d = width
    tree: dict[str, Any] = {
        "wte": jnp.zeros((vocab, d)),
        "wpe": jnp.zeros((positions, d)),
        "ln_f": {"scale": jnp.zeros(d), "bias": jnp.zeros(d)},
    }
    for i in range(layers):
        tree[f"h{i}"] = {
            "ln_1": {"scale": jnp.zeros(d), "bias": jnp.zeros(d)},
            "c_attn": {"kernel": jnp.zeros((d, 3 * d)), "bias": jnp.zeros(3 * d)},
            "attn_proj": {"kernel": jnp.zeros((d, d)), "bias": jnp.zeros(d)},
            "ln_2": {"scale": jnp.zeros(d), "bias": jnp.zeros(d)},
            "c_fc": {"kernel": jnp.zeros((d, 4 * d)), "bias": jnp.zeros(4 * d)},
            "mlp_proj": {"kernel": jnp.zeros((4 * d, d)), "bias": jnp.zeros(d)},
        }
    return tree


def _bits_as_float(k: jax.Array, x: jax.Array) -> jax.Array:
    return jax.random.bits(k, x.shape, jnp.uint32).astype(x.dtype)


def _box_muller(k: jax.Array, x: jax.Array) -> jax.Array:
    """Standard normals by Box-Muller: two uniforms per pair of draws, ``log``, ``sqrt``, ``cos``, ``sin``."""
    n = x.size
    u = jax.random.uniform(k, (2, (n + 1) // 2), x.dtype, minval=jnp.finfo(x.dtype).tiny)
    r, theta = jnp.sqrt(-2.0 * jnp.log(u[0])), 2.0 * jnp.pi * u[1]
    return jnp.reshape(jnp.concatenate([r * jnp.cos(theta), r * jnp.sin(theta)])[:n], x.shape)


def _per_leaf(draw: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[[Any, jax.Array], Any]:
    """``tree + draw`` leaf by leaf, one key per leaf (split as optax splits them)."""

    def f(tree: Any, key: jax.Array) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(
            treedef, [x + draw(k, x) for x, k in zip(leaves, keys, strict=True)]
        )

    return f


def _pairs_normal(k: jax.Array, x: jax.Array) -> jax.Array:
    """Standard normals from both words of each threefry2x32 hash: ``ceil(n / 2)`` hashes of
    the counters ``0, 1, ...`` under ``k``'s two words, the words stored (an optimization barrier:
    one fusion computes each hash once and writes both), then transformed as ``jax.random.normal``
    transforms its bits. JAX's own draw (partitionable threefry) hashes once per value and keeps
    the xor of the two words; whether a GPU's fusion keeps both words of one hash is what this
    part measures."""
    n = x.size
    counters = jnp.arange(-(-n // 2), dtype=jnp.uint32)
    k1, k2 = jax.random.key_data(k)
    words = lax.optimization_barrier(
        threefry2x32_p.bind(k1, k2, jnp.zeros_like(counters), counters)
    )
    return jnp.reshape(normal_from_bits(jnp.concatenate(words)[:n]), x.shape).astype(x.dtype)


def _one_draw(tree: Any, key: jax.Array) -> Any:
    """One normal draw of the whole tree's size, cut into the leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    z = jax.random.normal(key, (sum(x.size for x in leaves),), leaves[0].dtype)
    cuts = np.cumsum([x.size for x in leaves])[:-1]
    return jax.tree.unflatten(
        treedef,
        [x + jnp.reshape(p, x.shape) for x, p in zip(leaves, jnp.split(z, cuts), strict=True)],
    )


# name -> (what the row measures, the function of (tree, key), JAX config flags it is compiled with)
PARTS: dict[str, tuple[str, Callable[[Any, jax.Array], Any], dict[str, Any]]] = {
    "floor": (
        "tree + 1 per leaf (a read and a write of the tree: the memory floor)",
        lambda t, k: jax.tree.map(lambda x: x + 1.0, t),
        {},
    ),
    "pairs": (
        "tree + normals from both words of each threefry hash (words stored, then transformed)",
        _per_leaf(_pairs_normal),
        {},
    ),
    "bits": ("tree + threefry bits per leaf", _per_leaf(_bits_as_float), {}),
    "uniform": (
        "tree + uniforms per leaf",
        _per_leaf(lambda k, x: jax.random.uniform(k, x.shape, x.dtype)),
        {},
    ),
    "box_muller": ("tree + Box-Muller normals per leaf", _per_leaf(_box_muller), {}),
    "one_draw": ("tree + one normal draw of the whole tree, cut into leaves", _one_draw, {}),
    "threefry_kernel": (
        "optax per-leaf draw with JAX's threefry GPU kernel (jax_threefry_gpu_kernel_lowering)",
        lambda t, k: optax_noise(t, 1.0, k),
        {"jax_threefry_gpu_kernel_lowering": True},
    ),
}


@contextlib.contextmanager
def _flags(flags: dict[str, Any]) -> Iterator[None]:
    old = {name: getattr(jax.config, name) for name in flags}
    try:
        for name, value in flags.items():
            jax.config.update(name, value)
        yield
    finally:
        for name, value in old.items():
            jax.config.update(name, value)


def _by_shape(tree: Any, key: jax.Array) -> Any:
    """Ours with ``NOISE_STRATEGY`` ``"shapes"`` (read when traced): the per-leaf draws made once
    per distinct leaf shape."""
    with backend_setting(gcx.dp.noise.NOISE_STRATEGY, "shapes"):
        return gcx.dp.noise.add_gaussian_noise(tree, 1.0, key)


PARTS["per_shape"] = (
    "add_gaussian_noise with NOISE_STRATEGY 'shapes' (one vmapped draw per distinct shape)",
    _by_shape,
    {},
)


def part_rows(
    tree: Any, key: jax.Array, what: str, reps: int, deadline: float = math.inf
) -> list[dict]:
    """Two rows per part of :data:`PARTS`, each against optax's per-leaf normal draw: its time, and
    the time to lower and compile it (JAX's persistent compilation cache off, so that no program
    is read back from an earlier process). Parts whose compile would end past ``deadline``
    (``time.perf_counter()``'s clock, judged by the longest compile so far) are left out, in
    :data:`PARTS`' order."""
    compiled, compile_s = {}, {}
    with _flags({"jax_enable_compilation_cache": False}):
        compiled["optax"], compile_s["optax"] = _compile(
            lambda t, k: optax_noise(t, 1.0, k), tree, key
        )
        for name, (_, f, flags) in PARTS.items():
            if flags and jax.default_backend() != "gpu":
                continue  # a GPU lowering flag: the same program elsewhere
            if time.perf_counter() + max(compile_s.values()) > deadline:
                print(
                    f"[noise] parts from {name!r} on left out: {BUDGET_ENV} would be spent",
                    flush=True,
                )
                break
            with _flags(flags):
                compiled[name], compile_s[name] = _compile(f, tree, key)
    ms = interleaved_ms({k: (lambda c=c: c(tree, key)) for k, c in compiled.items()}, reps=reps)
    rows = []
    for name in compiled:
        if name != "optax":
            title = PARTS[name][0]
            rows.append(
                row(
                    "noise",
                    f"noise parts: {title} vs optax per-leaf normal draw: time",
                    ms[name],
                    ms["optax"],
                    what,
                )
            )
            rows.append(
                row(
                    "noise",
                    f"noise parts: {title} vs optax per-leaf normal draw: lower+compile (ms)",
                    compile_s[name] * 1e3,
                    compile_s["optax"] * 1e3,
                    what,
                )
            )
    return rows


def _then_adamw(noise: Callable[[Any, jax.Array], Any]) -> Callable[..., Any]:
    """``noise`` followed by adamw's update of the tree by the noised tree, as a DP step reads its
    noise: adamw reads each gradient leaf in more than one fusion (see :func:`adamw_rows`)."""
    opt = optax.adamw(1e-4)

    def f(tree: Any, state: Any, key: jax.Array) -> Any:
        updates, state = opt.update(noise(tree, key), state, tree)
        return optax.apply_updates(tree, updates), state

    return f


def adamw_rows(tree: Any, key: jax.Array, what: str, reps: int) -> list[dict]:
    """Ours then adamw against optax's per-leaf draw then adamw: time, and lower+compile.

    Without a stored draw XLA's GPU fusion recomputes a leaf's whole draw in each
    fusion that reads it (on an H100, GPT-2 small's tied embedding took three
    1.1-1.5 ms fusions in a DP step); ours stores each noised leaf
    (``gradclip_jax.dp.noise._stored``)."""
    state = optax.adamw(1e-4).init(tree)
    fns = {
        "ours": _then_adamw(lambda t, k: gcx.dp.noise.add_gaussian_noise(t, 1.0, k)),
        "optax": _then_adamw(lambda t, k: optax_noise(t, 1.0, k)),
    }
    compiled, compile_s = {}, {}
    with _flags({"jax_enable_compilation_cache": False}):
        for name, f in fns.items():
            compiled[name], compile_s[name] = _compile(f, tree, state, key)
    ms = interleaved_ms(
        {k: (lambda c=c: c(tree, state, key)) for k, c in compiled.items()}, reps=reps
    )
    title = "add_gaussian_noise then adamw's update vs optax per-leaf draw then adamw's update"
    return [
        row("noise", f"{title}: time", ms["ours"], ms["optax"], what),
        row(
            "noise",
            f"{title}: lower+compile (ms)",
            compile_s["ours"] * 1e3,
            compile_s["optax"] * 1e3,
            what,
        ),
    ]


def hardened_rows(tree: Any, key: jax.Array, what: str, reps: int) -> list[dict]:
    """The hardened noise (``gcx.dp.hardened``) against ``add_gaussian_noise``, each jitted on ``tree``:
    the sum of four normals over two, and the integer grid's discrete Gaussian (sigma 1024, int32
    leaves of the same shapes) added to an int32 tree and read back as float32 (``from_grid``)."""
    hd = gcx.dp.hardened
    ints = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.int32), tree)
    fns = {
        "default": (lambda t, k: gcx.dp.noise.add_gaussian_noise(t, 1.0, k), tree),
        "sum_of_normals": (lambda t, k: hd.add_sum_of_normals_noise(t, 1.0, k), tree),
        "discrete": (
            lambda t, k: hd.from_grid(hd.add_discrete_gaussian_noise(t, 1024.0, k), 1024.0),
            ints,
        ),
    }
    compiled = {name: _compile(f, x, key)[0] for name, (f, x) in fns.items()}
    ms = interleaved_ms(
        {n: (lambda c=c, x=fns[n][1]: c(x, key)) for n, c in compiled.items()}, reps=reps
    )
    title = "hardened noise (gcx.dp.hardened) vs add_gaussian_noise: time"
    return [
        row("noise", f"{title}, sum of four normals", ms["sum_of_normals"], ms["default"], what),
        row(
            "noise",
            f"{title}, discrete Gaussian on the int32 grid (sigma 1024)",
            ms["discrete"],
            ms["default"],
            what,
        ),
    ]


def hardened_step_rows(reps: int, batch: int = 64) -> list[dict]:
    """The step of ``make_private`` hardened against the default step (same model, batch and target):
    an MLP 784-256-10 on random data, ``expected_batch_size=batch``; ``'discrete'`` at grid 2**10
    (its per-example gradients by ``jax.vmap``, as the default's ``method='auto'`` picks here)."""
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(784, 256)) * 0.05, jnp.float32),
        "b1": jnp.zeros(256),
        "w2": jnp.asarray(rng.normal(size=(256, 10)) * 0.05, jnp.float32),
        "b2": jnp.zeros(10),
    }
    data = {
        "x": jnp.asarray(rng.normal(size=(batch, 784)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 10, batch)),
    }

    def losses(p: Any, b: Any) -> jax.Array:
        h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], b["y"])

    kw = dict(
        dataset_size=60_000,
        expected_batch_size=batch,
        steps=1000,
        target_epsilon=8.0,
        delta=1e-5,
        l2_clip_norm=1.0,
        accountant="rdp",
        process_index=0,
        process_count=1,
    )
    modes = {
        "default": {},
        "sum_of_normals": {"hardened": True},
        "discrete": {"hardened": "discrete", "grid_scale": 1024.0},
    }
    mask = jnp.ones((batch,), bool)
    thunks = {}
    for name, extra in modes.items():
        priv = gcx.make_private(losses, optax.sgd(0.1), **kw, **extra)
        step, state, k = priv.step, priv.init(params), priv.noise_key()
        thunks[name] = lambda step=step, state=state, k=k: step(params, state, data, mask, k)
    ms = interleaved_ms(thunks, reps=reps)
    what = f"make_private step, MLP 784-256-10 ({784 * 256 + 256 + 2570} params), batch {batch}, {jax.default_backend()}"
    title = "make_private step hardened vs default: time"
    return [
        row(
            "noise",
            f"{title}, hardened=True (sum of normals)",
            ms["sum_of_normals"],
            ms["default"],
            what,
        ),
        row(
            "noise",
            f"{title}, hardened='discrete' (grid 2**10)",
            ms["discrete"],
            ms["default"],
            what,
        ),
    ]


def _compile(f: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _said(rows: list[dict]) -> list[dict]:
    """``rows``, printed as they are made: a run stopped at its time limit keeps what it measured."""
    for r in rows:
        print(
            f"[noise] {r['name']}: {r['ours_ms']:.2f} vs {r['baseline_ms']:.2f} -> {r['ratio']:.3f}",
            flush=True,
        )
    return rows


def _draw_rows(tree: Any, key: jax.Array, quick: bool) -> tuple[list[dict], str]:
    """The first rows: one draw of ``tree``'s noise, ours (by the backend's strategy and by
    ``'philox'``) against optax's per-leaf draw; and the rows' description."""
    leaves = jax.tree.leaves(tree)
    n = sum(x.size for x in leaves)
    fns = {
        "ours": lambda t, k: gcx.dp.noise.add_gaussian_noise(t, 1.0, k),
        "optax": lambda t, k: optax_noise(t, 1.0, k),
    }
    _compile(
        lambda t, k: optax_noise(t, 1.0, k), {"w": jnp.zeros(3)}, key
    )  # one-time warm-up of the compiler
    fns["philox"] = lambda t, k: gcx.dp.noise.add_gaussian_noise(
        t, 1.0, k
    )  # traced with "philox" below
    backend = jax.default_backend()
    compiled, compile_s, temp = {}, {}, {}
    for name, f in fns.items():  # compiled once each: a second compile would hit jax's cache
        with backend_setting(gcx.dp.noise.NOISE_STRATEGY, "philox" if name == "philox" else None):
            compiled[name], compile_s[name] = _compile(f, tree, key)
        temp[name] = memory_mb(compiled[name])[0]
    ms = interleaved_ms(
        {k: (lambda c=c: c(tree, key)) for k, c in compiled.items()}, reps=5 if quick else 15
    )
    strategy = gcx.dp.noise.NOISE_STRATEGY.get(backend, "leaves")
    what = (
        f"{len(leaves)} leaves, {n / 1e6:.1f}M params (GPT-2{' shapes at width 128' if quick else ' small'}), "
        f"{backend}, ours draws by {strategy!r}"
    )
    return _said(
        [
            row(
                "noise",
                "add_gaussian_noise vs optax per-leaf draw: time",
                ms["ours"],
                ms["optax"],
                what,
            ),
            row(
                "noise",
                "add_gaussian_noise vs optax per-leaf draw: lower+compile (ms)",
                compile_s["ours"] * 1e3,
                compile_s["optax"] * 1e3,
                what,
            ),
            row(
                "noise",
                "add_gaussian_noise vs optax per-leaf draw: temporaries (MiB, not ms)",
                temp["ours"],
                temp["optax"],
                what,
            ),
            row(
                "noise",
                "add_gaussian_noise drawing by 'philox' vs optax per-leaf draw (threefry): time",
                ms["philox"],
                ms["optax"],
                what.split(", ours draws")[0],
            ),
        ]
    ), what


def run(quick: bool = False) -> list[dict]:
    """The rows of the module's docstring: the draws, then with adamw, then the parts.

    ``NOISE_BUDGET_S`` (seconds; default: none) skips what would run past it: the adamw rows
    when the first rows took longer than what is left, the parts one by one
    (:func:`part_rows`). On a GPU each draw of GPT-2 small's tree takes tens of seconds to compile.
    """
    start = time.perf_counter()
    deadline = start + float(os.environ.get(BUDGET_ENV, "inf"))
    tree = gpt2_tree(width=128, vocab=4096) if quick else gpt2_tree()
    key = jax.random.key(0)
    rows, what = _draw_rows(tree, key, quick)
    if time.perf_counter() + (time.perf_counter() - start) < deadline:
        rows += _said(adamw_rows(tree, key, what, reps=5 if quick else 15))
        rows += _said(
            hardened_rows(tree, key, what.split(", ours draws")[0], reps=5 if quick else 15)
        )
        rows += _said(hardened_step_rows(reps=5 if quick else 15))
    else:
        print(
            f"[noise] adamw rows left out, and the hardened rows: {BUDGET_ENV} would be spent",
            flush=True,
        )
    return rows + _said(
        part_rows(
            tree, key, what.split(", ours draws")[0], reps=5 if quick else 15, deadline=deadline
        )
    )


if __name__ == "__main__":
    run()
