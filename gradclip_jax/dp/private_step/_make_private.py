""":func:`make_private`: a run's sampler from its arguments (or the one given), its noise
multiplier calibrated for the target, its accountant, and its step functions."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import optax

from gradclip_jax._core.validation import check_int, check_number, clip_norm_arg
from gradclip_jax.dp.accounting import PrivacyAccountant, calibrate
from gradclip_jax.dp.accounting._accountants import import_dp_accounting
from gradclip_jax.dp.hardened import BitGenerator
from gradclip_jax.dp.private_step._hardened import (
    DiscreteGaussianSampling,
    gaussian_noise,
    grid_functions,
    hardening,
    sampler_seed,
)
from gradclip_jax.dp.private_step._releases import ReleaseLog
from gradclip_jax.dp.private_step._resume import check_resume, resumed_noise, run_plan, sampler_rate
from gradclip_jax.dp.private_step._step import step_functions
from gradclip_jax.dp.private_step._training import PrivateTraining
from gradclip_jax.dp.sampling.poisson import PoissonSampler, poisson_rate
from gradclip_jax.dp.sampling.protocol import BatchSampler, check_sampler
from gradclip_jax.per_example.api import clipped_grad
from gradclip_jax.per_example.internal import Method

# the arguments of make_private that build its default PoissonSampler
_POISSON_ARGS = (
    "dataset_size",
    "expected_batch_size",
    "sample_rate",
    "steps",
    "epochs",
    "seed",
    "max_batch_size",
    "on_overflow",
    "accountant",
    "process_index",
    "process_count",
)


def _poisson_sampler(fn: str, a: dict[str, Any]) -> PoissonSampler:
    """make_private's default sampler, from its Poisson arguments ``a`` (by name)."""
    n = check_int(fn, "dataset_size", a["dataset_size"], 1)
    q = poisson_rate(fn, n, a["expected_batch_size"], a["sample_rate"])
    if (a["steps"] is None) == (a["epochs"] is None):
        raise ValueError(f"{fn}: give exactly one of `steps` and `epochs`")
    if a["steps"] is not None:
        t = check_int(fn, "steps", a["steps"], 1)
    else:
        e = check_number(fn, "epochs", a["epochs"], low=0.0, low_inclusive=False, allow_inf=False)
        t = max(1, math.ceil(e / q - 1e-9))
    if a["on_overflow"] == "truncate" and str(a["accountant"]).lower() != "pld":
        raise ValueError(
            f"{fn}: on_overflow='truncate' needs accountant='pld' (dp-accounting has no RDP bound for "
            f"truncated Poisson sampling), got accountant={a['accountant']!r}"
        )
    return PoissonSampler(
        n,
        steps=t,
        sample_rate=q,
        seed=a["sampler_seed"],
        max_batch_size=a["max_batch_size"],
        on_overflow=a["on_overflow"],
        process_index=a["process_index"],
        process_count=a["process_count"],
    )


def _given_sampler(fn: str, sampler: Any, a: dict[str, Any]) -> BatchSampler:
    """A ``sampler=`` checked against the Poisson arguments, which it replaces."""
    check_sampler(fn, sampler)
    defaults = {
        "expected_batch_size": None,
        "sample_rate": None,
        "epochs": None,
        "max_batch_size": None,
        "process_index": None,
        "process_count": None,
        "on_overflow": "raise",
        "seed": None,
    }
    # seed=0 was the default before hardening made it optional: still accepted with a sampler
    clash = [k for k, v in defaults.items() if a[k] != v and not (k == "seed" and a[k] == 0)]
    if clash:
        raise ValueError(
            f"{fn}: with `sampler`, leave {', '.join(f'`{k}`' for k in clash)} out: the sampler "
            "decides its rate, size, seed and processes"
        )
    for name in ("dataset_size", "steps"):
        if a[name] is not None and a[name] != getattr(sampler, name):
            raise ValueError(
                f"{fn}: `{name}`={a[name]!r}, but the sampler's is {getattr(sampler, name)!r}"
            )
    check_int(fn, "sampler.steps", sampler.steps, 1)
    return sampler  # type: ignore[no-any-return]


