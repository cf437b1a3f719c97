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
:func:`gradclip_jax.make_private`, a row whose gradient is zero changes
nothing, so the run is exactly the one on the data set without that canary.

:class:`GradientCanaries` builds the pieces (loss, parameters, data, scores,
bound) for any pipeline; :func:`audit_epsilon` runs the whole audit of a
:func:`gradclip_jax.make_private` run. A bound above the run's claimed
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

from gradclip_jax.dp.audit._canaries import (
    AuditResult,
    GradientCanaries,
    audit_epsilon,
    epsilon_lower_bound,
)
from gradclip_jax.dp.audit._sampling_audit import (
    SamplingAuditResult,
    audit_sampling,
    epsilon_lower_bound_from_runs,
)

__all__ = [
    "AuditResult",
    "GradientCanaries",
    "SamplingAuditResult",
    "audit_epsilon",
    "audit_sampling",
    "epsilon_lower_bound",
    "epsilon_lower_bound_from_runs",
]
