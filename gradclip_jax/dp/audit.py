"""An empirical lower bound on a private run's epsilon, from gradient canaries in one training run.

The audit of Steinke, Nasr and Jagielski (2023, "Privacy auditing with one (1)
training run", https://arxiv.org/abs/2305.08846): ``m`` canaries, each put in
the training set with probability 1/2 by a secret coin flip; after training, a
score per canary (here: how far the run moved the canary's own coordinate);
an attacker guesses "in" for the highest scores; how many of its guesses are
right bounds epsilon from below, with confidence ``1 - significance``
(:meth:`jax_privacy.auditing.CanaryScoreAuditor.epsilon_one_run`).

The canaries are **gradient canaries**: canary ``i``'s gradient is
``2C`` times the ``i``-th coordinate of an extra parameter block that the
model's own loss does not touch, so once clipped it is the fixed direction
``C e_i`` and no real example's gradient blurs it (a white-box "Dirac"
canary, as in Nasr et al. 2023, https://arxiv.org/abs/2302.07956). A canary that is out is
a row of zero gradient: with the public divisor ``q n`` of
:func:`gradclip_jax.dp.make_private`, a row whose gradient is zero changes
nothing, so the run is exactly the one on the data set without that canary.

:class:`GradientCanaries` builds the pieces (loss, parameters, data, scores,
bound) for any pipeline; :func:`audit_epsilon` runs the whole audit of a
:func:`gradclip_jax.dp.make_private` run. A bound above the run's claimed
epsilon falsifies the claim (up to the ``significance``); a bound below it
proves nothing: the audit is a test for gross bugs, not a proof of privacy.
The bound needs jax-privacy (``pip install 'gradclip_jax[jax-privacy]'``), imported when used.

A one-run audit sees the final model only, and cannot tell how the batches
were sampled (see the DP guide, section 10). :func:`audit_sampling` is the
audit of the **sampling**: many independent runs with one canary in and as
many with it zeroed out, an attacker who sees every step's noisy update, and a
Clopper-Pearson bound (Chua et al., 2024, "How Private are DP-SGD
Implementations?", https://arxiv.org/abs/2403.17673). It catches shuffled
batches accounted as Poisson sampling, at small noise multipliers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core.validation import check_choice, check_int, check_number
from gradclip_jax.dp.private_step import PrivateTraining, make_private
from gradclip_jax.dp.sampling.protocol import BatchSampler, check_sampler

__all__ = [
    "AuditResult",
    "GradientCanaries",
    "SamplingAuditResult",
    "audit_epsilon",
    "audit_sampling",
    "epsilon_lower_bound",
    "epsilon_lower_bound_from_runs",
]


def epsilon_lower_bound(
    scores: np.ndarray, included: np.ndarray, delta: float, significance: float = 0.05
) -> float:
    """The one-run epsilon lower bound of canary scores (jax-privacy's ``epsilon_one_run``).

    Args:
      scores: ``(m,)`` attack scores, higher for canaries believed in.
      included: ``(m,)`` bools, the secret coin flips.
      delta: the delta of the claim under audit.
      significance: the probability that the bound exceeds the true epsilon.

    Returns:
      A lower bound on the run's epsilon at ``delta``, valid with confidence
      ``1 - significance`` (0 when nothing is shown). The threshold is chosen
      with a Bonferroni correction, so the bound is valid as returned.

    Example:
      >>> import numpy as np
      >>> included = np.arange(1000) % 2 == 0
      >>> perfect = epsilon_lower_bound(included.astype(float), included, delta=1e-6)
      >>> blind = epsilon_lower_bound(np.zeros(1000), included, delta=1e-6)
      >>> bool(perfect > 4.0), blind
      (True, 0.0)
    """
    try:
        from jax_privacy.auditing import CanaryScoreAuditor
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "gradclip_jax.dp.audit needs jax-privacy: pip install 'gradclip_jax[jax-privacy]'"
        ) from err
    scores, included = np.asarray(scores, np.float64), np.asarray(included, bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(
            f"epsilon_lower_bound: `scores` and `included` need the same 1-D shape, got "
            f"{scores.shape} and {included.shape}"
        )
    auditor = CanaryScoreAuditor(scores[included], scores[~included])
    return float(auditor.epsilon_one_run(significance, delta))


@dataclasses.dataclass(frozen=True)
class GradientCanaries:
    """``m`` gradient canaries and their secret coin flips (see the module docstring).

    Attributes:
      included: ``(m,)`` bools: canary ``i`` is in the training set.
      l2_clip_norm: the run's clip norm ``C`` (a canary's gradient is ``2C e_i``
        before clipping, ``C e_i`` after).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from gradclip_jax.dp import make_private
      >>> def loss_fn(w, batch):
      ...     return 0.5 * (batch @ w) ** 2
      >>> canaries = GradientCanaries.draw(100, l2_clip_norm=1.0, seed=0)
      >>> data = canaries.wrap_data(np.ones((50, 3), np.float32))   # 50 rows, then 100 canary rows
      >>> priv = make_private(canaries.wrap_loss(loss_fn), optax.sgd(0.1), dataset_size=150,
      ...                     expected_batch_size=30, steps=10, target_epsilon=2.0, delta=1e-4,
      ...                     l2_clip_norm=1.0, process_index=0, process_count=1)
      >>> start = params = canaries.wrap_params(jnp.zeros(3))
      >>> opt_state = priv.init(params)
      >>> for t, (batch, mask) in enumerate(priv.batches(data)):   # your own loop goes here
      ...     params, opt_state, _ = priv.step(params, opt_state, batch, mask, jax.random.key(t))
      >>> bound = canaries.epsilon_lower_bound(canaries.scores(start, params), delta=1e-4)
      >>> bound < priv.epsilon()
      True
    """

    included: np.ndarray
    l2_clip_norm: float

    @classmethod
    def draw(cls, num_canaries: int, l2_clip_norm: float, seed: int) -> GradientCanaries:
        """``num_canaries`` canaries, each in with probability 1/2 (coin flips from ``seed``).

        Raises:
          ValueError: for fewer than 2 canaries.
        """
        if num_canaries < 2:
            raise ValueError(f"GradientCanaries: `num_canaries` must be at least 2, got {num_canaries}")
        included = np.random.default_rng(seed).random(num_canaries) < 0.5
        return cls(included=included, l2_clip_norm=float(l2_clip_norm))

    @property
    def num_canaries(self) -> int:
        return int(self.included.size)

    def wrap_loss(self, loss_fn: Callable[[Any, Any], jax.Array]) -> Callable[[Any, Any], jax.Array]:
        """The per-example loss over :meth:`wrap_params` and :meth:`wrap_data`.

        A real row's loss is ``loss_fn``'s; a canary row's is ``2C`` times its
        canary coordinate (a filler copy of a real row carries its data, weighted 0);
        an out canary's row has id -1 and zero gradient.
        """
        scale = 2.0 * self.l2_clip_norm

        def loss(params: Any, batch: Any) -> jax.Array:
            ids = batch["canary"]
            own = loss_fn(params["model"], batch["data"]) * (ids == -2)
            coord = params["canary"][jnp.maximum(ids, 0)]
            return own + jnp.where(ids >= 0, scale * coord, 0.0)

        return loss

    def wrap_params(self, params: Any) -> dict[str, Any]:
        """``{'model': params, 'canary': zeros(m)}``: the canaries' own coordinates start at 0."""
        return {"model": params, "canary": jnp.zeros(self.num_canaries, jnp.float32)}

    def wrap_data(self, data: Any) -> dict[str, Any]:
        """The real rows, then one row per canary: ``{'data': ..., 'canary': ids}``.

        ``ids`` is -2 for a real row, ``i`` for canary ``i`` when it is in, -1
        (a row of zero gradient) when it is out. The data set size,
        ``n + m``, is the same whatever the coin flips.
        """
        n = int(jax.tree.leaves(data)[0].shape[0])
        m = self.num_canaries
        # filler rows copy real row 0 (weighted 0): any finite row would do
        filled = jax.tree.map(lambda x: np.concatenate([np.asarray(x), np.repeat(np.asarray(x)[:1], m, 0)]), data)
        ids = np.concatenate([np.full(n, -2), np.where(self.included, np.arange(m), -1)]).astype(np.int32)
        return {"data": filled, "canary": ids}

    def scores(self, params_before: Any, params_after: Any) -> np.ndarray:
        """How far training moved each canary's coordinate against its gradient (``(m,)``)."""
        return np.asarray(params_before["canary"] - params_after["canary"], np.float64)

    def epsilon_lower_bound(self, scores: np.ndarray, delta: float, significance: float = 0.05) -> float:
        """:func:`epsilon_lower_bound` of ``scores`` with these coin flips."""
        return epsilon_lower_bound(scores, self.included, delta, significance)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """What :func:`audit_epsilon` found.

    Attributes:
      claimed_epsilon: the accountant's epsilon of the steps the run took.
      epsilon_lower_bound: the empirical lower bound (confidence ``1 - significance``).
      delta: the delta of both.
      scores: ``(m,)`` canary scores.
      included: ``(m,)`` the coin flips.
    """

    claimed_epsilon: float
    epsilon_lower_bound: float
    delta: float
    scores: np.ndarray
    included: np.ndarray

    @property
    def falsified(self) -> bool:
        """The run is less private than it claims (the bound exceeds the claim)."""
        return self.epsilon_lower_bound > self.claimed_epsilon


