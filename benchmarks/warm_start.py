"""A DP step's cold compile against its warm start from JAX's persistent compilation cache.

:func:`measure` runs one process that compiles the documented loop's step
(``priv.step`` of :func:`gradclip_jax.make_private`, called directly: clipped sum, noise,
optimizer) with an empty cache folder (cold: it compiles and writes the program),
then a second process with the same folder (warm: it reads the program back, as a
resumed run or a restarted notebook kernel does). Each process reports the seconds
to trace, lower and compile the step, the persistent cache's hits and misses while
it did, and a digest of one step's outputs: the two digests must be equal (the
program read back computes what the compiled one did).

Run alone: ``python -m benchmarks.warm_start [--quick]`` (both processes, one line
of JSON); ``python -m benchmarks.warm_start --child CACHE_DIR [--quick]`` is one process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

# The cache is what is measured: the child uses the folder it is given (never the caller's
# JAX_COMPILATION_CACHE_DIR) and stores every program, however fast it compiled.
_CHILD_ENV = {
    "JAX_ENABLE_COMPILATION_CACHE": "true",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_PLATFORMS": "cpu",
}


def _step_and_args(quick: bool) -> tuple[Any, tuple]:
    """The documented loop's jitted DP step of an MLP (784-128-10, or 784-32-10 with ``quick``)
    and its first step's arguments."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import gradclip_jax as gcx

    hidden, n = (32, 512) if quick else (128, 2048)
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(n, 784)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int32),
    }

    def per_example_loss(p: Any, b: Any) -> jax.Array:
        logits = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])

    priv = gcx.make_private(
        per_example_loss,
        optax.adam(1e-3),
        dataset_size=n,
        expected_batch_size=32,
        steps=100,
        target_epsilon=3.0,
        delta=1e-5,
        l2_clip_norm=1.0,
    )
    params = {
        "w1": jnp.asarray(rng.normal(size=(784, hidden)) / 28, jnp.float32),
        "b1": jnp.zeros(hidden),
        "w2": jnp.asarray(rng.normal(size=(hidden, 10)) / 8, jnp.float32),
        "b2": jnp.zeros(10),
    }
    batch, mask, key = next(iter(priv.batches(data, noise_key=jax.random.key(0))))
    return priv.step, (params, priv.init(params), batch, mask, key)


def child(cache_dir: str, quick: bool) -> dict[str, Any]:
    """One process's record: ``compile_s`` (trace, lower and compile the step), ``hits`` and
    ``misses`` (of the persistent cache while it compiled) and ``digest`` (of one step's new
    parameters and optimizer state)."""
    import jax
    import numpy as np

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    step, args = _step_and_args(quick)
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    seconds = time.perf_counter() - t0
    params, opt_state, _ = compiled(*args)
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves((params, opt_state)):
        digest.update(np.asarray(leaf).tobytes())
    return {
        "compile_s": seconds,
        "hits": events.count("/jax/compilation_cache/cache_hits"),
        "misses": events.count("/jax/compilation_cache/cache_misses"),
        "digest": digest.hexdigest(),
    }


def _run_child(cache_dir: str, quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.warm_start", "--child", cache_dir] + (
        ["--quick"] if quick else []
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **_CHILD_ENV}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(quick: bool = False) -> dict[str, Any]:
    """``{"cold": record, "warm": record, "entries": programs in the cache}``: two processes
    sharing an empty temporary cache folder (see the module docstring)."""
    with tempfile.TemporaryDirectory() as cache_dir:
        cold = _run_child(cache_dir, quick)
        entries = len(os.listdir(cache_dir))
        warm = _run_child(cache_dir, quick)
    return {"cold": cold, "warm": warm, "entries": entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", metavar="CACHE_DIR", default=None)
    args = parser.parse_args()
    print(json.dumps(child(args.child, args.quick) if args.child else measure(args.quick)))


if __name__ == "__main__":
    main()
