"""The one-run audit with gradient canaries (:func:`audit_epsilon`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradclip_jax._core.validation import clip_norm_arg
from gradclip_jax.dp.private_step import PrivateTraining, make_private


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
      >>> from gradclip_jax import make_private
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
            raise ValueError(
                f"GradientCanaries: `num_canaries` must be at least 2, got {num_canaries}"
            )
        included = np.random.default_rng(seed).random(num_canaries) < 0.5
        return cls(included=included, l2_clip_norm=float(l2_clip_norm))

    @property
    def num_canaries(self) -> int:
        return int(self.included.size)

    def wrap_loss(
        self, loss_fn: Callable[[Any, Any], jax.Array]
    ) -> Callable[[Any, Any], jax.Array]:
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
        filled = jax.tree.map(
            lambda x: np.concatenate([np.asarray(x), np.repeat(np.asarray(x)[:1], m, 0)]), data
        )
        ids = np.concatenate([np.full(n, -2), np.where(self.included, np.arange(m), -1)]).astype(
            np.int32
        )
        return {"data": filled, "canary": ids}

    def scores(self, params_before: Any, params_after: Any) -> np.ndarray:
        """How far training moved each canary's coordinate against its gradient (``(m,)``)."""
        return np.asarray(params_before["canary"] - params_after["canary"], np.float64)

    def epsilon_lower_bound(
        self, scores: np.ndarray, delta: float, significance: float = 0.05
    ) -> float:
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
    l2_clip_norm: float | None = None,
    expected_batch_size: float,
    steps: int,
    optimizer: optax.GradientTransformation | None = None,
    seed: int = 0,
    significance: float = 0.05,
    l2_norm_clip: float | None = None,
    **make_private_kwargs: Any,
) -> AuditResult:
    """Trains with :func:`gradclip_jax.make_private` and gradient canaries; bounds its epsilon.

    The data set is ``data``'s ``n`` rows plus ``num_canaries`` canary rows
    (``dataset_size = n + num_canaries``); the claim audited is the
    accountant's epsilon of the steps taken, at ``delta``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> (B,)`` per-example losses.
      params: the model's initial parameters.
      data: a pytree of host arrays with the ``n`` real examples on axis 0.
      num_canaries: ``m``; the bound's power grows with it (roughly as ``log m``).
      target_epsilon, delta, l2_clip_norm, expected_batch_size, steps: as
        :func:`gradclip_jax.make_private`.
      optimizer: default ``optax.sgd(0.1)``.
      seed: seeds the coin flips, the sampler and the noise (with ``hardened`` in
        ``make_private_kwargs``: the coin flips only; the run draws its own from the OS).
      significance: the probability that the bound exceeds the true epsilon.
      l2_norm_clip: ``l2_clip_norm`` under optax's spelling (give one of the two).
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
    l2_clip_norm = clip_norm_arg("audit_epsilon", l2_clip_norm, l2_norm_clip)
    canaries = GradientCanaries.draw(num_canaries, l2_clip_norm, seed)
    audited = canaries.wrap_data(data)
    # a hardened run refuses a seed: its sampler and noise come from the OS (see _train)
    seeded: dict[str, Any] = {} if make_private_kwargs.get("hardened") else {"seed": seed}
    priv = make_private(
        canaries.wrap_loss(loss_fn),
        optimizer or optax.sgd(0.1),
        dataset_size=int(audited["canary"].shape[0]),
        target_epsilon=target_epsilon,
        delta=delta,
        l2_clip_norm=l2_clip_norm,
        expected_batch_size=expected_batch_size,
        steps=steps,
        **seeded,
        **make_private_kwargs,
    )
    start = canaries.wrap_params(params)
    final = _train(priv, start, audited, jax.random.key(seed))
    scores = canaries.scores(start, final)
    return AuditResult(
        claimed_epsilon=priv.epsilon(),
        epsilon_lower_bound=canaries.epsilon_lower_bound(scores, delta, significance),
        delta=float(delta),
        scores=scores,
        included=canaries.included,
    )


def _train(priv: PrivateTraining, params: Any, data: Any, key: jax.Array) -> Any:
    """The run of ``priv`` over ``data`` from ``params`` (one noise key per step: from ``key``, or a
    hardened run's :meth:`~gradclip_jax.dp.PrivateTraining.noise_key`)."""
    opt_state, step = priv.init(params), priv.step
    for t, (batch, mask) in enumerate(priv.batches(data)):
        k = priv.noise_key() if priv.hardened else jax.random.fold_in(key, t)
        params, opt_state, _ = step(params, opt_state, batch, mask, k)
    return params