def _calibrated(
    sampler: BatchSampler, t: int, target_epsilon: float, delta: float, accountant: str, fn: str
) -> float:
    """The smallest noise multiplier whose ``t`` steps of the sampler's event meet the target."""
    compose = import_dp_accounting().SelfComposedDpEvent

    def event(z: float) -> Any:  # the whole run: the sampler's step, T times
        return compose(sampler.dp_event(z), t)

    return calibrate(
        event, target_epsilon, delta, accountant, fn=fn, neighboring=sampler.neighboring
    )


def make_private(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    dataset_size: int | None = None,
    target_epsilon: float,
    delta: float,
    l2_clip_norm: float | None = None,
    expected_batch_size: float | None = None,
    sample_rate: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    seed: int | None = None,
    max_batch_size: int | None = None,
    physical_batch_size: int | None = None,
    on_overflow: str = "raise",
    accountant: str = "pld",
    method: str = "auto",
    process_index: int | None = None,
    process_count: int | None = None,
    l2_norm_clip: float | None = None,
    allow_beyond_plan: bool = False,
    resume_from: dict[str, Any] | None = None,
    sampler: BatchSampler | None = None,
    hardened: bool | str = False,
    rng: BitGenerator | None = None,
    grid_scale: float | None = None,
) -> PrivateTraining:
    """Calibrates and builds a private training run (see the module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch) -> (B,)`` per-example losses (as
        :func:`gradclip_jax.clipped_grad`).
      optimizer: an optax ``GradientTransformation`` applied to the privatized
        (noised, averaged) gradient: post-processing, so any optimizer is fine.
      dataset_size: :math:`n` (with ``sampler``: optional, the sampler's).
      target_epsilon: :math:`\\varepsilon > 0` for the whole run.
      delta: :math:`\\delta \\in (0, 1)`; a warning when :math:`\\delta \\ge 1/n`.
      l2_clip_norm: :math:`C > 0`.
      expected_batch_size: :math:`qn` (give this or ``sample_rate``).
      sample_rate: :math:`q \\in (0, 1]` (give this or ``expected_batch_size``).
      steps: the number of logical steps :math:`T` (give this or ``epochs``;
        with ``sampler``: optional, the sampler's ``steps``).
      epochs: passes over the data set, :math:`T = \\lceil \\text{epochs}/q \\rceil`.
      seed: the sampler's seed (default 0; the noise key is an argument of ``step``). Not with
        ``hardened``, which draws it from the OS.
      max_batch_size, on_overflow: the padded size and overflow rule of the
        :class:`gradclip_jax.PoissonSampler` (default: the overflow
        probability of the whole run is at most 1e-9, and an overflow raises).
      physical_batch_size: compute the clipped sum this many examples at a time
        (``clipped_grad``'s ``microbatch_size``); the noise is still added once
        per logical step.
      accountant: ``'pld'`` (default) or ``'rdp'``: used for calibration and by
        the returned accountant.
      method: ``clipped_grad``'s method (default ``'auto'``).
      process_index, process_count: passed to the sampler (defaults from jax).
      l2_norm_clip: optax's spelling of ``l2_clip_norm`` (the canonical one),
        accepted without a warning, as everywhere in the DP API; give one of the two.
      allow_beyond_plan: let :meth:`PrivateTraining.record_step` record steps
        beyond ``steps`` (each with a :class:`PrivacyBudgetWarning` stating the
        epsilon spent); by default such a step is a :class:`PrivacyBudgetError`.
      resume_from: a :meth:`PrivateTraining.state_dict` of an interrupted run:
        its plan must equal this call's (a ``ValueError`` names the differing
        field), its accountant record is restored, its noise multiplier is used as
        calibrated (no search; a warning when its planned epsilon is above the target),
        and :meth:`PrivateTraining.batches` goes on with the next step. With the
        saved ``params`` and ``opt_state`` (and the same noise keys per step),
        the resumed run is the uninterrupted one.
      sampler: ``None`` (default: a :class:`gradclip_jax.PoissonSampler`
        from the arguments above), or any :class:`gradclip_jax.dp.BatchSampler`:
        the noise is calibrated for ``steps`` of its ``dp_event``, the
        accountant records its steps, the noised sum is divided by its
        ``expected_batch_size`` and the noise scales with the sensitivity
        under its ``neighboring`` relation. It replaces ``expected_batch_size``,
        ``sample_rate``, ``epochs``, ``max_batch_size``, ``on_overflow``,
        ``seed`` and the process arguments (a ``ValueError`` names any given).
      hardened: opt-in protection of the randomness (see the guide "Hardened noise and randomness"):
        ``False`` (default); ``True`` or ``'sum_of_normals'``: the sampler's seed from the OS's
        entropy (:func:`gradclip_jax.dp.hardened.os_seed`) and the noise as
        :math:`\\sigma(Z_1+Z_2+Z_3+Z_4)/2` (:func:`~gradclip_jax.dp.hardened.add_sum_of_normals_noise`:
        the Gaussian mechanism, accounted as before); ``'discrete'``: also each example's clipped
        gradient truncated onto the grid of step ``1/grid_scale``, summed exactly in int32, with
        discrete Gaussian noise of sigma ``z * grid_scale * sensitivity``
        (:func:`~gradclip_jax.dp.hardened.grid_clipped_sum`), accounted by RDP (needs
        ``accountant='rdp'``; per-example gradients by ``jax.vmap``). Either way pass
        :meth:`PrivateTraining.noise_key` as each step's ``key``. ``seed`` and ``sampler`` cannot
        be given with it (a ``ValueError`` names them).
      rng: a hardened run's source of randomness: ``None`` (the OS's, through :mod:`secrets`) or a
        generator with ``getrandbits`` (``secrets.SystemRandom()``; ``random.Random(0)`` only in
        tests: it is predictable). Seeds the sampler and :meth:`PrivateTraining.noise_key`.
      grid_scale: ``hardened='discrete'``'s :math:`\\gamma`, a power of two (e.g. ``2.0**10 / l2_clip_norm``
        rounded to one): finer is less bias (under :math:`1/\\gamma` per coordinate and example),
        coarser keeps :math:`B\\gamma C \\le 2^{30}` and the noise's sigma :math:`\\le 2^{16}`.

    Returns:
      A :class:`PrivateTraining`.

    Raises:
      ValueError: naming the argument: a ``resume_from`` of another plan, a rate outside (0, 1], a
        ``max_batch_size`` below the expected batch size, an unreachable
        ``target_epsilon``, both or neither of ``steps``/``epochs``, a bad clip
        norm; the step raises for a ``mask`` of the wrong shape.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from gradclip_jax import make_private
      >>> x = np.random.default_rng(0).normal(size=(1000, 3)).astype(np.float32)
      >>> data = {'x': x, 'y': x @ np.array([1.0, -2.0, 0.5], np.float32)}
      >>> def loss_fn(w, batch):
      ...     return 0.5 * (batch['x'] @ w - batch['y']) ** 2
      >>> priv = make_private(loss_fn, optax.sgd(0.5), dataset_size=1000, expected_batch_size=100,
      ...                     steps=50, target_epsilon=2.0, delta=1e-4, l2_clip_norm=1.0,
      ...                     process_index=0, process_count=1)
      >>> step = jax.jit(priv.step)
      >>> w, state, key = jnp.zeros(3), priv.init(jnp.zeros(3)), jax.random.key(0)
      >>> for batch, mask in priv.batches(data):
      ...     key, sub = jax.random.split(key)
      ...     w, state, metrics = step(w, state, batch, mask, sub)
      >>> priv.accountant.steps, priv.epsilon() <= 2.0
      (50, True)
    """
    fn = "make_private"
    l2_clip_norm = clip_norm_arg(fn, l2_clip_norm, l2_norm_clip)
    if not callable(loss_fn):
        raise TypeError(f"{fn}: `loss_fn` must be callable, got {loss_fn!r}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"{fn}: `optimizer` must be an optax GradientTransformation, got {optimizer!r}"
        )
    methods = tuple(m.value for m in Method)
    if method not in methods:  # before the calibration
        raise ValueError(f"{fn}: `method` must be one of {methods}, got {method!r}")
    args = {k: v for k, v in locals().items() if k in _POISSON_ARGS}
    hard = hardening(
        fn,
        {
            **args,
            "hardened": hardened,
            "rng": rng,
            "grid_scale": grid_scale,
            "sampler": sampler,
            "physical_batch_size": physical_batch_size,
            "method": method,
        },
    )
    args["sampler_seed"] = sampler_seed(hard, {**args, "resume_from": resume_from})
    sampler = _poisson_sampler(fn, args) if sampler is None else _given_sampler(fn, sampler, args)
    if hard.mode == "discrete":  # its steps accounted as the discrete Gaussian's
        assert isinstance(sampler, PoissonSampler)  # hardening() refuses a sampler=
        sampler = DiscreteGaussianSampling(sampler)
    n, t, divisor = sampler.dataset_size, sampler.steps, float(sampler.expected_batch_size)
    for name, v in (("target_epsilon", target_epsilon), ("l2_clip_norm", l2_clip_norm)):
        check_number(fn, name, v, low=0.0, low_inclusive=False, allow_inf=False)
    check_number(fn, "delta", delta, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
    # the protected units: users under user-level DP (a sampler with num_users), else examples
    users = getattr(sampler, "num_users", None)
    what, units = ("dataset_size", n) if users is None else ("num_users", int(users))
    if delta >= 1.0 / units:
        warnings.warn(
            f"{fn}: `delta`={delta:g} >= 1/{what}={1.0 / units:g}: a mechanism that publishes one "
            "random unit (example, or user) outright meets such a delta; use delta well below 1/n",
            UserWarning,
            stacklevel=2,
        )
    if physical_batch_size is not None:
        physical_batch_size = check_int(fn, "physical_batch_size", physical_batch_size, 1)
    plan = run_plan(
        sampler, t, target_epsilon, delta, l2_clip_norm, accountant, hard.mode, hard.grid_scale
    )
    rel = sampler.neighboring
    if resume_from is None:
        z = _calibrated(sampler, t, float(target_epsilon), float(delta), accountant, fn)
    else:
        check_resume(resume_from, plan)
        z = resumed_noise(resume_from)  # the interrupted run's calibration: no search
    planned = PrivacyAccountant(accountant, rel)
    planned.step(z, **sampler.accounting(), steps=t)
    planned_eps = planned.epsilon(delta)
    if (
        not planned_eps <= target_epsilon
    ):  # a state saved under another accounting (version), or edited
        warnings.warn(
            f"{fn}: `resume_from`'s noise_multiplier={z!r} spends epsilon={planned_eps:.6g} over the planned "
            f"{t} steps under this accounting, above `target_epsilon`={target_epsilon:g}; the accountant "
            "reports what is spent",
            UserWarning,
            stacklevel=2,
        )
    acc = PrivacyAccountant(accountant, rel)
    if resume_from is not None:
        acc.load_state_dict(resume_from["accountant"], sampler=sampler)

    grad_fn = clipped_grad(
        loss_fn, l2_clip_norm, microbatch_size=physical_batch_size, method=method
    )
    std = z * float(grad_fn.sensitivity(rel))

    grid = None
    if hard.mode == "discrete":
        assert hard.grid_scale is not None  # checked by hardening()
        grid = grid_functions(
            loss_fn, float(l2_clip_norm), hard.grid_scale, float(grad_fn.sensitivity(rel)), z, fn
        )
    releases = ReleaseLog()
    if resume_from is not None:  # (a state saved before the keys were kept has none)
        releases.resume(resume_from.get("noise_keys", []))
    init, step, clipped_sum, noisy_update = step_functions(
        grad_fn,
        optimizer,
        std,
        divisor,
        noise=gaussian_noise(hard) if grid is None else grid.noise,
        summed_by=None if grid is None else grid.clipped_sum,
        releases=releases,
    )

    return PrivateTraining(
        noise_multiplier=z,
        l2_clip_norm=float(l2_clip_norm),
        sample_rate=sampler_rate(sampler),
        expected_batch_size=divisor,
        steps=t,
        target_epsilon=float(target_epsilon),
        delta=float(delta),
        planned_epsilon=planned_eps,
        sampler=sampler,
        accountant=acc,
        optimizer=optimizer,
        grad_fn=grad_fn,
        init=init,
        step=step,
        clipped_sum=clipped_sum,
        noisy_update=noisy_update,
        allow_beyond_plan=bool(allow_beyond_plan),
        hardened=hard.mode,
        rng=hard.rng,
        grid_scale=hard.grid_scale,
        releases=releases,
        recorded_before=acc.steps,
    )
