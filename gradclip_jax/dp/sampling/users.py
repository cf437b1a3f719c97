"""User-level DP: Poisson sampling over users, each user's gradient clipped as one unit.

Example-level DP-SGD protects one **example**: a user with many examples is
protected :math:`k` times less well (group privacy), since removing the user
moves the clipped sum by up to :math:`kC`. User-level DP-SGD protects one
**user** (all their examples): at each step every one of the :math:`N` users
is in the batch independently with probability :math:`q = \\text{expected
users}/N`, a sampled user contributes up to :math:`k` of their examples, and
the user's gradient (the sum, or the mean, of those examples' gradients) is
clipped as one unit:

.. math:: \\tilde g = \\frac{1}{qN}\\Big(\\sum_{u \\in B_t} \\mathrm{clip}_C\\big(
    \\textstyle\\sum_{i \\in S_{u,t}} w_{u}\\, \\nabla \\ell(\\theta; x_i)\\big)
    + \\mathcal{N}(0, z^2C^2 I)\\Big)

with :math:`S_{u,t}` the (at most :math:`k`) examples of user :math:`u` at
step :math:`t` and :math:`w_u = 1` (sum) or :math:`1/|S_{u,t}|` (mean).
Adding or removing one user adds or removes one term of norm at most
:math:`C`, so the step is the Poisson-sampled Gaussian mechanism over users:
``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, with add/remove-one-user
neighbours.

**The layout.** :func:`gradclip_jax.clipped_grad` clips one unit per row of
the batch's leading axis. :class:`UserPoissonSampler` lays a step's batch out
as ``[users, k, ...]`` (a :class:`UserBatch`: the examples and a ``[users, k]``
mask of the real ones) with a ``[users]`` mask of the real users, and
:func:`user_loss` turns a loss of the examples (``[users, k, ...] -> [users,
k]``) into one loss per user: the user is the unit, on the vmap path and on
the ghost path (a dense layer sees ``[users, k, d]``, the sequence layout, so
one user's :math:`k` rows form one Gram).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core.validation import check_choice, check_int, check_number
from gradclip_jax.dp.sampling.poisson import (
    BatchOverflowError,
    checked_schedule,
    overflow_probability,
)
from gradclip_jax.dp.sampling.protocol import IndexSampler, SampledBatch, gathered

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")

_CHOICES = ("random", "first")
_REDUCE = ("sum", "mean")


class UserBatch(NamedTuple):
    """A user-level batch: a pytree whose leaves all have the users on axis 0.

    Attributes:
      examples: the data pytree gathered as ``[users, k, ...]``.
      example_mask: bool ``[users, k]``: ``True`` for a user's real examples
        (a user with fewer than :math:`k` examples, and padding users, have
        ``False`` rows).
    """

    examples: Any
    example_mask: Any


def user_loss(example_loss: Callable[..., Any], reduce: str = "sum") -> Callable[..., Any]:
    """One loss per user, from a loss of the examples laid out ``[users, k, ...]``.

    .. math:: L_u(\\theta) = w_u \\sum_{j:\\ m_{uj}} \\ell_{uj}(\\theta),
        \\qquad w_u = 1 \\ (\\text{sum}) \\text{ or } 1/\\textstyle\\sum_j m_{uj} \\ (\\text{mean})

    Args:
      example_loss: ``example_loss(params, examples, *args) -> [users, k]``:
        the loss of every example, computed on the ``[users, k, ...]`` layout
        (keep the layout: a model that reshapes to ``[users * k, ...]`` loses
        the user axis that ghost clipping needs).
      reduce: ``'sum'`` (default) or ``'mean'`` over the user's real examples.

    Returns:
      ``loss(params, batch: UserBatch, *args) -> [users]``, for
      :func:`gradclip_jax.clipped_grad` and :func:`gradclip_jax.make_private`.

    Raises:
      ValueError: naming ``reduce`` for another value.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.dp import UserBatch, user_loss
      >>> loss = user_loss(lambda w, x: (x @ w) ** 2, reduce='mean')
      >>> batch = UserBatch(jnp.ones((2, 3, 1)), jnp.array([[True, True, False], [True, False, False]]))
      >>> loss(jnp.array([2.0]), batch).tolist()
      [4.0, 4.0]
    """
    check_choice("user_loss", "reduce", reduce, _REDUCE)

    def loss(params: Any, batch: UserBatch, *args: Any) -> jax.Array:
        per_example = example_loss(params, batch.examples, *args)
        m = jnp.asarray(batch.example_mask)
        # where, not a product: a padding row's loss may be inf or nan, and 0 * nan is nan
        total = jnp.sum(jnp.where(m, per_example, 0), axis=1)
        if reduce == "mean":
            total = total / jnp.maximum(jnp.sum(m, axis=1), 1).astype(total.dtype)
        return total

    return loss


def _users_from_ids(fn: str, user_ids: Any) -> tuple[list[np.ndarray], int]:
    """Each user's example indices (users in increasing id order), and the number of examples."""
    ids = np.asarray(user_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"{fn}: `user_ids` must be a non-empty 1-D integer array (one id per example), "
            f"got dtype {ids.dtype} and shape {ids.shape}"
        )
    if ids.min() < 0:
        raise ValueError(f"{fn}: `user_ids` must be >= 0, got {int(ids.min())}")
    order = np.argsort(ids, kind="stable")  # stable: a user's examples stay in increasing order
    _, starts = np.unique(ids[order], return_index=True)
    return [a.astype(np.int64) for a in np.split(order, starts[1:])], int(ids.size)


