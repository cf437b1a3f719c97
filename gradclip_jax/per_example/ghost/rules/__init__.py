"""Per-primitive rules of ghost clipping, one file per family, in one table
(:data:`RULES`, filled by each family's ``register`` calls)."""

from gradclip_jax.per_example.ghost.rules import (
    calls,
    conv,
    dense,
    elementwise,
    gather,
    names,
    prng,
    structural,
    unsupported,
)
from gradclip_jax.per_example.ghost.rules._registry import (
    CONST,
    MIXED,
    OPAQUE,
    ROW,
    RULES,
    Box,
    Factor,
    Formed,
    Merged,
    RowCtx,
    RowNorms,
    Rule,
    Site,
    State,
    Use,
    row_rule,
    rule_for,
    unmerged,
)
from gradclip_jax.per_example.ghost.rules.gather import is_row_lookup

__all__ = ["CONST", "MIXED", "OPAQUE", "ROW", "RULES", "Box", "Factor", "Formed", "Merged", "RowCtx", "RowNorms", "Rule", "Site", "State", "Use", "row_rule", "rule_for", "unmerged", "is_row_lookup",
           "calls", "conv", "dense", "elementwise", "gather", "names", "prng", "structural", "unsupported"]
