"""Settings chosen per JAX backend (``'cpu'``, ``'gpu'``, ``'cuda'``, ...), read when a function is traced."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax


def per_backend(table: Mapping[str, str], setting: str, default: str, allowed: Sequence[str]) -> str:
    """The entry of ``table`` for the default backend (``default`` if it has none).

    ``setting`` is the table's public name, for the error raised when the entry
    is not one of ``allowed``.
    """
    name = table.get(jax.default_backend(), default)
    if name not in allowed:
        raise ValueError(f"{setting}: unknown strategy {name!r}; expected one of {tuple(allowed)}")
    return name
