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

* **elementwise** (biases, LayerNorm/RMSNorm scales and biases, any
  broadcast parameter added to, subtracted from or multiplied with batched data)
  and **conv** (the kernel of a ``conv_general_dilated`` on a batched input):
  only that leaf's per-example gradient is formed, by pulling ``g_b`` back
  through that single operation on example ``b``'s operands (the leaf's size per
  example: small for biases, scales and kernels).
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
* anything else (a leaf used through ``sin``, inside a ``scan``/``cond``, ...)
  **falls back**: that leaf's per-example gradients are materialized with
  ``jax.vmap(jax.grad)`` (all other leaves held fixed), exactly as
  ``method='vmap'`` does. :func:`ghost_report` lists each leaf's kind or reason.

Nested ``jit`` calls (``jnp.take``, ``jax.nn.log_softmax``, ...) are inlined
before the analysis, so models written with flax or equinox work unchanged.

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
bound; 16-bit parameters use the vmap path (both ways of forming the sum would
round each clipped contribution in 16 bits);
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

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as _jcore

from gradclip_jax import norms as _norms
from gradclip_jax import per_example as _pe

__all__ = ["GhostReport", "ghost_report", "make_ghost_impl"]

# A value's state: an int ``k`` (it carries the batch on axis ``k``, one example
# per slice, computed from that example alone), _CONST (does not depend on the
# batch) or _MIXED (anything else). _ROW is the batch on axis 0.
_ROW, _CONST, _MIXED = 0, "const", "mixed"
State = int | str

# Operations applied to a parameter that keep the gradient's norm: the gradient
# with respect to the parameter is a permutation/reshape/cast of the gradient with
# respect to the result.
_NORM_KEEPING = frozenset({"convert_element_type", "transpose", "reshape", "squeeze", "copy", "copy_p"})
# Operations allowed between a parameter and an elementwise use (bias broadcasting).
_CHAIN = _NORM_KEEPING | {"broadcast_in_dim"}

_ELEMENTWISE = frozenset(
    [
        "add", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "sign", "floor", "ceil",
        "round", "is_finite", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
        "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt",
        "rsqrt", "cbrt", "abs", "integer_pow", "square", "erf", "erfc", "erf_inv", "lgamma", "digamma",
        "igamma", "select_n", "clamp", "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge",
        "and", "or", "not", "xor", "stop_gradient", "nextafter", "reduce_precision", "copy", "copy_p",
        "real", "imag", "conj", "shift_left", "shift_right_logical", "shift_right_arithmetic",
        "population_count", "bessel_i0e", "bessel_i1e", "random_gamma_grad", "add_any",
    ]
)
_REDUCE_AXES = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
     "reduce_xor", "argmax", "argmin"}
)
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Call-like primitives whose sub-jaxpr runs once on the equation's operands (not
# loops or conditionals: a scan over a batched axis would run over examples).
_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
     "custom_vjp_call_jaxpr", "remat", "checkpoint", "remat2"}
)


# ----------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------


@dataclass
class _Site:
    """A recognised use of one parameter leaf (by the top-level equation ``eqn``)."""

    kind: str  # 'dense' | 'elementwise' | 'embedding' | 'conv'
    leaf: int  # index into the flattened params
    eqn: int
    pos: int  # operand position of the parameter (after its chain)
    chain: list[int]  # top-level equations from the parameter to the operand
    rows: tuple[int, ...] = ()  # operand positions carrying the batch on axis 0
    axis: int = 0  # dense: the batch axis of the batched operand (the others: 0)
    out_axis: int = 0  # the batch axis of the operation's output


@dataclass
class _Plan:
    row_wise: bool
    sites: list[_Site]
    ghost: set[int]  # leaf indices (flattened params) measured without materializing
    reasons: dict[int, str] = field(default_factory=dict)  # fallback leaf -> why
    act_elems: int = 0  # elements of the batched intermediates of the loss (a proxy for activations)

    def ct_elems(self, jaxpr: Any) -> int:
        """Elements of the site output cotangents that book-keeping holds at once."""
        return sum(math.prod(_shape(jaxpr.eqns[s.eqn].outvars[0])) for s in self.sites)


class GhostReport(tuple):
    """Which parameter leaves ghost clipping measures directly.

    A pair ``(ghost, fallback)``: ``ghost`` lists ``(path, kind)`` for leaves whose
    per-example norms come from activations (``kind`` is ``'dense'``,
    ``'elementwise'``, ``'embedding'`` or ``'unused'``); ``fallback`` lists
    ``(path, reason)`` for leaves whose per-example gradients are materialized.
    """

    __slots__ = ()

    @property
    def ghost(self) -> list[tuple[str, str]]:
        return self[0]  # type: ignore[no-any-return]

    @property
    def fallback(self) -> list[tuple[str, str]]:
        return self[1]  # type: ignore[no-any-return]


def _sub_jaxpr(eqn: Any) -> Any | None:
    """The (closed or open) jaxpr a call-like equation runs on its operands, if any."""
    for name in _CALL_PARAMS:
        j = eqn.params.get(name)
        if j is not None and (hasattr(j, "eqns") or hasattr(j, "jaxpr")):
            return j
    return None


