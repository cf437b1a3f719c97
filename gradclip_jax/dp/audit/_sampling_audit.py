"""The audit of the sampling: many runs, every step seen (:func:`audit_sampling`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core.validation import check_choice, check_int, clip_norm_arg
from gradclip_jax.dp.private_step import PrivateTraining, make_private
from gradclip_jax.dp.sampling.protocol import BatchSampler, check_sampler

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
      noise_multiplier: :math:`z`, as :func:`gradclip_jax.make_private` calibrated it.
      in_scores: ``(runs,)`` scores of the runs with the canary in.
      out_scores: ``(runs,)`` scores of the runs with the canary zeroed out.
      in_sums, out_sums: ``(runs,)`` the second score, each run's sum over all its steps
        (``None`` where it is the first: ``epoch_steps=1``).
    """

    claimed_epsilon: float
    epsilon_lower_bound: float
    delta: float
    noise_multiplier: float
    in_scores: np.ndarray
    out_scores: np.ndarray
    in_sums: np.ndarray | None = None
    out_sums: np.ndarray | None = None

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


def _draw_runs(
    fn: str, first: Any, sampler_for_seed: Callable[[int], Any], seed: int, runs: range
) -> tuple[np.ndarray, np.ndarray]:
    """The batch indices and masks of ``runs`` (run ``r`` by the sampler of seed ``seed + r``; run 0
    by ``first``), stacked; every run's sampler must have ``first``'s sizes."""
    sizes = (int(first.dataset_size), int(first.steps), int(first.max_batch_size))
    drawn = []
    for r in runs:
        sampler = first if r == 0 else check_sampler(fn, sampler_for_seed(seed + r))
        if (int(sampler.dataset_size), int(sampler.steps), int(sampler.max_batch_size)) != sizes:
            raise ValueError(
                f"{fn}: every seed's sampler must have the same dataset_size, steps and "
                "max_batch_size"
            )
        drawn.append(_run_batches(sampler, fn))
    return np.stack([d[0] for d in drawn]), np.stack([d[1] for d in drawn])


def _first_sampler(
    fn: str, sampler_for_seed: Callable[[int], Any], seed: int
) -> tuple[Any, int, int]:
    """The first run's sampler, checked, with its data set size and steps."""
    first = check_sampler(fn, sampler_for_seed(seed))
    n, steps = int(first.dataset_size), int(first.steps)
    if n < 2 or steps < 1:
        raise ValueError(
            f"{fn}: the sampler needs at least 2 rows and 1 step, got {n} rows and {steps} steps"
        )
    if getattr(first, "process_count", 1) != 1:
        raise ValueError(f"{fn}: the sampler must give the whole batch (process_count=1)")
    return first, n, steps


