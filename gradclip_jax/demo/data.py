"""The demo's data and model: scikit-learn's digits, split, and a small tanh MLP."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "accuracy",
    "batch_indices",
    "init_mlp",
    "mlp",
    "per_example_loss",
]  # the others: gradclip_jax.demo


def load_digits_split(seed: int = 0, test_fraction: float = 0.25) -> tuple[np.ndarray, ...]:
    """The digits data set, scaled to [0, 1] and split stratified into train and test.

    Returns:
      ``(x_train, y_train, x_test, y_test)``: float32 images of 64 pixels and
      int32 labels 0-9.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return x_tr, y_tr, x_te, y_te


def init_mlp(key: jax.Array, sizes: Sequence[int] = (64, 64, 10)) -> list[dict[str, jax.Array]]:
    """Glorot-uniform weights, zero biases."""
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), itertools.pairwise(sizes)):
        lim = math.sqrt(6.0 / (n_in + n_out))
        params.append(
            {
                "w": jax.random.uniform(k, (n_in, n_out), jnp.float32, -lim, lim),
                "b": jnp.zeros(n_out, jnp.float32),
            }
        )
    return params


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """The logits of the MLP (tanh hidden layers)."""
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def per_example_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Softmax cross-entropy of each example, shape ``(B,)``."""
    logits = mlp(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def accuracy(params: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float(jnp.mean(jnp.argmax(mlp(params, jnp.asarray(x)), -1) == jnp.asarray(y)))


def batch_indices(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """``(steps, batch_size)`` indices: consecutive slices of a fresh permutation per epoch."""
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(n)
        out.extend(perm[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch))
    return np.stack(out[:steps]).astype(np.int32)