def _users_from_lists(
    fn: str, user_examples: Sequence[Any], dataset_size: int | None
) -> tuple[list[np.ndarray], int]:
    """``user_examples`` checked: non-empty, in range, each example of one user only."""
    users = [np.sort(np.asarray(e, np.int64).reshape(-1)) for e in user_examples]
    if not users:
        raise ValueError(f"{fn}: `user_examples` must list at least one user")
    for u, e in enumerate(users):
        if e.size == 0:
            raise ValueError(f"{fn}: `user_examples[{u}]` is empty (every user needs an example)")
    flat = np.concatenate(users)
    n = (
        int(flat.max()) + 1
        if dataset_size is None
        else check_int(fn, "dataset_size", dataset_size, 1)
    )
    if flat.min() < 0 or flat.max() >= n:
        raise ValueError(
            f"{fn}: `user_examples` holds an example index outside [0, {n}) (dataset_size={n})"
        )
    if np.unique(flat).size != flat.size:
        # an example of two users would be in two clipped units: removing one user would not remove it
        raise ValueError(f"{fn}: `user_examples` lists an example under two users (or twice)")
    return users, n


class UserPoissonSampler(IndexSampler):
    """Poisson sampling over users, up to ``max_examples_per_user`` examples each (see the module docstring).

    A :class:`gradclip_jax.dp.BatchSampler`: pass it to
    ``make_private(..., sampler=...)`` with a :func:`user_loss`; its
    :meth:`gather` (which :meth:`gradclip_jax.dp.PrivateTraining.batches`
    uses) lays out a step as ``(UserBatch, user_mask)``.

    **Which examples.** A user with more than :math:`k` examples contributes
    :math:`k` of them: a uniformly random subset drawn afresh each step
    (``example_choice='random'``, default: over the run every example is used)
    or the first :math:`k` in index order (``'first'``). Either keeps the
    guarantee: the choice for user :math:`u` is a function of ``(seed, step,
    u)`` and of :math:`u`'s own examples only, so adding or removing a user
    changes no other user's contribution, and whatever :math:`u` contributes is
    clipped to norm :math:`C` as one unit.

    Args:
      user_ids: one integer user id per example (``dataset_size`` is its
        length; users are the distinct ids). Give this or ``user_examples``.
      user_examples: each user's example indices (a list of lists): give this
        or ``user_ids``.
      expected_users: :math:`qN`, the expected number of users per step, in
        :math:`(0, N]`.
      max_examples_per_user: :math:`k \\ge 1`.
      steps: :math:`T`.
      seed: an int; step :math:`t`'s users come from
        ``numpy.random.default_rng([seed, t])``, user :math:`u`'s examples from
        ``default_rng([seed, t, u + 1])``.
      dataset_size: the number of examples (rows of the data), with
        ``user_examples`` only (default: the largest index + 1).
      max_users: the padded number of users per step (a multiple of
        ``process_count``); default: the overflow probability of the run is at
        most ``overflow_bound``.
      overflow_bound: default 1e-9.
      example_choice: ``'random'`` (default) or ``'first'``.
      process_index, process_count: as :class:`gradclip_jax.PoissonSampler`.

    Attributes:
      num_users: :math:`N`.
      sample_rate: :math:`q` (over users).
      expected_batch_size: :math:`qN` (the divisor of the noised sum).
      max_batch_size: the padded number of users.
      max_examples_per_user: :math:`k`.

    Raises:
      ValueError: naming the argument: neither or both of ``user_ids`` and
        ``user_examples``, negative or non-integer ids, an example index
        outside the data set or under two users, ``k < 1``, ``expected_users``
        outside :math:`(0, N]`, ``max_users`` below ``expected_users``.

    Example:
      >>> import numpy as np
      >>> from gradclip_jax.dp import UserPoissonSampler
      >>> user_ids = np.repeat(np.arange(50), 4)          # 50 users, 4 examples each
      >>> s = UserPoissonSampler(user_ids, expected_users=10, max_examples_per_user=2, steps=3,
      ...                        process_index=0, process_count=1)
      >>> b = s.batch(0)
      >>> b.indices.shape == b.example_mask.shape == (s.max_batch_size, 2), b.mask.shape == (s.max_batch_size,)
      (True, True)
      >>> batch, user_mask = s.gather({'x': np.arange(200.0)}, b)
      >>> batch.examples['x'].shape == (s.max_batch_size, 2)
      True
      >>> rows = [set(user_ids[i[m]]) for i, m in zip(b.indices[b.mask], b.example_mask[b.mask])]
      >>> all(len(r) == 1 for r in rows), s.sample_rate  # each row is one user's examples
      (True, 0.2)
    """

    def __init__(
        self,
        user_ids: Any = None,
        *,
        user_examples: Sequence[Any] | None = None,
        expected_users: float,
        max_examples_per_user: int,
        steps: int,
        seed: int = 0,
        dataset_size: int | None = None,
        max_users: int | None = None,
        overflow_bound: float = 1e-9,
        example_choice: str = "random",
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        fn = "UserPoissonSampler"
        self.users, n = self._users(fn, user_ids, user_examples, dataset_size)
        self.num_users = len(self.users)
        self.max_examples_per_user = check_int(
            fn, "max_examples_per_user", max_examples_per_user, 1
        )
        self.example_choice = check_choice(fn, "example_choice", example_choice, _CHOICES)
        users = self._expected_users(fn, expected_users, self.num_users)
        self.sample_rate = users / self.num_users
        self.expected_batch_size = self.sample_rate * self.num_users
        run = checked_schedule(
            fn,
            self.num_users,
            self.sample_rate,
            steps,
            overflow_bound,
            max_users,
            process_index,
            process_count,
        )
        super().__init__(
            n,
            steps=run.steps,
            max_batch_size=run.max_size,
            seed=seed,
            process_index=run.process_index,
            process_count=run.process_count,
        )
        if self.max_batch_size < self.expected_batch_size:
            raise ValueError(
                f"{fn}: `max_users` ({self.max_batch_size}) is below `expected_users` ({users:g})"
            )
        self.overflow_probability = overflow_probability(
            self.num_users, self.sample_rate, self.max_batch_size, self.steps
        )

    @staticmethod
    def _expected_users(fn: str, expected_users: Any, num_users: int) -> float:
        """``expected_users``, checked: positive and at most the number of users."""
        users = check_number(fn, "expected_users", expected_users, low=0.0, low_inclusive=False)
        if users > num_users:
            raise ValueError(
                f"{fn}: `expected_users` ({users:g}) must be at most the number of users "
                f"({num_users})"
            )
        return users

    @staticmethod
    def _users(
        fn: str, user_ids: Any, user_examples: Any, dataset_size: Any
    ) -> tuple[list[np.ndarray], int]:
        if (user_ids is None) == (user_examples is None):
            raise ValueError(f"{fn}: give exactly one of `user_ids` and `user_examples`")
        if user_ids is not None:
            if dataset_size is not None:
                raise ValueError(
                    f"{fn}: with `user_ids`, leave `dataset_size` out (it is len(user_ids))"
                )
            return _users_from_ids(fn, user_ids)
        return _users_from_lists(fn, user_examples, dataset_size)

    def __repr__(self) -> str:
        return (
            f"UserPoissonSampler(num_users={self.num_users}, sample_rate={self.sample_rate:g}, "
            f"max_examples_per_user={self.max_examples_per_user}, steps={self.steps}, "
            f"max_users={self.max_batch_size}, example_choice={self.example_choice!r})"
        )

    def draw(self, step: int) -> np.ndarray:
        """The sorted users (positions in ``self.users``) drawn at ``step``: Poisson at rate :math:`q`.

        Raises:
          BatchOverflowError: when more than ``max_users`` users are drawn.
        """
        t = check_int("UserPoissonSampler.draw", "step", step, 0)
        rng = np.random.default_rng([self.seed, t])
        size = int(rng.binomial(self.num_users, self.sample_rate))
        if size > self.max_batch_size:
            # truncating would change the mechanism the accountant describes: stop instead
            raise BatchOverflowError(
                f"step {t}: the Poisson draw has {size} users, more than max_users={self.max_batch_size} "
                f"(probability {self.overflow_probability:.1e} per run). Nothing was released for this "
                "step; use a larger max_users (or the default)."
            )
        chosen = rng.choice(self.num_users, size, replace=False) if size else np.zeros(0, np.int64)
        return np.sort(chosen).astype(np.int32)

    def examples_of(self, user: int, step: int) -> np.ndarray:
        """The (at most :math:`k`, increasing) example indices user ``user`` contributes at ``step``."""
        own, k = self.users[user], self.max_examples_per_user
        if len(own) <= k or self.example_choice == "first":
            return own[:k]
        # keyed by (seed, step, user) only: no other user's presence changes this user's choice
        rng = np.random.default_rng([self.seed, step, user + 1])
        return np.sort(rng.choice(own, k, replace=False))

    def global_batch(self, step: int) -> SampledBatch:
        """The whole padded batch: indices and ``example_mask`` ``[max_users, k]``, ``mask`` ``[max_users]``."""
        users = self.draw(step)
        m, k = self.max_batch_size, self.max_examples_per_user
        indices, example_mask = np.zeros((m, k), np.int32), np.zeros((m, k), bool)
        for row, u in enumerate(users):
            own = self.examples_of(int(u), int(step))
            indices[row, : len(own)] = own
            example_mask[row, : len(own)] = True
        mask = np.zeros(m, bool)
        mask[: len(users)] = True
        return SampledBatch(indices=indices, mask=mask, step=int(step), example_mask=example_mask)

    def gather(self, data: Any, batch: SampledBatch) -> tuple[UserBatch, np.ndarray]:
        """``(UserBatch(data[indices], example_mask), user_mask)``: the step's input for :func:`user_loss`.

        Args:
          data: a pytree of host arrays with the examples on axis 0.
          batch: a :class:`gradclip_jax.dp.SampledBatch` of this sampler.
        """
        keep = (
            np.ones(batch.indices.shape, bool) if batch.example_mask is None else batch.example_mask
        )
        examples = gathered(data, batch.indices, keep)
        return UserBatch(examples, batch.example_mask), batch.mask

    def dp_event(self, noise_multiplier: float) -> Any:
        """``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` over users (add/remove-one-user neighbours)."""
        from gradclip_jax.dp.accounting._accountants import import_dp_accounting

        dpa = import_dp_accounting()
        return dpa.PoissonSampledDpEvent(self.sample_rate, dpa.GaussianDpEvent(noise_multiplier))

    def plan(self) -> dict[str, Any]:
        """The sampling's identity for resume checks (plain values)."""
        return {
            "sampler": "UserPoissonSampler",
            "num_users": self.num_users,
            "max_batch_size": self.max_batch_size,
            "max_examples_per_user": self.max_examples_per_user,
            "example_choice": self.example_choice,
            "seed": self.seed,
        }
