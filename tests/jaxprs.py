"""Reading traced programs in tests: every equation of a jaxpr, nested jaxprs included."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from gradclip_jax._core.jaxcompat import sub_jaxprs


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations (calls, loop
    bodies, branches), once per call site."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from equations(sub)


def primitive_counts(jaxpr: Any) -> Counter:
    """How many times each primitive runs in ``jaxpr`` (:func:`equations`), by name."""
    return Counter(eqn.primitive.name for eqn in equations(jaxpr))
