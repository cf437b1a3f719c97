"""A small private training setup shared by the single- and multi-process tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from gradclip_jax import PrivateTraining, make_private
from gradclip_jax.demo import init_mlp, per_example_loss

N, EXPECTED, STEPS = 512, 48, 4


def data() -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    return {
        "x": r.normal(size=(N, 64)).astype(np.float32),
        "y": r.integers(0, 10, N).astype(np.int32),
    }


def build(process_index: int = 0, process_count: int = 1, **kw: Any) -> PrivateTraining:
    return make_private(
        per_example_loss,
        optax.sgd(0.5),
        dataset_size=N,
        expected_batch_size=EXPECTED,
        steps=STEPS,
        target_epsilon=4.0,
        delta=1e-4,
        l2_clip_norm=0.5,
        seed=3,
        max_batch_size=96,
        method="vmap",
        process_index=process_index,
        process_count=process_count,
        accountant="rdp",
        **kw,
    )


def run_steps(
    priv: PrivateTraining, d: dict, put: Callable[..., tuple], steps: int, replicated: Any = None
) -> Any:
    params = init_mlp(jax.random.key(0))
    if replicated is not None:
        params = jax.device_put(params, replicated)
    state = priv.init(params)
    step = jax.jit(priv.step)
    key = jax.random.key(7)
    for (batch, mask), _ in zip(priv.batches(d), range(steps)):
        key, sub = jax.random.split(key)
        params, state, _m = step(params, state, *put(batch, mask), sub)
    return params
