"""A run's plan as plain values, saved in its state and checked against the run that resumes it."""

from __future__ import annotations

from typing import Any

import numpy as np

from gradclip_jax.dp.sampling.protocol import BatchSampler

STATE_FORMAT = "gradclip_jax.make_private/1"


def check_resume(state: Any, plan: dict[str, Any]) -> None:
    """ValueError naming ``resume_from`` and the field, when ``state`` is not a state_dict of this plan:
    a field of either plan that the other lacks, or holds another value.

    ``plan`` lacks ``noise_multiplier``: the resumed run takes the state's (:func:`resumed_noise`).
    """
    fn = "make_private"
    keys = ("format", "plan", "accountant", "sampler")
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise ValueError(
            f"{fn}: `resume_from` must be a dict from PrivateTraining.state_dict() (keys {keys}), "
            f"got {type(state).__name__}"
        )
    if state["format"] != STATE_FORMAT:
        raise ValueError(
            f"{fn}: `resume_from` has format {state['format']!r}, expected {STATE_FORMAT!r}"
        )
    saved = state["plan"]
    for name, value in plan.items():
        if name not in saved:
            raise ValueError(f"{fn}: `resume_from` has no plan field {name!r}")
        old = saved[name]
        numeric = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
            value, bool
        )
        both_ints = isinstance(old, (int, np.integer)) and isinstance(value, (int, np.integer))
        same = (
            (
                not isinstance(old, (str, bool))
                and isinstance(old, (int, float, np.integer, np.floating))
                # ints exactly: as floats, 64-bit seeds 2**60 and 2**60 + 1 compare equal
                and (int(old) == int(value) if both_ints else float(old) == float(value))
            )
            if numeric
            else old == value
        )
        if not same:
            raise ValueError(
                f"{fn}: `resume_from` was saved by another plan: {name}={old!r} there, {value!r} in this "
                f"call. Resume with the arguments of the interrupted run (the same arguments calibrate "
                "the same noise multiplier and draw the same batches)"
            )
    # a saved field this call lacks: e.g. a hardened run resumed as a default one (its noise
    # would no longer be hardened)
    dropped = sorted(set(saved) - set(plan) - {"noise_multiplier"})
    if dropped:
        name = dropped[0]
        raise ValueError(
            f"{fn}: `resume_from` was saved by another plan: {name}={saved[name]!r} there, and this "
            f"call has no {name!r}. Resume with the arguments of the interrupted run"
        )
    taken = state["sampler"].get("steps_taken") if isinstance(state["sampler"], dict) else None
    recorded = sum(int(p[2]) for p in state["accountant"].get("phases", ()))
    if taken != recorded or taken > plan["steps"]:
        raise ValueError(
            f"{fn}: `resume_from` is inconsistent: the sampler took {taken!r} steps, the accountant "
            f"recorded {recorded} (plan: {plan['steps']} steps)"
        )


def resumed_noise(state: dict[str, Any]) -> float:
    """The noise multiplier the interrupted run calibrated (its plan's), checked to be a positive number."""
    z = state["plan"].get("noise_multiplier")
    if (
        isinstance(z, bool)
        or not isinstance(z, (int, float, np.integer, np.floating))
        or not float(z) > 0.0
    ):
        raise ValueError(
            f"make_private: `resume_from` has no positive plan field 'noise_multiplier' (got {z!r})"
        )
    return float(z)


def run_plan(
    sampler: BatchSampler,
    steps: int,
    target_epsilon: float,
    delta: float,
    clip: float,
    accountant: str,
    hardened: str | None = None,
    grid_scale: float | None = None,
) -> dict[str, Any]:
    """The run's plan (plain values) without the noise multiplier: checked on resume.

    A hardened run's plan also holds its mode (``'hardened'``) and, on the integer grid, its
    ``'grid_scale'``; a default run's has neither field.
    """
    extra: dict[str, Any] = {} if hardened is None else {"hardened": hardened}
    if grid_scale is not None:
        extra["grid_scale"] = float(grid_scale)
    return {
        **extra,
        "dataset_size": int(sampler.dataset_size),
        "sample_rate": sampler_rate(sampler),
        "steps": int(steps),
        "target_epsilon": float(target_epsilon),
        "delta": float(delta),
        "l2_clip_norm": float(clip),
        "accountant": str(accountant).lower(),
        **sampler.plan(),
    }


def sampler_rate(sampler: BatchSampler) -> float:
    """The sampler's rate: a Poisson sampler's own (exact, as saved in plans), else expected size / n."""
    q = getattr(sampler, "sample_rate", None)
    return float(sampler.expected_batch_size) / sampler.dataset_size if q is None else float(q)
