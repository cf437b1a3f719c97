"""Demo: an MLP on scikit-learn's digits, trained three ways.

Run it with ``python -m gradclip_jax.demo`` (``--help`` lists the flags). It
trains the same small MLP (64-64-10, tanh) on the 8x8 digits images bundled
with scikit-learn (``sklearn.datasets.load_digits``: nothing is downloaded):

1. **none**: ``optax.adam``, no clipping;
2. **global**: ``optax.chain(gcx.clip_by_global_norm(C), optax.adam(...))``;
3. **dp-sgd**: DP-Adam built with :func:`gradclip_jax.make_private`:
   **Poisson-sampled** batches (each training example is in a step's batch
   independently with probability ``q = batch_size / n_train``), padded to one
   fixed size with a mask, per-example clipping with
   :func:`gradclip_jax.clipped_grad`, Gaussian noise once per step, then
   ``optax.adam`` (Adam only post-processes the privatized gradient). The
   noise multiplier is calibrated (PLD accountant) for the target
   ``--epsilon`` at ``delta=1e-5``.

It prints a table (test accuracy, epsilon, time per step, fraction clipped) and
saves a PNG with the training-loss curves and the clip fraction per step (by
default in a new temporary folder, whose path it prints; ``--out PATH`` puts it
elsewhere). The output folder is checked before training, so a bad ``--out``
fails at once.

The global clip norm (0.3) sits near the 70th percentile of this model's batch
gradient norms, so global clipping acts on about a quarter of the steps and its
loss curve visibly departs from the unclipped one. (At 1.0 it would clip under 1%
of the steps, and the two curves would coincide.)

**Accounting.** The epsilon in the table is the one of the steps the DP-SGD run
actually took, read from its :class:`gradclip_jax.PrivacyAccountant`
after training (every step is recorded as its batch is drawn). The batches are
the Poisson-sampled ones the accountant assumes; the padded size is chosen so
that the whole run overflows it with probability below 1e-9, and an overflow
would raise rather than be dropped silently. The non-private runs use
fixed-size slices of a fresh permutation each epoch.

Needs the optional packages scikit-learn, matplotlib and dp-accounting; tqdm is
used for the progress bar when it is installed (a plain text bar otherwise); the
DP-SGD run's bar shows the epsilon spent so far.

The package: ``data`` (the digits split, the MLP), ``training`` (the three runs, :func:`run`),
``progress`` (the bars), ``output`` (the output path's check, the table, the plot) and ``cli``
(:func:`main`, behind ``python -m gradclip_jax.demo``).
"""

from gradclip_jax.demo import (
    training as training,  # the module of run (gradclip_jax.demo.run is the function)
)
from gradclip_jax.demo.cli import main
from gradclip_jax.demo.data import (
    accuracy as accuracy,
    batch_indices as batch_indices,
    init_mlp as init_mlp,
    load_digits_split,
    mlp as mlp,
    per_example_loss as per_example_loss,
)
from gradclip_jax.demo.output import DELTA as DELTA, check_output_path, format_table, plot_results
from gradclip_jax.demo.training import METHODS as METHODS, DemoResult, run

__all__ = [
    "DemoResult",
    "check_output_path",
    "format_table",
    "load_digits_split",
    "main",
    "plot_results",
    "run",
]
