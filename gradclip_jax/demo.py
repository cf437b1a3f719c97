"""Demo: an MLP on scikit-learn's digits, trained three ways.

Run it with ``python -m gradclip_jax.demo`` (``--help`` lists the flags). It
trains the same small MLP (64-64-10, tanh) on the 8x8 digits images bundled
with scikit-learn (``sklearn.datasets.load_digits``: nothing is downloaded):

1. **none**: ``optax.adam``, no clipping;
2. **global**: ``optax.chain(gcx.clip_by_global_norm(C), optax.adam(...))``;
3. **dp-sgd**: per-example clipping with :func:`gradclip_jax.clipped_grad`,
   Gaussian noise with :func:`gradclip_jax.dp_noise`, then ``optax.adam``
   (DP-Adam: Adam only post-processes the privatized gradient). The noise
   multiplier is calibrated with
   :func:`gradclip_jax.privacy.calibrate_noise_multiplier` for the target
   ``--epsilon`` at ``delta=1e-5``.

It prints a table (test accuracy, epsilon, time per step, fraction clipped) and
saves a PNG with the training-loss curves and the clip fraction per step.

**Accounting assumption.** The batches are fixed-size slices of a fresh
permutation of the training set each epoch (shuffling, not Poisson sampling),
and the privacy accounting treats them as Poisson sampling at rate
``sample_rate = batch_size / n_train``. This is common practice, but the
epsilon reported is formally that of Poisson-sampled DP-SGD, not of the
shuffled batches actually used.

Needs the optional packages scikit-learn, matplotlib and dp-accounting; tqdm is
used for the progress bar when it is installed (a plain text bar otherwise).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx

__all__ = ["DemoResult", "format_table", "load_digits_split", "main", "plot_results", "run"]

DELTA = 1e-5
METHODS = ("none", "global", "dp-sgd")


@dataclass
class DemoResult:
    """What one training run of the demo measured.

    Attributes:
      name: ``'none'``, ``'global'`` or ``'dp-sgd'``.
      test_accuracy: accuracy on the held-out test split, in [0, 1].
      epsilon: the epsilon spent at ``delta`` (``inf`` without DP).
      noise_multiplier: the calibrated noise multiplier (0 without DP).
      sec_per_step: mean wall time of one training step, compilation excluded.
      clip_fraction: mean over steps of the fraction clipped: for ``'dp-sgd'``
        the fraction of examples in the batch whose gradient was clipped, for
        ``'global'`` the fraction of steps whose batch gradient was clipped, and
        0 for ``'none'``.
      losses: the mean training loss of each step's batch.
      clip_fractions: the fraction clipped at each step.
    """

    name: str
    test_accuracy: float
    epsilon: float
    noise_multiplier: float
    sec_per_step: float
    clip_fraction: float
    losses: list[float] = field(default_factory=list)
    clip_fractions: list[float] = field(default_factory=list)


# ----------------------------------------------------------------------------
# Data and model
# ----------------------------------------------------------------------------


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> tuple[np.ndarray, ...]:
    """The digits data set, scaled to [0, 1] and split stratified into train and test.

    Returns:
      ``(x_train, y_train, x_test, y_test)``: float32 images of 64 pixels and
      int32 labels 0-9.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return x_tr, y_tr, x_te, y_te


