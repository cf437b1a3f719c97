"""Elementwise primitives: the batch axis passes through; a broadcast parameter
added to, subtracted from or multiplied with batched data is an ``elementwise`` site."""

from __future__ import annotations

from gradclip_jax._core.jaxcompat import shape
from gradclip_jax.per_example.ghost.rules._registry import (
    RowCtx,
    Rule,
    Site,
    State,
    Use,
    register,
)

_UNARY_OR_MIXED = (
    "div",
    "rem",
    "pow",
    "max",
    "min",
    "neg",
    "sign",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "atan2",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "abs",
    "integer_pow",
    "square",
    "erf",
    "erfc",
    "erf_inv",
    "lgamma",
    "digamma",
    "igamma",
    "select_n",
    "clamp",
    "convert_element_type",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "stop_gradient",
    "nextafter",
    "reduce_precision",
    "copy",
    "copy_p",
    "real",
    "imag",
    "conj",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "bessel_i0e",
    "bessel_i1e",
    "random_gamma_grad",
    "add_any",
    "polygamma",
    "zeta",
    "igammac",
    "igamma_grad_a",
    "regularized_incomplete_beta",
    # added since jax 0.5: integer high product, staging, comparisons to a total order
    "mulhi",
    "clz",
    "complex",
    "stage",
    "eq_to",
    "le_to",
    "lt_to",
    "sharding_constraint",
    # added in jax 0.11 (seen in jax 0.11.2's jax.lax): log base 2, and 1 - x**2 (tanh's derivative)
    "log2",
    "one_minus_square",
)


class Elementwise(Rule):
    """Same-rank operands: the output keeps the (common) batch axis."""

    primitives: tuple[str, ...] = _UNARY_OR_MIXED
    kind = "elementwise"

    def row(self, c: RowCtx) -> list[State]:
        k0, ins, outs = c.k0, c.ins, c.outs
        if k0 is None or not all(len(ins[i]) == len(outs[0]) for i in c.rows):
            return c.mixed()
        return c.res_at(k0)


class AffineElementwise(Elementwise):
    """``add``, ``sub``, ``mul``: a parameter (scalar or broadcast over the batch) is a site.

    The batch may be on any axis ``k`` of the output (``jax.vmap`` of ``W @ x + b`` puts it on
    axis 1). The parameter operand is a scalar, has size 1 on axis ``k``, or is ``B`` copies of
    one value along axis ``k`` (its chain's broadcast: haiku's ``jnp.broadcast_to(b, out.shape)``,
    keras' position embeddings): row ``b`` of the output then depends on row ``b`` of the other
    operand and on that one value alone, and the pull-back of the cotangent's row ``b`` through
    the operation on row ``b``, the broadcast making one copy, is example ``b``'s gradient.
    """

    primitives = ("add", "sub", "mul")

    def classify(self, use: Use) -> Site | None:
        k = use.out_states[0]
        if not isinstance(k, int) or len(use.eqn.invars) != 2 or use.in_states[1 - use.pos] != k:
            return None
        if any(isinstance(s, int) and s != k for s in use.in_states):
            return None
        rows = tuple(i for i, s in enumerate(use.in_states) if s == k)
        q = shape(use.eqn.invars[use.pos])
        out = shape(use.eqn.outvars[0])
        if len(q) == 0 or (len(q) == len(out) and (q[k] == 1 or k in use.batch_axes)):
            return self.site(use, rows, k, k)
        return None


register(Elementwise())
register(AffineElementwise())
