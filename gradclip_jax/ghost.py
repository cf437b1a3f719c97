"""Ghost clipping: per-example gradient norms without per-example gradients.

:func:`gradclip_jax.per_example.clipped_grad` with ``method='ghost'`` (or
``'auto'``) dispatches here. The loss is traced to a jaxpr, and every parameter
leaf is classified by how the loss uses it:

* **dense**: the leaf (possibly cast, transposed or reshaped) is an operand of
  a ``dot_general`` whose other operand ``a`` carries the batch on some free
  axis (``x @ w``, ``jnp.einsum('btd,dp->btp', x, w)``, ``w @ x.T``,
  ``flax.linen.Dense``, ``jax.vmap`` of ``equinox.nn.Linear``). With ``a_b`` of
  shape ``(T, D)`` (``T`` = product of the other free axes, e.g. the sequence)
  and the output cotangent ``g_b`` of shape ``(T, P)``, the per-example gradient
  is :math:`G_b = a_b^\\top g_b` and

  .. math:: \\|G_b\\|_F = \\|a_b\\|_2 \\, \\|g_b\\|_2 \\quad (T = 1), \\qquad
            \\|G_b\\|_F^2 = \\langle a_b a_b^\\top, g_b g_b^\\top \\rangle \\quad (T > 1)

  (Goodfellow 2015; Li et al. 2021, Eq. 3). The Gram form costs
  :math:`O(T^2)` per example and is used when :math:`2T^2 < PD`; otherwise only
  that layer's per-example gradient :math:`a_b^\\top g_b` is formed.
* **embedding**: the leaf is the table of a row lookup ``E[ids]`` /
  ``jnp.take`` / ``flax.linen.Embed`` (a ``gather``) with batched indices. With
  ``ids_b`` of length ``T`` and cotangents ``g_b`` (zeroed for dropped
  out-of-range ids),

  .. math:: \\|G_b\\|_F^2 = \\sum_{t,s} [\\mathrm{ids}_{bt} = \\mathrm{ids}_{bs}]
            \\, \\langle g_{bt}, g_{bs} \\rangle .

* **conv** (the kernel of a ``conv_general_dilated`` on a batched input): with
  :math:`P_b` example ``b``'s input patches ``(T, D)`` and :math:`G_b` its output
  cotangent ``(T, P)``, per group, either the Gram form
  :math:`\\langle P_b P_b^\\top, G_b G_b^\\top\\rangle` (small ``T``) or the
  kernel gradient :math:`P_b^\\top G_b` as batched matmuls (large ``T``), picked
  per layer by cost; the patches are read one kernel tap at a time, never formed.
* **elementwise** (biases, LayerNorm/RMSNorm scales and biases, any
  broadcast parameter added to, subtracted from or multiplied with batched data):
  only that leaf's per-example gradient is formed, by pulling ``g_b`` back
  through that single operation on example ``b``'s operands (the leaf's size per
  example: small for biases and scales).
* **tied** leaves (used several times, e.g. an embedding table reused as the
  output projection, ``flax`` ``Embed.attend``, or one matrix applied twice):
  the norm of the *sum* of the uses' gradients, cross terms included. When the
  leaf is a matrix and every use is a dense product or a row lookup (through
  casts and transposes), each use is a sum of outer products
  :math:`G_{b,i} = \\sum_t x_{bit} \\otimes y_{bit}` (activation and cotangent
  rows; one-hot rows for a lookup) and

  .. math:: \\Big\\|\\sum_i G_{b,i}\\Big\\|_F^2 = \\sum_{i,j} \\sum_{t,s}
            \\langle x_{bit}, x_{bjs}\\rangle \\langle y_{bit}, y_{bjs}\\rangle ,

  which never forms anything of the table's size (used when it is cheaper:
  :math:`(\\sum_i T_i)^2 (V + d) < (\\sum_i T_i) V d`). Otherwise (and for
  other uses with the batch on axis 0) each use's per-example gradient is formed
  as for ``conv`` and they are summed before the norm.
* **stacked** leaves (layers stacked on a leading axis and run by
  ``lax.scan``, ``flax.linen.scan``, ``nnx.scan``): each use reads a disjoint
  block of the leaf (one layer's weights), so
  :math:`\\|G_b\\|_F^2 = \\sum_l \\|G_{b,l}\\|_F^2` with each block measured by its
  use's rule above.
* anything else (a leaf used through ``sin``, inside a ``cond`` or a ``while``,
  a scan longer than :data:`gradclip_jax.per_example.ghost._jaxpr.MAX_UNROLL`
  steps, ...) **falls back**: that leaf's per-example gradients are materialized
  with ``jax.vmap(jax.grad)`` (all other leaves held fixed), exactly as
  ``method='vmap'`` does. :func:`ghost_report` lists each leaf's kind or reason,
  and :class:`GhostFallbackWarning` says once which leaves fell back and at which
  primitive (silent when ``method='auto'`` finds the model too small for ghost
  clipping anyway).

Nested ``jit`` calls (``jnp.take``, ``jax.nn.log_softmax``, ...) and
``jax.checkpoint`` blocks are inlined, and scans that read a parameter (at most
128 steps) unrolled, before the analysis, so models written with flax or
equinox work unchanged. ``jnp.split``, ``concatenate``, reshapes, transposes
and slices along any axis but the batch's keep the ghost path (a fused qkv
projection is one dense site). A table looked up at constant positions (a
position embedding, ``wpe[jnp.arange(T)]``) and added to every example is an
elementwise use of the table; ``custom_jvp``/``custom_vjp`` functions of
activations (``jax.nn.relu``, ``jax.nn.dot_product_attention``) are followed
through their primal. On the ghost path a ``jax.checkpoint`` block is not
rematerialized (its activations are needed for the norms).

The cotangents ``g`` come from *one* backward pass: a zero "probe" is added to
the output of every recognised operation, and ``jax.vjp`` of the per-example
losses with respect to the probes, with cotangent ``ones(B)``, gives every
example's cotangent at once, because example ``b``'s loss depends only on row
``b`` (checked, see below). The per-example norm is
:math:`\\|g_b\\| = \\sqrt{\\sum_l \\|G_{b,l}\\|^2}` (the norm of the per-leaf norms,
combined as in the vmap path). The clipped sum, with
:math:`c_b = \\min(1, C / \\|g_b\\|)` (or :math:`C / (\\|g_b\\| + \\gamma)` with
``normalize=True``) held constant, is formed one of two ways (``ghost_sum``):

* ``'backward'``: a **second backward pass** on the reweighted loss,

  .. math:: \\nabla_\\theta \\sum_b c_b \\, \\ell_b(\\theta) = \\sum_b c_b \\nabla_\\theta
            \\ell_b(\\theta) .

  Each cotangent lives only while it is used, so peak memory stays close to a
  non-private step (1.2x on the benchmark MLP).
* ``'bookkeeping'``: from what pass 1 kept (Bu et al. 2023): per dense use
  :math:`\\sum_b c_b a_b^\\top g_b = a^\\top \\mathrm{diag}(c)\\, g`, the pull-back of
  :math:`c_b g_b` through that one operation (and weighted row sums for the
  leaves whose per-example gradients were formed). No second backward pass,
  so it costs about one non-private step plus the norms, but every layer's
  output cotangent is held at once (about 2x a non-private step's temporary
  memory on the benchmark MLP, 1.0x on the benchmark transformer). Per-layer
  clipping always uses it, because each leaf has its own factors.
* ``'auto'`` (default): book-keeping when the output cotangents it holds are at
  most :data:`BOOKKEEPING_MAX_SHARE` of the elements of the loss's batched
  intermediates (a static proxy for the activations; true of transformers,
  whose norms, attention and nonlinearities dominate), else the second pass.

16-bit (bfloat16, float16) parameters or activations take the ghost path
too. The norms accumulate in float32 (every rule widens the operands and
cotangents it reads), and the sum is always book-kept in float32: each site's
operation is evaluated on its 16-bit operands and the reweighted cotangent
:math:`c_b g_b`, all widened to float32, at full precision, so example ``b``
adds :math:`c_b a_b^\top g_b` to float32 rounding, the very gradient whose norm
was measured (per-example gradients that are formed, for biases, scales,
kernels and fallback leaves, are float32 rows or the 16-bit rows the vmap path
forms, summed in float32). The operands and cotangents both read are pinned
behind an optimization barrier, so XLA cannot round them for one consumer and
keep them in excess precision for the other. The sums are float32, as on the
vmap path, and each example's contribution stays within :math:`C` with the
float32 stored-bound margin. ``ghost_sum='backward'`` raises ``ValueError``
there: a second backward pass would carry :math:`c_b g_b` in 16 bits, and
each rounding (up to ``2**-9`` relative in bfloat16) could take the
contribution's norm above :math:`C`.

Soundness: ghost norms are only valid if example ``b``'s loss depends on row
``b`` of the batch alone. The analysis propagates a "row-wise" property through
the jaxpr (elementwise ops, dot_general, reductions and reshapes that keep axis
0, gathers, convolutions, pooling, nested calls, ...); a loss that mixes
examples (batch norm, a mean over the batch) or uses an operation the analysis
does not know on batched data is computed entirely by the vmap path.

Differences from ``method='vmap'`` (documented, by design): norms and sums agree
to float rounding (the sum is accumulated by autodiff in the parameter dtype,
then cast to the accumulation dtype); an example whose norm does not fit in the
dtype (finite elements, norm above ~3.4e38 in float32) is treated as non-finite
(dropped with ``nan_safe``) instead of being clipped with the vmap path's upper
bound; with 16-bit parameters the ghost path forms each per-example gradient
from the 16-bit activations and cotangents in float32, the vmap path in the
model's 16 bits (the norms and sums agree to a few units of 16-bit rounding);
a loss that reads the batch size as a number (``x.shape[0]``) sees ``B`` here
and 1 in the vmap path (per-example losses should not do that).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from gradclip_jax.per_example import clipped_grad
  >>> def loss(p, x):  # per-example losses, shape (B,)
  ...     return jnp.sum(jnp.tanh(x @ p['w'] + p['b']), axis=-1)
  >>> params = {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}
  >>> x = jnp.arange(12.0).reshape(4, 3) / 10
  >>> g_ghost, info = jax.jit(clipped_grad(loss, 1.0, method='ghost'))(params, x)
  >>> g_vmap, _ = clipped_grad(loss, 1.0, method='vmap')(params, x)
  >>> bool(jnp.allclose(g_ghost['w'], g_vmap['w'], rtol=1e-5)), info.norms.shape
  (True, (4,))
"""

from gradclip_jax.per_example.ghost import (
    AUTO_MIN_ELEMENTS,
    BOOKKEEPING_MAX_SHARE,
    GhostFallbackWarning,
    GhostReport,
    ghost_report,
)

__all__ = ["AUTO_MIN_ELEMENTS", "BOOKKEEPING_MAX_SHARE", "GhostFallbackWarning", "GhostReport", "ghost_report"]