def _open(j: Any) -> tuple[Any, list[Any] | None]:
    """``(jaxpr, consts)`` of a ClosedJaxpr, or ``(jaxpr, None)`` of an open one."""
    if hasattr(j, "jaxpr") and hasattr(j, "consts"):
        return j.jaxpr, list(j.consts)
    return j, None


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _row_rule(eqn: Any, states: list[State], bsize: int) -> list[State]:
    """Output states of one equation given its input states (row-wise propagation)."""
    n_out = len(eqn.outvars)
    if all(s == _CONST for s in states):
        return [_CONST] * n_out
    if any(s == _MIXED for s in states):
        return [_MIXED] * n_out
    name = eqn.primitive.name
    p = eqn.params
    ins = [_shape(v) for v in eqn.invars]
    outs = [_shape(v) for v in eqn.outvars]
    ok_out = all(len(o) >= 1 and o[0] == bsize for o in outs)
    rows = [i for i, s in enumerate(states) if isinstance(s, int)]
    axes = {states[i] for i in rows}

    def res(ok: bool) -> list[State]:
        return [_ROW if (ok and ok_out) else _MIXED] * n_out

    def res_at(k: Any) -> list[State]:
        k = int(k)  # params may hold numpy integers
        ok = all(0 <= k < len(o) and o[k] == bsize for o in outs)
        return [k if ok else _MIXED] * n_out

    # Rules that follow the batch axis wherever it is (vmapped libraries such as
    # equinox compute `W @ x`, which puts it on axis 1, then transpose it back).
    k0 = int(next(iter(axes))) if len(axes) == 1 else None
    if name in _ELEMENTWISE:
        if k0 is None or not all(len(ins[i]) == len(outs[0]) for i in rows):
            return [_MIXED] * n_out
        return res_at(k0)
    if name == "transpose" and k0 is not None:
        return res_at(tuple(p["permutation"]).index(k0))
    if name == "broadcast_in_dim" and k0 is not None and states[0] == k0:
        return res_at(tuple(p["broadcast_dimensions"])[k0])
    if name in _REDUCE_AXES and k0 is not None:
        red = tuple(p["axes"])
        return [_MIXED] * n_out if k0 in red else res_at(k0 - sum(a < k0 for a in red))
    if name == "squeeze" and k0 is not None:
        sq = tuple(p["dimensions"])
        return [_MIXED] * n_out if k0 in sq else res_at(k0 - sum(a < k0 for a in sq))
    if name in _CUMULATIVE and k0 is not None:
        return [_MIXED] * n_out if p["axis"] == k0 else res_at(k0)
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lfree = [d for d in range(len(ins[0])) if d not in lc and d not in lb]
        rfree = [d for d in range(len(ins[1])) if d not in rc and d not in rb]
        sl, sr = states[0], states[1]
        if isinstance(sl, int) and sr == _CONST and sl in lfree:
            return res_at(len(lb) + lfree.index(sl))
        if sl == _CONST and isinstance(sr, int) and sr in rfree:
            return res_at(len(lb) + len(lfree) + rfree.index(sr))
        if isinstance(sl, int) and isinstance(sr, int) and sl in lb and sr in rb:
            i = tuple(lb).index(sl)
            return res_at(i) if tuple(rb)[i] == sr else [_MIXED] * n_out
        return [_MIXED] * n_out
    sub = _sub_jaxpr(eqn) if name in _CALLS else None
    if sub is not None:
        jaxpr, _ = _open(sub)
        if len(jaxpr.invars) != len(states):
            return [_MIXED] * n_out
        return _row_states(jaxpr, states, bsize)
    if axes != {0}:
        return [_MIXED] * n_out

    if name == "reshape":
        return res(p.get("dimensions") is None)
    if name == "concatenate":
        return res(p["dimension"] != 0)
    if name == "slice":
        strides = p.get("strides")
        return res(
            p["start_indices"][0] == 0 and p["limit_indices"][0] == bsize
            and (strides is None or strides[0] == 1)
        )
    if name == "pad":
        return res(states[0] == _ROW and tuple(p["padding_config"][0]) == (0, 0, 0))
    if name == "dynamic_slice":
        return res(states[0] == _ROW and all(s == _CONST for s in states[1:]) and p["slice_sizes"][0] == bsize)
    if name == "gather":
        dn = p["dimension_numbers"]
        if 0 in tuple(dn.offset_dims) and states[1] == _ROW:
            return [_MIXED] * n_out
        if states[1] == _ROW:  # batched indices
            if len(ins[1]) < 2:
                return [_MIXED] * n_out
            if states[0] == _ROW:
                ob, sb = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
                return res(0 in ob and sb[ob.index(0)] == 0)
            return res(True)
        # batched operand, constant indices: the whole batch axis must be sliced through
        return res(
            0 not in tuple(dn.start_index_map) and 0 not in tuple(dn.collapsed_slice_dims)
            and p["slice_sizes"][0] == bsize and len(dn.offset_dims) > 0 and dn.offset_dims[0] == 0
            and not tuple(dn.operand_batching_dims)
        )
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        return res(
            states[0] == _ROW and states[1] == _CONST and dn.lhs_spec[0] == 0 and dn.out_spec[0] == 0
            and p["batch_group_count"] == 1
        )
    if name.startswith("reduce_window") or name in ("reduce_window",):
        wd, ws = p["window_dimensions"], p["window_strides"]
        pad = p["padding"]
        return res(wd[0] == 1 and ws[0] == 1 and tuple(pad[0]) == (0, 0))
    if name in ("sort",):
        return res(p["dimension"] != 0)
    if name == "top_k":
        return res(len(ins[0]) >= 2)
    if name == "iota":
        return [_CONST] * n_out
    return [_MIXED] * n_out


def _row_states(jaxpr: Any, in_states: Sequence[State], bsize: int) -> list[State]:
    """Propagates the row-wise property through ``jaxpr`` (constvars are constant)."""
    env: dict[Any, State] = {}
    for v, s in zip(jaxpr.invars, in_states, strict=True):
        env[v] = s

    def read(v: Any) -> State:
        return env.get(v, _CONST) if not _is_literal(v) else _CONST

    for eqn in jaxpr.eqns:
        outs = _row_rule(eqn, [read(v) for v in eqn.invars], bsize)
        for v, s in zip(eqn.outvars, outs, strict=True):
            env[v] = s
    return [read(v) for v in jaxpr.outvars]


def _is_literal(v: Any) -> bool:
    return isinstance(v, _jcore.Literal)