def audit_sampling(
    sampler_for_seed: Callable[[int], BatchSampler],
    *,
    target_epsilon: float,
    delta: float,
    runs: int,
    l2_clip_norm: float | None = None,
    background: str = "opposite",
    seed: int = 0,
    significance: float = 0.05,
    chunk_size: int = 4096,
    epoch_steps: int | None = None,
    l2_norm_clip: float | None = None,
    **make_private_kwargs: Any,
) -> SamplingAuditResult:
    """Audits a sampler's privacy claim with many runs of :func:`gradclip_jax.make_private`.

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
    block's largest step: shuffling puts the canary in each epoch once), and a
    second score, the sum over all steps :math:`\\sum_t \\langle s_t, e_0 \\rangle / C`:
    a sampler that takes the canary more often than it claims (in every step, say)
    moves the sum, where the largest step hides it among the batch sizes' spread
    (at 20 steps of :math:`q = 0.05`, :math:`z = 1`: bound 0.76 by the largest
    step, 2.69 by the sum, against a claim of 2). The reported bound is the larger
    of the two, each at ``significance / 2``. With
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
      target_epsilon, delta: as :func:`gradclip_jax.make_private`.
      runs: :math:`r`, the runs on each side; the bound cannot exceed about
        :math:`\\ln(r / 4)`.
      l2_clip_norm: :math:`C` (default 1.0); ``l2_norm_clip``, optax's spelling, is accepted
        too (give one of the two).
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

      >>> from gradclip_jax import PoissonSampler
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
    c = clip_norm_arg(fn, l2_clip_norm, l2_norm_clip, default=1.0, low=0.0, low_inclusive=False)
    first, n, steps = _first_sampler(fn, sampler_for_seed, seed)
    block = _epoch_block(fn, steps, epoch_steps)
    priv = make_private(
        _sampling_loss(c),
        optax.sgd(1.0),
        sampler=first,
        target_epsilon=target_epsilon,
        delta=delta,
        l2_clip_norm=c,
        seed=seed,
        **make_private_kwargs,
    )
    scores_of = _scores_of(priv, steps, block, float(priv.expected_batch_size) / c)
    data = {side: _sampling_data(n, side, background) for side in (True, False)}
    keys = {
        side: jax.random.split(jax.random.fold_in(jax.random.key(seed), int(side)), runs)
        for side in (True, False)
    }
    scores: dict[bool, list[np.ndarray]] = {True: [], False: []}
    for start in range(0, runs, chunk_size):
        stop = min(start + chunk_size, runs)
        indices, masks = _draw_runs(fn, first, sampler_for_seed, seed, range(start, stop))
        for side in (True, False):
            scores[side].append(
                np.asarray(scores_of(data[side], indices, masks, keys[side][start:stop]))
            )
    return _result(
        priv,
        np.concatenate(scores[True]),
        np.concatenate(scores[False]),
        block,
        delta,
        significance,
    )


def _result(
    priv: PrivateTraining,
    both_in: np.ndarray,
    both_out: np.ndarray,
    block: int,
    delta: float,
    significance: float,
) -> SamplingAuditResult:
    """The audit's result from the runs' two scores ``(runs, 2)`` a side: the larger of their
    bounds, each at half the significance (a union bound); one score where a block is a step."""
    in_scores, out_scores = both_in[:, 0], both_out[:, 0]
    if block == 1:  # (the largest step of each one-step block: the sum, the second score)
        bound = epsilon_lower_bound_from_runs(in_scores, out_scores, delta, significance)
        in_sums = out_sums = None
    else:
        in_sums, out_sums = both_in[:, 1], both_out[:, 1]
        bound = max(
            epsilon_lower_bound_from_runs(in_scores, out_scores, delta, significance / 2),
            epsilon_lower_bound_from_runs(in_sums, out_sums, delta, significance / 2),
        )
    return SamplingAuditResult(
        claimed_epsilon=float(priv.planned_epsilon),
        epsilon_lower_bound=bound,
        delta=float(delta),
        noise_multiplier=float(priv.noise_multiplier),
        in_scores=in_scores,
        out_scores=out_scores,
        in_sums=in_sums,
        out_sums=out_sums,
    )


def _scores_of(
    priv: PrivateTraining, steps: int, block: int, scale: float
) -> Callable[..., jax.Array]:
    """The attacker's two scores of each of a batch of runs, ``(runs, 2)``: the sum over blocks of
    ``block`` steps of the largest move of the canary's coordinate, and the sum of all its moves
    (``scale``: an iterate's move times this is the noisy sum / C), as one jitted function of
    ``(data, indices, mask, key)`` vmapped over runs."""

    def one_run(data: Any, indices: jax.Array, mask: jax.Array, key: jax.Array) -> jax.Array:
        def body(carry: Any, xs: Any) -> tuple[Any, jax.Array]:
            w, opt_state = carry
            idx, m, t = xs
            batch = jax.tree.map(lambda a: a[idx], data)
            w_next, opt_state, _ = priv.step(w, opt_state, batch, m, jax.random.fold_in(key, t))
            return (w_next, opt_state), (w - w_next)[0] * scale

        w0 = jnp.zeros(2, jnp.float32)
        _, observed = jax.lax.scan(body, (w0, priv.init(w0)), (indices, mask, jnp.arange(steps)))
        blocks = jnp.sum(jnp.max(observed.reshape(steps // block, block), axis=1))
        return jnp.stack([blocks, jnp.sum(observed)])

    return jax.jit(jax.vmap(one_run, in_axes=(None, 0, 0, 0)))
