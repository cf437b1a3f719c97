"""The demo's command line: ``python -m gradclip_jax.demo [--steps N] ...``."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence

from gradclip_jax.demo.output import DELTA, format_table
from gradclip_jax.demo.training import run

__all__: list[str] = []  # its names: gradclip_jax.demo


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
    p.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="examples per step; the expected size of the DP-SGD run's Poisson batches "
        "(default 64)",
    )
    p.add_argument(
        "--method",
        default="vmap",
        choices=("vmap", "ghost", "auto"),
        help="clipped_grad method for DP-SGD (default vmap)",
    )
    p.add_argument(
        "--epsilon",
        type=float,
        default=3.0,
        help=f"target epsilon of the DP-SGD run at delta={DELTA:g} (default 3)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="where to save the plot (default: gradclip_demo.png in a new temporary "
        "folder, printed at the end); checked before training",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = a.out
    try:
        if out is None:  # run() checks a given path before training
            out = os.path.join(tempfile.mkdtemp(prefix="gradclip_demo_"), "gradclip_demo.png")
        results = run(
            steps=a.steps,
            batch_size=a.batch_size,
            method=a.method,
            epsilon=a.epsilon,
            out=out,
            seed=a.seed,
            progress=not a.no_progress,
        )
    except (ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(results))
    print(f"plot saved to {out}; total {time.perf_counter() - t0:.1f} s")
    return 0