def _analyse(jaxpr: Any, n_params: int, active: Sequence[int], n_batch: int, bsize: int) -> _Plan:
    """Classifies every active parameter leaf of the top-level ``jaxpr``.

    ``jaxpr.invars`` are the flattened ``(params, batch, args)``; the first output
    is the per-example loss.
    """
    invars = jaxpr.invars
    states: dict[Any, State] = {}
    for i, v in enumerate(invars):
        states[v] = _ROW if n_params <= i < n_params + n_batch else _CONST
    alias: dict[Any, tuple[int, list[int], bool]] = {}
    for i in range(n_params):
        alias[invars[i]] = (i, [], False)
    uses: dict[int, list[_Site | None]] = {i: [] for i in range(n_params)}
    act_elems = 0

    def state(v: Any) -> State:
        return _CONST if _is_literal(v) else states.get(v, _CONST)

    for k, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        in_states = [state(v) for v in eqn.invars]
        aliased = [(pos, alias[v]) for pos, v in enumerate(eqn.invars) if not _is_literal(v) and v in alias]
        if name in _CHAIN and len(eqn.invars) == 1 and aliased:
            leaf, chain, bcast = aliased[0][1]
            alias[eqn.outvars[0]] = (leaf, [*chain, k], bcast or name not in _NORM_KEEPING)
            states[eqn.outvars[0]] = _CONST
            continue
        out_states = _row_rule(eqn, in_states, bsize)
        for v, s in zip(eqn.outvars, out_states, strict=True):
            states[v] = s
            if isinstance(s, int) and name not in _CHAIN:
                act_elems += math.prod(_shape(v))
        for pos, (leaf, chain, bcast) in aliased:
            uses[leaf].append(_classify(eqn, k, pos, leaf, chain, bcast, in_states, out_states, len(aliased)))
    for v in jaxpr.outvars:
        if not _is_literal(v) and v in alias:
            uses[alias[v][0]].append(None)

    row_wise = state(jaxpr.outvars[0]) in (_ROW, _CONST)
    sites: list[_Site] = []
    ghost: set[int] = set()
    reasons: dict[int, str] = {}
    for leaf in active:
        u = uses[leaf]
        if not row_wise:
            reasons[leaf] = "the loss mixes examples or uses an unsupported operation on batched data"
        elif len(u) == 0:
            ghost.add(leaf)
        elif len(u) > 1:
            if all(x is not None and x.axis == 0 for x in u):  # tied: every use recognised
                sites.extend(x for x in u if x is not None)
                ghost.add(leaf)
            else:
                reasons[leaf] = f"used {len(u)} times, not all in a supported way"
        elif u[0] is None:
            reasons[leaf] = "unsupported use"
        else:
            sites.append(u[0])
            ghost.add(leaf)
    for leaf in active:
        if leaf not in ghost and leaf not in reasons:
            reasons[leaf] = "unsupported use"
    return _Plan(row_wise, sites, ghost, reasons, act_elems)


def _classify(
    eqn: Any, k_eqn: int, pos: int, leaf: int, chain: list[int], bcast: bool,
    in_states: list[State], out_states: list[State], n_aliased: int,
) -> _Site | None:
    """A :class:`_Site` when this use of a parameter is recognised, else ``None``."""
    name = eqn.primitive.name
    if n_aliased != 1 or not isinstance(out_states[0], int):
        return None
    other = 1 - pos
    if name == "dot_general":  # the batch may be on any free axis of the other operand
        (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
        k = in_states[other]
        contracted = lc if other == 0 else rc
        if not bcast and isinstance(k, int) and not lb and k not in contracted:
            return _Site("dense", leaf, k_eqn, pos, chain, (other,), k, int(out_states[0]))
        return None
    if out_states[0] != _ROW or any(isinstance(st, int) and st != 0 for st in in_states):
        return None
    rows = tuple(i for i, st in enumerate(in_states) if st == _ROW)
    if name == "conv_general_dilated" and pos == 1 and not bcast and rows == (0,):
        return _Site("conv", leaf, k_eqn, pos, chain, rows)
    if name in ("add", "sub", "mul") and len(eqn.invars) == 2:
        q = _shape(eqn.invars[pos])
        out = _shape(eqn.outvars[0])
        if in_states[other] != _ROW:
            return None
        if len(q) == 0 or (len(q) == len(out) and q[0] == 1):
            return _Site("elementwise", leaf, k_eqn, pos, chain, rows)
        return None
    if name == "gather" and pos == 0 and not bcast and in_states[1] == _ROW:
        dn = eqn.params["dimension_numbers"]
        q = _shape(eqn.invars[0])
        out = _shape(eqn.outvars[0])
        idx = _shape(eqn.invars[1])
        if (
            len(q) >= 1 and tuple(dn.collapsed_slice_dims) == (0,) and tuple(dn.start_index_map) == (0,)
            and not tuple(dn.operand_batching_dims) and idx[-1] == 1
            and tuple(eqn.params["slice_sizes"]) == (1, *q[1:])
            and tuple(dn.offset_dims) == tuple(range(len(out) - len(q) + 1, len(out)))
        ):
            return _Site("embedding", leaf, k_eqn, pos, chain, rows)
        return None
    return None


# ----------------------------------------------------------------------------
# Evaluation with probes
# ----------------------------------------------------------------------------


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        ans = eqn.primitive.bind(*invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _run(closed: Any, inputs: Sequence[Any], sites: Sequence[_Site], probes: Sequence[Any]) -> tuple[list, list]:
    """Evaluates ``closed`` on ``inputs`` adding ``probes[j]`` to site ``j``'s output.

    Returns ``(outputs, per-site operand values)``.
    """
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, inputs, strict=True):
        env[v] = x
    at = {s.eqn: j for j, s in enumerate(sites)}
    operands: list[Any] = [None] * len(sites)

    def read(v: Any) -> Any:
        return v.val if _is_literal(v) else env[v]

    for k, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        outs = _bind(eqn, invals)
        j = at.get(k)
        if j is not None:
            operands[j] = invals
            outs = [outs[0] + probes[j].astype(outs[0].dtype)]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars], operands


def _replay_chain(closed: Any, chain: Sequence[int], x: Any) -> Any:
    for k in chain:
        x = _bind(closed.jaxpr.eqns[k], [x])[0]
    return x


def _hi_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)