def audit_epsilon(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    data: Any,
    *,
    num_canaries: int,
    target_epsilon: float,
    delta: float,
    l2_clip_norm: float,
    expected_batch_size: float,
    steps: int,
    optimizer: optax.GradientTransformation | None = None,
    seed: int = 0,
    significance: float = 0.05,
    **make_private_kwargs: Any,
) -> AuditResult:
    """Trains with :func:`gradclip_jax.dp.make_private` and gradient canaries; bounds its epsilon.

    The data set is ``data``'s ``n`` rows plus ``num_canaries`` canary rows
    (``dataset_size = n + num_canaries``); the claim audited is the
    accountant's epsilon of the steps taken, at ``delta``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> (B,)`` per-example losses.
      params: the model's initial parameters.
      data: a pytree of host arrays with the ``n`` real examples on axis 0.
      num_canaries: ``m``; the bound's power grows with it (roughly as ``log m``).
      target_epsilon, delta, l2_clip_norm, expected_batch_size, steps: as
        :func:`gradclip_jax.dp.make_private`.
      optimizer: default ``optax.sgd(0.1)``.
      seed: seeds the coin flips, the sampler and the noise (with ``hardened`` in
        ``make_private_kwargs``: the coin flips only; the run draws its own from the OS).
      significance: the probability that the bound exceeds the true epsilon.
      **make_private_kwargs: passed on (e.g. ``method``, ``accountant``).

    Returns:
      An :class:`AuditResult`.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = np.random.default_rng(0).normal(size=(200, 3)).astype(np.float32)
      >>> def loss_fn(w, batch):
      ...     return 0.5 * (batch @ w) ** 2
      >>> res = audit_epsilon(loss_fn, jnp.zeros(3), x, num_canaries=200, target_epsilon=2.0,
      ...                     delta=1e-5, l2_clip_norm=1.0, expected_batch_size=40, steps=20,
      ...                     process_index=0, process_count=1)
      >>> res.epsilon_lower_bound <= res.claimed_epsilon <= 2.0, res.falsified
      (True, False)
    """
    canaries = GradientCanaries.draw(num_canaries, l2_clip_norm, seed)
    audited = canaries.wrap_data(data)
    # a hardened run refuses a seed: its sampler and noise come from the OS (see _train)
    seeded: dict[str, Any] = {} if make_private_kwargs.get("hardened") else {"seed": seed}
    priv = make_private(
        canaries.wrap_loss(loss_fn), optimizer or optax.sgd(0.1),
        dataset_size=int(audited["canary"].shape[0]), target_epsilon=target_epsilon, delta=delta,
        l2_clip_norm=l2_clip_norm, expected_batch_size=expected_batch_size, steps=steps, **seeded,
        **make_private_kwargs,
    )
    start = canaries.wrap_params(params)
    final = _train(priv, start, audited, jax.random.key(seed))
    scores = canaries.scores(start, final)
    return AuditResult(
        claimed_epsilon=priv.epsilon(), epsilon_lower_bound=canaries.epsilon_lower_bound(scores, delta, significance),
        delta=float(delta), scores=scores, included=canaries.included,
    )


