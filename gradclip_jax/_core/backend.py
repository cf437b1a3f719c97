"""Settings chosen per JAX backend (``'cpu'``, ``'gpu'``, ``'cuda'``, ...), read when a function is traced."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping, Sequence

import jax


def per_backend(
    table: Mapping[str, str], setting: str, default: str, allowed: Sequence[str]
) -> str:
    """The entry of ``table`` for the default backend (``default`` if it has none).

    ``setting`` is the table's public name, for the error raised when the entry
    is not one of ``allowed``.
    """
    name = table.get(jax.default_backend(), default)
    if name not in allowed:
        raise ValueError(f"{setting}: unknown strategy {name!r}; expected one of {tuple(allowed)}")
    return name


@contextlib.contextmanager
def backend_setting(table: MutableMapping[str, str], value: str | None) -> Iterator[None]:
    """``table[backend] = value`` for the default backend while the block runs (``None``: unchanged),
    restored afterwards. The per-backend tables are read when a function is traced, so this picks
    the setting of what is traced inside the block (benchmarks and tests compare settings)."""
    backend = jax.default_backend()
    old = table.get(backend)
    if value is not None:
        table[backend] = value
    try:
        yield
    finally:
        if old is None:
            table.pop(backend, None)
        else:
            table[backend] = old
