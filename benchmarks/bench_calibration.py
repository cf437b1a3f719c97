"""Benchmark: noise calibration of :func:`gradclip_jax.dp.make_private` at targets from 0.1 to 1e6.

The time :func:`gradclip_jax.dp.accounting.calibrate` takes to find the smallest noise
multiplier of a run (n=1500, expected batch 64, 100 steps, delta=1e-5) at
``target_epsilon`` 0.1, 1, 10, 1e3 and 1e6 (``quick``: 1 and 1e6), with the PLD
accountant (``ours``, the default) and the RDP one (``baseline``), and the peak
memory the PLD calibration allocates (``tracemalloc``: numpy's buffers included).
Before the PLD grid followed the noise (:func:`gradclip_jax.dp.accounting.pld_interval`),
the whole ``make_private`` call (calibration and the planned epsilon) took 3.2 s,
6.4 s, 23 s, > 60 s (minutes) and > 60 s (memory growing ~19 MB/s, never ending)
at these targets with PLD on a shared 2-core machine (2.4 to 3.5 s with RDP);
after, 2.1, 4.1, 6.7, 4.4 and 3.8 s.

Rows: ``{"group": "calibration", "name", "ours_ms", "baseline_ms", "ratio", "note",
"pld_peak_mb", "pld_z", "rdp_z"}``. Run alone: ``python -m benchmarks.bench_calibration``
(``--quick``).
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

from benchmarks.common import row
from gradclip_jax.dp.accounting import calibrate_noise_multiplier, epsilon

N, BATCH, STEPS, DELTA = 1500, 64, 100, 1e-5
TARGETS = (0.1, 1.0, 10.0, 1e3, 1e6)
QUICK_TARGETS = (1.0, 1e6)


def _calibrate(target: float, accountant: str) -> tuple[float, float]:
    """``(z, seconds)`` of one calibration."""
    t0 = time.perf_counter()
    z = calibrate_noise_multiplier(target, BATCH / N, STEPS, DELTA, accountant)
    return z, time.perf_counter() - t0


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (see the module docstring)."""
    rows: list[dict] = []
    for target in QUICK_TARGETS if quick else TARGETS:
        z_pld, s_pld = _calibrate(target, "pld")
        z_rdp, s_rdp = _calibrate(target, "rdp")
        tracemalloc.start()
        calibrate_noise_multiplier(target, BATCH / N, STEPS, DELTA, "pld")
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        eps = epsilon(z_pld, BATCH / N, STEPS, DELTA)
        rows.append(row(
            "calibration", f"calibrate z for target epsilon {target:g} (n={N}, E[B]={BATCH}, {STEPS} steps): "
            "PLD vs RDP", s_pld * 1e3, s_rdp * 1e3,
            note=f"z pld {z_pld:.5g} (epsilon {eps:.6g}), z rdp {z_rdp:.5g}; PLD peak {peak:.0f} MB",
            pld_peak_mb=peak, pld_z=z_pld, rdp_z=z_rdp,
        ))
    return rows


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer targets")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=1))


if __name__ == "__main__":
    _main()