def _dense_norm(site: _Site, eqn: Any, a: jax.Array, g: jax.Array, acc: Any) -> jax.Array:
    """Per-example ``||a_b^T g_b||_F`` for ``dot_general`` of ``a`` with a parameter.

    ``a`` is the batched operand (batch on axis ``site.axis``) and ``g`` the
    output cotangent. ``a``'s free axes other than the batch are the ``T`` axes,
    its contracted axes the ``D`` axes, and the parameter's free axes the ``P``
    axes of the output.
    """
    a3, g3 = _dense_views(site, eqn, a, g, acc)
    bsz, t, dsz = a3.shape
    psz = g3.shape[-1]
    if t == 1:  # 2-D views (a bitcast for the usual (B, D) operand, no copy of the activations)
        na, ng = _pe.leaf_example_norms([jnp.reshape(a3, (bsz, dsz)), jnp.reshape(g3, (bsz, psz))])
        return (na * ng).astype(acc)
    if 2 * t * t < psz * dsz:
        aa = _hi_einsum("btd,bsd->bts", a3, a3)
        gg = _hi_einsum("btp,bsp->bts", g3, g3)
        sq = jnp.sum(aa * gg, axis=(1, 2))
        return _pe._sqrt_safe(jnp.maximum(sq, jnp.zeros_like(sq)))
    per_example = _hi_einsum("btd,btp->bdp", a3, g3)  # this layer's per-example gradients only
    return _pe.leaf_example_norms([per_example])[0]


def _embedding_views(eqn: Any, idx: jax.Array, g: jax.Array, acc: Any) -> tuple[jax.Array, jax.Array]:
    """``(ids, g3)`` of a row lookup: in-range ids ``(B, T)`` and cotangents ``(B, T, d)``.

    Out-of-range ids get no gradient (their cotangent rows are zeroed) under
    ``FILL_OR_DROP``; otherwise they are clipped, as the lookup did.
    """
    bsz = idx.shape[0]
    ids = jnp.reshape(idx, (bsz, -1))
    g3 = jnp.reshape(g, (bsz, ids.shape[1], -1)).astype(acc)
    rows = _shape(eqn.invars[0])[0]
    if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        ok = (ids >= 0) & (ids < rows)
        g3 = jnp.where(ok[:, :, None], g3, jnp.zeros((), acc))
    return jnp.clip(ids, 0, rows - 1), g3


def _embedding_norm(eqn: Any, idx: jax.Array, g: jax.Array, acc: Any) -> jax.Array:
    """Per-example norm of the gradient of an embedding table ``E[ids]`` (see module doc)."""
    ids, g3 = _embedding_views(eqn, idx, g, acc)
    if ids.shape[1] == 1:
        return _pe.leaf_example_norms([g3])[0]
    same = (ids[:, :, None] == ids[:, None, :]).astype(acc)
    gg = _hi_einsum("btp,bsp->bts", g3, g3)
    sq = jnp.sum(same * gg, axis=(1, 2))
    return _pe._sqrt_safe(jnp.maximum(sq, jnp.zeros_like(sq)))


def _dense_views(site: _Site, eqn: Any, a: jax.Array, g: jax.Array, acc: Any) -> tuple[jax.Array, jax.Array]:
    """``(a3, g3)``: a dense site's operand as ``(B, T, D)`` and cotangent as ``(B, T, P)``."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    a_pos, k = 1 - site.pos, site.axis
    ca = tuple(lc if a_pos == 0 else rc)
    n_lhs_free = len(_shape(eqn.invars[0])) - len(lc)
    n_rhs_free = len(_shape(eqn.invars[1])) - len(rc)
    a_free = [d for d in range(a.ndim) if d not in ca]
    offset = 0 if a_pos == 0 else n_lhs_free
    w_out = list(range(n_lhs_free, n_lhs_free + n_rhs_free)) if a_pos == 0 else list(range(n_lhs_free))
    seq = [d for d in a_free if d != k]
    g_perm = (offset + a_free.index(k), *[offset + a_free.index(d) for d in seq], *w_out)
    bsz = a.shape[k]
    t = math.prod(a.shape[d] for d in seq)
    dsz = math.prod(a.shape[d] for d in ca)
    a3 = jnp.reshape(jnp.transpose(a, (k, *seq, *ca)), (bsz, t, dsz)).astype(acc)
    g3 = jnp.reshape(jnp.transpose(g, g_perm), (bsz, t, -1)).astype(acc)
    return a3, g3


# A factor of a per-example gradient along one axis of a 2-D leaf: ("dense", X)
# with X of shape (B, T, n) (one vector per position), or ("onehot", ids) with
# ids of shape (B, T) (the basis vector e_id per position).
Factor = tuple[str, jax.Array]


def _site_factors(closed: Any, site: _Site, ops: Sequence[Any], g: jax.Array, leaf: jax.Array,
                  acc: Any) -> tuple[Factor, Factor] | None:
    """A use of a 2-D leaf as a sum of outer products, ``G_b = sum_t x_bt (x) y_bt``.

    Returns the factors along leaf axes 0 and 1, or ``None`` when this use does
    not factor that way (a leaf that is not a matrix, a chain with a reshape or
    broadcast, a dense site contracting several axes, ...). A dense use
    :math:`a_b^\\top g_b` gives the rows of ``a`` along the contracted axis and
    those of ``g`` along the free one; an embedding lookup gives one-hot rows
    of the table along axis 0 and the cotangent rows along axis 1.
    """
    if leaf.ndim != 2:
        return None
    eqn = closed.jaxpr.eqns[site.eqn]
    perm = [0, 1]  # perm[i]: the leaf axis that is axis i of the operand
    for k in site.chain:
        e = closed.jaxpr.eqns[k]
        name = e.primitive.name
        if name == "transpose":
            perm = [perm[p] for p in e.params["permutation"]]
        elif name not in ("convert_element_type", "copy", "copy_p"):
            return None
    if site.kind == "dense":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        cw = tuple(lc if site.pos == 0 else rc)
        if len(cw) != 1:
            return None
        a3, g3 = _dense_views(site, eqn, ops[1 - site.pos], g, acc)
        by_axis = {perm[cw[0]]: ("dense", a3), perm[1 - cw[0]]: ("dense", g3)}
        return by_axis[0], by_axis[1]
    if site.kind == "embedding" and perm == [0, 1]:
        ids, g3 = _embedding_views(eqn, ops[1], g, acc)
        return ("onehot", ids), ("dense", g3)
    return None


def _factor_inner(f: Factor, h: Factor) -> jax.Array:
    """``<x_bt, x'_bs>`` for all positions: ``(B, T, S)``."""
    (kf, xf), (kh, xh) = f, h
    if kf == "dense" and kh == "dense":
        return _hi_einsum("btn,bsn->bts", xf, xh)
    if kf == "onehot" and kh == "onehot":
        return (xf[:, :, None] == xh[:, None, :]).astype(jnp.float32)
    if kf == "dense":  # x_bt[ids_bs]
        return jnp.swapaxes(_factor_inner(h, f), 1, 2)
    cols = jnp.swapaxes(xh, 1, 2)  # (B, n, S): x'_bs[ids_bt] for every t
    return jnp.take_along_axis(cols, xf[:, :, None], axis=1)


