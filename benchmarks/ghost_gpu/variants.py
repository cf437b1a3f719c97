"""The GPU DP-step suite's steps of one config (from :mod:`benchmarks.variants`, the one table)
and the accuracy of its reduced-pass products."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import gradclip_jax as gcx
from benchmarks.ghost_gpu.configs import Config
from benchmarks.steps import CLIP
from benchmarks.variants import VARIANTS, parts_of
from gradclip_jax._core.backend import backend_setting


def error_text(err: BaseException) -> str:
    """One line (at most 300 characters) naming an error, for a results record."""
    return f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def step_variants(
    cfg: Config, losses: Callable, batch_size: int, wanted: Sequence[str]
) -> dict[str, Callable | str]:
    """Each step function of ``cfg``, or a string saying why the step is skipped.

    ``nonprivate`` comes first, then the ``wanted`` steps in the order asked for (a run cut
    short by its budget measured those), then the config's other steps, marked skipped.
    """
    parts = parts_of(losses, batch_size)
    out: dict[str, Callable | str] = {"nonprivate": VARIANTS["nonprivate"](parts, "nonprivate")}
    order = [n for n in wanted if n in cfg.steps[1:]] + [
        n for n in cfg.steps[1:] if n not in wanted
    ]
    for name in order:
        out[name] = (
            VARIANTS[name](parts, name)
            if name in wanted
            else "skipped: not selected (GHOST_GPU_STEPS)"
        )
    return out


def product_accuracy(
    losses: Callable, params: Any, data: Any, settings: Sequence[str]
) -> dict[str, Any]:
    """How far the clipped sum and the per-example norms at each reduced-pass ``setting`` are
    from those at ``Precision.HIGHEST`` (ghost path, same batch): max relative error of the
    norms, and the sum's L2 error relative to its norm."""

    def run(setting: str) -> tuple[Any, Any]:
        with backend_setting(gcx.per_example.PRODUCT_PRECISION, setting):
            grads, info = jax.jit(gcx.clipped_grad(losses, CLIP, method="ghost"))(params, data)
        return jax.device_get((grads, info.norms))

    ref_g, ref_n = run("highest")
    ref_n = np.asarray(ref_n, np.float64)
    ref_leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(ref_g)]
    ref_norm = float(np.sqrt(sum(np.sum(x * x) for x in ref_leaves)))
    out: dict[str, Any] = {}
    for setting in settings:
        try:
            g, n = run(setting)
        except Exception as err:  # recorded; the other settings go on
            out[setting] = {"error": error_text(err)}
            continue
        diff = sum(
            np.sum((np.asarray(a, np.float64) - b) ** 2)
            for a, b in zip(jax.tree.leaves(g), ref_leaves)
        )
        out[setting] = {
            "norm_rel_err": float(np.max(np.abs(np.asarray(n, np.float64) / ref_n - 1))),
            "sum_rel_err": float(np.sqrt(diff)) / ref_norm,
        }
    return out
