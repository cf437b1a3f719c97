"""The demo's outputs: the output path's check, the table and the plot."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gradclip_jax.demo.training import DemoResult

DELTA = 1e-5

__all__ = ["DELTA", "smooth"]  # the others: gradclip_jax.demo


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
        raise ValueError(
            f"out={path!r}: unknown image format {ext!r}; use one of "
            f"{', '.join(sorted(formats))} (e.g. demo.png)"
        )
    try:  # a real write: os.access is wrong for root and some file systems
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"out={path!r}: cannot write to the folder {folder!r} ({err})") from err


def format_table(results: dict[str, DemoResult], delta: float = DELTA) -> str:
    """A plain-text table of the results (one row per run)."""
    head = f"{'run':<8} {'test acc':>8} {'epsilon':>9} {'noise z':>8} {'ms/step':>8} {'clipped':>8}"
    lines = [head, "-" * len(head)]
    for r in results.values():
        eps = "inf" if math.isinf(r.epsilon) else f"{r.epsilon:.3f}"
        lines.append(
            f"{r.name:<8} {r.test_accuracy:>8.3f} {eps:>9} {r.noise_multiplier:>8.3f} "
            f"{1e3 * r.sec_per_step:>8.3f} {r.clip_fraction:>8.3f}"
        )
    lines.append(
        f"epsilon at delta={delta:g}; 'clipped': dp-sgd = fraction of examples clipped, "
        "global = fraction of steps clipped (means over steps)"
    )
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
        ax1.plot(smooth(r.losses), label=f"{r.name} (test acc {r.test_accuracy:.2f})")
        if r.name != "none":
            ax2.plot(smooth(r.clip_fractions), label=r.name)
    ax1.set(
        xlabel="step",
        ylabel="training loss (moving avg. 20)",
        yscale="log",
        title="digits MLP: training loss",
    )
    ax2.set(
        xlabel="step",
        ylabel="fraction clipped (moving avg. 20)",
        ylim=(-0.02, 1.02),
        title="clip fraction (dp-sgd: examples, global: steps)",
    )
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def smooth(v: Sequence[float], k: int = 20) -> np.ndarray:
    a = np.asarray(v, np.float64)
    k = max(1, min(k, len(a)))
    return np.convolve(a, np.ones(k) / k, mode="valid")
