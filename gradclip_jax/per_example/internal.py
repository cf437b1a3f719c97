"""The per-example package's API for the other packages of gradclip_jax (``dp``, ``interop``).

Not public: these names may change with the package. They are the only door
through which another package reaches per-example machinery, so the private
modules behind them can move without touching their users.
"""

from gradclip_jax.per_example._batch import (
    batch_flatten,
    batch_size_of,
    call_on_one_example,
    explicit_spec,
    match_batch_sharding,
)
from gradclip_jax.per_example._clip_sum import clip_and_sum
from gradclip_jax.per_example._config import Method, clip_factors, sensitivity_factor
from gradclip_jax.per_example._example_norms import as_rows, unrow
from gradclip_jax.per_example._keys import example_keys

# The ghost report and warning, for the top level (their home) only: not listed below
from gradclip_jax.per_example.ghost._analysis import (
    GhostFallbackWarning as GhostFallbackWarning,
    GhostReport as GhostReport,
    ghost_report as ghost_report,
)

__all__ = [
    "Method",
    "as_rows",
    "batch_flatten",
    "batch_size_of",
    "call_on_one_example",
    "clip_and_sum",
    "clip_factors",
    "example_keys",
    "explicit_spec",
    "match_batch_sharding",
    "sensitivity_factor",
    "unrow",
]
