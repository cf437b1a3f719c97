"""Private training in one call: calibrated noise, Poisson batches, an accountant, a jit-able step.

:func:`make_private` is the JAX counterpart of Opacus'
``PrivacyEngine.make_private_with_epsilon``: from the per-example loss, an optax
optimizer and the run's shape (data set size, expected batch size, steps or
epochs) and privacy target (:math:`\\varepsilon`, :math:`\\delta`, clip norm
:math:`C`), it returns a :class:`PrivateTraining` holding

* ``noise_multiplier``: the smallest :math:`z` whose run spends at most the
  target (:func:`gradclip_jax.dp.accounting.calibrate_noise_multiplier`, PLD);
* ``sampler``: a :class:`gradclip_jax.PoissonSampler` (fixed shapes), or
  the :class:`gradclip_jax.dp.BatchSampler` you pass as ``sampler=``: the
  noise is calibrated for, and the accountant records, its ``dp_event``;
* ``accountant``: a :class:`gradclip_jax.PrivacyAccountant` that
  :meth:`PrivateTraining.batches` fills one step per batch;
* ``step(params, opt_state, batch, mask, key) -> (params, opt_state, metrics)``:
  one DP-SGD step, jit-compatible, a function of its arguments (it reports its key to the host):

  .. math:: \\tilde g = \\frac{1}{qn}\\Big(\\sum_{i:\\ \\text{mask}_i} g_i
      \\min\\big(1, \\tfrac{C}{\\|g_i\\|_2}\\big) + \\mathcal{N}(0, z^2C^2 I)\\Big),
      \\qquad (u, s) = \\text{optimizer.update}(\\tilde g, s, \\theta),
      \\qquad \\theta \\leftarrow \\theta + u

  with the clipped sum from :func:`gradclip_jax.clipped_grad` (``method='auto'``
  by default) and the noise from :func:`gradclip_jax.dp.noise.add_gaussian_noise`.
  The sum is divided by the **expected** batch size :math:`qn`, a public
  constant (the actual batch size is not public under Poisson sampling); the
  noise's :math:`C` is the sum's sensitivity under the sampler's neighbouring
  relation (:math:`2C` for ``'replace'``).

**Large logical batches.** With ``physical_batch_size=p``, the step still takes
the whole padded logical batch, but computes the clipped sum ``p`` examples at a
time (a sequential ``lax.scan`` inside :func:`gradclip_jax.clipped_grad`), so peak
memory scales with ``p``, and adds the noise **once** to the sum of all pieces.
When even the logical batch's data cannot be on the device at once, accumulate
on the host: add the ``clipped_sum(params, piece, piece_mask)`` of the pieces
(tree sums) and call ``noisy_update`` once per logical step. Do **not** wrap a
noising transform in ``optax.MultiSteps``: it averages the updates it is given,
which divides the signal by the number of pieces but not the noise;
:func:`gradclip_jax.dp_noise` raises inside it.

**Several devices and processes.** Under ``jax.jit`` with the batch sharded over
devices (one global array, e.g. from ``jax.make_array_from_process_local_data``
with the pieces the sampler gives each process) every example is clipped on the
device that holds it, the cross-device sum comes after, and the noise is drawn
once from the (replicated) ``key``: every device and process adds the same
noise, as in a single-process run.

Nothing is hidden: the step's state is ``params`` and ``opt_state`` (pytrees)
and the ``key`` you pass (:meth:`PrivateTraining.batches` with ``noise_key=``
gives each step's, the same after a resume); the accountant is a host-side record.
Each executed update reports its noise key to the host (``_releases``): the run gives no
epsilon while more updates ran than steps were recorded, or a key was used twice. ``step`` and
``noisy_update`` are jitted functions: called directly, their program reports nothing (so JAX's
persistent cache keeps it) and the host counts each call (``_counted``).
"""

# _make_private: make_private; _step: the jit-able step functions and their metrics; _training: the
# run on the host (batches recorded step by step, progress, state); _resume: the plan, checked on resume;
# _releases: the executed noisy updates, counted on the host; _counted: step and noisy_update as
# jitted functions whose direct calls are counted on the host (a program JAX's cache can keep)
from gradclip_jax.dp.private_step._make_private import (
    make_private as make_private,
)
from gradclip_jax.dp.private_step._step import (
    PrivateStepMetrics as PrivateStepMetrics,
)
from gradclip_jax.dp.private_step._training import (
    PrivacyBudgetError as PrivacyBudgetError,
    PrivacyBudgetWarning as PrivacyBudgetWarning,
    PrivateTraining as PrivateTraining,
)

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")