def _factored_norm(factors: Sequence[tuple[Factor, Factor]], acc: Any) -> jax.Array:
    """Per-example Frobenius norm of ``sum_i G_i`` from the factors of every use ``i``.

    .. math:: \\|\\sum_i G_{b,i}\\|_F^2 = \\sum_{i,j} \\sum_{t,s}
              \\langle x_{bit}, x_{bjs} \\rangle \\langle y_{bit}, y_{bjs} \\rangle ,

    cross terms included (each pair once, doubled), in ``O(T_i T_j (n_0 + n_1))``
    per example and pair: nothing of the leaf's size is formed.
    """
    total = None
    for i, (xi, yi) in enumerate(factors):
        for j in range(i, len(factors)):
            xj, yj = factors[j]
            term = jnp.sum(_factor_inner(xi, xj).astype(acc) * _factor_inner(yi, yj).astype(acc), axis=(1, 2))
            term = term if i == j else 2 * term
            total = term if total is None else total + term
    assert total is not None
    return _pe._sqrt_safe(jnp.maximum(total, jnp.zeros_like(total)))


def _factored_is_cheaper(factors: Sequence[tuple[Factor, Factor]], shape: tuple[int, ...]) -> bool:
    """Inner products of the factors cost less than forming each use's gradient."""
    ts = [x[1].shape[1] for x, _ in factors]
    n0, n1 = shape
    return sum(ti * tj for ti in ts for tj in ts) * (n0 + n1) < sum(ts) * n0 * n1


def _apply_site(closed: Any, site: _Site, vals: Sequence[Any], param: jax.Array) -> jax.Array:
    """The site's one operation on ``vals``, with ``param`` (through its chain) as the parameter operand."""
    v = list(vals)
    v[site.pos] = _replay_chain(closed, site.chain, param)
    return _bind(closed.jaxpr.eqns[site.eqn], v)[0]  # type: ignore[no-any-return]


def _local_grads(closed: Any, site: _Site, param: jax.Array, invals: Sequence[Any], g: jax.Array) -> jax.Array:
    """Per-example gradients of one parameter leaf through one operation only, ``(B, *leaf)``.

    With the operation's output cotangent ``g`` (from the probe), example ``b``'s
    gradient is the pull-back of ``g_b`` through that single operation evaluated
    on row ``b`` of its batched operands, and through the parameter's chain
    (cast, reshape, broadcast). Nothing else of the model is differentiated per
    example; the result has the size of the leaf per example (biases, scales,
    convolution kernels, tied tables).
    """

    def one(row_vals: list, gb: jax.Array) -> jax.Array:
        vals = list(invals)
        for r, x in zip(site.rows, row_vals, strict=True):
            vals[r] = jnp.expand_dims(x, 0)
        out, pull = jax.vjp(lambda w: _apply_site(closed, site, vals, w), param)
        return pull(jnp.expand_dims(gb, 0).astype(out.dtype))[0]  # type: ignore[no-any-return]

    row_vals = [invals[r] for r in site.rows]
    ref = row_vals[0]
    row_vals = [_pe.match_batch_sharding(x, ref) for x in row_vals]  # vmap needs one batch sharding
    return jax.vmap(one)(row_vals, _pe.match_batch_sharding(g, ref))  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------
# The clipped_grad implementation
# ----------------------------------------------------------------------------


def _trace(loss_fn: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any], has_aux: bool) -> Any:
    """The closed jaxpr of ``loss_fn`` over flattened ``(params, batch, args)``."""

    def flat_loss(p: Any, b: Any, a: Any) -> Any:
        out = loss_fn(p, b, *a)
        return out[0] if has_aux else out

    closed = jax.make_jaxpr(flat_loss)(params, batch, tuple(args))
    if not any(e.primitive.name in _INLINE for e in closed.jaxpr.eqns):
        return closed

    def inlined(p: Any, b: Any, a: Any) -> Any:
        leaves = jax.tree_util.tree_leaves((p, b, a))
        return _inline_eval(closed.jaxpr, closed.consts, leaves)[0]

    return jax.make_jaxpr(inlined)(params, batch, tuple(args))


_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})


def _inline_eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluates ``jaxpr``, running nested ``jit`` calls inline (so that, traced, the
    parameters used inside library helpers such as ``jnp.take`` appear at the top level)."""
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x

    def read(v: Any) -> Any:
        return v.val if _is_literal(v) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn) if eqn.primitive.name in _INLINE else None
        j, sub_consts = _open(sub) if sub is not None else (None, None)
        if j is not None and (sub_consts is not None or not j.constvars):
            outs = _inline_eval(j, sub_consts or [], invals)
        else:
            outs = _bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _plan_for(loss_fn: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any], has_aux: bool, fn: str) -> tuple:
    pflat = _norms.flatten(params, fn)
    n_params = len(pflat.leaves)
    n_batch = len(jax.tree_util.tree_leaves(batch))
    bsize = _pe.batch_size_of(batch, fn)
    closed = _trace(loss_fn, params, batch, args, has_aux)
    plan = _analyse(closed.jaxpr, n_params, pflat.active, n_batch, bsize)
    return closed, plan, pflat


def ghost_report(loss_fn: Callable[..., Any], params: Any, batch: Any, *args: Any, has_aux: bool = False) -> GhostReport:
    """Which leaves of ``params`` ghost clipping measures directly, and why others fall back.

    Static (nothing is computed); use it to check a model before training.

    Example:
      >>> import jax.numpy as jnp
      >>> from gradclip_jax.ghost import ghost_report
      >>> def loss(p, b):
      ...     return jnp.sum((b @ p['w'] + p['b']) ** 2, axis=-1)
      >>> rep = ghost_report(loss, {'w': jnp.ones((3, 2)), 'b': jnp.zeros(2)}, jnp.ones((4, 3)))
      >>> rep.ghost, rep.fallback
      ([("['b']", 'elementwise'), ("['w']", 'dense')], [])
    """
    _, plan, pflat = _plan_for(loss_fn, params, batch, args, has_aux, "ghost_report")
    by_leaf: dict[int, list[str]] = {}
    for site in plan.sites:
        by_leaf.setdefault(site.leaf, []).append(site.kind)
    kinds = {i: (k[0] if len(k) == 1 else "tied:" + "+".join(k)) for i, k in by_leaf.items()}
    ghost = [(_pe._keystr(pflat.paths[i]), kinds.get(i, "unused")) for i in pflat.active if i in plan.ghost]
    fallback = [(_pe._keystr(pflat.paths[i]), plan.reasons[i]) for i in pflat.active if i not in plan.ghost]
    return GhostReport((ghost, fallback))


AUTO_MIN_ELEMENTS = 2**20
"""``method='auto'`` uses ghost clipping when the per-example gradients of the
ghost-measurable leaves would hold at least this many elements (``B`` times their
size) and those leaves hold at least half of the parameters; below that, the
single backward pass of the vmap path is as cheap and exact to the last bit."""


BOOKKEEPING_MAX_SHARE = 0.5
"""``ghost_sum='auto'`` uses book-keeping when the output cotangents it holds
(the elements of every recognised operation's output) are at most this share
of the loss's batched intermediates (a proxy for the activations a backward
pass keeps): then holding them costs little beside the activations, and it
saves the second backward pass. Above it (plain MLPs, where the layer outputs
are most of the activations) the second backward pass keeps the peak memory
near a non-private step's."""