def _train(priv: PrivateTraining, params: Any, data: Any, key: jax.Array) -> Any:
    """The run of ``priv`` over ``data`` from ``params`` (one noise key per step: from ``key``, or a
    hardened run's :meth:`~gradclip_jax.dp.PrivateTraining.noise_key`)."""
    opt_state, step = priv.init(params), jax.jit(priv.step)
    for t, (batch, mask) in enumerate(priv.batches(data)):
        k = priv.noise_key() if priv.hardened else jax.random.fold_in(key, t)
        params, opt_state, _ = step(params, opt_state, batch, mask, k)
    return params


# ----------------------------------------------------------------------------
# The audit of the sampling: many runs, every step seen
# ----------------------------------------------------------------------------

BACKGROUNDS = ("opposite", "orthogonal")


@dataclasses.dataclass(frozen=True)
class SamplingAuditResult:
    """What :func:`audit_sampling` found.

    Attributes:
      claimed_epsilon: the accountant's epsilon of the planned run (from the
        sampler's ``dp_event``), at ``delta``.
      epsilon_lower_bound: the empirical lower bound (confidence ``1 - significance``).
      delta: the delta of both.
      noise_multiplier: :math:`z`, as :func:`gradclip_jax.dp.make_private` calibrated it.
      in_scores: ``(runs,)`` scores of the runs with the canary in.
      out_scores: ``(runs,)`` scores of the runs with the canary zeroed out.
    """

    claimed_epsilon: float
    epsilon_lower_bound: float
    delta: float
    noise_multiplier: float
    in_scores: np.ndarray
    out_scores: np.ndarray

    @property
    def runs(self) -> int:
        """The runs on each side (canary in, canary out)."""
        return int(self.in_scores.size)

    @property
    def falsified(self) -> bool:
        """The pipeline is less private than it claims (the bound exceeds the claim)."""
        return self.epsilon_lower_bound > self.claimed_epsilon


