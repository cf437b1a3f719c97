"""Demo: an MLP on scikit-learn's digits, trained three ways.

Run it with ``python -m gradclip_jax.demo`` (``--help`` lists the flags). It
trains the same small MLP (64-64-10, tanh) on the 8x8 digits images bundled
with scikit-learn (``sklearn.datasets.load_digits``: nothing is downloaded):

1. **none**: ``optax.adam``, no clipping;
2. **global**: ``optax.chain(gcx.clip_by_global_norm(C), optax.adam(...))``;
3. **dp-sgd**: DP-Adam built with :func:`gradclip_jax.dp.make_private`:
   **Poisson-sampled** batches (each training example is in a step's batch
   independently with probability ``q = batch_size / n_train``), padded to one
   fixed size with a mask, per-example clipping with
   :func:`gradclip_jax.clipped_grad`, Gaussian noise once per step, then
   ``optax.adam`` (Adam only post-processes the privatized gradient). The
   noise multiplier is calibrated (PLD accountant) for the target
   ``--epsilon`` at ``delta=1e-5``.

It prints a table (test accuracy, epsilon, time per step, fraction clipped) and
saves a PNG with the training-loss curves and the clip fraction per step (by
default in a new temporary folder, whose path it prints; ``--out PATH`` puts it
elsewhere). The output folder is checked before training, so a bad ``--out``
fails at once.

The global clip norm (0.3) sits near the 70th percentile of this model's batch
gradient norms, so global clipping acts on about a quarter of the steps and its
loss curve visibly departs from the unclipped one. (At 1.0 it would clip under 1%
of the steps, and the two curves would coincide.)

**Accounting.** The epsilon in the table is the one of the steps the DP-SGD run
actually took, read from its :class:`gradclip_jax.privacy.PrivacyAccountant`
after training (every step is recorded as its batch is drawn). The batches are
the Poisson-sampled ones the accountant assumes; the padded size is chosen so
that the whole run overflows it with probability below 1e-9, and an overflow
would raise rather than be dropped silently. The non-private runs use
fixed-size slices of a fresh permutation each epoch.

Needs the optional packages scikit-learn, matplotlib and dp-accounting; tqdm is
used for the progress bar when it is installed (a plain text bar otherwise); the
DP-SGD run's bar shows the epsilon spent so far.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx

__all__ = [
    "DemoResult",
    "check_output_path",
    "format_table",
    "load_digits_split",
    "main",
    "plot_results",
    "run",
]

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
      sec_per_step: median wall time of one training step (drawing its batch and running it
        to completion), compilation excluded.
      clip_fraction: mean over steps of the fraction clipped: for ``'dp-sgd'``
        the fraction of examples in the batch whose gradient was clipped, for
        ``'global'`` the fraction of steps whose batch gradient was clipped, and
        0 for ``'none'``.
      losses: the mean training loss of each step's batch.
      clip_fractions: the fraction clipped at each step.
      batch_sizes: the number of real examples in each step's batch (fixed
        for ``'none'`` and ``'global'``, Poisson-distributed for ``'dp-sgd'``).
      padded_batch_size: the size of the arrays each step saw (the batch size,
        or for ``'dp-sgd'`` the sampler's ``max_batch_size``).
      accountant: for ``'dp-sgd'``, the
        :class:`gradclip_jax.privacy.PrivacyAccountant` holding the steps the
        run took (``epsilon`` is its ``epsilon(delta)``); ``None`` otherwise.
    """

    name: str
    test_accuracy: float
    epsilon: float
    noise_multiplier: float
    sec_per_step: float
    clip_fraction: float
    losses: list[float] = field(default_factory=list)
    clip_fractions: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    padded_batch_size: int = 0
    accountant: gcx.privacy.PrivacyAccountant | None = None


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


def _has_tqdm() -> bool:
    return importlib.util.find_spec("tqdm") is not None


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    if not _has_tqdm():
        return _TextBar(total, desc)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=True)


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def _train(
    name: str,
    step_fn: Callable[..., Any],
    params: Any,
    opt_state: Any,
    batches: Iterable[tuple[Any, ...]],
    total: int,
    data: tuple[np.ndarray, ...],
    progress: bool,
) -> tuple[Any, list[float], list[float], float]:
    """Runs ``step_fn(params, opt_state, x, y, *args) -> (params, opt_state, loss, frac)``.

    ``batches`` yields each step's ``args`` (host arrays of one fixed shape, so
    the step compiles once); the training data stays on the device. The time per
    step is the median over the steps after the first (which compiles) of drawing
    the batch and running the step to completion.
    """
    x_tr, y_tr = jnp.asarray(data[0]), jnp.asarray(data[1])
    step = jax.jit(step_fn)
    bar = _progress(total, name, progress)
    losses, fracs, times = [], [], []
    start = time.perf_counter()
    for i, args in enumerate(batches):
        params, opt_state, loss, frac = step(params, opt_state, x_tr, y_tr, *args)
        jax.block_until_ready(params)
        now = time.perf_counter()
        if i > 0:  # step 0 compiles
            times.append(now - start)
        losses.append(loss)
        fracs.append(frac)
        if bar is not None:
            bar.update(1)
        start = time.perf_counter()
    if bar is not None:
        bar.close()
    # the median time of a step with its batch: a live-epsilon bar's occasional refresh is left out
    sec = float(np.median(times)) if times else 0.0
    return params, [float(v) for v in losses], [float(v) for v in fracs], sec


