"""Adapters that put gradclip_jax's clipping behind other libraries' interfaces.

* :mod:`gradclip_jax.interop.jax_privacy`: ``clipped_grad``, ``clipped_fun`` and
  ``clip_pytree`` with the signatures and semantics of ``jax_privacy.clipping``
  (jax-privacy 2.0), backed by :func:`gradclip_jax.clipped_grad` (ghost clipping
  where it applies). It needs the ``jax-privacy`` extra
  (``pip install 'gradclip_jax[jax-privacy]'``), so it is not imported here:
  ``from gradclip_jax.interop import jax_privacy``.
* :mod:`gradclip_jax.interop.correlated_noise`: jax-privacy's DP-BandMF execution
  plan (correlated, matrix-factorization noise, its calibration and accounting)
  with these clipped sums inside: ``bandmf_plan`` and ``with_gradclip`` (the same
  extra).
"""

__all__: list[str] = []