def _sum_mode(ghost_sum: str, closed: Any, plan: _Plan) -> str:
    """``'backward'`` or ``'bookkeeping'``: how global clipping forms the clipped sum."""
    if ghost_sum != "auto":
        return ghost_sum
    return "bookkeeping" if plan.ct_elems(closed.jaxpr) <= BOOKKEEPING_MAX_SHARE * plan.act_elems else "backward"


def _use_ghost(plan: _Plan, pflat: _norms.FlatTree, bsize: int, method: str) -> bool:
    """Whether to take the ghost path (else the vmap path computes everything)."""
    if not plan.row_wise or not plan.ghost:
        return False
    # 16-bit parameters: the second pass or book-keeping would round each clipped
    # contribution in 16 bits (norm up to ~0.4% above C); the vmap path clips in float32.
    if any(np.dtype(pflat.leaves[i].dtype).itemsize < 4 for i in pflat.active):
        return False
    if method == "ghost":
        return True
    sizes = {i: math.prod(np.shape(pflat.leaves[i])) for i in pflat.active}
    ghost_size = sum(sizes[i] for i in plan.ghost)
    return bsize * ghost_size >= AUTO_MIN_ELEMENTS and 2 * ghost_size >= sum(sizes.values())


def make_ghost_impl(
    loss_fn: Callable[..., Any],
    l2_clip_norm: Any,
    *,
    method: str,
    layer_mode: str | None = None,
    factors: Callable[[jax.Array, Any], jax.Array],
    vmap_impl: Callable[..., Any],
    has_aux: bool,
    microbatch_size: int | None,
    nan_safe: bool,
    spmd_axis_name: Any,
    ghost_sum: str = "auto",
) -> Callable[..., Any]:
    """The ``(params, batch, *args, mask=None) -> (grads, info)`` function of ``method='ghost'``.

    Used by :func:`gradclip_jax.per_example.clipped_grad`, which validates the
    arguments. ``factors(norms, C)`` maps per-example norms to clip factors (clip
    or normalize); ``vmap_impl`` is the vmap implementation, used when no leaf
    can be measured without materializing. ``ghost_sum`` picks how the clipped
    sum is formed (``'auto'``, ``'backward'`` or ``'bookkeeping'``, see the
    module doc); per-layer clipping always uses book-keeping.
    """
    fn = "clipped_grad"

    def impl(params: Any, batch: Any, *args: Any, mask: Any = None) -> tuple[Any, Any]:
        bsize = _pe.batch_size_of(batch, fn)
        _pe._check_loss_shape(loss_fn, params, batch, args, bsize, has_aux, fn)
        valid = _pe.check_mask(mask, bsize, fn)
        _, plan0, pflat0 = _plan_for(loss_fn, params, batch, args, has_aux, fn)
        if not _use_ghost(plan0, pflat0, bsize, method):
            return vmap_impl(params, batch, *args, mask=mask)  # type: ignore[no-any-return]

        params = _pe._vary_like_batch(params, batch)
        pflat = _norms.flatten(params, fn)
        ref = jax.tree_util.tree_leaves(batch)[0]
        clip_list: list[Any] | None = None
        if layer_mode == "tree":
            budgets_tree = _pe._match_clip_tree(l2_clip_norm, params, fn)
            clip_list = [budgets_tree[i] for i in pflat.active]
        elif layer_mode is not None:
            shapes = [jnp.zeros((1, *x.shape), jnp.float32) for x in pflat.arrays]
            clip_list = _pe.layer_budgets(shapes, l2_clip_norm, layer_mode == "uniform")

        def chunk(chunk_batch: Any, chunk_valid: jax.Array | None) -> tuple:
            closed, plan, _ = _plan_for(loss_fn, params, chunk_batch, args, has_aux, fn)
            second_pass = layer_mode is None and _sum_mode(ghost_sum, closed, plan) == "backward"
            m = jax.tree_util.tree_leaves(chunk_batch)[0].shape[0]
            eqns = closed.jaxpr.eqns
            probes = [
                _pe._vary_like(jnp.zeros(_shape(eqns[s.eqn].outvars[0]), eqns[s.eqn].outvars[0].aval.dtype), ref)
                for s in plan.sites
            ]

            def probed(p: Any, pr: list) -> tuple:
                inputs = jax.tree_util.tree_leaves((p, chunk_batch, tuple(args)))
                outs, operands = _run(closed, inputs, plan.sites, pr)
                return outs[0], operands

            # One forward pass, then a backward pass to the probes: every site's
            # operands and its output cotangent for every example. For the
            # second backward pass the forward is linearized with respect to the
            # parameters too (and pulled back twice); book-keeping holds the
            # parameters fixed, so pass 1 forms no parameter gradient.
            losses: jax.Array
            operands: list[Any]
            if second_pass:
                losses, pull, operands = jax.vjp(probed, params, probes, has_aux=True)
                cts = pull(jnp.ones_like(losses))[1]
            else:
                losses, pull, operands = jax.vjp(lambda pr: probed(params, pr), probes, has_aux=True)
                cts = pull(jnp.ones_like(losses))[0]

            acc = _norms.tree_acc_dtype(pflat.arrays) if pflat.arrays else np.dtype(np.float32)
            leaf_norm: dict[int, jax.Array] = {}
            n_sites: dict[int, int] = {}
            for s in plan.sites:
                n_sites[s.leaf] = n_sites.get(s.leaf, 0) + 1
            # Tied leaves whose every use factors into per-position vectors: the
            # norm from inner products of those (cross terms included).
            factored: dict[int, list | None] = {}
            for s, ops, g in zip(plan.sites, operands, cts, strict=True):
                prev = factored.get(s.leaf, [])
                if n_sites[s.leaf] > 1 and prev is not None:
                    f2 = _site_factors(closed, s, ops, g, pflat.leaves[s.leaf], acc)
                    factored[s.leaf] = None if f2 is None else [*prev, f2]
            for i, fl in factored.items():
                if fl is not None and _factored_is_cheaper(fl, pflat.leaves[i].shape):
                    leaf_norm[i] = _factored_norm(fl, acc)
            local: dict[int, jax.Array] = {}  # summed per-example gradients of tied / local leaves
            for s, ops, g in zip(plan.sites, operands, cts, strict=True):
                eqn = eqns[s.eqn]
                if s.leaf in leaf_norm:  # a factored tied leaf
                    continue
                if n_sites[s.leaf] == 1 and s.kind == "dense":
                    leaf_norm[s.leaf] = _dense_norm(s, eqn, ops[1 - s.pos], g, acc)
                elif n_sites[s.leaf] == 1 and s.kind == "embedding":
                    leaf_norm[s.leaf] = _embedding_norm(eqn, ops[1], g, acc)
                else:  # elementwise, conv, or one use of a tied leaf: that leaf's gradient only
                    lg = _local_grads(closed, s, pflat.leaves[s.leaf], ops, g).astype(acc)
                    local[s.leaf] = lg if s.leaf not in local else local[s.leaf] + lg
            rows: dict[int, jax.Array] = {i: _pe.as_rows(lg) for i, lg in local.items()}
            fb = [i for i in pflat.active if i not in plan.ghost]
            if fb:
                fb_rows = _fallback_rows(loss_fn, pflat, fb, chunk_batch, args, has_aux, spmd_axis_name)
                rows.update(zip(fb, fb_rows, strict=True))
            for i, r in rows.items():
                leaf_norm[i] = _pe.leaf_example_norms([r])[0]
            ref_c = jax.tree_util.tree_leaves(chunk_batch)[0]
            all_norms = [
                _pe.match_batch_sharding(leaf_norm.get(i, jnp.zeros((m,), acc)).astype(acc), ref_c)
                for i in pflat.active
            ]
            if chunk_valid is not None:
                chunk_valid = _pe.match_batch_sharding(chunk_valid, ref_c)
            vals, aux = _values_and_aux(loss_fn, params, chunk_batch, args, has_aux, losses, spmd_axis_name)
            if clip_list is not None:  # per-layer: one factor per leaf and example
                finite = jnp.all(jnp.stack([jnp.isfinite(n) for n in all_norms]), axis=0)
                fs = [factors(n, c) for n, c in zip(all_norms, clip_list, strict=True)]
                ns: Any = list(all_norms)
            else:
                ns = _pe.combine_l2(all_norms)
                finite = jnp.isfinite(ns)
                fs = [factors(ns, l2_clip_norm)] * len(all_norms)
            keep = chunk_valid
            if nan_safe:
                keep = finite if keep is None else keep & finite
            ws = [lax.stop_gradient(f) for f in fs]
            if keep is not None:  # dropped examples weigh 0 (enough when they are finite)
                ws = [jnp.where(keep, w, jnp.zeros_like(w)) for w in ws]
            if second_pass:
                def fast() -> list[jax.Array]:
                    g = _norms.flatten(pull(ws[0].astype(losses.dtype))[0], fn).arrays
                    return [x.astype(_norms.acc_dtype(x.dtype)) for x in g]
            else:
                def fast() -> list[jax.Array]:
                    return _bookkept_sums(closed, plan, pflat, operands, cts, rows, ws)
            sums = _clipped_sums(fast, loss_fn, params, pflat, chunk_batch, args, ws, keep, finite, has_aux)
            flags, ns = _pe.clip_flags(fs, ns, chunk_valid, clip_list is not None)
            return sums, ns, flags, vals, aux

        return _pe.run_chunks(  # type: ignore[no-any-return]
            chunk, pflat, batch, valid, bsize, microbatch_size, clip_list is not None, has_aux)

    return impl


