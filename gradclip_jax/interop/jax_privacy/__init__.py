"""jax-privacy 2.0's clipping API (``jax_privacy.clipping``), backed by gradclip_jax.

A drop-in module: replace ``from jax_privacy import clipping`` by
``from gradclip_jax.interop import jax_privacy as clipping`` and
``clipping.clipped_grad``, ``clipping.clipped_fun`` and ``clipping.clip_pytree``
keep jax-privacy 2.0's signatures, return types
(:class:`jax_privacy.clipping.BoundedSensitivityCallable`,
:class:`jax_privacy.clipping.AuxiliaryOutput`) and semantics: ``argnums``,
``batch_argnums``, ``keep_batch_dim``, ``return_values``, ``return_grad_norms``,
``normalize_by``, padding examples (``is_padding_example=``), ``prng_argnum``,
``pre_clipping_transform``, ``rescale_to_unit_norm``, ``dtype``,
``spmd_axis_name`` and ``sensitivity(neighboring_relation)``. The sums of clipped
gradients come from :func:`gradclip_jax.clipped_grad`, by default with
``method='auto'`` (ghost clipping, which never forms per-example gradients, where it
applies); ``clipped_grad(..., method='vmap' | 'ghost')`` picks the method.

jax-privacy's current source (GitHub, ``2.3.0.dev0``) is accepted too: ``l2_clip_norm``
may be a pytree that is a prefix of the clipped tree (per-layer clipping: each subtree
clipped jointly to its norm, on the ghost and vmap paths, sensitivity
``sqrt(sum C_i**2) / normalize_by``, ``sqrt(K) / normalize_by`` rescaled), and
``grid_scale`` rounds each clipped example onto an integer grid (its rule and rounding,
:func:`clip_and_round_to_grid`) for an exact int64 sum of sensitivity ``grid_scale``.
Where the two versions' contracts conflict (``clipped_fun``'s output with ``return_norms``
alone, ``nan_safe`` in ``clipped_fun`` and ``clip_pytree``) the drop-in follows the
jax-privacy installed beside it.

Where the results differ from jax-privacy 2.0's (each keeps the sensitivity bound):

* ``nan_safe=True`` (default): in ``clipped_grad`` an example whose gradient has a NaN
  or inf contributes zero, as in jax-privacy's current source; 2.0.0 zeroes only its
  non-finite elements and clips the rest.
* padding examples get ``grad_norms`` 0 (jax-privacy reports their norms).
* with ``pre_clipping_transform``, ``grad_norms`` are the norms of the transformed
  gradients, the ones clipped (jax-privacy reports the untransformed norms).
* the sums are accumulated in float32 for 16-bit gradients, then cast to their dtype
  (or ``dtype``); ``microbatch_size`` need not divide the batch size.
* arguments are checked when the function is made (or called, for what depends on
  the arguments), and each error names the argument at fault.
* ``clip_pytree`` (and so ``clipped_fun``) stores every output within its bound
  (``clip_norm``, or 1 with ``rescale_to_unit_norm``) in exact arithmetic, rounding
  included: jax-privacy's factor where an exact check proves that it stores within
  the bound (the same bits as jax-privacy's, about half the clipped float32 trees), else
  that factor lowered by the measured excess or a rounding margin. jax-privacy's
  outputs land a few units in the last place above the bound in about half the
  clipped trees, and in rescaled trees whose norm is just below ``clip_norm``. So
  jax-privacy's ``test_clip_pytree_clip_norm_zero_rescale`` fails here: it asks a
  global norm of 1 to 7 places for ``{a: [3, 0], b: [0, 4]}`` divided by its norm,
  which every float32 factor stores either above 1 (0.2, whose 0.6 and 0.8 round up:
  exact norm 1 + 2.4e-8) or at most 0.99999994 (ours: 0.9999998).

Importing this module needs jax-privacy: ``pip install 'gradclip_jax[jax-privacy]'``.
"""

try:
    from jax_privacy.clipping import AuxiliaryOutput, BoundedSensitivityCallable
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "gradclip_jax.interop.jax_privacy needs jax-privacy 2.0 or later: "
        "pip install 'gradclip_jax[jax-privacy]'"
    ) from err

# one file per function (_clip_pytree, _clipped_fun, _clipped_grad) and the arguments the last
# two share (_arguments); each file imports jax_privacy once this check has passed
from gradclip_jax.interop.jax_privacy._clip_pytree import clip_pytree
from gradclip_jax.interop.jax_privacy._clipped_fun import clipped_fun
from gradclip_jax.interop.jax_privacy._clipped_grad import clipped_grad
from gradclip_jax.interop.jax_privacy._grid import clip_and_round_to_grid

__all__ = [
    "AuxiliaryOutput",
    "BoundedSensitivityCallable",
    "clip_and_round_to_grid",
    "clip_pytree",
    "clipped_fun",
    "clipped_grad",
]