def _private_run(
    method: str, epsilon: float, delta: float, clip: float, learning_rate: float,
    batch_size: int, steps: int, n_train: int, seed: int,
) -> Any:
    """The DP-SGD run's :class:`gradclip_jax.dp.PrivateTraining` (single process)."""
    try:
        return gcx.dp.make_private(
            per_example_loss, optax.adam(learning_rate), dataset_size=n_train,
            expected_batch_size=batch_size, steps=steps, target_epsilon=epsilon, delta=delta,
            l2_clip_norm=clip, method=method, seed=seed, process_index=0, process_count=1,
        )
    except ValueError as err:
        if method == "ghost" and "method" in str(err):
            raise ValueError(_ghost_message(err)) from err
        raise


def run(
    steps: int = 600,
    batch_size: int = 64,
    method: str = "vmap",
    epsilon: float = 3.0,
    out: str | None = None,
    seed: int = 0,
    *,
    learning_rate: float = 3e-3,
    dp_learning_rate: float = 1e-2,
    clip_norm: float = 0.3,
    dp_clip_norm: float = 1.0,
    delta: float = DELTA,
    methods: Iterable[str] = METHODS,
    progress: bool = True,
) -> dict[str, DemoResult]:
    """Trains the MLP on digits once per entry of ``methods`` and returns the results.

    Args:
      steps: training steps of each run.
      batch_size: examples per step: the fixed size of the non-private runs'
        batches, and the expected size ``q * n_train`` of the DP-SGD run's
        Poisson batches.
      method: passed to :func:`gradclip_jax.clipped_grad` (``'vmap'``,
        ``'ghost'`` or ``'auto'``).
      epsilon: the target epsilon of the DP-SGD run at ``delta`` (the noise
        multiplier is calibrated for it; the result's ``epsilon`` is what the
        run's accountant reports after training).
      out: the PNG to write, or ``None`` (default) for no plot. Its folder must
        exist and be writable: that is checked before any training.
      seed: seeds the data split, the initialization, the batches and the noise.
      learning_rate: Adam's learning rate for ``'none'`` and ``'global'``.
      dp_learning_rate: Adam's learning rate for ``'dp-sgd'``.
      clip_norm: the ``max_norm`` of ``gcx.clip_by_global_norm`` (default 0.3,
        near the 70th percentile of the batch gradient norms, so that clipping
        acts on about a quarter of the steps).
      dp_clip_norm: the per-example clip norm of the DP-SGD run.
      delta: the delta of the privacy accounting.
      methods: which runs, a subset of ``('none', 'global', 'dp-sgd')``.
      progress: show a progress bar per run.

    Returns:
      ``{name: DemoResult}`` in the order of ``methods``.

    Raises:
      ValueError: for a bad argument (``out`` in a missing or read-only folder
        included), or when ``clipped_grad`` rejects ``method`` (e.g. ``'ghost'``
        in a version without ghost clipping); the message says so.
    """
    if out is not None:
        check_output_path(out)
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
        live = False  # the DP-SGD run shows priv.batches' bar (with the epsilon) instead
        accountant = None
        if name in ("none", "global"):
            if name == "none":
                tx = optax.adam(learning_rate)
            else:
                tx = optax.chain(gcx.clip_by_global_norm(clip_norm), optax.adam(learning_rate))

            def plain_step(p, s, x, y, b, tx=tx, clipping=(name == "global")):
                batch = {"x": x[b], "y": y[b]}
                loss, g = jax.value_and_grad(lambda q: jnp.mean(per_example_loss(q, batch)))(p)
                u, s = tx.update(g, s, p)
                frac = jnp.float32(0.0)
                if clipping:
                    norm = optax.tree_utils.tree_get(s, "norm")
                    frac = (norm > clip_norm).astype(jnp.float32)
                return optax.apply_updates(p, u), s, loss, frac

            step_fn: Callable[..., Any] = plain_step
            opt_state = tx.init(params0)
            batches: Iterable[tuple[Any, ...]] = ((b,) for b in idx)
            sizes = [batch_size] * steps
            padded, z = batch_size, 0.0
        else:
            priv = _private_run(method, epsilon, delta, dp_clip_norm, dp_learning_rate,
                                batch_size, steps, n_train, seed)
            noise_key = jax.random.fold_in(jax.random.key(seed), 1)

            def dp_step(p, s, x, y, b, mask, t, priv=priv, noise_key=noise_key):
                batch = {"x": x[b], "y": y[b]}
                p, s, m = priv.step(p, s, batch, mask, priv.step_key(noise_key, t))
                real = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
                return p, s, m.loss, m.num_clipped.astype(jnp.float32) / real

            opt_state = priv.init(params0)
            step_fn = dp_step
            sizes = []

            live = progress and _has_tqdm()  # tqdm bar with the live epsilon from priv.batches

            def poisson_batches(priv=priv, sizes=sizes, live=live):
                # priv.batches() records each step in priv.accountant as it draws it
                for pb in priv.batches(progress=live):
                    sizes.append(int(pb.mask.sum()))
                    yield pb.indices, pb.mask, np.int32(pb.step)

            batches = poisson_batches()
            padded, z = priv.sampler.max_batch_size, priv.noise_multiplier
            accountant = priv.accountant

        try:
            params, losses, fracs, sec = _train(name, step_fn, params0, opt_state, batches, steps,
                                                data, progress and not live)
        except ValueError as err:
            if name == "dp-sgd" and method == "ghost":
                raise ValueError(_ghost_message(err)) from err
            raise
        results[name] = DemoResult(
            name=name,
            test_accuracy=accuracy(params, data[2], data[3]),
            epsilon=math.inf if accountant is None else accountant.epsilon(delta),
            noise_multiplier=z,
            sec_per_step=sec,
            clip_fraction=float(np.mean(fracs)),
            losses=losses,
            clip_fractions=fracs,
            batch_sizes=sizes,
            padded_batch_size=padded,
            accountant=accountant,
        )

    if out:
        plot_results(results, out)
    return results


