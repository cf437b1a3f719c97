"""The noisy updates a private run has executed, counted on the host.

The accountant records a step when :meth:`PrivateTraining.batches` draws its batch; the noise is
added when ``noisy_update`` (and so ``step``) *runs*, in a program the user jits. Only the two
together make the epsilon the guarantee of what ran: a batch used twice (a cached list of batches
trained over twice), or a step run on a batch not drawn from the run, releases more than the
accountant holds, and a noise key used twice adds the same noise to two sums, whose difference
then carries none. So each executed ``noisy_update`` reports its key to the host
(``jax.debug.callback``, which runs under ``jax.jit``, ``lax.scan`` and ``vmap``: once per
executed update), and :class:`PrivateTraining` refuses to give an epsilon, or a state to resume
from, while more updates ran than steps were recorded, or a key was used twice.

JAX's persistent compilation cache stores no program with a host callback, so ``priv.step``
and ``priv.noisy_update`` called directly (not inside a transformation) run a program without
one, compiled on their first call, and hand the key to the log on the host as they dispatch it
(:meth:`ReleaseLog.dispatched`, :mod:`._counted`): that program is read back from the cache by
a resumed run or a rerun notebook cell. Traced (inside the user's ``jax.jit``, ``lax.scan`` or
``vmap``) they carry the callback, as a call's count is then the program's.

Under ``jax.vmap`` (many runs at once, as an audit simulates them) the keys of all the runs go
to the host in one call (``jax.custom_batching.custom_vmap``), not one callback per run; runs
that share one key while their sums differ are each a release with that key (a reuse).

Inside ``shard_map`` the callback runs on every device: a key reported by several devices in
one update (the replicated key of a replicated sum: one draw, the same on every device) is one
release; the same key twice from one device is a reuse; different keys from different devices
(a per-device key) are as many releases, as the replicas then differ.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradclip_jax._core import jaxcompat


def key_words(key: Any) -> jax.Array:
    """A noise key's bits as the program holds them (a typed key's data; a raw key as is)."""
    key = jnp.asarray(key)
    return (
        jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    )


class ReleaseLog:
    """The noise keys of the noisy updates a run has executed, each with the devices it ran on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[bytes, int] = {}  # key bits -> bit mask of the devices that used them
        self._reused = 0
        self._report = self._reporter()
        self.warned_unreleased = False  # the warning of batches drawn without an update: once
        self._before: set[bytes] = set()  # keys the run used before it was resumed
        # keys of updates dispatched from the host, not yet read; one reader at a time reads them
        self._pending: list[jax.Array] = []
        self._reading = threading.Lock()

    def resume(self, saved: Any) -> None:
        """Takes the keys an interrupted run used (:meth:`saved`): using one again is a reuse."""
        if not isinstance(saved, (list, tuple)) or not all(isinstance(k, str) for k in saved):
            raise ValueError(
                "make_private: `resume_from['noise_keys']` must be the list of hex strings "
                f"PrivateTraining.state_dict() saved, got {type(saved).__name__}"
            )
        self._before = {bytes.fromhex(k) for k in saved}

    def saved(self) -> list[str]:
        """Every key used, before the resume and since, as hex strings (plain values for a checkpoint)."""
        with self._reading:
            self._read_pending(wait=True)
            with self._lock:
                return sorted(k.hex() for k in self._before | set(self._devices))

    def __deepcopy__(self, memo: dict) -> ReleaseLog:
        # a copy of a run (``copy.deepcopy(priv)``) keeps its step functions, which report here
        return self

    def mark(self, key: jax.Array, summed: Any) -> None:
        """Inside the traced update: reports ``key`` to the host each time the update of ``summed``
        runs (``summed`` only says whether, under ``vmap``, there is one sum per run)."""
        key = key_words(key)
        leaves = jax.tree_util.tree_leaves(summed)
        runs = jnp.ravel(leaves[0])[:0] if leaves else jnp.zeros((0,))  # batched as the sums are
        self._report(key, jaxcompat.manual_device_index(), runs)

    def _reporter(self) -> Callable[..., Any]:
        """``report(key words, device, runs)``: one host callback, however many ``vmap`` levels wrap it."""

        @jax.custom_batching.custom_vmap
        def report(words: jax.Array, device: jax.Array, runs: jax.Array) -> tuple:
            jax.debug.callback(self._record, words, device)
            return ()

        @report.def_vmap
        def many(size: int, mapped: list[bool], words: Any, device: Any, runs: Any) -> tuple:
            if not mapped[0]:  # one key for every run: each run with its own sum uses it
                words = jnp.broadcast_to(words, (size, *words.shape))
            if mapped[1]:  # (a device index does not vary over a vmap; one stands for all)
                device = device[0]
            report(words, device, runs if mapped[2] else jnp.zeros((size, 0)))
            return (), ()

        return report

    def dispatched(self, words: jax.Array) -> None:
        """On the host: an update was dispatched (one program for every device); ``words`` are
        its key's bits as that program received them, an output of the program (a buffer of
        the log's own: the caller's key may be deleted, donated or refilled since). They are
        read later (:meth:`counts`), so the loop does not wait for them."""
        with self._lock:  # counted first: the copy below may fail or be interrupted
            self._pending.append(words)
        words.copy_to_host_async()

    def _read_pending(self, wait: bool) -> int:
        """Records the dispatched keys whose bits are on hand (all with ``wait``); returns how
        many are left (they count as run: a dispatched update runs). The caller holds
        ``_reading``: a reader waiting for bits holds the others back, which would otherwise
        see neither those keys pending nor recorded."""
        with self._lock:
            pending = list(self._pending)
        done = 0
        try:
            for words in pending:
                try:
                    if not (wait or words.is_ready()):  # type: ignore[attr-defined]
                        break
                    bits = np.asarray(words)
                except Exception:  # unreadable (deleted): still one update that ran
                    bits = np.frombuffer(f"unread {id(words)} {done}".encode(), np.uint8)
                self._record(bits, np.asarray(0))
                done += 1
        finally:  # (the ones read are recorded; the rest stay pending, counted under one lock)
            with self._lock:
                del self._pending[:done]
                left = len(self._pending)
        return left

    def _record(self, words: np.ndarray, device: np.ndarray) -> None:
        # (``_read_pending`` and the callback both record; ``_lock`` guards the tables)
        words = np.asarray(words)
        rows = words.reshape(-1, words.shape[-1]) if words.ndim else words.reshape(1, 1)
        bit = 1 << int(device)
        with self._lock:
            for row in rows:
                bits = row.tobytes()
                used = self._devices.get(bits, 0)
                self._reused += bool(used & bit) or bits in self._before
                self._devices[bits] = used | bit

    def counts(self, wait: bool = True) -> tuple[int, int]:
        """``(updates run, keys used again)``; ``wait``: once every update dispatched has run
        (``jax.effects_barrier``), else as far as the host has heard."""
        if wait:
            jax.effects_barrier()
        with self._reading:  # the keys read and the count, as one reader's view
            left = self._read_pending(wait)
            with self._lock:
                return len(self._devices) + left, self._reused
