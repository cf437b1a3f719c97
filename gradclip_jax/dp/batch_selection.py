"""Deprecated: the sampler protocol moved to :mod:`gradclip_jax.dp.sampling`.

The samplers live in one folder, :mod:`gradclip_jax.dp.sampling`. Importing this module warns
(``DeprecationWarning``); its names still work, each the same object as at the new path, for
one release.
"""

from gradclip_jax._core.deprecations import deprecation_getattr, moved_names, warn_moved
from gradclip_jax.dp import sampling as _new

warn_moved(__name__, _new.__name__)

_deprecations = moved_names(
    __name__,
    _new,
    ("NEIGHBORING", "BatchSampler", "IndexSampler", "SampledBatch", "check_sampler", "processes"),
)
__getattr__ = deprecation_getattr(__name__, _deprecations)


def __dir__() -> list[str]:
    return sorted(_deprecations)