def check_output_path(path: str) -> None:
    """Checks, before any training, that the plot can be saved at ``path``.

    Raises:
      TypeError: if ``path`` is not a string or ``os.PathLike``.
      ValueError: if ``path`` is a folder, its folder does not exist or is not
        writable, or its extension is not an image format matplotlib writes.
      ImportError: if matplotlib is not installed.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"out must be a path (str or os.PathLike), got {type(path).__name__}")
    from matplotlib.figure import Figure

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"out={path!r} is a folder; give a file name such as {path}/demo.png")
    if not os.path.isdir(folder):
        raise ValueError(f"out={path!r}: the folder {folder!r} does not exist")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if ext not in formats:
        raise ValueError(f"out={path!r}: unknown image format {ext!r}; use one of "
                         f"{', '.join(sorted(formats))} (e.g. demo.png)")
    try:  # a real write: os.access is wrong for root and some file systems
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"out={path!r}: cannot write to the folder {folder!r} ({err})") from err


def _ghost_message(err: BaseException) -> str:
    return (f"clipped_grad(method='ghost') is not available in this version of gradclip_jax "
            f"({err}); use --method vmap")


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
    for r in results.values():
        if r.accountant is not None:
            sizes = np.asarray(r.batch_sizes)
            lines.append(
                f"{r.name}: Poisson batches (sizes {sizes.min()}-{sizes.max()}, mean {sizes.mean():.1f}, "
                f"padded to {r.padded_batch_size}); epsilon from the {r.accountant.accountant.upper()} "
                f"accountant after the {r.accountant.steps} steps taken"
            )
    return "\n".join(lines)


def plot_results(results: dict[str, DemoResult], path: str) -> None:
    """Saves the loss curves and the clip fraction per step as an image.

    Uses a bare ``matplotlib.figure.Figure``, so pyplot's backend (and plots
    shown in a notebook) are left alone.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
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
        epilog="DP-SGD draws Poisson batches (rate batch_size / n_train, padded to a fixed size) "
        "and reports the epsilon its accountant gives for the steps it took.",
    )
    p.add_argument("--steps", type=int, default=600, help="training steps per run (default 600)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per step; the expected size of the DP-SGD run's Poisson batches "
                   "(default 64)")
    p.add_argument("--method", default="vmap", choices=("vmap", "ghost", "auto"),
                   help="clipped_grad method for DP-SGD (default vmap)")
    p.add_argument("--epsilon", type=float, default=3.0,
                   help=f"target epsilon of the DP-SGD run at delta={DELTA:g} (default 3)")
    p.add_argument("--out", default=None,
                   help="where to save the plot (default: gradclip_demo.png in a new temporary "
                   "folder, printed at the end); checked before training")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = a.out
    try:
        if out is None:  # run() checks a given path before training
            out = os.path.join(tempfile.mkdtemp(prefix="gradclip_demo_"), "gradclip_demo.png")
        results = run(steps=a.steps, batch_size=a.batch_size, method=a.method, epsilon=a.epsilon,
                      out=out, seed=a.seed, progress=not a.no_progress)
    except (ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(results))
    print(f"plot saved to {out}; total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
