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
import numpy as np

from gradclip_jax._core import jaxcompat
from gradclip_jax.dp.private_step._releases import ReleaseLog, key_words


class CountedUpdate:
    """A noisy update (``traced``, whose program reports its key; ``plain``, the same without the
    report) called as one jitted function; its ``key`` argument is what the log counts."""

    def __init__(
        self, traced: Callable[..., Any], plain: Callable[..., Any], releases: ReleaseLog
    ) -> None:
        signature = inspect.signature(traced)

        def counted(*args: Any, **kwargs: Any) -> tuple[Any, jax.Array]:
            # the key's bits as this program received them, in a buffer of the log's own
            key = signature.bind(*args, **kwargs).arguments["key"]
            return plain(*args, **kwargs), key_words(key)

        self._signature = signature
        self._traced = traced
        self._jitted = jax.jit(counted)
        self._releases = releases
        functools.update_wrapper(self, traced)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (under ``jax.disable_jit`` the program's outputs could be the caller's own key: the
        # traced update's report then runs at once)
        if jaxcompat.jit_disabled() or jaxcompat.tracing((args, kwargs)):
            return self._traced(*args, **kwargs)
        args, kwargs = self.own_key(args, kwargs)
        return self.counted(self._jitted(*args, **kwargs))

    def own_key(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments with a NumPy ``key`` copied. JAX may read a host buffer after the call
        has returned (on the CPU it can use the buffer itself), so a caller refilling it with
        the next step's key could change the key this update draws its noise with: two updates
        would then share their noise (the log counts it, as a reused key)."""
        bound = self._signature.bind(*args, **kwargs)
        if not isinstance(bound.arguments.get("key"), np.ndarray):
            return args, kwargs
        bound.arguments["key"] = np.array(bound.arguments["key"], copy=True)
        return bound.args, bound.kwargs

    def counted(self, result: tuple[Any, jax.Array]) -> Any:
        """The update's outputs; hands the key's bits among them to the log."""
        out, words = result
        self._releases.dispatched(words)
        return out

    def lower(self, *args: Any, **kwargs: Any) -> _Lowered:
        """The update lowered for these arguments (as ``jax.jit(f).lower``, without the host
        callback): ``.compile()`` gives a function whose every call is counted."""
        return _Lowered(self._jitted.lower(*args, **kwargs), self)

    def __deepcopy__(self, memo: dict) -> CountedUpdate:
        return self  # a copy of a run (``copy.deepcopy(priv)``) reports to the same log


# What a lowered or compiled update shows of JAX's own object: text and analyses, never the
# executable (one serialized and loaded again would run without the count)
_SHOWN = frozenset(
    {"as_text", "cost_analysis", "memory_analysis", "compiler_ir", "in_tree", "out_tree"}
)


class _Stage:
    """A stage of an update's compilation that shows JAX's object's :data:`_SHOWN` attributes
    alone and cannot be pickled."""

    def __init__(self, stage: Any, update: CountedUpdate) -> None:
        self._stage, self._update = stage, update

    def __getattr__(self, name: str) -> Any:
        if name not in _SHOWN:
            raise AttributeError(
                f"a counted update's {type(self).__name__.strip('_').lower()} step shows "
                f"{sorted(_SHOWN)} of JAX's object, not {name!r}: its executable would run "
                "updates the release log does not count"
            )
        return getattr(self._stage, name)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a counted update's compiled step cannot be serialized: loaded again, it would run "
            "updates the release log does not count (JAX's persistent cache keeps its program)"
        )


class _Lowered(_Stage):
    """``jax.stages.Lowered`` of an update; ``compile()`` keeps the count of its calls."""

    def compile(self, *args: Any, **kwargs: Any) -> _Compiled:
        return _Compiled(self._stage.compile(*args, **kwargs), self._update)


class _Compiled(_Stage):
    """``jax.stages.Compiled`` of an update: each call's key goes to the log."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._update.own_key(args, kwargs)
        return self._update.counted(self._stage(*args, **kwargs))