def epsilon_lower_bound_from_runs(
    in_scores: np.ndarray, out_scores: np.ndarray, delta: float, significance: float = 0.05
) -> float:
    """The Clopper-Pearson epsilon lower bound of independent runs' scores.

    At a threshold :math:`\\tau`, an attacker says "in" for a score above it;
    with TPR and FPR its rates, an :math:`(\\varepsilon, \\delta)`-DP run has
    :math:`\\mathrm{TPR} \\le e^{\\varepsilon}\\,\\mathrm{FPR} + \\delta`, so
    :math:`\\varepsilon \\ge \\ln\\frac{\\underline{\\mathrm{TPR}} - \\delta}{\\overline{\\mathrm{FPR}}}`
    with Clopper-Pearson bounds on both rates (jax-privacy's
    ``CanaryScoreAuditor.epsilon_clopper_pearson``, Jagielski et al. 2020). The best threshold
    is chosen with a Bonferroni correction over all thresholds, so the bound holds
    as returned.

    Args:
      in_scores: ``(r,)`` scores of runs with the canary, higher when it is believed in.
      out_scores: ``(r',)`` scores of runs without it.
      delta: the delta of the claim under audit.
      significance: the probability that the bound exceeds the true epsilon.

    Returns:
      A lower bound on epsilon at ``delta`` (0 when nothing is shown).

    Example:
      >>> import numpy as np
      >>> rng = np.random.default_rng(0)
      >>> apart = epsilon_lower_bound_from_runs(rng.normal(4, 1, 5000), rng.normal(0, 1, 5000), 1e-5)
      >>> same = epsilon_lower_bound_from_runs(rng.normal(0, 1, 5000), rng.normal(0, 1, 5000), 1e-5)
      >>> bool(apart > 3.0), bool(same < 0.3)
      (True, True)
    """
    try:
        from jax_privacy.auditing import CanaryScoreAuditor
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            "gradclip_jax.dp.audit needs jax-privacy: pip install 'gradclip_jax[jax-privacy]'"
        ) from err
    in_scores, out_scores = np.asarray(in_scores, np.float64), np.asarray(out_scores, np.float64)
    if in_scores.ndim != 1 or out_scores.ndim != 1 or not in_scores.size or not out_scores.size:
        raise ValueError(
            "epsilon_lower_bound_from_runs: `in_scores` and `out_scores` must be non-empty 1-D arrays, got "
            f"shapes {in_scores.shape} and {out_scores.shape}"
        )
    auditor = CanaryScoreAuditor(in_scores, out_scores)
    return float(auditor.epsilon_clopper_pearson(significance, delta))


