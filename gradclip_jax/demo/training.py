"""The demo's three runs: no clipping, global-norm clipping and DP-SGD (``make_private``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradclip_jax as gcx
from gradclip_jax._core.validation import renamed_kwarg
from gradclip_jax.demo.data import (
    accuracy,
    batch_indices,
    init_mlp,
    load_digits_split,
    per_example_loss,
)
from gradclip_jax.demo.output import DELTA, check_output_path, plot_results
from gradclip_jax.demo.progress import has_tqdm, progress_bar

METHODS = ("none", "global", "dp-sgd")

__all__ = ["METHODS", "ghost_message"]  # the others: gradclip_jax.demo


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
        :class:`gradclip_jax.PrivacyAccountant` holding the steps the
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
    accountant: gcx.PrivacyAccountant | None = None


def train(
    name: str,
    step_fn: Callable[..., Any],
    params: Any,
    opt_state: Any,
    batches: Iterable[tuple[Any, ...]],
    total: int,
    data: tuple[np.ndarray, ...],
    progress: bool,
) -> tuple[Any, list[float], list[float], float]:
    """Runs ``step_fn(params, opt_state, x, y, *args) -> (params, opt_state, loss, frac)``
    (jitted already: the DP run's is a host function around ``priv.step``, called directly).

    ``batches`` yields each step's ``args`` (host arrays of one fixed shape, so
    the step compiles once); the training data stays on the device. The time per
    step is the median over the steps after the first (which compiles) of drawing
    the batch and running the step to completion.
    """
    x_tr, y_tr = jnp.asarray(data[0]), jnp.asarray(data[1])
    bar = progress_bar(total, name, progress)
    losses, fracs, times = [], [], []
    start = time.perf_counter()
    for i, args in enumerate(batches):
        params, opt_state, loss, frac = step_fn(params, opt_state, x_tr, y_tr, *args)
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


def private_run(
    method: str,
    epsilon: float,
    delta: float,
    clip: float,
    learning_rate: float,
    batch_size: int,
    steps: int,
    n_train: int,
    seed: int,
) -> Any:
    """The DP-SGD run's :class:`gradclip_jax.PrivateTraining` (single process)."""
    try:
        return gcx.make_private(
            per_example_loss,
            optax.adam(learning_rate),
            dataset_size=n_train,
            expected_batch_size=batch_size,
            steps=steps,
            target_epsilon=epsilon,
            delta=delta,
            l2_clip_norm=clip,
            method=method,
            seed=seed,
            process_index=0,
            process_count=1,
        )
    except ValueError as err:
        if method == "ghost" and "method" in str(err):
            raise ValueError(ghost_message(err)) from err
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
    l2_clip_norm: float | None = None,
    delta: float = DELTA,
    methods: Iterable[str] = METHODS,
    progress: bool = True,
    dp_clip_norm: float | None = None,
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
      l2_clip_norm: the per-example clip norm of the DP-SGD run (default 1.0).
      delta: the delta of the privacy accounting.
      methods: which runs, a subset of ``('none', 'global', 'dp-sgd')``.
      progress: show a progress bar per run.
      dp_clip_norm: deprecated spelling of ``l2_clip_norm`` (warns).

    Returns:
      ``{name: DemoResult}`` in the order of ``methods``.

    Raises:
      ValueError: for a bad argument (``out`` in a missing or read-only folder
        included), or when ``clipped_grad`` rejects ``method`` (e.g. ``'ghost'``
        in a version without ghost clipping); the message says so.
    """
    clip = renamed_kwarg("demo.run", "dp_clip_norm", "l2_clip_norm", dp_clip_norm, l2_clip_norm)
    clip = 1.0 if clip is None else clip
    if out is not None:
        check_output_path(out)
    methods = _check_runs(methods, steps)
    data = load_digits_split(seed)
    n_train = len(data[0])
    if not 1 <= batch_size <= n_train:
        raise ValueError(f"batch_size must be in [1, {n_train}], got {batch_size}")
    idx = batch_indices(n_train, batch_size, steps, seed)
    params0 = init_mlp(jax.random.key(seed))
    results: dict[str, DemoResult] = {}

    for name in methods:
        if name in ("none", "global"):
            setup = _plain_setup(name, learning_rate, clip_norm, params0, idx, batch_size, steps)
        else:
            setup = _private_setup(
                method,
                epsilon,
                delta,
                clip,
                dp_learning_rate,
                batch_size,
                steps,
                n_train,
                seed,
                params0,
                progress,
            )
        try:
            results[name] = _result(name, setup, params0, steps, data, delta, progress)
        except ValueError as err:
            if name == "dp-sgd" and method == "ghost":
                raise ValueError(ghost_message(err)) from err
            raise

    if out:
        plot_results(results, out)
    return results


class _Setup(NamedTuple):
    """What a run trains with: its step, optimizer state and batches, and what it reports."""

    step_fn: Callable[..., Any]
    opt_state: Any
    batches: Iterable[tuple[Any, ...]]
    sizes: list[int]
    padded: int
    noise_multiplier: float
    accountant: Any
    live: bool  # the DP-SGD run shows priv.batches' bar (with the epsilon) instead of train's


def _plain_setup(
    name: str,
    learning_rate: float,
    clip_norm: float,
    params0: Any,
    idx: np.ndarray,
    batch_size: int,
    steps: int,
) -> _Setup:
    """The ``'none'`` or ``'global'`` run: Adam, with global-norm clipping for ``'global'``."""
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

    return _Setup(
        jax.jit(plain_step),
        tx.init(params0),
        ((b,) for b in idx),
        [batch_size] * steps,
        batch_size,
        0.0,
        None,
        False,
    )


def _private_setup(
    method: str,
    epsilon: float,
    delta: float,
    clip: float,
    learning_rate: float,
    batch_size: int,
    steps: int,
    n_train: int,
    seed: int,
    params0: Any,
    progress: bool,
) -> _Setup:
    """The ``'dp-sgd'`` run: :func:`gradclip_jax.make_private`'s step on its Poisson batches."""
    priv = private_run(
        method, epsilon, delta, clip, learning_rate, batch_size, steps, n_train, seed
    )
    noise_key = jax.random.fold_in(jax.random.key(seed), 1)

    gather = jax.jit(lambda x, y, b: {"x": x[b], "y": y[b]})

    @jax.jit
    def loss_and_frac(m, mask):
        real = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
        return m.loss, m.num_clipped.astype(jnp.float32) / real

    def dp_step(p, s, x, y, b, mask, t):
        # priv.step called directly: its program has no host callback, so JAX's persistent cache
        # keeps it (a rerun notebook cell reads it back) and the host counts each call
        p, s, m = priv.step(p, s, gather(x, y, b), mask, priv.step_key(noise_key, t))
        return p, s, *loss_and_frac(m, mask)

    sizes: list[int] = []
    live = progress and has_tqdm()  # tqdm bar with the live epsilon from priv.batches

    def poisson_batches():
        # priv.batches() records each step in priv.accountant as it draws it
        for pb in priv.batches(progress=live):
            sizes.append(int(pb.mask.sum()))
            yield pb.indices, pb.mask, np.int32(pb.step)

    return _Setup(
        dp_step,
        priv.init(params0),
        poisson_batches(),
        sizes,
        priv.sampler.max_batch_size,
        priv.noise_multiplier,
        priv.accountant,
        live,
    )


