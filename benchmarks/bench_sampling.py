"""Benchmark: Poisson sampling with padding against fixed-size batches.

One whole private training step on the host and device, timed interleaved
(medians, compile excluded, ``block_until_ready``), for a 784-512-512-10 MLP
(softmax cross-entropy, float32) on a synthetic data set of 60,000 examples, at
expected batch sizes 64 and 256 (64 with ``quick=True``):

* ``ours``: draw the step's Poisson batch with
  :class:`gradclip_jax.PoissonSampler` (binomial size, uniform subset,
  padded to ``max_batch_size`` with a mask; the default size keeps the run's
  overflow probability below 1e-9), gather the rows on the host, and run the
  jitted :func:`gradclip_jax.make_private` step on the padded batch;
* ``baseline``: draw ``B`` indices with ``rng.choice(n, B, replace=False)``,
  gather, and run the same step on exactly ``B`` rows (all real).

The ratio is the cost of honest sampling: the host-side draw plus computing the
padded rows (``max_batch_size / B`` more examples; the masked rows are computed
and dropped).

Rows: ``{"group": "sampling", "name", "ours_ms", "baseline_ms", "ratio", "note"}``.
Run alone: ``python -m benchmarks.bench_sampling`` (``--quick``).
"""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any

import jax
import numpy as np
import optax

from benchmarks.common import interleaved_ms, row
from benchmarks.models import mlp
from gradclip_jax import make_private

N = 60000


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (see the module docstring)."""
    reps = 10 if quick else 30
    env = f"{jax.default_backend()} x{jax.device_count()}, jax {jax.__version__}, {platform.machine()}"
    rows: list[dict] = []
    for b in (64,) if quick else (64, 256):
        losses, params, _ = mlp(0, 1)
        r = np.random.default_rng(0)
        data = {
            "x": r.normal(size=(N, 784)).astype(np.float32),
            "y": r.integers(0, 10, N).astype(np.int32),
        }
        priv = make_private(
            losses,
            optax.sgd(0.1),
            dataset_size=N,
            expected_batch_size=b,
            steps=10000,
            target_epsilon=8.0,
            delta=1e-6,
            l2_clip_norm=1.0,
            method="vmap",
            process_index=0,
            process_count=1,
            accountant="rdp",
        )
        step = priv.step
        state = priv.init(params)
        key = jax.random.key(0)
        counter = {"t": 0}
        rng = np.random.default_rng(1)
        full = np.ones(b, bool)

        def ours() -> Any:
            t = counter["t"] = counter["t"] + 1
            pb = priv.sampler.batch(t)
            batch = {k: v[pb.indices] for k, v in data.items()}
            return step(params, state, batch, pb.mask, key)[0]

        def fixed() -> Any:
            idx = rng.choice(N, b, replace=False)
            batch = {k: v[idx] for k, v in data.items()}
            return step(params, state, batch, full, key)[0]

        ms = interleaved_ms({"ours": ours, "fixed": fixed}, reps, warmup=2)
        sample_ms = interleaved_ms({"draw": lambda: priv.sampler.batch(7).indices}, reps, warmup=1)[
            "draw"
        ]
        rows.append(
            row(
                "sampling",
                f"mlp 784-512-512-10 E[B]={b}: Poisson sample+pad to {priv.sampler.max_batch_size} vs fixed B={b}",
                ms["ours"],
                ms["fixed"],
                note=(
                    f"whole step incl. host draw/gather; padded rows {priv.sampler.max_batch_size / b:.2f}x; "
                    f"draw alone {sample_ms:.3f} ms; overflow prob/run "
                    f"{priv.sampler.overflow_probability:.1e} (10k steps); {env}"
                ),
            )
        )
    return rows


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and batch sizes")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=1))


if __name__ == "__main__":
    _main()