def _sampling_loss(l2_clip_norm: float) -> Callable[[jax.Array, Any], jax.Array]:
    """Per-example loss of the audit's two-coordinate linear model: ``2C (g w_0 + h w_1)``.

    A row's gradient is ``2C (g, h)``, of norm ``2C`` for the rows used
    (``(g, h)`` a unit vector or zero), so once clipped it is ``C (g, h)``.
    """
    scale = 2.0 * l2_clip_norm

    def loss(w: jax.Array, batch: Any) -> jax.Array:
        return scale * (batch["g"] * w[0] + batch["h"] * w[1])

    return loss


def _sampling_data(n: int, canary_in: bool, background: str) -> dict[str, np.ndarray]:
    """Row 0 is the canary (``g = 1``, or 0: zeroed out), rows 1.. the background."""
    g = np.zeros(n, np.float32)
    h = np.zeros(n, np.float32)
    if background == "opposite":
        g[1:] = -1.0
    else:
        h[1:] = 1.0
    g[0] = 1.0 if canary_in else 0.0
    return {"g": g, "h": h}


def _run_batches(sampler: BatchSampler, fn: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, m)`` indices and masks of one run, padded to the sampler's ``max_batch_size``."""
    m, steps = int(sampler.max_batch_size), int(sampler.steps)
    indices, masks = np.zeros((steps, m), np.int32), np.zeros((steps, m), bool)
    for t in range(steps):
        b = sampler.batch(t)
        if b.example_mask is not None:
            raise ValueError(f"{fn}: samplers of groups of examples (users) are not supported")
        k = len(b.indices)
        indices[t, :k], masks[t, :k] = b.indices, b.mask
    return indices, masks


def _epoch_block(fn: str, steps: int, epoch_steps: Any) -> int:
    """The steps scored as one block: ``epoch_steps`` (checked to divide ``steps``), else all."""
    block = steps if epoch_steps is None else check_int(fn, "epoch_steps", epoch_steps, 1)
    if steps % block:
        raise ValueError(f"{fn}: `epoch_steps` ({block}) must divide the sampler's steps ({steps})")
    return block


def _draw_runs(fn: str, first: Any, sampler_for_seed: Callable[[int], Any], seed: int,
               runs: range) -> tuple[np.ndarray, np.ndarray]:
    """The batch indices and masks of ``runs`` (run ``r`` by the sampler of seed ``seed + r``; run 0
    by ``first``), stacked; every run's sampler must have ``first``'s sizes."""
    sizes = (int(first.dataset_size), int(first.steps), int(first.max_batch_size))
    drawn = []
    for r in runs:
        sampler = first if r == 0 else check_sampler(fn, sampler_for_seed(seed + r))
        if (int(sampler.dataset_size), int(sampler.steps), int(sampler.max_batch_size)) != sizes:
            raise ValueError(f"{fn}: every seed's sampler must have the same dataset_size, steps and "
                             "max_batch_size")
        drawn.append(_run_batches(sampler, fn))
    return np.stack([d[0] for d in drawn]), np.stack([d[1] for d in drawn])


