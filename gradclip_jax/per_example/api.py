"""The public entry point: :func:`clipped_grad` validates its arguments into a
frozen :class:`~gradclip_jax.per_example._config.ClipConfig`, picks a strategy
(vmap or ghost) and returns a :class:`ClippedGradFn`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from gradclip_jax._core import jaxcompat as jc
from gradclip_jax._core.validation import (
    check_int,
    check_scalar,
    check_sum_dtype,
    clip_norm_arg,
    is_traced,
    static_value,
)
from gradclip_jax.per_example._batch import (
    BATCHNORM_REMEDY,
    batchnorm_in_loss,
    check_one_example,
    prepare_call,
)
from gradclip_jax.per_example._config import (
    ClipConfig,
    ClippedGradFn,
    ClippedGradInfo,
    GhostSum,
    LayerMode,
    Method,
)
from gradclip_jax.per_example._keys import split_key_arg
from gradclip_jax.per_example._on_device import check_loss_on_device
from gradclip_jax.per_example._optax_compat import (  # the top level's public door to them
    per_example_global_norm_clip as per_example_global_norm_clip,
    per_example_layer_norm_clip as per_example_layer_norm_clip,
    per_example_norms as per_example_norms,
)
from gradclip_jax.per_example._vmap import run_vmap
from gradclip_jax.per_example.ghost._strategy import run_ghost

__all__: list[str] = []  # every name here has its home elsewhere (CONTRIBUTING.md, "Import paths")

_FN = "clipped_grad"


def _tree_is_scalar(x: Any) -> bool:
    if callable(x):
        return False
    leaves = jax.tree_util.tree_leaves(x)
    if len(leaves) != 1 or leaves[0] is not x:
        return False
    return np.ndim(x) == 0 or (hasattr(x, "shape") and math.prod(x.shape) == 1)


def _enum(cls: Any, name: str, value: Any, expected: str) -> Any:
    value = static_value(_FN, name, value)
    try:
        return cls(value)
    except (ValueError, TypeError):
        raise ValueError(f"{_FN}: unknown {name} {value!r}; expected {expected}") from None


def _microbatch_size(mb: Any) -> int | None:
    mb = static_value(_FN, "microbatch_size", mb)
    return None if mb is None else check_int(_FN, "microbatch_size", mb, 1)


def _layer_mode(l2_clip_norm: Any, per_layer: Any) -> LayerMode:
    """The clip-norm layout; checks every clip norm."""
    per_layer = static_value(_FN, "per_layer", per_layer)
    if per_layer not in (False, True, "uniform", "size"):
        raise ValueError(
            f"{_FN}: per_layer must be False, True, 'uniform' or 'size', got {per_layer!r}"
        )
    if _tree_is_scalar(l2_clip_norm):
        check_scalar(_FN, "l2_clip_norm", l2_clip_norm)
        return {
            False: LayerMode.GLOBAL,
            True: LayerMode.UNIFORM,
            "uniform": LayerMode.UNIFORM,
            "size": LayerMode.SIZE,
        }[per_layer]
    if not jax.tree_util.tree_leaves(l2_clip_norm):
        raise ValueError(f"{_FN}: l2_clip_norm is an empty tree")
    if per_layer is not False:  # (it would be ignored: the tree gives each subtree its norm)
        raise ValueError(
            f"{_FN}: per_layer={per_layer!r} with a tree of clip norms: the tree already gives "
            "each leaf (or subtree) its own clip norm; pass per_layer=False, or one clip norm"
        )
    for path, c in jax.tree_util.tree_flatten_with_path(l2_clip_norm)[0]:
        check_scalar(_FN, f"l2_clip_norm{jax.tree_util.keystr(path)}", c)
    return LayerMode.TREE


def _grad_fn(config: ClipConfig) -> Callable[..., tuple[Any, ClippedGradInfo]]:
    """The strategy for ``config.method``: ghost (which falls back to vmap by itself) or vmap."""

    def grad_fn(
        params: Any, batch: Any, *args: Any, mask: Any = None
    ) -> tuple[Any, ClippedGradInfo]:
        cfg = config
        if config.prng_argnum is not None:
            loss, batch, args = split_key_arg(
                config.loss_fn, config.prng_argnum, config.has_aux, batch, args, config.fn
            )
            cfg = dataclasses.replace(config, loss_fn=loss)
        call = prepare_call(params, batch, args, mask, cfg.fn)
        run = run_vmap if cfg.method is Method.VMAP else run_ghost
        try:
            # arrays on an explicit mesh, outside jax.set_mesh: JAX's vmap of a sharded batch
            # (the ghost path's per-row gradients) needs that mesh in context
            with jc.mesh_context_of(call.batch):
                check_loss_on_device(cfg.fn, cfg.loss_fn, cfg.has_aux, call)
                return run(cfg, call)
        except ValueError as err:
            if "combines examples at" in str(
                err
            ):  # the batch-crossing check: a BatchNorm's statistics?
                layer = batchnorm_in_loss(cfg.loss_fn, call.params, call.batch, call.args)
                if layer is not None:
                    raise ValueError(
                        f"{cfg.fn}: loss_fn combines examples in BatchNorm layer {layer!r}; {BATCHNORM_REMEDY}"
                    ) from err
            if str(err).startswith(f"{cfg.fn}:"):
                raise  # our own checks: already name the argument or leaf
            check_one_example(cfg.fn, cfg.loss_fn, cfg.has_aux, call.params, call.batch, call.args)
            raise
        except Exception:
            # Diagnosed only on failure: a check up front would trace the loss once
            # more on every call. Raises a ValueError stating the per-example
            # contract when the loss cannot run on one example; else the original.
            check_one_example(cfg.fn, cfg.loss_fn, cfg.has_aux, call.params, call.batch, call.args)
            raise

    return grad_fn


def _prng_argnum(n: Any) -> int | None:
    n = static_value(_FN, "prng_argnum", n)
    if n is None:
        return None
    n = check_int(_FN, "prng_argnum", n)
    if n < 2:
        raise ValueError(
            f"{_FN}: prng_argnum={n} names loss_fn's argument {n}, but arguments 0 and 1 are params and "
            "the batch; the key must be one of the extra arguments (prng_argnum >= 2)"
        )
    return n


def _dtype(d: Any) -> Any:
    if d is None:
        return None
    try:
        dt = np.dtype(d)
    except TypeError:
        raise TypeError(f"{_FN}: dtype must be None or a floating-point dtype, got {d!r}") from None
    if not np.issubdtype(dt, np.floating) and dt != np.dtype(jax.numpy.bfloat16):
        raise ValueError(f"{_FN}: dtype must be a floating-point dtype, got {dt}")
    check_sum_dtype(_FN, dt)
    return dt


def _method(method: Any, transform: Any) -> Method:
    m = _enum(Method, "method", method, "'vmap', 'ghost' or 'auto'")
    if transform is None:
        return m  # type: ignore[no-any-return]
    if not callable(transform):
        raise TypeError(
            f"{_FN}: pre_clipping_transform must be callable or None, got {transform!r}"
        )
    if m is Method.GHOST:
        raise ValueError(
            f"{_FN}: pre_clipping_transform needs each example's gradient, which method='ghost' never "
            "forms (it measures norms from activations); use method='vmap' or 'auto' (which then uses vmap)"
        )
    return Method.VMAP


def clipped_grad(
    loss_fn: Callable[..., Any],
    l2_clip_norm: Any = None,
    *,
    has_aux: bool = False,
    microbatch_size: int | None = None,
    method: str = "auto",
    per_layer: bool | str = False,
    normalize: bool = False,
    gamma: float = 0.01,
    nan_safe: bool = True,
    spmd_axis_name: Any = None,
    ghost_sum: str = "auto",
    prng_argnum: int | None = None,
    pre_clipping_transform: Callable[[Any], Any] | None = None,
    rescale_to_unit_norm: bool = False,
    dtype: Any = None,
    l2_norm_clip: Any = None,
) -> ClippedGradFn:
    """A function computing the sum of clipped per-example gradients of ``loss_fn``.

    **Contract:** ``loss_fn(params, batch, *args)`` must return the per-example
    losses :math:`\\ell_i` of shape ``(B,)`` (or ``(losses, aux)`` with
    ``has_aux``), each computed from its own example alone: it is called on
    batches of one example, so it must not close over arrays of length ``B`` nor
    use statistics of the whole batch (batch norm in training mode). The call
    traces the loss once on the whole batch and raises ``ValueError`` stating
    this contract when the loss certainly combines examples (a reduction,
    cumulative sum, contraction or scan over the batch axis; an outer product,
    sort or top-k across it); when the loss
    fails on a one-example batch, the error states the contract too. The
    returned ``grad_fn(params, batch, *args, mask=None)`` gives ``(grads, info)``:

    .. math:: \\text{grads} = \\sum_{i:\\ \\text{mask}_i} g_i \\cdot f_i, \\qquad
        g_i = \\nabla_{\\theta}\\, \\ell_i(\\theta), \\qquad
        f_i = \\begin{cases} \\min(1, C/\\|g_i\\|_2) & \\text{(clipping, default)} \\\\
        C / (\\|g_i\\|_2 + \\gamma) & \\text{(normalize=True: automatic clipping)} \\end{cases}

    a tree shaped like ``params`` (in the accumulation dtype: float32 for 16-bit
    params), so :math:`\\|g_i f_i\\|_2 \\le C` and ``grad_fn.sensitivity()`` is
    :math:`C` for add/remove neighbours (:math:`2C` for replace-one). Add noise
    of standard deviation ``z * grad_fn.sensitivity()`` and divide by the
    (expected) batch size to get a DP-SGD gradient (see
    :func:`gradclip_jax.dp_noise`).

    How it runs (``method='vmap'``; for ``'ghost'``, see :mod:`gradclip_jax.per_example.ghost`): each example
    is passed to ``loss_fn`` as a batch of one (leaves of shape ``(1, ...)``),
    ``jax.vmap(jax.value_and_grad(...))`` materializes the per-example gradients of a
    chunk of examples once, as one row per example, the norm engine measures the
    rows, and the clip and the sum are one ``dot_general`` of the clip factors with
    the rows (no second copy of the per-example gradients; a ``lax.cond`` takes a
    slower, memory-light path only when a dropped example holds NaN or inf).
    With ``microbatch_size=m`` the batch is cut into
    :math:`\\lceil B/m \\rceil` chunks of ``m`` examples run one after another in a
    ``lax.scan`` (the last one padded and masked): peak memory scales with ``m``,
    and the result is the same as without chunks up to float rounding. Chunks
    take every :math:`\\lceil B/m\\rceil`-th example, so a batch sharded over
    devices keeps every device busy in every chunk.

    Args:
      loss_fn: ``loss_fn(params, batch, *args) -> losses`` with ``losses`` of shape
        ``(B,)``, or ``(losses, aux)`` when ``has_aux``. ``batch`` is any pytree
        whose leaves carry the batch on axis 0; ``args`` are shared by all
        examples (they are not split).
      l2_clip_norm: the clip norm :math:`C \\ge 0` (number or array, traced
        too), or a pytree of per-layer clip norms whose structure is ``params``'
        or a prefix of it (per-layer clipping: the leaf or subtree :math:`l` of
        every example that clip norm :math:`C_l` covers is clipped jointly to
        :math:`C_l`, and the sensitivity is :math:`\\sqrt{\\sum_l C_l^2}`;
        jax-privacy's layout).
      has_aux: ``loss_fn`` returns ``(losses, aux)``. ``info.aux`` stacks the aux
        of each example over the batch: a leaf that has a leading axis of size 1
        for a one-example batch (a per-example output) comes back with shape
        ``(B, ...)``, exactly as ``loss_fn`` on the whole batch would return it;
        any other leaf gets a new leading axis of size ``B``.
      microbatch_size: ``None`` (default: one vmap over the whole batch) or a
        positive int, the number of examples per sequential chunk.
      method: ``'vmap'``; ``'ghost'`` (per-example norms from activations and
        output cotangents, then the clipped sum (see ``ghost_sum``); leaves the analysis
        does not recognise fall back to vmap; see :mod:`gradclip_jax.per_example.ghost`);
        ``'auto'`` (default): ghost when the ghost-measurable per-example
        gradients would be large (``ghost.AUTO_MIN_ELEMENTS``), or, with no
        leaf falling back, not tiny (``ghost.AUTO_MIN_ELEMENTS_NO_FALLBACK``)
        and at least the output cotangents the ghost norms read; else vmap
        (``ghost_report(...).auto`` says which and why).
        16-bit parameters and activations take the ghost path too (norms and
        sums in float32, see ``ghost_sum``).
      per_layer: ``False`` (default) clips each example's global norm. ``True`` or
        ``'uniform'`` clips each leaf of each example to :math:`C/\\sqrt{K}` (K
        leaves, optax's uniform rule); ``'size'`` to :math:`C\\sqrt{D_l/D}` (by
        parameter count). Either way the sensitivity stays :math:`C`.
      normalize: automatic clipping (Bu et al. 2022, AUTO-S): scale every example
        by :math:`C/(\\|g_i\\|+\\gamma)` instead of clipping. Contributions have
        norm :math:`C\\|g_i\\|/(\\|g_i\\|+\\gamma) < C`.
      gamma: the stability constant :math:`\\gamma \\ge 0` of ``normalize``
        (default 0.01, as fastDP).
      nan_safe: (default ``True``) an example whose gradient has a NaN or inf
        contributes zero, so the sensitivity bound holds whatever the data; its
        ``info.norms`` entry shows the non-finite norm. With ``False`` it
        propagates into the sum.
      spmd_axis_name: passed to ``jax.vmap`` (for ``shard_map``/``pmap`` setups).
      ghost_sum: how the ghost path forms the clipped sum once the norms are
        known. ``'backward'``: a second backward pass on the loss reweighted by
        the clip factors (each layer's output cotangent lives only while it is
        used, as in a non-private step). ``'bookkeeping'``: reuse the stored
        activations and output cotangents, :math:`\\sum_b c_b a_b^\\top g_b`
        per layer (no second backward pass: faster, but every layer's output
        cotangent is held at once). ``'auto'`` (default): book-keeping when
        those cotangents are a small share of the loss's activations
        (``ghost.BOOKKEEPING_MAX_SHARE``; transformers), else the second pass
        (plain MLPs). Book-kept sums are formed in float32 at full precision
        (``Precision.HIGHEST``), from the very values whose norms were measured.
        Per-layer clipping, 16-bit (bf16, fp16) parameters or activations, and
        backends whose float32 products default to reduced precision (TF32 on
        NVIDIA GPUs, bfloat16 passes on TPUs, unless
        ``jax_default_matmul_precision`` is ``'float32'``) always use
        book-keeping; an explicit ``'backward'`` there raises ``ValueError``
        (its second pass would round each clipped contribution at that
        precision, so its norm could exceed the clip norm). Ignored by
        ``method='vmap'``.
      prng_argnum: ``None`` (default) or the position ``k >= 2`` of a PRNG key
        among ``loss_fn``'s arguments (params is 0, the batch 1; as
        jax-privacy). The key is split with ``jax.random.split(key, B)`` and
        example ``i`` receives key ``i`` in its place (per-example dropout and
        augmentation), on every path and whatever ``microbatch_size``.
      pre_clipping_transform: ``None`` or a function applied to each example's
        gradient before it is measured and clipped (a projection, per-layer
        scaling, dropping leaves); the sum has its output's structure and the
        sensitivity is unchanged. Needs per-example gradients: ``method='ghost'``
        raises ``ValueError``, ``'auto'`` uses vmap.
      rescale_to_unit_norm: divide the sum by the clip norm (the whole example's),
        so ``grad_fn.sensitivity()`` is 1 (De et al. 2022's decoupling of the clip
        norm from the learning rate).
      dtype: ``None`` (default: each leaf's accumulation dtype, float32 for
        16-bit params) or the floating-point dtype of the returned sums, 32 bits
        at least (a sum rounded to 16 bits before the noise moves by more than
        one example's clip norm: ``ValueError``); the running sum over
        microbatches is kept in the wider of the two.
      l2_norm_clip: optax's spelling of ``l2_clip_norm`` (the canonical one),
        accepted without a warning; give one of the two.

    Each example's clipped contribution, as returned (in ``dtype``), has norm at
    most the clip norm, rounding included: a factor below 1 is lowered by a few
    units in the last place of the output dtype.

    Returns:
      A :class:`ClippedGradFn`, called as
      ``grad_fn(params, batch, *args, mask=None) -> (grads, info)``
      with ``info`` a :class:`ClippedGradInfo`, and
      ``grad_fn.sensitivity(relation='add_or_remove')``. ``mask`` is an optional
      ``(B,)`` bool array: examples where it is False (padding) contribute
      nothing, are not counted and get norm 0 in ``info``.

    Raises:
      TypeError: a non-callable ``loss_fn`` or ``pre_clipping_transform``, a
        non-int ``prng_argnum``, a missing clip norm or both of its spellings, a
        key argument that is not a PRNG key.
      ValueError: at construction for a negative / NaN clip norm, a bad
        ``microbatch_size``, ``gamma`` or ``method``; at call time, naming the leaf
        or argument, for batch leaves without a batch axis or with different
        batch sizes, a loss that is not of shape ``(B,)`` or that combines
        examples, a bad ``mask``, a per-layer clip-norm tree that is not a
        prefix of ``params``, or ``ghost_sum='backward'`` (with ``method='ghost'``
        or ``'auto'``) for 16-bit parameters or activations or on a backend whose
        float32 products default to reduced precision.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gradclip_jax import clipped_grad
      >>> def loss_fn(w, batch):  # per-example squared errors, shape (B,)
      ...     return 0.5 * jnp.sum((batch['x'] * w - batch['y']) ** 2, axis=-1)
      >>> grad_fn = clipped_grad(loss_fn, 1.0)
      >>> batch = {'x': jnp.ones((3, 1)), 'y': jnp.array([[0.5], [-3.0], [0.0]])}
      >>> grads, info = jax.jit(grad_fn)(jnp.zeros(1), batch)
      >>> grads  # -0.5 + 1 (clipped from 3) + 0
      Array([0.5], dtype=float32)
      >>> info.norms, info.num_clipped, grad_fn.sensitivity('replace')
      (Array([0.5, 3. , 0. ], dtype=float32), Array(1, dtype=int32), 2.0)
    """
    if not callable(loss_fn):
        raise TypeError(f"{_FN}: loss_fn must be callable, got {loss_fn!r}")
    l2_clip_norm = clip_norm_arg(_FN, l2_clip_norm, l2_norm_clip)
    check_scalar(_FN, "gamma", gamma)
    layer_mode = _layer_mode(l2_clip_norm, per_layer)
    rescale = bool(static_value(_FN, "rescale_to_unit_norm", rescale_to_unit_norm))
    if (
        rescale
        and layer_mode is not LayerMode.TREE
        and not is_traced(l2_clip_norm)
        and float(np.asarray(l2_clip_norm).reshape(())) == 0.0
    ):
        raise ValueError(f"{_FN}: rescale_to_unit_norm=True divides by l2_clip_norm, which is 0")
    config = ClipConfig(
        loss_fn=loss_fn,
        l2_clip_norm=l2_clip_norm,
        method=_method(method, pre_clipping_transform),
        microbatch_size=_microbatch_size(microbatch_size),
        layer_mode=layer_mode,
        normalize=bool(static_value(_FN, "normalize", normalize)),
        gamma=gamma,
        has_aux=bool(static_value(_FN, "has_aux", has_aux)),
        nan_safe=bool(static_value(_FN, "nan_safe", nan_safe)),
        spmd_axis_name=spmd_axis_name,
        ghost_sum=_enum(GhostSum, "ghost_sum", ghost_sum, "'auto', 'backward' or 'bookkeeping'"),
        prng_argnum=_prng_argnum(prng_argnum),
        pre_clipping_transform=pre_clipping_transform,
        rescale_to_unit_norm=rescale,
        dtype=_dtype(dtype),
    )
    return ClippedGradFn(_grad_fn(config), clipped_grad.__doc__ or "", config)