def init_mlp(key: jax.Array, sizes: Sequence[int] = (64, 64, 10)) -> list[dict[str, jax.Array]]:
    """Glorot-uniform weights, zero biases."""
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), itertools.pairwise(sizes)):
        lim = math.sqrt(6.0 / (n_in + n_out))
        params.append({"w": jax.random.uniform(k, (n_in, n_out), jnp.float32, -lim, lim),
                       "b": jnp.zeros(n_out, jnp.float32)})
    return params


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """The logits of the MLP (tanh hidden layers)."""
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def per_example_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Softmax cross-entropy of each example, shape ``(B,)``."""
    logits = mlp(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def accuracy(params: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float(jnp.mean(jnp.argmax(mlp(params, jnp.asarray(x)), -1) == jnp.asarray(y)))


def batch_indices(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """``(steps, batch_size)`` indices: consecutive slices of a fresh permutation per epoch."""
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(n)
        out.extend(perm[i * batch_size:(i + 1) * batch_size] for i in range(per_epoch))
    return np.stack(out[:steps]).astype(np.int32)


# ----------------------------------------------------------------------------
# Progress bar
# ----------------------------------------------------------------------------


class _TextBar:
    """A minimal progress bar on stderr, for when tqdm is not installed."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self._every = max(1, total // 40)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.n % self._every == 0 or self.n == self.total:
            filled = int(30 * self.n / max(self.total, 1))
            sys.stderr.write(f"\r{self.desc:>8} [{'#' * filled}{'.' * (30 - filled)}] "
                             f"{self.n}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _TextBar(total, desc)
    return tqdm(total=total, desc=desc, leave=True)


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def _train(
    name: str,
    step_fn: Callable[..., Any],
    params: Any,
    opt_state: Any,
    idx: np.ndarray,
    data: tuple[np.ndarray, ...],
    progress: bool,
) -> tuple[Any, list[float], list[float], float]:
    x_tr, y_tr = jnp.asarray(data[0]), jnp.asarray(data[1])
    step = jax.jit(step_fn)
    bar = _progress(len(idx), name, progress)
    losses, fracs = [], []
    t0 = None
    for i, b in enumerate(idx):
        params, opt_state, loss, frac = step(params, opt_state, x_tr, y_tr, jnp.asarray(b))
        if i == 0:  # exclude compilation from the timing
            jax.block_until_ready(params)
            t0 = time.perf_counter()
        losses.append(loss)
        fracs.append(frac)
        if bar is not None:
            bar.update(1)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    if bar is not None:
        bar.close()
    sec = elapsed / max(len(idx) - 1, 1)
    return params, [float(v) for v in losses], [float(v) for v in fracs], sec


def run(
    steps: int = 600,
    batch_size: int = 64,
    method: str = "vmap",
    epsilon: float = 3.0,
    out: str | None = "gradclip_demo.png",
    seed: int = 0,
    *,
    learning_rate: float = 3e-3,
    dp_learning_rate: float = 1e-2,
    clip_norm: float = 1.0,
    dp_clip_norm: float = 1.0,
    delta: float = DELTA,
    methods: Iterable[str] = METHODS,
    progress: bool = True,
) -> dict[str, DemoResult]:
    """Trains the MLP on digits once per entry of ``methods`` and returns the results.

    Args:
      steps: training steps of each run.
      batch_size: examples per step (fixed size).
      method: passed to :func:`gradclip_jax.clipped_grad` (``'vmap'``,
        ``'ghost'`` or ``'auto'``).
      epsilon: the target epsilon of the DP-SGD run at ``delta``.
      out: the PNG to write, or ``None`` for no plot.
      seed: seeds the data split, the initialization, the batches and the noise.
      learning_rate: Adam's learning rate for ``'none'`` and ``'global'``.
      dp_learning_rate: Adam's learning rate for ``'dp-sgd'``.
      clip_norm: the ``max_norm`` of ``gcx.clip_by_global_norm``.
      dp_clip_norm: the per-example clip norm of the DP-SGD run.
      delta: the delta of the privacy accounting.
      methods: which runs, a subset of ``('none', 'global', 'dp-sgd')``.
      progress: show a progress bar per run.

    Returns:
      ``{name: DemoResult}`` in the order of ``methods``.

    Raises:
      ValueError: for a bad argument, or when ``clipped_grad`` rejects ``method``
        (e.g. ``'ghost'`` in a version without ghost clipping); the message says so.
    """
    methods = tuple(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}; expected a subset of {METHODS}")
    if steps < 2:
        raise ValueError(f"steps must be at least 2, got {steps}")
    data = load_digits_split(seed)
    n_train = len(data[0])
    if not 1 <= batch_size <= n_train:
        raise ValueError(f"batch_size must be in [1, {n_train}], got {batch_size}")
    idx = batch_indices(n_train, batch_size, steps, seed)
    params0 = init_mlp(jax.random.key(seed))
    results: dict[str, DemoResult] = {}

    for name in methods:
        if name in ("none", "global"):
            if name == "none":
                tx = optax.adam(learning_rate)
            else:
                tx = optax.chain(gcx.clip_by_global_norm(clip_norm), optax.adam(learning_rate))

            def step_fn(p, s, x, y, b, tx=tx, clipping=(name == "global")):
                batch = {"x": x[b], "y": y[b]}
                loss, g = jax.value_and_grad(lambda q: jnp.mean(per_example_loss(q, batch)))(p)
                u, s = tx.update(g, s, p)
                frac = jnp.float32(0.0)
                if clipping:
                    norm = optax.tree_utils.tree_get(s, "norm")
                    frac = (norm > clip_norm).astype(jnp.float32)
                return optax.apply_updates(p, u), s, loss, frac

            z, eps = 0.0, math.inf
        else:
            q = batch_size / n_train
            z = gcx.privacy.calibrate_noise_multiplier(epsilon, q, steps, delta)
            eps = gcx.privacy.epsilon(z, q, steps, delta)
            grad_fn = _clipped_grad_or_explain(method, dp_clip_norm)
            tx = optax.chain(
                gcx.dp_noise(stddev=z * grad_fn.sensitivity(), seed=seed, normalize_by=batch_size),
                optax.adam(dp_learning_rate),
            )

            def step_fn(p, s, x, y, b, tx=tx, grad_fn=grad_fn):
                batch = {"x": x[b], "y": y[b]}
                g, info = grad_fn(p, batch)
                u, s = tx.update(g, s, p)
                frac = info.num_clipped.astype(jnp.float32) / b.shape[0]
                return optax.apply_updates(p, u), s, jnp.mean(info.values), frac

        opt_state = tx.init(params0)
        try:
            params, losses, fracs, sec = _train(name, step_fn, params0, opt_state, idx, data, progress)
        except ValueError as err:
            if name == "dp-sgd" and method == "ghost":
                raise ValueError(_ghost_message(err)) from err
            raise
        results[name] = DemoResult(
            name=name,
            test_accuracy=accuracy(params, data[2], data[3]),
            epsilon=eps,
            noise_multiplier=z,
            sec_per_step=sec,
            clip_fraction=float(np.mean(fracs)),
            losses=losses,
            clip_fractions=fracs,
        )

    if out:
        plot_results(results, out)
    return results


def _ghost_message(err: BaseException) -> str:
    return (f"clipped_grad(method='ghost') is not available in this version of gradclip_jax "
            f"({err}); use --method vmap")


def _clipped_grad_or_explain(method: str, clip: float) -> Any:
    try:
        return gcx.clipped_grad(per_example_loss, clip, method=method)
    except ValueError as err:
        if method == "ghost":
            raise ValueError(_ghost_message(err)) from err
        raise


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------


def format_table(results: dict[str, DemoResult], delta: float = DELTA) -> str:
    """A plain-text table of the results (one row per run)."""
    head = f"{'run':<8} {'test acc':>8} {'epsilon':>9} {'noise z':>8} {'ms/step':>8} {'clipped':>8}"
    lines = [head, "-" * len(head)]
    for r in results.values():
        eps = "inf" if math.isinf(r.epsilon) else f"{r.epsilon:.3f}"
        lines.append(f"{r.name:<8} {r.test_accuracy:>8.3f} {eps:>9} {r.noise_multiplier:>8.3f} "
                     f"{1e3 * r.sec_per_step:>8.3f} {r.clip_fraction:>8.3f}")
    lines.append(f"epsilon at delta={delta:g}; 'clipped': dp-sgd = fraction of examples clipped, "
                 "global = fraction of steps clipped (means over steps)")
    return "\n".join(lines)


def plot_results(results: dict[str, DemoResult], path: str) -> None:
    """Saves the loss curves and the clip fraction per step as a PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results.values():
        ax1.plot(_smooth(r.losses), label=f"{r.name} (test acc {r.test_accuracy:.2f})")
        if r.name != "none":
            ax2.plot(_smooth(r.clip_fractions), label=r.name)
    ax1.set(xlabel="step", ylabel="training loss (moving avg. 20)", yscale="log",
            title="digits MLP: training loss")
    ax2.set(xlabel="step", ylabel="fraction clipped (moving avg. 20)", ylim=(-0.02, 1.02),
            title="clip fraction (dp-sgd: examples, global: steps)")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(v: Sequence[float], k: int = 20) -> np.ndarray:
    a = np.asarray(v, np.float64)
    k = max(1, min(k, len(a)))
    return np.convolve(a, np.ones(k) / k, mode="valid")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m gradclip_jax.demo [--steps N] ...``."""
    p = argparse.ArgumentParser(
        prog="python -m gradclip_jax.demo",
        description="Train an MLP on scikit-learn's digits without clipping, with global-norm "
        "clipping and with DP-SGD (per-example clipping + Gaussian noise).",
        epilog="Privacy accounting treats the fixed-size shuffled batches as Poisson sampling "
        "at rate batch_size / n_train (a common approximation).",
    )
    p.add_argument("--steps", type=int, default=600, help="training steps per run (default 600)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per step (default 64)")
    p.add_argument("--method", default="vmap", choices=("vmap", "ghost", "auto"),
                   help="clipped_grad method for DP-SGD (default vmap)")
    p.add_argument("--epsilon", type=float, default=3.0,
                   help=f"target epsilon of the DP-SGD run at delta={DELTA:g} (default 3)")
    p.add_argument("--out", default="gradclip_demo.png", help="PNG path (default gradclip_demo.png)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        results = run(steps=a.steps, batch_size=a.batch_size, method=a.method, epsilon=a.epsilon,
                      out=a.out, seed=a.seed, progress=not a.no_progress)
    except (ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(results))
    print(f"plot saved to {a.out}; total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