def _site_sum(closed: Any, site: _Site, param: jax.Array, invals: Sequence[Any], g: jax.Array,
              w: jax.Array) -> jax.Array:
    """Book-keeping: ``sum_b w_b G_b`` for one use of a leaf, from its operands and cotangent.

    The pull-back of the cotangent ``w_b g_b`` through the single operation (and
    the leaf's chain) at the whole batch.
    """
    shape = (1,) * site.out_axis + (-1,) + (1,) * (g.ndim - site.out_axis - 1)
    ct = g * w.reshape(shape).astype(g.dtype)
    _, pull = jax.vjp(lambda p: _apply_site(closed, site, invals, p), param)
    return pull(ct)[0]  # type: ignore[no-any-return]


def _bookkept_sums(
    closed: Any, plan: _Plan, pflat: _norms.FlatTree, operands: Sequence[Any], cts: Sequence[Any],
    rows: dict[int, jax.Array], weights: Sequence[jax.Array],
) -> list[jax.Array]:
    """The clipped sum of every active leaf, :math:`\\sum_b c_{b,l} G_{b,l}`, by book-keeping.

    Nothing is differentiated a second time: a dense or embedding leaf's sum is
    the pull-back of the reweighted cotangent :math:`c_{b,l} g_b` through its
    one operation at the whole batch (for a dense layer, :math:`a^\\top
    \\mathrm{diag}(c)\\, g`: the parameter half of one backward pass), summed
    over its uses for a tied leaf measured by factors; a leaf whose per-example
    gradients were formed anyway (``rows``: elementwise, conv, other tied and
    fallback leaves) is their weighted row sum. ``weights`` holds one ``(B,)``
    vector per active leaf (the same one, for global clipping), already 0 for
    dropped examples (see :func:`_clipped_sums` for non-finite ones).
    """
    w_of = dict(zip(pflat.active, weights, strict=True))
    row_ids = [i for i in pflat.active if i in rows]
    totals: dict[int, jax.Array] = {}
    if row_ids:
        sums = _pe.fused_sums([rows[i] for i in row_ids], [w_of[i] for i in row_ids])
        totals.update(zip(row_ids, sums, strict=True))
    for s, o, g in zip(plan.sites, operands, cts, strict=True):  # every use of the other leaves
        i = s.leaf
        if i in rows or i not in w_of:
            continue
        total = _site_sum(closed, s, pflat.leaves[i], o, g, w_of[i]).astype(_norms.acc_dtype(pflat.leaves[i].dtype))
        totals[i] = total if i not in totals else totals[i] + total
    out = []
    for i in pflat.active:
        leaf = pflat.leaves[i]
        acc = _norms.acc_dtype(leaf.dtype)
        t = totals.get(i)
        total = jnp.zeros(leaf.shape, acc) if t is None else t  # None: an unused leaf
        out.append(jnp.reshape(total, leaf.shape).astype(acc))
    return out


