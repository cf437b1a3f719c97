"""Benchmark: calibration and accounting of :func:`gradclip_jax.make_private` at targets from 0.1 to 1e6.

For a run of n=1500, expected batch 64, 100 steps, delta=1e-5, at ``target_epsilon``
0.1, 1, 8, 1e3 and 1e6 (``quick``: 1 and 1e6), with the PLD accountant (``ours``,
the default) and the RDP one (``baseline``):

* ``calibrate z ...``: :func:`gradclip_jax.dp.accounting.calibrate_noise_multiplier`
  alone, with the peak memory the PLD calibration allocates (``tracemalloc``:
  numpy's buffers included);
* ``make_private ...``: the whole :func:`gradclip_jax.make_private` call
  (sampler, calibration, planned epsilon, step functions; no compilation).

And ``epsilon() per call at step T`` (T = 100 and 10,000, z = 1, rate 64/1500):
:meth:`gradclip_jax.PrivacyAccountant.epsilon` after each new step, the
mean over 20 steps up to T (``ours``: the accountant, which keeps its per-step
PLD or RDP and extends its composition), against dp-accounting's accountant
composing the same record from scratch on the same grid (``baseline``), for PLD
and RDP.

Times are the process's CPU time (``time.process_time``), the time on an idle
core: the benchmark machine is shared, and wall time there counts the other jobs.
Every measurement starts with empty caches (each step's PLD and RDP are cached
across calls). Before issue 43 the whole ``make_private`` call took 11-16 s and
``epsilon()`` 0.5-1.4 s a call after 100 steps; the ``note`` of each row gives
the noise multipliers and the epsilon planned.

Rows: ``{"group": "calibration", "name", "ours_ms", "baseline_ms", "ratio", "note", ...}``
(extra fields: ``pld_peak_mb``, ``pld_z``, ``rdp_z`` for the calibration rows).
Run alone: ``python -m benchmarks.bench_calibration`` (``--quick``).
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from benchmarks.common import row
from gradclip_jax.dp.accounting import PrivacyAccountant, calibrate_noise_multiplier, epsilon

N, BATCH, STEPS, DELTA = 1500, 64, 100, 1e-5
TARGETS = (0.1, 1.0, 8.0, 1e3, 1e6)
QUICK_TARGETS = (1.0, 1e6)
EPSILON_STEPS = (100, 10_000)
EPSILON_Z = 1.0


def _clear_caches() -> None:
    from gradclip_jax.dp.accounting import _composition

    _composition._step_pld_cached.cache_clear()
    _composition._step_rdp_cached.cache_clear()


def _cpu(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), CPU seconds)``, from empty caches."""
    _clear_caches()
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def _calibration_row(target: float) -> dict:
    q = BATCH / N
    z_pld, s_pld = _cpu(lambda: calibrate_noise_multiplier(target, q, STEPS, DELTA, "pld"))
    z_rdp, s_rdp = _cpu(lambda: calibrate_noise_multiplier(target, q, STEPS, DELTA, "rdp"))
    _clear_caches()
    tracemalloc.start()
    calibrate_noise_multiplier(target, q, STEPS, DELTA, "pld")
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    eps = epsilon(z_pld, q, STEPS, DELTA)
    return row(
        "calibration",
        f"calibrate z for target epsilon {target:g} (n={N}, E[B]={BATCH}, {STEPS} steps): "
        "PLD vs RDP",
        s_pld * 1e3,
        s_rdp * 1e3,
        note=f"z pld {z_pld:.5g} (epsilon {eps:.6g}), z rdp {z_rdp:.5g}; PLD peak {peak:.0f} MB",
        pld_peak_mb=peak,
        pld_z=z_pld,
        rdp_z=z_rdp,
    )


def _make_private_row(target: float) -> dict:
    import optax

    from gradclip_jax import make_private

    def loss_fn(w: Any, batch: Any) -> Any:
        return (batch @ w) ** 2

    def call(accountant: str) -> Any:
        return make_private(
            loss_fn,
            optax.sgd(0.1),
            dataset_size=N,
            expected_batch_size=BATCH,
            steps=STEPS,
            target_epsilon=target,
            delta=DELTA,
            l2_clip_norm=1.0,
            accountant=accountant,
            process_index=0,
            process_count=1,
        )

    call("rdp")  # imports (jax, optax, scipy) outside the timing
    pld, s_pld = _cpu(lambda: call("pld"))
    rdp, s_rdp = _cpu(lambda: call("rdp"))
    return row(
        "calibration",
        f"make_private whole call, target epsilon {target:g} (n={N}, E[B]={BATCH}, {STEPS} steps): "
        "PLD vs RDP",
        s_pld * 1e3,
        s_rdp * 1e3,
        note=f"z pld {pld.noise_multiplier:.5g} (planned {pld.planned_epsilon:.6g}), "
        f"z rdp {rdp.noise_multiplier:.5g} (planned {rdp.planned_epsilon:.6g})",
    )


def _epsilon_row(kind: str, steps: int, calls: int = 20) -> dict:
    import dp_accounting

    from gradclip_jax.dp.accounting._accountants import pld_interval
    from gradclip_jax.dp.accounting._composition import loss_std, phases_of

    q = BATCH / N
    _clear_caches()
    acc = PrivacyAccountant(kind)
    acc.step(EPSILON_Z, q, steps=steps - calls)
    acc.epsilon(DELTA)  # the run so far, as a progress bar's first refresh
    cpu = 0.0
    for _ in range(calls):
        acc.step(EPSILON_Z, q)
        t0 = time.process_time()
        eps = acc.epsilon(DELTA)
        cpu += time.process_time() - t0

    def scratch() -> float:
        event = acc.dp_event()
        if kind == "rdp":
            direct = dp_accounting.rdp.RdpAccountant()
        else:
            grid = pld_interval(EPSILON_Z, loss_std(phases_of(event)))
            direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=grid)
        direct.compose(event)
        return float(direct.get_epsilon(DELTA))

    ref, s_ref = _cpu(scratch)
    return row(
        "calibration",
        f"{kind.upper()} epsilon() per call at step {steps:,} (z={EPSILON_Z:g}, q={BATCH}/{N}): "
        "kept composition vs from scratch",
        cpu / calls * 1e3,
        s_ref * 1e3,
        note=f"epsilon {eps:.6g} (from scratch {ref:.6g}); mean of {calls} calls, one after each new step",
    )


def run(quick: bool = False) -> list[dict]:
    """Runs the benchmark and returns its rows (see the module docstring)."""
    targets = QUICK_TARGETS if quick else TARGETS
    for kind in (
        "pld",
        "rdp",
    ):  # imports (scipy.optimize, dp-accounting's modules) outside the timing
        calibrate_noise_multiplier(2.0, BATCH / N, 10, DELTA, kind)
    rows = [_calibration_row(t) for t in targets]
    rows += [_make_private_row(t) for t in targets]
    rows += [_epsilon_row(kind, t) for kind in ("pld", "rdp") for t in EPSILON_STEPS]
    return rows


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer targets")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=1))


if __name__ == "__main__":
    _main()
