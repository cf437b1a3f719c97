"""``priv.step`` and ``priv.noisy_update``: compiled on their first call, each call's noise key
counted on the host, so the program has no host callback and JAX's persistent cache keeps it.

A call outside any JAX transformation runs ``jax.jit`` of the update without the release log's
callback and hands its ``key`` to the log as it is dispatched (:meth:`ReleaseLog.dispatched`):
one call, one update. A call inside one (the user's ``jax.jit``, ``lax.scan``, ``vmap``,
``shard_map``) cannot know how often its program will run, so it traces the update with the
callback (:meth:`ReleaseLog.mark`), which reports each execution. ``lower(...).compile()`` gives
a compiled update that counts its calls too: no way of running the update escapes the log.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

from gradclip_jax._core import jaxcompat
from gradclip_jax.dp.private_step._releases import ReleaseLog


class CountedUpdate:
    """A noisy update (``traced``, whose program reports its key; ``plain``, the same without the
    report) called as one jitted function; its ``key`` argument is what the log counts."""

    def __init__(
        self, traced: Callable[..., Any], plain: Callable[..., Any], releases: ReleaseLog
    ) -> None:
        self._traced = traced
        self._jitted = jax.jit(plain)
        self._signature = inspect.signature(traced)
        self._releases = releases
        functools.update_wrapper(self, traced)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if jaxcompat.tracing((args, kwargs)):
            return self._traced(*args, **kwargs)
        out = self._jitted(*args, **kwargs)
        self.count(args, kwargs)
        return out

    def count(self, args: tuple, kwargs: dict) -> None:
        """Hands the ``key`` among a dispatched call's arguments to the log."""
        self._releases.dispatched(self._signature.bind(*args, **kwargs).arguments["key"])

    def lower(self, *args: Any, **kwargs: Any) -> _Lowered:
        """The update lowered for these arguments (as ``jax.jit(f).lower``, without the host
        callback): ``.compile()`` gives a function whose every call is counted."""
        return _Lowered(self._jitted.lower(*args, **kwargs), self)

    def __deepcopy__(self, memo: dict) -> CountedUpdate:
        return self  # a copy of a run (``copy.deepcopy(priv)``) reports to the same log


class _Lowered:
    """``jax.stages.Lowered`` of an update; ``compile()`` keeps the count of its calls."""

    def __init__(self, lowered: Any, update: CountedUpdate) -> None:
        self._lowered, self._update = lowered, update

    def compile(self, *args: Any, **kwargs: Any) -> _Compiled:
        return _Compiled(self._lowered.compile(*args, **kwargs), self._update)

    def __getattr__(self, name: str) -> Any:  # as_text, cost_analysis, ...
        return getattr(self._lowered, name)


class _Compiled:
    """``jax.stages.Compiled`` of an update: each call's key goes to the log."""

    def __init__(self, compiled: Any, update: CountedUpdate) -> None:
        self._compiled, self._update = compiled, update

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._compiled(*args, **kwargs)
        self._update.count(args, kwargs)
        return out

    def __getattr__(self, name: str) -> Any:  # memory_analysis, cost_analysis, as_text, ...
        return getattr(self._compiled, name)