def _one_example_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    def scalar_loss(p: Any, example: Any, *a: Any) -> tuple:
        ex1 = jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), example)
        out = loss_fn(p, ex1, *a)
        loss, aux = out if has_aux else (out, None)
        if has_aux:
            aux = jax.tree_util.tree_map(_pe._squeeze_example_axis, aux)
        return jnp.reshape(loss, ()), aux

    return scalar_loss


def _fallback_rows(
    loss_fn: Callable[..., Any], pflat: _norms.FlatTree, fb: Sequence[int], batch: Any,
    args: Sequence[Any], has_aux: bool, spmd_axis_name: Any,
) -> list[jax.Array]:
    """Per-example gradients of the fallback leaves only, one row per example."""
    scalar_loss = _one_example_loss(loss_fn, has_aux)

    def one(sub: list, example: Any, *a: Any) -> list:
        def f(s: list) -> jax.Array:
            leaves = list(pflat.leaves)
            for i, x in zip(fb, s, strict=True):
                leaves[i] = x
            p = jax.tree_util.tree_unflatten(pflat.treedef, leaves)
            return scalar_loss(p, example, *a)[0]

        return jax.grad(f)(sub)  # type: ignore[no-any-return]

    sub = [pflat.leaves[i] for i in fb]
    g = jax.vmap(one, in_axes=(None, 0) + (None,) * len(args), spmd_axis_name=spmd_axis_name)(sub, batch, *args)
    return [_pe.as_rows(x) for x in g]


def _clipped_sums(
    fast: Callable[[], list[jax.Array]],
    loss_fn: Callable[..., Any], params: Any, pflat: _norms.FlatTree, batch: Any, args: Sequence[Any],
    ws: Sequence[jax.Array], keep: jax.Array | None, finite: jax.Array, has_aux: bool,
) -> list[jax.Array]:
    """The clipped sums, ``fast()`` (second backward pass or book-keeping) unless that could leak NaN.

    ``ws`` holds each active leaf's ``(B,)`` weights, 0 for dropped examples
    (``keep`` False). A weight of 0 removes an example's contribution exactly
    when its values are finite; a dropped example with a non-finite norm could
    leak NaN through ``0 * inf`` in the shared computation, so then (rarely) a
    ``lax.cond`` takes a path that forms each kept example's gradient in turn,
    with no copy of any activation or of the per-example gradients.
    """
    if keep is None:
        return fast()
    accs = [_norms.acc_dtype(x.dtype) for x in pflat.arrays]
    scalar_loss = _one_example_loss(loss_fn, has_aux)

    def safe(_: Any) -> list[jax.Array]:
        def body(carry: list, xs: tuple) -> tuple:
            example, wis, ki = xs
            g = jax.grad(lambda p: scalar_loss(p, example, *args)[0])(params)
            rows = _norms.flatten(g, "clipped_grad").arrays
            new = [
                c + jnp.where(ki, wi.astype(a) * r.astype(a), jnp.zeros((), a))
                for c, wi, r, a in zip(carry, wis, rows, accs, strict=True)
            ]
            return new, None

        init = [jnp.zeros(x.shape, a) for x, a in zip(pflat.arrays, accs, strict=True)]
        ref = jax.tree_util.tree_leaves(batch)[0]
        if _pe.batch_axis_sharding(ref)[0] is not None:
            # a scan cannot run over a sharded axis: form the per-example gradients
            per_ex = jax.vmap(lambda ex: jax.grad(lambda p: scalar_loss(p, ex, *args)[0])(params))(batch)
            arrays = _norms.flatten(per_ex, "clipped_grad").arrays
            sums = _pe.fused_sums([_pe.as_rows(x) for x in arrays], list(ws), keep, jnp.zeros_like(keep))
            return _pe.unrow(sums, arrays)
        out, _ = lax.scan(body, init, (batch, list(ws), keep))
        return out  # type: ignore[no-any-return]

    risky = jnp.any(~keep & ~finite)
    return lax.cond(risky, safe, lambda _: fast(), None)  # type: ignore[no-any-return]


def _values_and_aux(
    loss_fn: Callable[..., Any], params: Any, batch: Any, args: Sequence[Any], has_aux: bool,
    losses: jax.Array, spmd_axis_name: Any,
) -> tuple[jax.Array, Any]:
    """Per-example losses, and with ``has_aux`` the per-example aux (one forward per example)."""
    if not has_aux:
        return losses, None
    scalar_loss = _one_example_loss(loss_fn, has_aux)
    vals, aux = jax.vmap(
        lambda ex, *a: scalar_loss(params, ex, *a), in_axes=(0,) + (None,) * len(args),
        spmd_axis_name=spmd_axis_name,
    )(batch, *args)
    return vals, aux