def audit_sampling(
    sampler_for_seed: Callable[[int], BatchSampler],
    *,
    target_epsilon: float,
    delta: float,
    runs: int,
    l2_clip_norm: float = 1.0,
    background: str = "opposite",
    seed: int = 0,
    significance: float = 0.05,
    chunk_size: int = 4096,
    epoch_steps: int | None = None,
    **make_private_kwargs: Any,
) -> SamplingAuditResult:
    """Audits a sampler's privacy claim with many runs of :func:`gradclip_jax.dp.make_private`.

    The data set has ``n = sampler.dataset_size`` rows of a two-coordinate
    linear model: row 0 is a **gradient canary**, whose clipped gradient is
    :math:`C e_0`; in the runs "out" it is zeroed out (a row of zero gradient,
    the zero-out neighbour: for Poisson sampling with the public divisor this
    run is the run without it, so an add/remove epsilon covers it; for
    fixed-size batches it is the run without it whose batch is one example
    short). The other rows are the **background**: with ``'opposite'`` each
    one's clipped gradient is :math:`-C e_0`, with ``'orthogonal'`` it is
    :math:`C e_1`.

    Each run is ``make_private``'s step (our clipped sum and noise, SGD with
    learning rate 1) over the batches of ``sampler_for_seed(seed + r)``; the
    attacker sees every iterate, so every step's noisy sum
    :math:`s_t = \\sum_{i \\in B_t} \\mathrm{clip}(g_i) + \\mathcal{N}(0, z^2C^2 I)`.
    A run's **score** is :math:`\\max_t \\langle s_t, e_0 \\rangle / C` (with
    ``epoch_steps``: the sum, over consecutive blocks of that many steps, of each
    block's largest step: shuffling puts the canary in each epoch once). With
    ``'opposite'`` and batches of :math:`b` examples shuffled once per epoch,
    :math:`\\langle s_t, e_0\\rangle/C = -b + 2\\cdot[\\text{canary in } B_t] + z\\xi_t`
    in, :math:`-b + [\\ldots] + z\\xi_t` out: the canary's batch stands out
    by :math:`+2` or :math:`+1` over the others, at a step that is random but
    always present, so at small :math:`z` the two cases are told apart almost as
    well as without any sampling, while the Poisson accountant credits each step
    with amplification by sampling (Chua et al., 2024). Under honest Poisson
    sampling the batch size varies by about :math:`\\sqrt{b}` and hides the
    canary's step.

    ``runs`` runs with the canary in and ``runs`` with it out (run ``r`` of
    each side uses the same sampler, with independent noise: the bound needs
    the runs of each side independent, not the two sides apart) give
    :func:`epsilon_lower_bound_from_runs`. The claim is the accountant's
    epsilon of the planned run, ``make_private``'s calibration for the
    sampler's ``dp_event``. A bound above it falsifies the claim (up to the
    ``significance``); a bound below it proves nothing.

    Args:
      sampler_for_seed: ``seed -> sampler`` of one run, following
        :class:`gradclip_jax.dp.BatchSampler` (one process, one example per row).
        ``sampler_for_seed(seed)`` is also the one ``make_private`` calibrates with.
      target_epsilon, delta: as :func:`gradclip_jax.dp.make_private`.
      runs: :math:`r`, the runs on each side; the bound cannot exceed about
        :math:`\\ln(r / 4)`.
      l2_clip_norm: :math:`C`.
      background: ``'opposite'`` (default) or ``'orthogonal'``.
      seed: seeds the samplers (``seed``, ..., ``seed + runs - 1``) and the noise.
      significance: the probability that the bound exceeds the true epsilon.
      epoch_steps: the steps of one epoch of the sampler, to score block by block
        (default: one block of all the steps). A divisor of the steps.
      chunk_size: runs computed at once (memory: about ``24 * steps * max_batch_size``
        bytes per run).
      **make_private_kwargs: passed on (e.g. ``accountant``, ``method``).

    Returns:
      A :class:`SamplingAuditResult`.

    Raises:
      ValueError: for fewer than 2 rows, 1 step or 1 run, a sampler over several
        processes or of groups of examples, or another ``background``.

    Example:
      Honest Poisson sampling, 20 steps at :math:`q = 0.05`:

      >>> from gradclip_jax.dp import PoissonSampler
      >>> def sampler(seed):
      ...     return PoissonSampler(100, expected_batch_size=5, steps=20, seed=seed,
      ...                           process_index=0, process_count=1)
      >>> res = audit_sampling(sampler, target_epsilon=2.0, delta=1e-5, runs=500)
      >>> res.claimed_epsilon <= 2.0 + 1e-9, res.falsified
      (True, False)
    """
    fn = "audit_sampling"
    runs = check_int(fn, "runs", runs, 1)
    seed = check_int(fn, "seed", seed, 0)
    chunk_size = check_int(fn, "chunk_size", chunk_size, 1)
    background = check_choice(fn, "background", background, BACKGROUNDS)
    c = check_number(fn, "l2_clip_norm", l2_clip_norm, low=0.0, low_inclusive=False)
    first = check_sampler(fn, sampler_for_seed(seed))
    n, steps = int(first.dataset_size), int(first.steps)
    if n < 2 or steps < 1:
        raise ValueError(f"{fn}: the sampler needs at least 2 rows and 1 step, got {n} rows and {steps} steps")
    block = _epoch_block(fn, steps, epoch_steps)
    if getattr(first, "process_count", 1) != 1:
        raise ValueError(f"{fn}: the sampler must give the whole batch (process_count=1)")
    priv = make_private(
        _sampling_loss(c), optax.sgd(1.0), sampler=first, target_epsilon=target_epsilon, delta=delta,
        l2_clip_norm=c, seed=seed, **make_private_kwargs,
    )
    scale = float(priv.expected_batch_size) / c  # an iterate's move times this is the noisy sum / C

    def one_run(data: Any, indices: jax.Array, mask: jax.Array, key: jax.Array) -> jax.Array:
        def body(carry: Any, xs: Any) -> tuple[Any, jax.Array]:
            w, opt_state = carry
            idx, m, t = xs
            batch = jax.tree.map(lambda a: a[idx], data)
            w_next, opt_state, _ = priv.step(w, opt_state, batch, m, jax.random.fold_in(key, t))
            return (w_next, opt_state), (w - w_next)[0] * scale

        w0 = jnp.zeros(2, jnp.float32)
        _, observed = jax.lax.scan(body, (w0, priv.init(w0)), (indices, mask, jnp.arange(steps)))
        return jnp.sum(jnp.max(observed.reshape(steps // block, block), axis=1))

    scores_of = jax.jit(jax.vmap(one_run, in_axes=(None, 0, 0, 0)))
    data = {side: _sampling_data(n, side, background) for side in (True, False)}
    keys = {side: jax.random.split(jax.random.fold_in(jax.random.key(seed), int(side)), runs)
            for side in (True, False)}
    scores: dict[bool, list[np.ndarray]] = {True: [], False: []}
    for start in range(0, runs, chunk_size):
        stop = min(start + chunk_size, runs)
        indices, masks = _draw_runs(fn, first, sampler_for_seed, seed, range(start, stop))
        for side in (True, False):
            scores[side].append(np.asarray(scores_of(data[side], indices, masks, keys[side][start:stop])))
    in_scores, out_scores = np.concatenate(scores[True]), np.concatenate(scores[False])
    return SamplingAuditResult(
        claimed_epsilon=float(priv.planned_epsilon),
        epsilon_lower_bound=epsilon_lower_bound_from_runs(in_scores, out_scores, delta, significance),
        delta=float(delta), noise_multiplier=float(priv.noise_multiplier),
        in_scores=in_scores, out_scores=out_scores,
    )