def _check_runs(methods: Iterable[str], steps: int) -> tuple[str, ...]:
    """``methods`` as a tuple, checked against :data:`METHODS`, and ``steps`` at least 2."""
    methods = tuple(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}; expected a subset of {METHODS}")
    if steps < 2:
        raise ValueError(f"steps must be at least 2, got {steps}")
    return methods


def _result(
    name: str,
    setup: _Setup,
    params0: Any,
    steps: int,
    data: tuple[np.ndarray, ...],
    delta: float,
    progress: bool,
) -> DemoResult:
    """Trains one run as ``setup`` says and measures it."""
    params, losses, fracs, sec = train(
        name,
        setup.step_fn,
        params0,
        setup.opt_state,
        setup.batches,
        steps,
        data,
        progress and not setup.live,
    )
    accountant = setup.accountant
    return DemoResult(
        name=name,
        test_accuracy=accuracy(params, data[2], data[3]),
        epsilon=math.inf if accountant is None else accountant.epsilon(delta),
        noise_multiplier=setup.noise_multiplier,
        sec_per_step=sec,
        clip_fraction=float(np.mean(fracs)),
        losses=losses,
        clip_fractions=fracs,
        batch_sizes=setup.sizes,
        padded_batch_size=setup.padded,
        accountant=accountant,
    )


def ghost_message(err: BaseException) -> str:
    return (
        f"clipped_grad(method='ghost') is not available in this version of gradclip_jax "
        f"({err}); use --method vmap"
    )
