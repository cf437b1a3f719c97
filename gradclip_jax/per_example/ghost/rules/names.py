"""The primitive names the tracing (``_jaxpr``) and the analysis (``_analysis``) act on by
name, outside a rule: every JAX primitive name of the package lives under ``rules/``."""

from __future__ import annotations

SLICE = "slice"
SPLIT = "split"
TILE = "tile"
DYNAMIC_SLICE = "dynamic_slice"
BROADCAST = "broadcast_in_dim"
TRANSPOSE = "transpose"
GATHER = "gather"
DOT_GENERAL = "dot_general"
CONCATENATE = "concatenate"
SCAN = "scan"
CUSTOM_JVP = "custom_jvp_call"
CUSTOM_VJP = "custom_vjp_call"

INLINE = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "remat",
        "xla_metadata_call",
    }
)
"""Inlined: the sub-jaxpr runs once on the operands. ``checkpoint`` (remat) is inlined for the
analysis (a parameter used inside it must be seen); the streamed path (``_streamed``) runs a
kept scan's steps under the checkpoint its body had (``REMAT``), the probed path stores the
activations for the norms. ``xla_metadata_call``
(jax 0.11) only attaches XLA metadata to the calls it wraps."""

REMAT = frozenset({"remat2", "checkpoint", "remat"})
"""The names of ``jax.checkpoint``'s primitive: the streamed path recomputes a scan's steps
when its body holds one (see ``_streamed``)."""

CASTS = frozenset({"convert_element_type", "copy", "copy_p"})
"""Casts and copies: the value is the operand's, in another dtype or buffer."""

CHAIN_OPS = CASTS | {"transpose", "reshape", "squeeze", BROADCAST}
"""One-operand operations allowed between a parameter and its use (the analysis's chains):
casts, copies, transposes and reshapes keep the gradient's norm (the gradient with respect
to the parameter is a permutation, reshape or cast of that with respect to the result); a
broadcast is a bias broadcast over the batch or positions."""

VIEWS = CHAIN_OPS | {SLICE}
"""Through these and static slices a value stays a view of a parameter: a scan reading
such a value as a constant or carry is unrolled, not kept as a loop."""

FOLDABLE = frozenset(
    {
        "iota",
        BROADCAST,
        "reshape",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "concatenate",
        SLICE,
        "add",
        "sub",
        "mul",
        "neg",
        "rem",
        "max",
        "min",
        "clamp",
        "select_n",
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "and",
        "or",
        "not",
    }
)
"""Pure index arithmetic only (no collectives, no sharding casts, no calls): folded while
tracing when computed from constants alone."""

RETRACED = frozenset({SCAN, "iota", SPLIT, DYNAMIC_SLICE, TILE})
"""Top-level primitives that the re-trace rewrites: unrolled scans, folded index arithmetic
(``iota``), splits and dynamic slices at known indices as static slices, tiles along size-1
axes as broadcasts."""

THROUGH = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        DOT_GENERAL,
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "tanh",
        "logistic",
        "square",
        "integer_pow",
        "abs",
        "max",
        "min",
        "log1p",
        "expm1",
    }
)
"""Operations a parameter's chain may compute with, their other operands constants: ``scale * c``,
``1 + scale`` (Gemma's RMSNorm), ``scale * rsqrt(var + eps)`` (a BatchNorm with frozen statistics),
``W @ h0`` (a recurrent weight on a constant initial state), ``exp(log_scale)``."""

JOINS = frozenset({"add", "sub", "add_any", CONCATENATE})
"""Operations that add, subtract or join several values (several leaves' values: a chain step
whose other leaves' operands are zeroed when it is replayed)."""

LINEAR = CHAIN_OPS | {SLICE, GATHER, "add", "sub", "neg", "mul", DOT_GENERAL, CONCATENATE}
"""Chain steps linear in the parameter's operand (its other operands constants): after a step
that adds or joins other leaves' values, only these may follow."""

SAME_SHAPE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "neg",
        "add_any",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "tanh",
        "logistic",
        "square",
        "integer_pow",
        "abs",
        "log1p",
        "expm1",
    }
)
"""Elementwise operations whose output has their operands' shape (the axes of copies they keep)."""
